"""The CPU token permutation (moe_lab.workbench.cpu.permute) against the plain-PyTorch
references of moe_lab.kernels.permute: the counting-sort row-id map equals a stable argsort,
permute equals ``index_copy`` bit for bit, unpermute equals the weighted ``index_select``
sum, gradients match autograd on the references; bad maps raise instead of touching memory."""

from __future__ import annotations

import pytest
import torch
from support import topk  # the Triton kernels' routings generator: distinct experts per token

from moe_lab.kernels.permute import (
    make_row_id_map_reference,
    permute_reference,
    permuted_rows,
    unpermute_reference,
)
from moe_lab.workbench.cpu import permute as cp
from moe_lab.workbench.cpu.build import compiler

pytestmark = [pytest.mark.skipif(compiler() is None,
                                reason="no C++ compiler: moe_lab's CPU kernels cannot be built"),
              pytest.mark.usefixtures("cpu_plugin")]


ROUTINGS = {
    "random": lambda: (topk(37, 3, 5), 5),
    "skewed_empty_experts": lambda: (topk(40, 2, 12, skew=3.0), 12),
    "no_tokens": lambda: (torch.zeros(0, 2, dtype=torch.int64), 4),
    "all_to_one_expert": lambda: (torch.full((29, 1), 3, dtype=torch.int64), 6),
    "k_equals_E": lambda: (topk(21, 4, 4), 4),
    "one_expert": lambda: (torch.zeros(13, 1, dtype=torch.int64), 1),
    "contest_shape": lambda: (topk(2048, 4, 16, skew=0.5), 16),  # the small preset's layer
    "int32_ids": lambda: (topk(33, 2, 7).int(), 7),
}


@pytest.mark.parametrize("align", [1, 16, 64])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_row_id_map_equals_stable_argsort(name, align):
    ids, n_experts = ROUTINGS[name]()
    row_id_map, offsets = cp.make_row_id_map(ids, n_experts, align=align)
    ref_map, ref_offsets = make_row_id_map_reference(ids, n_experts, align)
    assert row_id_map.dtype == offsets.dtype == torch.int32
    assert row_id_map.shape == ids.shape and offsets.shape == (n_experts + 1,)
    assert torch.equal(row_id_map, ref_map)
    assert torch.equal(offsets, ref_offsets)
    assert int(offsets[-1]) <= permuted_rows(*ids.shape, n_experts, align)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["random", "skewed_empty_experts", "no_tokens", "one_expert",
                                  "contest_shape"])
