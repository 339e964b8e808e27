"""Hints of the exercise checks of notebooks 05, 06, 07 and 10, each against the wrong answer
it names: a check catches the answer's slip (a crash included) and says what is wrong, and
the numbers it quotes agree with the reference it compares against."""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from moe_lab.sim.schedule import schedule_order
from moe_lab.workbench.exercises import ExerciseError, NotDoneError
from moe_lab.workbench.exercises import nb05_fused_router as ex05
from moe_lab.workbench.exercises import nb06_mxfp8_attention_triton as ex06t
from moe_lab.workbench.exercises import nb07_fused_grouped_gemm_triton as ex07t
from moe_lab.workbench.exercises import nb10_pipeline_layout as ex10

# ------------------------------------------------------------------ 05 · group-limited selection


def _selection_with_a_fixed_top2(scores, n_groups, topk_groups):
    # Right but for one case: topk(2) has no second expert in a group of one.
    tokens, n_experts = scores.shape
    grouped = scores.view(tokens, n_groups, n_experts // n_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    best = group_scores.topk(topk_groups, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, n_experts)


def test_a_crash_on_a_group_of_one_expert_is_a_check_message_that_says_why():
    hint = r"each group holds one expert.*min\(2, experts per group\)"
    with pytest.raises(ExerciseError, match=hint) as err:
        ex05.check_group_limited_selection(_selection_with_a_fixed_top2)
    assert not isinstance(err.value, NotDoneError)
    assert "8 experts in 8 groups" in str(err.value)


# ------------------------------------------------------------------------ 06 · E8M0 block scale


@triton.jit
def _scale_bias_128(x):
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)
    biased = tl.minimum(tl.maximum((amax >> 23) - 127 - 8, -127), 127) + 128  # the bias off by one
    return tl.where(amax > 0x7F800000, 255, biased)


@triton.jit
def _scale_bias_126(x):
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1)
    biased = tl.minimum(tl.maximum((amax >> 23) - 127 - 8, -127), 127) + 126
    return tl.where(amax > 0x7F800000, 255, biased)


@pytest.mark.parametrize("answer, offset", [(_scale_bias_128, "+1"), (_scale_bias_126, "-1")])
def test_a_wrong_bias_is_told_the_bias_is_wrong_not_the_sign_bit(answer, offset):
    with pytest.raises(ExerciseError) as err:
        ex06t.check_e8m0_block_scale(answer)
    message = str(err.value)
    assert f"off by {offset}: the bias is wrong" in message and "+ 127" in message
    assert "sign bit" not in message


# --------------------------------------------------------------------------- 07 · gather_tile


@triton.jit
def _gather_without_top_k_division(x_ptr, src_ptr, rows, row_end, ks, K, TOP_K):
    src = tl.load(src_ptr + rows, mask=rows < row_end, other=-1).to(tl.int64)
    ok = (rows < row_end) & (src >= 0)
    token = tl.where(ok, src, 0)  # the (token, slot) pair used as a token
    return tl.load(x_ptr + token[:, None] * K + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)


def test_a_gather_without_the_top_k_division_is_told_to_divide():
    with pytest.raises(ExerciseError, match=r"src // TOP_K") as err:
        ex07t.check_gather_tile(_gather_without_top_k_division)
    assert "not x[src]" in str(err.value)


# --------------------------------------------------------------------------------- 10 · 1F1B


def _with_warmup(extra):
    def order(rank, n_ranks, n_microbatches):
        warm = max(0, min(n_ranks - rank - 1 + extra, n_microbatches))
        ops = [("F", i) for i in range(warm)]
        for i in range(n_microbatches - warm):
            ops += [("F", warm + i), ("B", i)]
        return ops + [("B", i) for i in range(n_microbatches - warm, n_microbatches)]

    return order


def _gpipe(rank, n_ranks, n_microbatches):
    return [("F", i) for i in range(n_microbatches)] + [("B", i) for i in range(n_microbatches)]


@pytest.mark.parametrize("answer", [_with_warmup(1), _with_warmup(-1), _gpipe],
                         ids=["too-many", "too-few", "gpipe"])
def test_the_1f1b_hint_counts_the_forwards_the_reference_runs_before_its_first_backward(answer):
    for _ in range(5):  # random sizes: the message's figures must hold for whichever it drew
        with pytest.raises(ExerciseError) as err:
            ex10.check_one_f_one_b_order(answer)
        message = str(err.value)
        rank, p, m = map(int, re.search(r"rank=(\d+), n_ranks=(\d+), n_microbatches=(\d+)", message).groups())
        want = [kind for kind, _, _ in schedule_order("1f1b", p, m)[rank]]
        before_b0 = want.index("B")
        warm = re.search(r"min\(p - rank - 1, m\) = (\d+) warm-up forwards", message)
        assert warm is not None, message
        assert int(warm.group(1)) == min(p - rank - 1, m)
        said = re.search(r"(\d+) forwards come before its first backward|after (\d+) forwards"
                         r"|which are all (\d+) of its forwards", message)
        assert said is not None, message
        assert int(next(g for g in said.groups() if g)) == before_b0, message
