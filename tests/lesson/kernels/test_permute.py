"""Token permutation (moe_lab.kernels.permute): the device-built row-id map equals a stable
argsort, permute equals ``index_copy`` bit for bit, unpermute equals the weighted
``index_select`` sum, gradients match autograd on the references, and nothing syncs.

Kernel outputs that the kernels fill completely are allocated poisoned here (NaN, or -7
for integers: `moe_lab.kernels.common.poison_outputs`), so an element a kernel forgot to write
fails the comparison. Tensors live on the ``device`` fixture's device (CUDA: compiled kernels;
else the CPU, interpreted); the small blocks a GPU uses are forced (what the compiled kernels
become is tests/workbench/compile_report/test_specs.py's).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support import poison_outputs, topk

from moe_lab.kernels import permute as pm
from moe_lab.kernels.permute import (
    make_row_id_map,
    make_row_id_map_reference,
    permute,
    permute_reference,
    permuted_rows,
    unpermute,
    unpermute_reference,
)
from moe_lab.training.sync import assert_sync_free, count_syncs


@pytest.fixture(autouse=True)
def poisoned_outputs() -> Iterator[None]:
    with poison_outputs():
        yield


# name -> (topk_ids, n_experts): awkward routings
ROUTINGS = {
    "random": lambda: (topk(37, 3, 5), 5),
    "skewed_empty_experts": lambda: (topk(40, 2, 12, skew=3.0), 12),
    "no_tokens": lambda: (torch.zeros(0, 2, dtype=torch.int64), 4),
    "all_to_one_expert": lambda: (torch.full((29, 1), 3, dtype=torch.int64), 6),
    "k_equals_E": lambda: (topk(21, 4, 4), 4),
    "one_expert": lambda: (torch.zeros(13, 1, dtype=torch.int64), 1),
    "many_blocks": lambda: (topk(300, 8, 64), 64),  # 2400 entries: several map programs
    "int32_ids": lambda: (topk(33, 2, 7).int(), 7),
}


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_row_id_map_equals_stable_argsort(name, align, device):
    ids, n_experts = ROUTINGS[name]()
    ids = ids.to(device)
    row_id_map, offsets = make_row_id_map(ids, n_experts, align=align)
    ref_map, ref_offsets = make_row_id_map_reference(ids, n_experts, align)
    assert row_id_map.dtype == offsets.dtype == torch.int32
    assert row_id_map.shape == ids.shape and offsets.shape == (n_experts + 1,)
    assert torch.equal(row_id_map, ref_map)
    assert torch.equal(offsets, ref_offsets)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=n_experts)
    sizes = offsets.diff()
    assert torch.all(sizes % align == 0) and torch.all(sizes >= counts) and torch.all(sizes - counts < align)
    assert int(offsets[-1]) <= permuted_rows(*ids.shape, n_experts, align)
    # Every destination is used once, and each lands inside its expert's segment.
    flat = row_id_map.reshape(-1).long()
    assert flat.unique().numel() == flat.numel()
    e = ids.reshape(-1).long()
    assert torch.all((flat >= offsets[e]) & (flat < offsets[e] + counts[e]))


def test_row_id_map_across_many_small_blocks(monkeypatch: pytest.MonkeyPatch, device):
    # Small programs, as compiled on a GPU: the per-block prefix over earlier blocks matters,
    # and the row kernels loop over several feature blocks.
    launched = []

    def small_blocks(kernel, n, width, *, interpreted):
        launched.append(kernel)
        if kernel == "map":
            return pm.LaunchConfig({"BLOCK": 16, "BLOCK_E": 8}, num_warps=4, num_stages=2)
        return pm.LaunchConfig({"BLOCK_T": 16, "BLOCK_D": 16}, num_warps=4, num_stages=2)

    monkeypatch.setattr(pm, "launch_config", small_blocks)
    ids, n_experts = topk(70, 3, 6, skew=1.0).to(device), 6
    row_id_map, offsets = make_row_id_map(ids, n_experts, align=4)
    ref_map, ref_offsets = make_row_id_map_reference(ids, n_experts, 4)
    assert torch.equal(row_id_map, ref_map) and torch.equal(offsets, ref_offsets)
    x = torch.randn(70, 40, device=device, requires_grad=True)
    weights = torch.rand(70, 3, device=device, requires_grad=True)
    n_rows = permuted_rows(70, 3, n_experts, 4)
    y = permute(x, row_id_map, n_rows)
    assert torch.equal(y, permute_reference(x, row_id_map, n_rows))
    out = unpermute(y.cos(), row_id_map, weights)
    ref = unpermute_reference(y.cos(), row_id_map, weights)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (x, weights), g, retain_graph=True),
                    torch.autograd.grad(ref, (x, weights), g), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert set(launched) == {"map", "rows"}  # every wrapper took its blocks from launch_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("name", ["random", "skewed_empty_experts", "no_tokens", "k_equals_E", "one_expert"])
def test_permute_is_index_copy_bit_for_bit(name, align, dtype, device):
    ids, n_experts = ROUTINGS[name]()
    ids = ids.to(device)
    row_id_map, offsets = make_row_id_map(ids, n_experts, align=align)
    n_rows = permuted_rows(*ids.shape, n_experts, align)
    x = torch.randn(ids.shape[0], 40).to(device, dtype)
    y = permute(x, row_id_map, n_rows)
    assert y.shape == (n_rows, 40) and y.dtype == dtype
    assert torch.equal(y, permute_reference(x, row_id_map, n_rows))
    padding = torch.ones(n_rows, dtype=torch.bool, device=device)
    padding[row_id_map.reshape(-1).long()] = False
    assert torch.all(y[padding] == 0)  # align padding and the tail past offsets[E]


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.float64, torch.bfloat16, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpermute_is_the_weighted_gather_sum(dtype, weights_dtype, device):
    ids, n_experts = ROUTINGS["random"]()
    row_id_map, _ = make_row_id_map(ids.to(device), n_experts, align=4)
    y = torch.randn(permuted_rows(*ids.shape, n_experts, 4), 48).to(device, dtype)
    weights = None if weights_dtype is None else torch.rand(ids.shape).to(device, weights_dtype)
    out = unpermute(y, row_id_map, weights)
    assert out.shape == (ids.shape[0], 48) and out.dtype == dtype
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    torch.testing.assert_close(out, unpermute_reference(y, row_id_map, weights), **tol)


def test_round_trip_with_weights_summing_to_one_returns_the_tokens(device):
    ids, n_experts = ROUTINGS["many_blocks"]()
    row_id_map, _ = make_row_id_map(ids.to(device), n_experts, align=8)
    x = torch.randn(ids.shape[0], 32, device=device)
    weights = torch.rand(ids.shape, device=device).softmax(-1)
    y = permute(x, row_id_map, permuted_rows(*ids.shape, n_experts, 8))
    torch.testing.assert_close(unpermute(y, row_id_map, weights), x, rtol=1e-5, atol=1e-6)


def test_non_contiguous_inputs(device):
    ids, n_experts = ROUTINGS["random"]()
    ids = ids.to(device)
    ids_nc = torch.stack([ids, ids], -1)[..., 0]  # [T, k] with stride (2k, 2)
    row_id_map, _ = make_row_id_map(ids_nc, n_experts)
    assert torch.equal(row_id_map, make_row_id_map_reference(ids, n_experts)[0])
    x = torch.randn(40, 2 * ids.shape[0], device=device)[:, ::2].t()  # [T, 40], strides (2, 2T)
    map_nc = torch.stack([row_id_map, row_id_map], 0)[0].t().contiguous().t()  # column-major
    n_rows = ids.numel()
    assert not (ids_nc.is_contiguous() or x.is_contiguous() or map_nc.is_contiguous())
    y = permute(x, map_nc, n_rows)
    assert torch.equal(y, permute_reference(x, row_id_map, n_rows))
    weights = torch.rand(ids.shape[1], ids.shape[0], device=device).t()
    y_nc = torch.randn(40, n_rows, device=device).t()
    torch.testing.assert_close(unpermute(y_nc, map_nc, weights),
                               unpermute_reference(y_nc, row_id_map, weights), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["random", "skewed_empty_experts", "no_tokens", "all_to_one_expert"])
def test_gradients_match_autograd_on_the_references(name, device):
    ids, n_experts = ROUTINGS[name]()
    row_id_map, _ = make_row_id_map(ids.to(device), n_experts, align=16)
    n_rows = permuted_rows(*ids.shape, n_experts, 16)
    x = torch.randn(ids.shape[0], 24, device=device, requires_grad=True)
    weights = torch.rand(ids.shape, dtype=torch.float64, device=device, requires_grad=True)
    mix = torch.randn(24, 24, device=device)  # something that mixes rows between permute and unpermute

    def layer(perm, unperm, x, weights):
        return unperm(perm(x, row_id_map, n_rows) @ mix, row_id_map, weights)

    out = layer(permute, unpermute, x, weights)
    ref = layer(permute_reference, unpermute_reference, x, weights)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, weights), grad_out)
    ref_grads = torch.autograd.grad(ref, (x, weights), grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert grads[1].dtype == torch.float64
    for mine, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)


def test_weighted_permute_gradients_are_the_transposes(device):
    # permute_op's backward serves both directions: here a weighted permute (each token row times
    # its weight into its rows), against the same sum written with index_add.
    ids, n_experts = ROUTINGS["random"]()
    row_id_map, _ = make_row_id_map(ids.to(device), n_experts, align=16)
    n_rows = permuted_rows(*ids.shape, n_experts, 16)
    x = torch.randn(ids.shape[0], 8, device=device, requires_grad=True)
    weights = torch.rand(ids.shape, device=device, requires_grad=True)
    out = pm.permute_op(x, row_id_map, weights, n_rows, False)
    rows = row_id_map.long().reshape(-1)
    weighted = (weights[..., None] * x[:, None]).flatten(0, 1)
    ref = torch.zeros(n_rows, 8, device=device).index_add(0, rows, weighted)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, weights), grad_out)
    ref_grads = torch.autograd.grad(ref, (x, weights), grad_out)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for mine, expected in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5)


def test_unpermute_gradient_with_respect_to_y_zeroes_padding_rows(device):
    ids, n_experts = ROUTINGS["skewed_empty_experts"]()
    row_id_map, _ = make_row_id_map(ids.to(device), n_experts, align=16)
    y = torch.randn(permuted_rows(*ids.shape, n_experts, 16), 16, device=device, requires_grad=True)
    weights = torch.rand(ids.shape, device=device)
    out = unpermute(y, row_id_map, weights)
    grad_out = torch.randn_like(out)
    (dy,) = torch.autograd.grad(out, (y,), grad_out)
    (ref_dy,) = torch.autograd.grad(unpermute_reference(y, row_id_map, weights), (y,), grad_out)
    torch.testing.assert_close(dy, ref_dy, rtol=1e-6, atol=1e-6)


def test_sync_free_forward_and_backward(device):
    ids, n_experts = ROUTINGS["random"]()
    ids = ids.to(device)
    x = torch.randn(ids.shape[0], 32, device=device, requires_grad=True)
    weights = torch.rand(ids.shape, device=device, requires_grad=True)

    def dispatch_and_combine(x, ids, weights):
        row_id_map, _ = make_row_id_map(ids, n_experts, align=8)
        y = permute(x, row_id_map, permuted_rows(*ids.shape, n_experts, 8))
        return unpermute(y * 2, row_id_map, weights)

    out = assert_sync_free(dispatch_and_combine, x, ids, weights)
    assert out.shape == x.shape

    def step(x, ids, weights):
        out = dispatch_and_combine(x, ids, weights)
        return torch.autograd.grad(out, (x, weights), torch.ones_like(out))

    _, counts = count_syncs(step, x, ids, weights)
    assert sum(counts.values()) == 0, counts


def test_torch_compile_traces_the_custom_ops(device):
    ids, n_experts = ROUTINGS["random"]()
    ids = ids.to(device)
    x = torch.randn(ids.shape[0], 32, device=device, requires_grad=True)
    weights = torch.rand(ids.shape, device=device, requires_grad=True)

    def dispatch_and_combine(x, ids, weights):
        row_id_map, _ = make_row_id_map(ids, n_experts, align=8)
        y = permute(x, row_id_map, permuted_rows(*ids.shape, n_experts, 8))
        return unpermute(y.sin(), row_id_map, weights)

    compiled = torch.compile(dispatch_and_combine, fullgraph=True, backend="aot_eager")
    out, eager = compiled(x, ids, weights), dispatch_and_combine(x, ids, weights)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (x, weights), g),
                    torch.autograd.grad(eager, (x, weights), g), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_out_of_range_expert_ids_fail_loudly(device):
    if device.type == "cuda":
        pytest.skip("a failed device assert poisons the CUDA context for every later test")
    ids = torch.tensor([[0, 1], [2, 5]])
    with pytest.raises(RuntimeError, match="topk_ids must hold expert ids in \\[0, n_experts = 4\\)"):
        make_row_id_map(ids, 4)
    with pytest.raises(RuntimeError, match="topk_ids must hold expert ids"):
        make_row_id_map(-ids, 4)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda ids, m, x: make_row_id_map(ids.float(), 4), ValueError, "topk_ids must be \\[T, k\\] int64"),
        (lambda ids, m, x: make_row_id_map(ids[0], 4), ValueError, "topk_ids must be \\[T, k\\]"),
        (lambda ids, m, x: make_row_id_map(ids, 0), ValueError, "n_experts must be a positive int"),
        (lambda ids, m, x: make_row_id_map(ids, 4, align=0), ValueError, "align must be a positive"),
        (lambda ids, m, x: permute(x, m.long(), 12), ValueError, "row_id_map must be \\[T = 6, k\\] int32"),
        (lambda ids, m, x: permute(x[:5], m, 12), ValueError, "row_id_map must be \\[T = 5, k\\]"),
        (lambda ids, m, x: permute(x, m, 11), ValueError, "n_rows must be at least T·k = 12"),
        (lambda ids, m, x: permute(x.double(), m, 12), ValueError, "x.dtype must be one of"),
        (lambda ids, m, x: permute(x[0], m, 12), ValueError, "x must be 2-D"),
        (lambda ids, m, x: permute(x, m.to("meta"), 12), ValueError, "row_id_map must be on (cpu|cuda)"),
        (lambda ids, m, x: unpermute(x, m, None), ValueError, "n_rows must be at least T·k = 12"),
        (lambda ids, m, x: unpermute(x.repeat(2, 1), m, torch.rand(6, 3)), ValueError,
         "weights must be \\[T, k\\] = \\(6, 2\\)"),
        (lambda ids, m, x: unpermute(x.repeat(2, 1), m, m), ValueError,
         "weights must be a floating-point tensor"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, error, match, device):
    ids = topk(6, 2, 4).to(device)
    row_id_map, _ = make_row_id_map(ids, 4)
    x = torch.randn(6, 8, device=device)
    with pytest.raises(error, match=match):
        call(ids, row_id_map, x)


def test_one_expert_gets_a_two_wide_one_hot_tile(device):
    # tl.arange(0, 1) would make the one-hot tile [BLOCK, 1]; the launch config keeps the
    # expert axis at least 2 wide (the extra column is masked), and the map is still exact.
    assert pm.launch_config("map", 13, 1, interpreted=False).blocks["BLOCK_E"] == 2
    assert pm.launch_config("map", 13, 1, interpreted=True).blocks["BLOCK_E"] == 2
    ids = torch.zeros(13, 2, dtype=torch.int64, device=device)  # k = 2 slots, both expert 0
    row_id_map, offsets = make_row_id_map(ids, 1)
    assert row_id_map.tolist() == [[2 * t, 2 * t + 1] for t in range(13)]
    assert offsets.tolist() == [0, 26]
