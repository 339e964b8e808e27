"""Launch configs measured rather than reasoned: the tuned table a launch reads.

`moe_lab.kernels.grouped_gemm.choose_config` is a rule: a reasoned default. On a GPU the
right tile, warp count, pipeline depth and tile order (``GROUP_M``, otherwise
`moe_lab.kernels.common.tile_group`'s) are a measurement, so the grouped GEMM's kernels
(forward, SwiGLU, dW) look a launch up first in a *tuned table*,
``moe_lab/kernels/tuned/<gpu>.json``. (The fused kernels keep the rule: a prologue or
epilogue changes their registers, so a tile tuned on the plain kernel need not suit them.)
A table maps a *key* (kernel, dtype, rows per expert rounded up to a power of two, N, K) to
the winning `LaunchConfig`. Keys the table lacks, a GPU without a table, Triton's
interpreter and the compile report (which has no device) all get the rule, and so does the
tile order of a row that records no ``group_m``.

The tuner that fills a table is a measurement, not part of a launch
(`moe_lab.workbench.measure.autotune`, times each config through the real op under
`forcing`; the rule first, so a tuned launch can only replace it by something faster).
``scripts/gpu_check.py`` writes a GPU's table into its run's results, never here: a table
is adopted by copying it here and committing it, so no run reads back a table it wrote.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from moe_lab.kernels.launch import LaunchConfig

TUNED_FILE = "tuned_configs.json"  # the name of the table in a gpu_check run's results
TUNED_DIR = Path(__file__).resolve().parent / "tuned"  # the tables launches read: <gpu slug>.json
_FORCED: dict[str, LaunchConfig] = {}


def gpu_slug(name: str) -> str:
    """The results folder of a GPU: ``"NVIDIA H200"`` -> ``"nvidia_h200"`` (each run of
    characters other than letters, digits, ``_``, ``.`` and ``-`` becomes one ``_``, none at
    the ends, lower case). ``scripts/gpu_check.py`` writes a GPU's results to this folder
    (under ``results/``) and names its section files by it too; an adopted tuned table is
    ``TUNED_DIR/<slug>.json``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_").lower()


def table_key(kernel: str, m: int, n: int, k: int, n_experts: int, dtype: torch.dtype) -> str:
    """The table's key of a launch: rows per expert bucketed to the next power of two (a
    routing's counts move from step to step; its tile choice should not), N and K exact."""
    rows = max(1, m // max(1, n_experts))
    return f"{kernel}|{str(dtype).removeprefix('torch.')}|rows<={1 << (rows - 1).bit_length()}|n={n}|k={k}"


def _config(entry: dict, where: str) -> LaunchConfig:
    try:
        group_m = entry.get("group_m")
        return LaunchConfig(dict(entry["blocks"]), int(entry["num_warps"]), int(entry["num_stages"]),
                            None if group_m is None else int(group_m))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: each entry must be {{'blocks': {{...}}, 'num_warps': int, "
                         f"'num_stages': int}} and may have 'group_m': int, got {entry!r} ({exc})") from exc


@functools.cache
def load_table(path: Path) -> dict[str, LaunchConfig]:
    """The tuned table at ``path`` (``{}`` if there is none); a malformed file is an error
    that names it, never a silent fallback."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"tuned table {path} is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise ValueError(f"tuned table {path} must be {{'configs': {{key: entry}}, ...}}")
    return {key: _config(entry, f"tuned table {path}, key {key!r}") for key, entry in data["configs"].items()}


def tuned_config(kernel: str, m: int, n: int, k: int, n_experts: int, dtype: torch.dtype,
                 device: torch.device | None) -> LaunchConfig | None:
    """The config `forcing` imposes on ``kernel``, else the tuned table's for this launch on
    ``device`` (a CUDA device whose GPU has a table), else ``None``: the rule decides."""
    if kernel in _FORCED:
        return _FORCED[kernel]
    if device is None or device.type != "cuda":
        return None
    path = TUNED_DIR / f"{gpu_slug(torch.cuda.get_device_name(device))}.json"
    return load_table(path).get(table_key(kernel, m, n, k, n_experts, dtype))


@contextlib.contextmanager
def forcing(kernel: str, config: LaunchConfig) -> Iterator[None]:
    """Every launch of ``kernel`` inside the block runs ``config`` (the tuner's way to time
    one config through the real op; under the interpreter too, to check each config's
    numerics)."""
    if not isinstance(config, LaunchConfig):
        raise TypeError(f"config must be a LaunchConfig, got {type(config).__name__}")
    previous = _FORCED.get(kernel)
    _FORCED[kernel] = config
    try:
        yield
    finally:
        if previous is None:
            del _FORCED[kernel]
        else:
            _FORCED[kernel] = previous


__all__ = ["TUNED_DIR", "TUNED_FILE", "forcing", "gpu_slug", "load_table", "table_key", "tuned_config"]
