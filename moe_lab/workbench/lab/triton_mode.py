"""Where a notebook lets the learner's own Triton kernels run: the one visible switch.

moe_lab's kernels decide compiled or interpreted for themselves (`moe_lab.kernels.common.jit`),
but a kernel the learner writes with ``@triton.jit`` is Triton's: interpreted only when
``TRITON_INTERPRET`` is set as Triton is imported and the kernel defined. A notebook whose
learner writes kernels calls `interpret_without_cuda` first in its setup cell, before it
imports Triton, so that on a machine without CUDA those kernels run on the CPU — and says so.
"""

from __future__ import annotations

import os
import sys


def interpret_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` for this process when it is unset and there is no CUDA
    device, printing one line that says so; otherwise change nothing. Returns whether it set
    it. Called after Triton was imported, it still sets it and says the kernel needs a
    restart (Triton's own library was made compiled)."""
    import torch

    if "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    late = "triton" in sys.modules
    print("no CUDA device: TRITON_INTERPRET=1 set for this notebook, so the Triton kernels you write "
          "run on the CPU under Triton's interpreter"
          + (" — but Triton was imported first: restart the kernel and run this cell first" if late else ""))
    return True


__all__ = ["interpret_without_cuda"]
