"""Pipeline layout strings: parsing, formatting, syntax errors, coverage of a model's layers."""

from __future__ import annotations

import numpy as np
import pytest

from moe_lab.config import preset
from moe_lab.sim.layout import check_layout, format_layout, parse_layout

MEGATRON_EXAMPLE = "Et*3|(tt|)*29,m|L"


def test_megatron_example_parses_to_its_documented_stages():
    layout = parse_layout(MEGATRON_EXAMPLE, n_ranks=16)
    assert layout.stages == ("Ettt",) + ("tt",) * 29 + ("m", "L")
    assert layout.n_chunks == 2
    # Megatron's convention: virtual stage k lives on rank k % p, chunk k // p.
    assert layout.rank_stages(0) == [0, 16]
    assert layout.rank_stages(15) == [15, 31]
    check_layout(layout, preset("deepseek_v3"))


def test_format_is_compact_and_round_trips_the_example():
    layout = parse_layout(MEGATRON_EXAMPLE, n_ranks=16)
    text = format_layout(layout)
    assert text == "Ettt|(tt|)*29,m|L"
    assert parse_layout(text, n_ranks=16) == layout


def test_nested_groups_commas_and_spaces():
    layout = parse_layout(" E (t(t|)*2 )*2 , L")
    assert layout.stages == ("Ett", "t", "tt", "t", "L")
    assert parse_layout("(E|t*2)*1,|L").stages == ("E", "tt", "L")


@pytest.mark.parametrize("seed", range(20))
def test_format_parse_round_trip_on_random_layouts(seed):
    rng = np.random.default_rng(seed)
    n_stages = int(rng.integers(1, 40))
    stages = []
    for _ in range(n_stages):
        if stages and rng.random() < 0.5:
            stages.append(stages[-1])  # runs of equal stages exercise the (..|)*n form
            continue
        length = int(rng.integers(0, 9))
        stages.append("".join(rng.choice(list("EtmL"), size=length, p=[0.05, 0.8, 0.05, 0.1])))
    text = format_layout(stages)
    assert parse_layout(text).stages == tuple(stages), text


@pytest.mark.parametrize(
    ("text", "position", "fragment"),
    [
        ("Et*x|L", 3, "repeat count"),
        ("Et*0|L", 2, ">= 1"),
        ("E(tt|L", 1, "never closed"),
        ("Ett)|L", 3, "without a matching"),
        ("*3t", 0, "must follow"),
        ("Et|()|L", 4, "empty group"),
        ("EtQ|L", 2, "unknown character 'Q'"),
    ],
)
def test_syntax_errors_name_the_position(text, position, fragment):
    with pytest.raises(ValueError) as info:
        parse_layout(text)
    message = str(info.value)
    assert f"at position {position}" in message
    assert fragment in message


def test_stage_count_must_divide_by_ranks():
    with pytest.raises(ValueError, match="n_ranks=3 does not divide"):
        parse_layout("Et|t|tL|t", n_ranks=3)


def test_layout_must_cover_every_layer():
    cfg = preset("deepseek_v3")
    with pytest.raises(ValueError, match=r"60 × 't'.*expected 61"):
        check_layout(parse_layout("Et*2|(tt|)*29,m|L", 16), cfg)
    with pytest.raises(ValueError, match="0 × 'm'"):
        check_layout(parse_layout("Et*3|(tt|)*29,L", 31), cfg)
    with pytest.raises(ValueError, match="wrong order"):
        check_layout(parse_layout("Et*3|(tt|)*28,tm|tL", 31), cfg)
