"""Where a notebook lets the learner's own Triton kernels run: the one visible switch.

moe_lab's kernels decide compiled or interpreted for themselves (`moe_lab.kernels.interpreter`),
but a kernel the learner writes with ``@triton.jit`` is Triton's: interpreted only when
``TRITON_INTERPRET`` is set as Triton is imported and the kernel defined. A notebook whose
learner writes kernels calls `interpret_without_cuda` first in its setup cell, before it
imports Triton, so that on a machine without CUDA those kernels run on the CPU — and says so.

Where Triton is not installed at all (macOS, Windows: it publishes Linux wheels only), a
notebook calls `label_triton_cells` in its setup cell: each later cell whose first line is
``# needs Triton`` prints what it needs and where to get it instead of running, and the
notebook runs to its end on everything else.
"""

from __future__ import annotations

import os
import sys

from moe_lab.registry import TRITON_MISSING

#: The first line of a notebook cell that cannot run without Triton.
NEEDS_TRITON = "# needs Triton"


def why_no_triton() -> str | None:
    """Why moe_lab's Triton kernels cannot run in this process, or ``None``: Triton is not
    installed (`moe_lab.kernels.TRITON_MISSING`), or the GPU is older than Triton's sm_80
    (`moe_lab.perf.capabilities`: its kernels are refused there, a T4's notebook runs on PyTorch)."""
    if TRITON_MISSING:
        return TRITON_MISSING
    from moe_lab.perf.capabilities import capabilities

    caps = capabilities()
    if caps.triton_mode.startswith("unsupported"):
        return (f"Triton's kernels need compute capability 8.0 or newer; this {caps.device_name} is "
                f"{caps.triton_mode.removeprefix('unsupported on ')}")
    return None


def interpret_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` for this process when it is unset and there is no CUDA
    device, printing one line that says so; otherwise change nothing. Returns whether it set
    it. Called after Triton was imported, it still sets it and says the kernel needs a
    restart (Triton's own library was made compiled). Where Triton is not installed it sets
    nothing and calls `label_triton_cells` instead."""
    import torch

    if why_no_triton():
        label_triton_cells()
        return False
    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    late = "triton" in sys.modules
    print("no CUDA device: TRITON_INTERPRET=1 set for this notebook, so the Triton kernels you write "
          "run on the CPU under Triton's interpreter"
          + (" — but Triton was imported first: restart the kernel and run this cell first" if late else ""))
    return True


def label_triton_cells() -> bool:
    """Where Triton's kernels cannot run (`why_no_triton`: not installed, or a GPU older than
    sm_80), make each cell run after this one whose first line is `NEEDS_TRITON` print one
    line (why) instead of running, and say so once. Returns whether it did: False where
    Triton runs, or outside IPython."""
    why = why_no_triton()
    if why is None:
        return False
    from IPython import get_ipython  # installed wherever a notebook runs (ipykernel)

    shell = get_ipython()
    if shell is None:
        return False
    label = f"this cell was skipped: {why}"

    def skip_triton_cell(lines: list[str]) -> list[str]:
        if lines and lines[0].strip().lower().startswith(NEEDS_TRITON.lower()):
            return [f"print({label!r})\n"]
        return lines

    if not any(getattr(t, "__name__", "") == "skip_triton_cell" for t in shell.input_transformers_cleanup):
        shell.input_transformers_cleanup.append(skip_triton_cell)
    print(f"Triton's kernels cannot run here ({why}): the cells marked {NEEDS_TRITON!r} say so "
          "instead of running; the others run on PyTorch")
    return True

