"""Checks for the learner's answers.

Each exercise in a notebook is a stub the learner fills in and a ``check_<name>(fn)``
that runs ``fn`` on fresh random inputs against the package's reference and *raises*
``ExerciseError`` with a helpful message when the answer is wrong — a headless run never
"passes" an unsolved exercise. The notebook parameter ``SOLUTIONS=True`` (CI) passes the
reference solution itself, so the same check runs either way.
"""

from __future__ import annotations

from collections.abc import Callable


class ExerciseError(AssertionError):
    """The learner's answer is wrong (or not written yet)."""


def not_done(*_args, **_kwargs):
    """The body of an unsolved stub."""
    raise NotImplementedError("exercise not solved yet: write your answer in the cell above")


def _call(fn: Callable, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        raise ExerciseError(f"{getattr(fn, '__name__', 'your function')}: {exc}") from None


def solution(name: str) -> Callable:
    """The reference solution of exercise ``name`` (what ``SOLUTIONS=True`` uses)."""
    try:
        return SOLUTIONS[name]
    except KeyError:
        raise ValueError(f"exercise name must be one of {sorted(SOLUTIONS)}, got {name!r}") from None


# name -> reference solution; each notebook's section below registers its own.
SOLUTIONS: dict[str, Callable] = {}
