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
``nb05_fused_router`` for ``05_fused_router.ipynb``, ...), holds that notebook's checks,
registers its solutions with ``@reference_solution("name")`` and marks each check with
``@exercise("name")``. The Triton exercises launch the learner's ``@triton.jit``
function from a small kernel of the module, compiled on a GPU and under Triton's
interpreter on a CPU (`moe_lab.workbench.exercises.kernel_checks`).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from typing import NoReturn

import torch

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


class NotDone(NotImplementedError):
    """Raised by ``not_done()``, the body of an unsolved stub."""


def not_done(*_args: object, **_kwargs: object) -> NoReturn:
    """The body of an unsolved stub."""
    raise NotDone(f"{NOT_DONE}: write your answer in the cell above")


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


def random_routing(g: torch.Generator, tokens: int, n_experts: int, top_k: int) -> torch.Tensor:
    """``[tokens, top_k]`` distinct expert ids per token, drawn from a random, skewed
    popularity (some experts likely get nothing): fresh inputs for a check."""
    if tokens == 0:
        return torch.zeros(0, top_k, dtype=torch.int64)
    popularity = torch.rand(n_experts, generator=g, dtype=torch.float64) ** 3 + 1e-3
    return torch.multinomial(popularity.expand(tokens, n_experts), top_k, replacement=False,
                             generator=g)


# name -> reference solution; each notebook's module registers its own.
SOLUTIONS: dict[str, Callable] = {}


def reference_solution(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the reference solution of exercise ``name``."""

    def register(fn: Callable) -> Callable:
        if name in SOLUTIONS:
            raise ValueError(f"exercise {name!r} is registered twice")
        SOLUTIONS[name] = fn
        return fn

    return register


def solution(name: str) -> Callable:
    """The reference solution of exercise ``name`` (what ``SOLUTIONS=True`` uses). A check's
    solution sits in its own module, imported with it; any other name imports every notebook's
    module (which needs Triton for notebooks 03-07)."""
    if name not in SOLUTIONS:
        _import_all()
    try:
        return SOLUTIONS[name]
    except KeyError:
        raise ValueError(f"exercise name must be one of {sorted(SOLUTIONS)}, got {name!r}") from None


def not_done_message(name: str, err: NotDoneError) -> str:
    """What a notebook prints for an exercise not written yet."""
    return (f"◻ exercise {name!r} is not done yet. To do: {err.todo}; the check then says "
            "whether your answer is right.\n  Meanwhile the cells below use the reference solution.")


def exercise(name: str) -> Callable[[Callable], Callable]:
    """Decorator for ``check_…(answer, ...)``, the check of exercise ``name``.

    The decorated check takes a keyword ``solutions``: None (the default) only checks;
    True checks the reference solution and returns it; False checks ``answer`` and returns
    it when right, raises ``ExerciseError`` when wrong, and when the stub is not written
    yet prints so (`not_done_message`) and returns the reference solution.
    """

    def wrap(check: Callable) -> Callable:
        @functools.wraps(check)
        def run(answer: object, *args: object, solutions: bool | None = None, **kwargs: object) -> object:
            if solutions is not None and not isinstance(solutions, bool):  # -p SOLUTIONS false: "false"
                raise ValueError(f"solutions must be True, False or None, got {solutions!r}")
            if solutions:
                answer = solution(name)
            if solutions is None or solutions:
                check(answer, *args, **kwargs)
                return answer
            try:
                check(answer, *args, **kwargs)
            except NotDoneError as err:
                print(not_done_message(name, err))
                return solution(name)
            return answer

        run.exercise_name = name
        return run

    return wrap


def _import_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
