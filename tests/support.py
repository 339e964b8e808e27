"""What several test files share: routings as a router makes them, MXFP8 operands, and
compiling a kernel module's `CompileSpec` list for a GPU the way the compile report does (no
GPU needed).

On the path as ``support`` (pytest's ``pythonpath`` setting): ``from support import topk``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.utils._device

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_lab.workbench.compile_report.worker import triton_signature

specs = []
{setup}
out = {{}}
for spec in specs:
    module, name = spec.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    signature, constexprs, attrs, _ = triton_signature(kernel, spec.kernel, spec.signature, spec.constexprs)
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", {arch}, 32),
        options={{"num_warps": spec.config.num_warps, "num_stages": spec.config.num_stages}},
    )
    out[spec.label] = {{"ptx": compiled.asm["ptx"], "ttir": compiled.asm["ttir"]}}
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""


def compile_for_gpu(setup: str, tmp_path: Path, arch: int = 90) -> dict[str, dict[str, str]]:
    """Compile the `CompileSpec` list that ``setup`` (Python source) leaves in ``specs`` for
    ``sm_<arch>`` as the compile report does (`moe_lab.workbench.compile_report.worker.triton_signature`:
    a launch's specializations), in a process where Triton compiles (``TRITON_INTERPRET=0``:
    no GPU needed, ptxas comes with Triton). Returns ``{label: {"ptx": ..., "ttir": ...}}``."""
    out = tmp_path / "compiled.json"
    code = _COMPILE.format(setup=textwrap.dedent(setup), arch=arch)
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def tile_offsets_are_int64(ttir: str) -> bool:
    """Every ``tt.addptr`` on a 2-D tile of pointers takes int64 offsets."""
    tiles = re.findall(r"tt\.addptr .*: tensor<\d+x\d+x!tt\.ptr<\w+>>, tensor<\d+x\d+x(\w+)>", ttir)
    return bool(tiles) and set(tiles) == {"i64"}


def checked_compile_specs(module: types.ModuleType) -> list:
    """A kernel module's specs (`moe_lab.workbench.compile_report.specs.for_module`), checked
    to name every kernel of the module (``*_kernel``) and, per spec, every kernel parameter:
    runtime ones typed in the signature or, for a unit stride, the constant 1 (as Triton's
    launcher passes it), constexpr ones valued, the launch config's blocks among them."""
    from moe_lab.workbench.compile_report.specs import for_module

    specs = for_module(module)
    kernels = {name: obj for name, obj in vars(module).items()
               if name.endswith("_kernel") and hasattr(obj, "fn")}
    assert {s.kernel for s in specs} == {f"{module.__name__}:{name}" for name in kernels}
    for spec in specs:
        params = inspect.signature(kernels[spec.kernel.split(":")[1]].fn).parameters.values()
        constexpr = {p.name for p in params if "constexpr" in str(p.annotation)}
        unit = {name for name in spec.constexprs if name not in constexpr}
        assert set(spec.signature) == {p.name for p in params} - constexpr - unit, spec.label
        assert set(spec.constexprs) >= constexpr and all(spec.constexprs[n] == 1 for n in unit)
        assert spec.config.blocks.items() <= spec.constexprs.items(), spec.label
    return specs


def topk(tokens: int, top_k: int, n_experts: int, skew: float = 0.0) -> torch.Tensor:
    """Distinct experts per token, as a router picks them; ``skew`` favours low ids, so
    some experts get no tokens."""
    scores = torch.rand(tokens, n_experts) - skew * torch.arange(n_experts) / n_experts
    return scores.topk(top_k, dim=-1).indices


