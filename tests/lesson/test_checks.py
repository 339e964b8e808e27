"""The shared argument checks: what passes, and the message of what does not."""

from __future__ import annotations

import numpy as np
import pytest

from moe_lab.checks import (
    boolean,
    int_in,
    integer,
    non_negative_int,
    non_negative_ints,
    non_negative_number,
    one_of,
    positive_int,
    positive_ints,
    positive_number,
)


def test_positive_int_takes_integers_from_one_on_numpy_ones_included():
    assert positive_int(1, "n") == 1 and positive_int(np.int64(7), "n") == 7
    assert type(positive_int(np.int32(3), "n")) is int
    assert positive_int(None, "n", or_none=True) is None


@pytest.mark.parametrize("bad", [0, -3, True, False, 2.0, "2", None, [1]])
def test_positive_int_refuses_with_the_arguments_name(bad):
    with pytest.raises(ValueError, match=r"^batch_size must be a positive integer, got "):
        positive_int(bad, "batch_size")


def test_or_none_is_named_in_the_message():
    with pytest.raises(ValueError, match="must be a positive integer or None, got 0"):
        positive_int(0, "seq_len", or_none=True)


def test_integer_takes_any_integer_but_a_bool():
    assert integer(-5, "seed") == -5 and integer(np.uint8(3), "seed") == 3
    for bad in (True, 1.5, "1"):
        with pytest.raises(ValueError, match="seed must be an integer, got "):
            integer(bad, "seed")


def test_non_negative_int_and_int_in():
    assert non_negative_int(0, "n") == 0
    with pytest.raises(ValueError, match="n must be a non-negative integer, got -1"):
        non_negative_int(-1, "n")
    assert int_in(5, "seed", 0, 5) == 5
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 5\], got 6"):
        int_in(6, "seed", 0, 5)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_positive_number_refuses_zero_negative_and_non_finite(bad):
    with pytest.raises(ValueError, match="lr must be a finite number > 0"):
        positive_number(bad, "lr")
    assert positive_number(3, "lr") == 3.0


def test_field_checks_name_the_type_and_the_field():
    class Cfg:
        steps, warmup = 0, -1

    with pytest.raises(ValueError, match=r"^Cfg\.steps must be a positive integer, got 0$"):
        positive_ints(Cfg(), "steps")
    with pytest.raises(ValueError, match=r"^Cfg\.warmup must be a non-negative integer, got -1$"):
        non_negative_ints(Cfg(), "warmup")


def test_one_of_lists_the_choices_and_survives_unhashable_values():
    assert one_of("a", "kind", {"a": 1, "b": 2}) == "a"
    with pytest.raises(ValueError, match=r"kind must be one of \['a', 'b'\], got 'c'"):
        one_of("c", "kind", ("b", "a"))
    with pytest.raises(ValueError, match="got \\[1\\]"):
        one_of([1], "kind", {"a": 1})


@pytest.mark.parametrize("bad", [-1e-9, float("nan"), float("inf"), True, "0"])
def test_non_negative_number_refuses_negative_and_non_finite(bad):
    with pytest.raises(ValueError, match="coef must be a finite number >= 0"):
        non_negative_number(bad, "coef")
    assert non_negative_number(0, "coef") == 0.0


@pytest.mark.parametrize("bad", ["no", "false", 0, 1, None])
def test_boolean_refuses_what_only_looks_like_a_bool(bad):
    with pytest.raises(ValueError, match="flag must be True or False"):
        boolean(bad, "flag")
    assert boolean(False, "flag") is False
