"""Checks for the learner's answers.

Each exercise in a notebook is a stub the learner fills in and a ``check_<name>(fn)``
that runs ``fn`` on fresh random inputs against the package's reference and *raises*
``ExerciseError`` with a helpful message when the answer is wrong — a headless run never
"passes" an unsolved exercise. The notebook parameter ``SOLUTIONS=True`` (CI) passes the
reference solution itself, so the same check runs either way.

One module per notebook, named after it (``nb00_lab_bench`` for ``00_lab_bench.ipynb``,
``nb04_fused_router`` for ``04_fused_router.ipynb``, ...), holds that notebook's checks and
registers its solutions with ``@reference_solution("name")``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

import torch


class ExerciseError(AssertionError):
    """The learner's answer is wrong (or not written yet)."""


def not_done(*_args, **_kwargs):
    """The body of an unsolved stub."""
    raise NotImplementedError("exercise not solved yet: write your answer in the cell above")


def call_answer(fn: Callable, *args, **kwargs):
    """Call the learner's ``fn``; an unsolved stub becomes an ``ExerciseError``."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        raise ExerciseError(f"{getattr(fn, '__name__', 'your function')}: {exc}") from None


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
    """The reference solution of exercise ``name`` (what ``SOLUTIONS=True`` uses)."""
    _import_all()
    try:
        return SOLUTIONS[name]
    except KeyError:
        raise ValueError(f"exercise name must be one of {sorted(SOLUTIONS)}, got {name!r}") from None


def _import_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