def without_triton(directory: Path) -> dict[str, str]:
    """The environment of a child process in which Triton is not installed, as on macOS or
    Windows: a ``sitecustomize`` on its PYTHONPATH puts ``None`` in ``sys.modules["triton"]``, so
    ``import triton`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` finds
    nothing (Jupyter kernels started from it inherit the same)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text('import sys\nsys.modules["triton"] = None\n')
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(directory), str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


@contextlib.contextmanager
def mounted_tmpfs(options: str):
    """A tmpfs mounted with ``options`` (e.g. ``"size=256k"``, ``"ro,size=64k"``): a real full or
    read-only disk, for root only (the test is skipped where mounting is refused). Mounted
    outside pytest's tmp_path, whose clean-up must never meet a mount point; unmounted lazily
    if a file is still open."""
    import pytest

    folder = Path(tempfile.mkdtemp(prefix="moe_lab_tmpfs_"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True)
    if done.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs ({options}) here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
        folder.rmdir()


def mx_operands(rows: int, k: int, device, spread: float = 4.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh MXFP8 operands ``(codes [rows, k], scales [rows, k/32])``: values over several
    binades, quantized by the reference quantizer."""
    from moe_lab.quant.mx import quantize

    binades = torch.exp2(torch.randint(-6, 7, (rows, k // 32)).float()).repeat_interleave(32, 1)
    mx = quantize(torch.randn(rows, k) * binades * spread, dim=-1)
    return mx.data.to(device), mx.scale.to(device)


def abs_product(a, a_s, b, b_s) -> torch.Tensor:
    """``|dequant(a)| · |dequant(b)|ᵀ`` in float64 for MXFP8 operands: the scale of a
    summation's rounding bound."""
    from moe_lab.kernels.mx_gemm import mx_gemm_reference
    from moe_lab.quant.mx import E4M3

    ones_a, ones_b = a.view(torch.uint8) & 0x7F, b.view(torch.uint8) & 0x7F
    return mx_gemm_reference(ones_a.view(E4M3), a_s, ones_b.view(E4M3), b_s)


def grouped_mx_operands(gen, counts: list[int], n: int, k: int, device) -> list[torch.Tensor]:
    """Operands of a grouped MXFP8 GEMM: ``[a, a_scale, b, b_scale, offsets]``, ``sum(counts)``
    rows of ``a`` over ``len(counts)`` experts, each with an ``[n, k]`` weight."""
    from moe_lab.quant.mx import quantize

    a = quantize(torch.randn(sum(counts), k, generator=gen) * 3, dim=-1, scale_mode="rceil")
    b = quantize(torch.randn(len(counts), n, k, generator=gen), dim=-1, scale_mode="rceil")
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return [t.to(device) for t in (a.data, a.scale, b.data, b.scale, offsets)]


def cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """Exit status and the stderr lines of ``python -m moe_lab *argv``, run in this process."""
    from moe_lab.__main__ import main

    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def one_line(lines: list[str], *words: str) -> str:
    """The single stderr line of a refused command, with no traceback and each of ``words``."""
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@contextlib.contextmanager
def poison_outputs() -> Iterator[None]:
    """Inside this block every ``torch.empty``/``torch.empty_like`` (what a kernel's wrapper
    allocates its outputs with) starts as NaN (integers: -7, unsigned bytes: 0xAB), not
    uninitialised, so an element a kernel forgot to write fails any comparison. Nests."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if t.dtype == torch.uint8:
            return t.fill_(0xAB)
        if t.dtype != torch.bool and not t.is_complex():
            return t.fill_(-7)
        return t

    # `with torch.device(...)` knows its constructors from a set it builds once and caches
    # (torch.utils._device): built while the stand-ins are in place, it would hold them
    # instead of torch.empty, and every device context after would be ignored. So the set is
    # built from the real functions before the swap, and again after it.
    constructors = getattr(torch.utils._device, "_device_constructors", None)
    outermost = not _poisoning
    if constructors is not None and outermost:
        constructors.cache_clear()
        constructors()
    _poisoning.append(True)
    torch.empty = lambda *args, **kwargs: poisoned(real_empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: poisoned(real_empty_like(*args, **kwargs))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like
        _poisoning.pop()
        if constructors is not None and outermost:
            constructors.cache_clear()


_poisoning: list[bool] = []  # one entry per open `poison_outputs` block
