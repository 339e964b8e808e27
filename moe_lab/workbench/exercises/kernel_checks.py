"""What the Triton exercises share: where their tensors live, and launching the learner's code.

A Triton exercise hands the learner's ``@triton.jit`` function to a small kernel of its
notebook's module (a ``@triton.jit`` kernel) as a ``tl.constexpr`` argument (Triton inlines a
jitted function passed that way), or launches the learner's kernel itself. On a GPU it is
compiled; on a CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, which the
notebook's setup cell sets where there is no CUDA:
`moe_lab.workbench.lab.triton_mode.interpret_without_cuda`), one Python call per program
instance — so the checks use float32, large blocks and small problems.

A stub holds the line ``tl.static_assert(False, "exercise not solved yet")``: compiled it
fails at compile time, interpreted when it runs, and either way `launch_answer` turns it
into `NotDoneError`. Any other failure of the learner's code — a compile error, a shape
mismatch — becomes an `ExerciseError` carrying Triton's message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_lab.workbench.exercises import NOT_DONE, ExerciseError, NotDoneError


def interpreted() -> bool:
    """True when Triton runs under its interpreter here."""
    from moe_lab.perf.capabilities import triton_interpreted

    return triton_interpreted()


def kernel_device() -> torch.device:
    """Where a Triton exercise's tensors live: the GPU when Triton compiles for it, else the
    CPU (interpreted Triton reads and writes host memory)."""
    return torch.device("cuda" if torch.cuda.is_available() and not interpreted() else "cpu")


def launch_answer(name: str, kernel: object, grid: Sequence[int], *args: object, **kwargs: object) -> None:
    """``kernel[grid](*args, **kwargs)``, where the kernel is the learner's or calls the
    learner's function: an unsolved stub raises `NotDoneError`, any other failure of the
    launch `ExerciseError` with Triton's message."""
    try:
        kernel[tuple(grid)](*args, **kwargs)
    except Exception as exc:  # the interpreter's and the compiler's errors have no common base
        parts, seen, cause = [], set(), exc  # the messages of the exception and its causes
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            parts.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        text = "\n".join(parts)
        if NOT_DONE in text:
            raise NotDoneError(name, f"in {name}, replace the line `tl.static_assert(False, "
                               f"\"{NOT_DONE}\")` with your answer and run the cell again") from None
        last_lines = "\n".join([line for line in text.splitlines() if line.strip()][-12:])
        raise ExerciseError(f"{name}: your Triton code failed to run:\n{last_lines}") from None


def where_differs(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> tuple | None:
    """The first index where ``got`` and ``want`` differ beyond the tolerance (NaN equal to
    NaN), or None."""
    bad = ~torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if not bool(bad.any()):
        return None
    return tuple(bad.nonzero()[0].tolist())

