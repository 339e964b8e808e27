"""Checks for the learner's answers.

Each exercise in a notebook is a stub the learner fills in and a ``check_<name>(fn)``
that runs ``fn`` on fresh random inputs against the package's reference and *raises*
``ExerciseError`` with a helpful message when the answer is wrong — a headless run never
"passes" a wrong answer. An answer not written yet (a stub that still says ``not_done()``,
or a Triton stub that still holds its ``tl.static_assert(False, "exercise not solved
yet")`` line) raises
``NotDoneError``, a kind of ``ExerciseError``.

A notebook cell calls the check with the notebook's ``SOLUTIONS`` parameter::

    tokens_per_expert = check_tokens_per_expert(tokens_per_expert, solutions=SOLUTIONS)

``solutions=True`` (``make workbook``, CI, the tests) checks the reference solution and
returns it. ``solutions=False`` (what a learner opens) checks the learner's answer: right,
it is returned; wrong, ``ExerciseError`` stops the cell; not written yet, the check prints
that the exercise is not done and what to do, and returns the reference solution, so the
notebook still runs to its end and the cells below use the reference. Called without
``solutions`` a check only checks (and raises ``NotDoneError`` for a stub).

One module per notebook, named after it (``nb00_lab_bench`` for ``00_lab_bench.ipynb``,
``nb05_fused_router`` for ``05_fused_router.ipynb``, ...), holds that notebook's reference
solutions and checks, and marks each check with ``@exercise(reference)``: the exercise is
named after its reference solution (``@exercise(keep_mask)`` checks ``keep_mask``). The
Triton exercises launch the learner's ``@triton.jit`` function from a small kernel of the
module, compiled on a GPU and under Triton's interpreter on a CPU
(`moe_lab.workbench.exercises.kernel_checks`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NoReturn

import torch

from moe_lab.training.sync import count_syncs

#: The message a Triton stub's ``tl.static_assert(False, NOT_DONE)`` line carries, and what
#: ``not_done()`` raises: how a check tells "not written yet" from "wrong".
NOT_DONE = "exercise not solved yet"


class ExerciseError(AssertionError):
    """The learner's answer is wrong (or not written yet)."""


class NotDoneError(ExerciseError):
    """The learner's answer is not written yet: the stub is still there. ``todo`` says what
    to do about it."""

    def __init__(self, name: str, todo: str) -> None:
        super().__init__(f"{name}: {NOT_DONE} — {todo}")
        self.todo = todo


def not_done(*_args: object, **_kwargs: object) -> NoReturn:
    """The body of an unsolved stub: a ``NotImplementedError`` carrying `NOT_DONE`."""
    raise NotImplementedError(f"{NOT_DONE}: write your answer in the cell above")


def call_answer(fn: Callable, *args: object, **kwargs: object) -> object:
    """Call the learner's ``fn``; an unsolved stub becomes a ``NotDoneError``."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        name = getattr(fn, "__name__", "your function")
        if NOT_DONE in str(exc):
            raise NotDoneError(name, f"in {name}, replace `return not_done()` with your answer "
                               "and run the cell again") from None
        raise ExerciseError(f"{name}: {exc}") from None


def require_sync_free(fn: Callable, args: tuple, advice: str) -> None:
    """Raise `ExerciseError` (with ``advice``) when ``fn(*args)``, an answer already found
    right, makes the host wait for the device (`moe_lab.training.sync.count_syncs`)."""
    _, syncs = count_syncs(fn, *args)
    if sum(syncs.values()):
        raise ExerciseError(f"correct, but it syncs with the host: {dict(syncs)}; {advice}")


def require_tensor(got: object, shape: tuple[int, ...], expected: str, then: str = "") -> None:
    """Raise `ExerciseError` ``"{expected}, got <got's shape, or its type>{then}"`` unless
    ``got`` is a tensor of ``shape``: the first thing a check asks of a tensor answer."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(shape):
        raise ExerciseError(f"{expected}, got {getattr(got, 'shape', type(got).__name__)}{then}")


def close(got: object, want: float, rel: float = 1e-6, abs_tol: float = 0.0) -> bool:
    """True when ``got`` is a number (anything ``float`` takes) within ``rel`` (relative) or
    ``abs_tol`` of ``want``: how a check compares a scalar answer."""
    try:
        return math.isclose(float(got), want, rel_tol=rel, abs_tol=abs_tol)
    except (TypeError, ValueError):
        return False


def random_routing(g: torch.Generator, tokens: int, n_experts: int, top_k: int) -> torch.Tensor:
    """``[tokens, top_k]`` distinct expert ids per token, drawn from a random, skewed
    popularity (some experts likely get nothing): fresh inputs for a check."""
    popularity = torch.rand(n_experts, generator=g, dtype=torch.float64) ** 3 + 1e-3
    return torch.multinomial(popularity.expand(tokens, n_experts), top_k, replacement=False,
                             generator=g)


def offsets_of(counts: list[int]) -> torch.Tensor:
    """``[len(counts) + 1]`` int32: where each of experts with ``counts`` rows starts."""
    return torch.tensor([0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


# exercise name -> reference solution; `exercise` registers each.
SOLUTIONS: dict[str, Callable] = {}


def exercise(reference: Callable) -> Callable[[Callable], Callable]:
    """Decorator for ``check_…(answer, ...)``, the check of the exercise whose reference
    solution is ``reference`` (a function, or a ``@triton.jit`` one): the exercise takes its
    name, and `SOLUTIONS` holds it under that name.

    The decorated check takes a keyword ``solutions``: None (the default) only checks;
    True checks the reference solution and returns it; False checks ``answer`` and returns
    it when right, raises ``ExerciseError`` when wrong, and when the stub is not written
    yet prints so and returns the reference solution.
    """
    name = reference.__name__
    SOLUTIONS[name] = reference

    def wrap(check: Callable) -> Callable:
        @functools.wraps(check)
        def run(answer: object, *args: object, solutions: bool | None = None, **kwargs: object) -> object:
            if solutions is not None and not isinstance(solutions, bool):  # -p SOLUTIONS false: "false"
                raise ValueError(f"solutions must be True, False or None, got {solutions!r}")
            if solutions:
                answer = reference
            try:
                check(answer, *args, **kwargs)
            except NotDoneError as err:
                if solutions is None:
                    raise
                print(f"◻ exercise {name!r} is not done yet. To do: {err.todo}; the check then says whether "
                      "your answer is right.\n  Meanwhile the cells below use the reference solution.")
                return reference
            return answer

        run.exercise_name = name
        return run

    return wrap
