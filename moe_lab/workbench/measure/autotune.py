"""The tuner: which launch config of a grouped GEMM kernel is fastest on this GPU, measured.

`moe_lab.kernels.grouped_gemm.choose_config` is a rule; `tune_space` lists what else to
time for one launch (the rule first), `autotune` times each config with a caller's timer
(on CUDA ``triton.testing.do_bench``, as ``triton.autotune`` does) by running the real op
under `forcing`, and `table_entry` is a winner as a tuned table stores it, under its
`table_key`. It runs where it is called (``scripts/gpu_check.py``'s tuning section), never
inside a launch: timing a kernel is not allowed while a CUDA graph is being captured or
``torch.compile`` traces, and a step must not pause to benchmark itself. No launch reads a
table: a measured winner is applied explicitly (`moe_lab.kernels.grouped_gemm.FORCED`), and
the launch rule stays the default.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from unittest import mock

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from moe_lab.kernels import grouped_gemm as gg
from moe_lab.kernels.launch import LaunchConfig

TUNED_FILE = "tuned_configs.json"  # the name of the table in a gpu_check run's results


def gpu_slug(name: str) -> str:
    """The results folder of a GPU: ``"NVIDIA H200"`` -> ``"nvidia_h200"`` (each run of
    characters other than letters, digits, ``_``, ``.`` and ``-`` becomes one ``_``, none at
    the ends, lower case). ``scripts/gpu_check.py`` writes a GPU's results to this folder
    (under ``results/``) and names its section files by it too."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_").lower()


def table_key(kernel: str, m: int, n: int, k: int, n_experts: int, dtype: torch.dtype) -> str:
    """A tuned table's key of a launch: rows per expert bucketed to the next power of two (a
    routing's counts move from step to step; its tile choice should not), N and K exact."""
    rows = max(1, m // max(1, n_experts))
    return f"{kernel}|{str(dtype).removeprefix('torch.')}|rows<={1 << (rows - 1).bit_length()}|n={n}|k={k}"


def forcing(kernel: str, config: LaunchConfig) -> AbstractContextManager:
    """Every launch of the grouped GEMM's ``kernel`` inside the block runs ``config``
    (`moe_lab.kernels.grouped_gemm.FORCED`, as it was restored at the block's end): the
    tuner's way to time one config through the real op; under the interpreter too, to check
    each config's numerics."""
    if not isinstance(config, LaunchConfig):
        raise TypeError(f"config must be a LaunchConfig, got {type(config).__name__}")
    return mock.patch.dict(gg.FORCED, {kernel: config})


def tune_space(kernel: str, m: int, n: int, k: int, n_experts: int,
               dtype: torch.dtype) -> list[LaunchConfig]:
    """What `autotune` times for one launch: the rule's config first, then the other tiles
    of `moe_lab.kernels.grouped_gemm.TILE_SPACE` for ``dtype`` (float32 takes only its
    CUDA-core tiles), each with 3, 4 and 5 pipeline stages. For the kernels of
    ``TILE_ORDERED`` every config carries its ``GROUP_M``: `tile_group`'s for its tile (the
    rule's order), and the rule's tile and stages are also timed in a few other orders,
    ``GROUP_M`` = 1 (N tile fastest) and half and twice the rule's: at most three configs
    more, not three times as many."""
    rule = gg.choose_config(kernel, m, n, k, n_experts, dtype)
    fp32 = {"gemm": (0,), "swiglu": (2,), "dw": (0,)}[kernel]
    tiles = [c for i, c in enumerate(gg.TILE_SPACE[kernel]) if (i in fp32) == (dtype == torch.float32)]
    space = [rule] + [LaunchConfig(c.blocks, c.num_warps, stages) for c in tiles for stages in (3, 4, 5)]
    if kernel in gg.TILE_ORDERED:
        space = [dataclasses.replace(c, group_m=c.group_m or gg.tile_group(m, n_experts, c.blocks["BLOCK_M"]))
                 for c in space]
        group = space[0].group_m
        space[1:1] = [dataclasses.replace(space[0], group_m=g) for g in (1, group // 2, 2 * group) if g]
    return [c for i, c in enumerate(space) if c not in space[:i]]


def autotune(kernel: str, space: Sequence[LaunchConfig], run: Callable[[], object],
             time_fn: Callable[[Callable[[], object]], float]) -> tuple[LaunchConfig, list[float]]:
    """``(fastest config, seconds of each)``: ``run`` (a call of the op that launches
    ``kernel``) timed by ``time_fn`` under each config of ``space``. A config that fails to
    launch is timed as infinite — Triton's `OutOfResources` (too much shared memory or too
    many registers for this GPU), `PTXASError` (ptxas refused it), `CompilationError`, or the
    `RuntimeError`/`ValueError` a launch raises — and if all fail, the first error is raised."""
    times, errors = [], []
    for config in space:
        try:
            with forcing(kernel, config):
                times.append(float(time_fn(run)))
        except (OutOfResources, PTXASError, CompilationError, RuntimeError, ValueError) as exc:
            times.append(float("inf"))
            errors.append(exc)
    if len(errors) == len(space):
        raise errors[0]
    return space[min(range(len(space)), key=times.__getitem__)], times


def table_entry(config: LaunchConfig) -> dict:
    """``config`` as a tuned table stores it (``group_m`` only where the config sets it)."""
    entry = {"blocks": dict(config.blocks), "num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.group_m is not None:
        entry["group_m"] = config.group_m
    return entry
