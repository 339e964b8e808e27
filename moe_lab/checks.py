"""Argument checks every module shares: one message per kind of mistake, naming the argument.

``positive_int(batch_size, "batch_size")`` returns the value or raises ``ValueError("batch_size
must be a positive integer, got 0")``; a dataclass checks its fields with
``positive_ints(self, "steps", "batch_size")``, which names them ``TrainConfig.steps``. A bool is
never an integer here (``True`` is not a batch size), and a NumPy integer is one.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable


def _require(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def integer(value: object, name: str) -> int:
    """``value`` if it is an integer (not a bool), else ``ValueError``."""
    _require(_is_int(value), name, "an integer", value)
    return int(value)


def positive_int(value: object, name: str, *, or_none: bool = False) -> int | None:
    """``value`` if it is an integer ``>= 1`` (or ``None`` where ``or_none``), else ``ValueError``."""
    if value is None and or_none:
        return None
    either = " or None" if or_none else ""
    _require(_is_int(value) and value >= 1, name, f"a positive integer{either}", value)
    return int(value)


def non_negative_int(value: object, name: str) -> int:
    """``value`` if it is an integer ``>= 0``, else ``ValueError``."""
    _require(_is_int(value) and value >= 0, name, "a non-negative integer", value)
    return int(value)


def int_in(value: object, name: str, low: int, high: int) -> int:
    """``value`` if it is an integer in ``[low, high]``, else ``ValueError``."""
    _require(_is_int(value) and low <= value <= high, name, f"an integer in [{low}, {high}]", value)
    return int(value)


def positive_number(value: object, name: str) -> float:
    """``value`` if it is a finite real number ``> 0``, else ``ValueError``."""
    _require(_is_finite(value) and value > 0, name, "a finite number > 0", value)
    return float(value)


def non_negative_number(value: object, name: str) -> float:
    """``value`` if it is a finite real number ``>= 0``, else ``ValueError``."""
    _require(_is_finite(value) and value >= 0, name, "a finite number >= 0", value)
    return float(value)


def boolean(value: object, name: str) -> bool:
    """``value`` if it is a bool (``"no"``, ``0`` and ``None`` are not), else ``ValueError``."""
    _require(isinstance(value, bool), name, "True or False", value)
    return value


def positive_ints(obj: object, *fields: str) -> None:
    """`positive_int` on each named attribute of ``obj``, named ``Type.field`` in the error."""
    for field in fields:
        positive_int(getattr(obj, field), f"{type(obj).__name__}.{field}")


def non_negative_ints(obj: object, *fields: str) -> None:
    """`non_negative_int` on each named attribute of ``obj``, named ``Type.field``."""
    for field in fields:
        non_negative_int(getattr(obj, field), f"{type(obj).__name__}.{field}")


def one_of(value: object, name: str, choices: tuple | list | dict) -> object:
    """``value`` if it is one of ``choices``, else ``ValueError`` listing them."""
    if value not in list(choices):  # by ==, so an unhashable value is refused, not a TypeError
        raise ValueError(f"{name} must be one of {sorted(choices, key=str)}, got {value!r}")
    return value


def first_derivative_only(what: str) -> Callable[[Callable], Callable]:
    """Decorator for a custom backward: in a backward run with ``create_graph=True`` (a double
    backward, e.g. a gradient penalty) it raises, in one line naming ``what``, instead of
    autograd's messages about ``once_differentiable`` or a missing formula. Autograd runs a
    backward with grad mode on exactly when a graph of it is being built."""

    def wrap(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def run(*args: object) -> object:
            import torch

            if torch.is_grad_enabled():
                raise RuntimeError(f"{what} has a first derivative only: a backward with "
                                   "create_graph=True (a double backward) is not supported")
            return backward(*args)

        return run

    return wrap