def test_permute_is_index_copy_bit_for_bit(name, dtype):
    ids, n_experts = ROUTINGS[name]()
    row_id_map, _ = cp.make_row_id_map(ids, n_experts, align=8)
    n_rows = permuted_rows(*ids.shape, n_experts, 8)
    # Dirty memory of the output's size first, so a padding row left unwritten shows.
    torch.full((n_rows, 48), float("nan"), dtype=dtype).sum()
    x = torch.randn(ids.shape[0], 96).to(dtype)[:, ::2]  # non-contiguous rows
    y = cp.permute(x, row_id_map, n_rows)
    assert torch.equal(y, permute_reference(x, row_id_map, n_rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["random", "skewed_empty_experts", "all_to_one_expert", "contest_shape"])
def test_weighted_permute_and_unpermute_match_the_references(name, dtype):
    ids, n_experts = ROUTINGS[name]()
    tokens, k = ids.shape
    row_id_map, _ = cp.make_row_id_map(ids, n_experts, align=4)
    n_rows = permuted_rows(tokens, k, n_experts, 4)
    x = torch.randn(tokens, 40).to(dtype)
    w = torch.rand(tokens, k)
    y = cp.permute(x, row_id_map, n_rows, weights=w)
    # the reference: w·x in float32, one rounding, rows index-copied
    scaled = (x.float().unsqueeze(1) * w.unsqueeze(-1)).to(dtype).reshape(tokens * k, -1)
    ref = torch.zeros(n_rows, 40, dtype=dtype).index_copy(0, row_id_map.reshape(-1).long(), scaled)
    assert torch.equal(y, ref)
    ys = torch.randn(n_rows, 40).to(dtype)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for weights in (w, None):
        out = cp.unpermute(ys, row_id_map, weights)
        assert out.dtype == dtype and out.shape == (tokens, 40)
        torch.testing.assert_close(out, unpermute_reference(ys, row_id_map, weights), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_autograd_on_the_references(dtype):
    ids, n_experts = topk(300, 4, 16, skew=1.0), 16
    row_id_map, _ = cp.make_row_id_map(ids, n_experts, align=16)
    n_rows = permuted_rows(300, 4, n_experts, 16)
    x = torch.randn(300, 64).to(dtype).requires_grad_()
    w = torch.rand(300, 4, requires_grad=True)
    out = cp.unpermute(cp.permute(x, row_id_map, n_rows).sin(), row_id_map, w)
    ref = unpermute_reference(permute_reference(x, row_id_map, n_rows).sin(), row_id_map, w)
    g = torch.randn_like(out)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(torch.autograd.grad(out, (x, w), g, retain_graph=True),
                    torch.autograd.grad(ref, (x, w), g), strict=True):
        torch.testing.assert_close(a, b, **tol)
    # The weighted permute's own backward (the unpermute's dy, and its weights' gradient).
    xw = torch.randn(300, 64, requires_grad=True)
    yw = cp.permute(xw, row_id_map, n_rows, weights=w)
    gy = torch.randn_like(yw)
    dx, dw = torch.autograd.grad(yw, (xw, w), gy)
    picked = gy.index_select(0, row_id_map.reshape(-1).long()).view(300, 4, 64)
    torch.testing.assert_close(dx, (picked * w.detach().unsqueeze(-1)).sum(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, (picked * xw.detach().unsqueeze(1)).sum(-1), rtol=1e-5, atol=1e-5)


def test_a_nan_stays_in_its_token():
    ids, n_experts = topk(50, 2, 6), 6
    row_id_map, _ = cp.make_row_id_map(ids, n_experts, align=8)
    n_rows = permuted_rows(50, 2, n_experts, 8)
    x = torch.randn(50, 16)
    x[7, 3] = float("nan")
    y = cp.permute(x, row_id_map, n_rows)
    bad_rows = torch.isnan(y).any(1).nonzero().flatten().sort().values
    assert torch.equal(bad_rows, row_id_map[7].long().sort().values)
    out = cp.unpermute(y, row_id_map, torch.rand(50, 2))
    assert torch.equal(torch.isnan(out).any(1).nonzero().flatten(), torch.tensor([7]))


def test_compiled_matches_eager():
    ids, n_experts = topk(64, 2, 8), 8
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.rand(64, 2, requires_grad=True)

    def layer(x, ids, w):
        row_id_map, offsets = cp.make_row_id_map(ids, n_experts, align=4)
        y = cp.permute(x, row_id_map, permuted_rows(64, 2, n_experts, 4))
        return cp.unpermute(y * 2.0, row_id_map, w), offsets

    eager, off = layer(x, ids, w)
    compiled, off_c = torch.compile(layer, fullgraph=True)(x, ids, w)
    assert torch.equal(off, off_c)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    g = torch.randn_like(eager)
    for a, b in zip(torch.autograd.grad(eager, (x, w), g), torch.autograd.grad(compiled, (x, w), g),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bad_input_raises_with_the_argument_named():
    ids = topk(10, 2, 4)
    row_id_map, _ = cp.make_row_id_map(ids, 4)
    x = torch.randn(10, 8)
    with pytest.raises(RuntimeError, match=r"expert ids in \[0, 4\)"):
        cp.make_row_id_map(torch.tensor([[0, 4]]), 4)
    with pytest.raises(RuntimeError, match=r"expert ids in \[0, 4\)"):
        cp.make_row_id_map(torch.tensor([[-1, 0]]), 4)
    with pytest.raises(RuntimeError, match="topk_ids must be"):
        cp.make_row_id_map(ids.float(), 4)
    with pytest.raises(RuntimeError, match="n_experts"):
        cp.make_row_id_map(ids, 0)
    with pytest.raises(RuntimeError, match="align"):
        cp.make_row_id_map(ids, 4, align=0)
    with pytest.raises(RuntimeError, match="row_id_map must be"):
        cp.permute(x, row_id_map.long(), 20)
    with pytest.raises(RuntimeError, match="row_id_map must be"):
        cp.permute(x[:9], row_id_map, 20)
    with pytest.raises(RuntimeError, match="n_rows must be at least"):
        cp.permute(x, row_id_map, 19)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        cp.permute(x.double(), row_id_map, 20)
    with pytest.raises(RuntimeError, match="weights must be"):
        cp.unpermute(torch.randn(20, 8), row_id_map, torch.rand(10, 3))
    outside = row_id_map.clone()
    outside[3, 1] = 20
    with pytest.raises(RuntimeError, match="outside the 20 rows"):
        cp.permute(x, outside, 20)
    with pytest.raises(RuntimeError, match="outside the 20 rows"):
        cp.unpermute(torch.randn(20, 8), outside)
    twice = row_id_map.clone()
    twice[3, 1] = twice[2, 0]
    with pytest.raises(RuntimeError, match="two \\(token, slot\\) pairs"):
        cp.permute(x, twice, 20)


# ------------------------------------------------------------------------------ the router's top-k


def _scores(rows: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    x[:, : n // 2] = x[:, : n // 2].round(decimals=1)  # many exact ties, at every rank
    return x


@pytest.mark.parametrize("rows, n, k", [(2048, 16, 4), (37, 5, 5), (9, 1, 1), (0, 8, 2), (7, 6, 0),
                                        (300, 64, 8), (5, 257, 3)])
def test_topk_lowest_index_equals_the_pytorch_reference(rows, n, k):
    from moe_lab.moe.router import topk_by_unique_keys

    x = _scores(rows, n, seed=rows + n + k)
    ours = cp.topk_lowest_index(x, k)
    assert ours.dtype == torch.int64 and ours.shape == (rows, k)
    assert torch.equal(ours, topk_by_unique_keys(x, k))
    # a non-contiguous view (every other column) gives its contiguous copy's answer
    wide = _scores(rows, 2 * n, seed=1)[:, ::2]
    assert torch.equal(cp.topk_lowest_index(wide, k), topk_by_unique_keys(wide.contiguous(), k))


def test_topk_lowest_index_special_values_and_signed_zeros():
    from moe_lab.moe.router import topk_by_unique_keys

    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, -0.0, 1.0, -1.0, 0.0],       # -0.0 ties with +0.0: the lower index first
                      [-inf, -inf, -inf, 2.0, -inf],       # -inf ties among themselves
                      [nan, inf, 3.0, -nan, 1e-45],        # NaN above +inf; a negative NaN last
                      [1e38, -1e38, inf, -inf, 0.5]])
    ours = cp.topk_lowest_index(x, 5)
    assert torch.equal(ours, topk_by_unique_keys(x, 5))
    assert ours[0].tolist() == [2, 0, 1, 4, 3]
    assert ours[1].tolist() == [3, 0, 1, 2, 4]
    assert ours[2, 0] == 0 and ours[2, -1] == 3


def test_topk_lowest_index_does_not_depend_on_the_thread_count():
    x = _scores(4096, 16, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cp.topk_lowest_index(x, 4)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, cp.topk_lowest_index(x, 4))


def test_the_cpu_topk_router_takes_the_kernel_and_the_reference_never_does(monkeypatch):
    import moe_lab.workbench.cpu
    from moe_lab.config import MoEConfig
    from moe_lab.moe import router

    assert moe_lab.workbench.cpu.register()
    calls = []
    kernel = cp.topk_lowest_index
    monkeypatch.setattr(cp, "topk_lowest_index", lambda v, k: calls.append(tuple(v.shape)) or kernel(v, k))
    x = _scores(512, 16, seed=5).requires_grad_()
    ids = cp.router_topk(x, 4)
    assert calls == [(512, 16)]  # the kernel, not the PyTorch form
    assert torch.equal(ids, router.topk_by_unique_keys(x, 4))
    compiled = torch.compile(cp.router_topk, fullgraph=True, dynamic=False)
    with torch.profiler.profile() as prof:
        assert torch.equal(compiled(x, 4), ids)
    assert any("cpu_topk_lowest_index" in e.key for e in prof.key_averages())
    y = x.gather(1, ids).sum()  # the values keep their gradient through the gather
    y.backward()
    assert x.grad.sum() == 512 * 4
    # float64 and other ranks keep the PyTorch forms
    calls.clear()
    assert torch.equal(cp.router_topk(x.detach().double(), 4), ids)
    cube = _scores(24, 16, seed=6).view(2, 12, 16)
    assert torch.equal(cp.router_topk(cube, 4), router.topk_by_unique_keys(cube, 4))
    assert calls == []
    # the registered router: the reference chain with this top-k, the same routing; the
    # reference router stays pure PyTorch with the plug-in loaded
    cfg = MoEConfig(d_model=16, n_experts=16, top_k=4, n_groups=4, topk_groups=2, d_expert=8)
    tokens, weight = torch.randn(64, 16), torch.randn(16, 16)
    ref = router.ROUTER_IMPLS["reference"](tokens, weight, cfg)
    assert calls == []
    mine = router.ROUTER_IMPLS["cpu_topk"](tokens, weight, cfg)
    assert calls == [(64, 4), (64, 16)]  # the groups, then the experts
    assert torch.equal(mine.topk_ids, ref.topk_ids)
    assert torch.equal(mine.topk_weights, ref.topk_weights)


def test_topk_lowest_index_bad_input():
    x = torch.randn(4, 6)
    with pytest.raises(RuntimeError, match=r"k must be in \[0, n = 6\]"):
        cp.topk_lowest_index(x, 7)
    with pytest.raises(RuntimeError, match="k must be"):
        cp.topk_lowest_index(x, -1)
    with pytest.raises(RuntimeError, match=r"values must be \[T, n\] float32"):
        cp.topk_lowest_index(x.double(), 2)
    with pytest.raises(RuntimeError, match=r"values must be \[T, n\] float32"):
        cp.topk_lowest_index(x[0], 2)
