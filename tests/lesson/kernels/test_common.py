"""What makes the kernels run interpreted (moe_lab.kernels.interpreter, run as the kernel package
is imported), the device check the kernels share (moe_lab.kernels.common), and the poisoned
outputs the kernel tests allocate (support.poison_outputs).

The rule (`moe_lab.perf.capabilities.interprets_triton`) is checked on every value of
``TRITON_INTERPRET``; a fresh process with the variable unset runs a moe_lab kernel on the CPU and
leaves its environment as it was; there, Triton interprets every ``@triton.jit`` kernel defined
after moe_lab's kernels were imported (the caller's own too: without CUDA it could not run
compiled), and its library (``tl.sum``) is made interpretable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl
from support import poison_outputs
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from moe_lab.kernels import common
from moe_lab.kernels import grouped_gemm as gg
from moe_lab.perf.capabilities import interprets_triton


@pytest.mark.parametrize(("value", "cuda", "expected"), [
    (None, False, True), (None, True, False),
    ("1", True, True), ("true", True, True), ("on", True, True), ("yes", True, True),
    ("0", False, False), ("false", False, False), ("off", False, False),
])
def test_the_rule_reads_triton_interpret_as_triton_does_else_asks_for_cuda(monkeypatch, value, cuda,
                                                                           expected):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interprets_triton(cuda) is expected


def test_every_moe_lab_kernel_follows_the_rule_of_this_session():
    kind = InterpretedFunction if common.INTERPRETED else JITFunction
    assert common.INTERPRETED == interprets_triton()
    for fn in (gg._grouped_gemm_kernel, common.tile_schedule, common.swiglu_k_loop, common.cast_for_store):
        assert isinstance(fn, kind), fn


def test_poison_outputs_fills_what_kernels_should_write_and_nests():
    shape, empty = (2, 3), torch.empty
    with poison_outputs():
        with poison_outputs():
            assert torch.isnan(torch.empty(shape, dtype=torch.bfloat16)).all()
        assert (torch.empty(shape, dtype=torch.int32) == -7).all()
        assert (torch.empty_like(torch.zeros(shape, dtype=torch.uint8)) == 0xAB).all()
    assert torch.empty is empty  # outside the block, torch's own again


def test_poison_outputs_leaves_device_contexts_working():
    """`with torch.device(...)` caches its constructors once: built inside the block it would
    hold the stand-ins, and every later device context would be ignored."""
    for _ in range(2):
        with poison_outputs(), poison_outputs(), torch.device("meta"):
            assert torch.empty(2).device.type == "meta"
        with torch.device("meta"):
            assert torch.empty(2).device.type == "meta"


def test_the_device_check_names_the_argument(monkeypatch):
    monkeypatch.setattr(common, "INTERPRETED", False)
    with pytest.raises(ValueError, match="x must be on a CUDA device for compiled Triton, got cpu"):
        common.check_device("x", torch.device("cpu"))



@triton.jit
def _sum_in_blocks(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):  # a loop bound from a scalar argument, as the K loops have
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, 0))


def test_a_loop_bound_read_from_a_scalar_argument(device):
    # Triton 3.6's interpreter with NumPy 2.4 failed here ("only 0-dimensional arrays can be
    # converted to Python scalars") until moe_lab.kernels.interpreter read the scalar as Triton
    # 3.7 does.
    x = torch.arange(37, dtype=torch.float32, device=device)
    out = torch.zeros(1, dtype=torch.float32, device=device)
    _sum_in_blocks[(1,)](x, out, x.numel(), BLOCK=8)
    assert out.item() == 666.0  # 0 + 1 + ... + 36


@triton.jit
def _twice(x):
    return 2 * x


@triton.jit
def _six_times(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, _twice(x) + _twice(x) + _twice(x))  # three calls of a @jit helper


def test_an_interpreted_launch_patches_the_language_once_and_puts_the_interpreter_back(
        interpreted, monkeypatch):
    # Triton's interpreter patches the language at every call of a @jit helper; within one
    # interpreted launch only the launch's own patch is made (moe_lab.kernels.interpreter).
    if not interpreted:
        pytest.skip("compiled kernels: the interpreter is not used")
    from triton.runtime import interpreter

    patched, patch = [], interpreter._patch_lang

    def counting(fn):
        patched.append(fn.__name__)
        return patch(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    x = torch.randn(16)
    out = torch.zeros(16)
    _six_times[(1,)](x, out, BLOCK=16)
    assert torch.equal(out, 6 * x)
    assert patched == ["_six_times"], patched  # not once more for each call of _twice
    assert interpreter._patch_lang is counting  # as it was before the launch


_FRESH = '''
import json, os, sys
import torch, torch._dynamo, triton  # torch._dynamo sets TORCHINDUCTOR_CACHE_DIR itself
import triton.language as tl
before = dict(os.environ)
from moe_lab.kernels import grouped_gemm as gg

@triton.jit
def users_kernel(x_ptr):
    tl.store(x_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, 4)), 0))

x, w = torch.randn(10, 8), torch.randn(2, 8, 4)
offsets = torch.tensor([0, 3, 10], dtype=torch.int32)
torch.testing.assert_close(gg.grouped_gemm(x, w, offsets), gg.grouped_gemm_reference(x, w, offsets))
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
x = torch.arange(4.0)
users_kernel[(1,)](x)
print(json.dumps({"changed": changed, "kernel": type(gg._grouped_gemm_kernel).__name__,
                  "users": type(users_kernel).__name__, "library": type(tl.sum).__name__,
                  "sum": x[0].item()}))
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the rule compiles: nothing runs on the CPU")
def test_a_fresh_process_without_triton_interpret_runs_the_kernels_interpreted(tmp_path):
    script = tmp_path / "fresh.py"  # Triton reads a kernel's source from its file
    script.write_text(textwrap.dedent(_FRESH))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"changed": [], "kernel": "InterpretedFunction", "users": "InterpretedFunction",
                    "library": "InterpretedFunction", "sum": 6.0}, seen
