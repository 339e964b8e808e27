"""One MoE forward a reader can follow (issue 48): the first forward of a fresh tiny
``MoELayer(dispatcher="dropless", expert_backend="triton")``, run under Triton's interpreter in a
fresh process with ``sys.setprofile``, enters at most `MAX_FILES` lesson files and at most
`MAX_HOST_FUNCTIONS` host functions.

What is counted: every Python frame whose file is in the lesson (``moe_lab/`` outside
``workbench/``), module bodies excluded, keyed by file and qualified name. Counted apart, and
printed:

- the ``@triton.jit`` functions (the kernels' own): a frame whose code is the function of a
  Triton kernel object found in a lesson module that ran (under the interpreter Triton runs a
  rewritten copy of the function, so a frame is matched by file, name and line span), and every
  frame whose chain of callers, up to the forward, passes through one (what a kernel calls
  under the interpreter);
- the interpreter's own: frames of `moe_lab.kernels.interpreter` (what makes the kernels run
  under Triton's interpreter, which a compiled launch never enters) and what they call;
- import-time frames: those whose chain of callers passes through a module body, that is what a
  module's import runs (a class body, a decorator), once per process whatever the forward.

The test prints the host functions with their call counts, so a closing note can quote them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
MAX_FILES = 6
MAX_HOST_FUNCTIONS = 35

_PROBE = r'''
import collections, json, sys
from pathlib import Path
import torch
import triton
import moe_lab
from moe_lab.config import preset
from moe_lab.moe.layer import MoELayer

PKG = Path(moe_lab.__file__).resolve().parent
WORKBENCH = PKG / "workbench"
_where = {}


def lesson_path(filename):
    """The file's path inside the lesson, or None (cached per file name)."""
    if filename not in _where:
        path = Path(filename).resolve()
        inside = path.is_relative_to(PKG) and not path.is_relative_to(WORKBENCH)
        _where[filename] = str(path.relative_to(PKG)) if inside else None
    return _where[filename]


def key(code):
    return (code.co_filename, code.co_name, code.co_firstlineno)


calls = []  # (code key, qualified name, lesson path, ancestors' code keys, under an import)


def run(layer, x):
    driver = sys._getframe().f_code

    def hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        rel = lesson_path(code.co_filename)
        if rel is None or code.co_name == "<module>":
            return
        ancestors, imported = [], False
        caller = frame.f_back
        while caller is not None and caller.f_code is not driver:
            if caller.f_code.co_name == "<module>":
                imported = True
            elif lesson_path(caller.f_code.co_filename) is not None:
                ancestors.append(key(caller.f_code))
            caller = caller.f_back
        calls.append((key(code), code.co_qualname, rel, ancestors, imported))

    sys.setprofile(hook)
    try:
        return layer(x)
    finally:
        sys.setprofile(None)


cfg = preset("tiny").moe
torch.manual_seed(0)
layer = MoELayer(cfg, dispatcher="dropless", expert_backend="triton")
x = torch.randn(64, cfg.d_model)
y, _ = run(layer, x)
assert torch.isfinite(y).all()

# Every Triton kernel object (compiled or interpreted) in a lesson module that ran: its
# function's file, name and line span. The interpreter runs a rewritten copy of the function,
# compiled with the same file name and line numbers, so a frame is matched by those.
jit_spans = {}
for module in list(sys.modules.values()):
    if lesson_path(getattr(module, "__file__", None) or "<none>") is None:
        continue
    for value in vars(module).values():
        fn = getattr(value, "fn", None)
        if isinstance(value, triton.runtime.jit.KernelInterface) and callable(fn):
            lines = [line for _, _, line in fn.__code__.co_lines() if line is not None]
            jit_spans[(fn.__code__.co_filename, fn.__name__)] = (min(lines), max(lines))


def is_jit(code_key):
    span = jit_spans.get(code_key[:2])
    return span is not None and span[0] <= code_key[2] <= span[1]


INTERPRETER = "kernels/interpreter.py"
host, jit, imported = collections.Counter(), collections.Counter(), collections.Counter()
interpreter = collections.Counter()
for code_key, qualname, rel, ancestors, under_import in calls:
    name = f"{rel}:{qualname}"
    if is_jit(code_key) or any(is_jit(a) for a in ancestors):
        jit[name] += 1
    elif under_import:
        imported[name] += 1
    elif any(lesson_path(k[0]) == INTERPRETER for k in [code_key, *ancestors]):
        interpreter[name] += 1
    else:
        host[name] += 1
print(json.dumps({"host": host, "jit": jit, "interpreter": interpreter, "imported": imported}))
'''


@pytest.fixture(scope="module")
def forward_path() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONHASHSEED": "0"}
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=900, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    host = seen["host"]
    files = sorted({name.split(":")[0] for name in host})
    print(f"\nthe dropless Triton forward: {len(files)} lesson files, {len(host)} host functions")
    for name in sorted(host):
        print(f"  {name}  x{host[name]}")
    print(f"@triton.jit functions (and what they call under the interpreter): {len(seen['jit'])}")
    for name in sorted(seen["jit"]):
        print(f"  {name}  x{seen['jit'][name]}")
    print(f"the interpreter's own (moe_lab.kernels.interpreter): {len(seen['interpreter'])}")
    for name in sorted(seen["interpreter"]):
        print(f"  {name}  x{seen['interpreter'][name]}")
    print(f"run by an import during the forward (once per process): {len(seen['imported'])}")
    for name in sorted(seen["imported"]):
        print(f"  {name}  x{seen['imported'][name]}")
    return seen


def test_the_dropless_triton_forward_enters_few_files_and_functions(forward_path):
    host = forward_path["host"]
    files = sorted({name.split(":")[0] for name in host})
    assert {"moe/layer.py", "kernels/grouped_gemm.py", "kernels/permute.py"} <= set(files), files
    assert forward_path["jit"], "no @triton.jit frame was seen: the kernels did not run interpreted"
    assert len(files) <= MAX_FILES, f"{len(files)} lesson files (at most {MAX_FILES}): {files}"
    assert len(host) <= MAX_HOST_FUNCTIONS, (
        f"{len(host)} host functions (at most {MAX_HOST_FUNCTIONS}): {sorted(host)}")
