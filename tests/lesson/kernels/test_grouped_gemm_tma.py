"""The persistent TMA grouped GEMM (moe_lab.kernels.grouped_gemm_tma) against the loop reference:
forward, backward (dX through the kernel on a transposed weight), awkward partitions, tiles that
do not divide the sizes, every program count, the tile order, and the expert backend ``triton_tma``.

Under ``TRITON_INTERPRET=1`` Triton's interpreter runs the descriptor ops themselves
(``tl.make_tensor_descriptor``, descriptor loads and stores, with the bounds a TMA copy has:
out-of-bounds elements load as zeros and are not stored), so these are real runs of the kernel's
logic, not of a stand-in. What the interpreter cannot show is the hardware (the copy engine, the
mbarriers, the pipelining, warp specialisation): tests/workbench/compile_report/
test_grouped_gemm_tma_compiled.py reads that off the compiled PTX. Outputs are NaN-poisoned
(`poison_outputs`), so an element the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import triton
import triton.language as tl
from support import poison_outputs

from moe_lab import MoELayer
from moe_lab.config import MoEConfig
from moe_lab.kernels import grouped_gemm_tma as tma
from moe_lab.kernels.common import grouped_tile
from moe_lab.kernels.grouped_gemm import grouped_gemm_reference
from moe_lab.kernels.grouped_gemm_tma import grouped_gemm_tma
from moe_lab.moe.experts import EXPERT_BACKENDS
from moe_lab.training.sync import assert_sync_free

DTYPES = [torch.float32, torch.bfloat16]
# Rows per expert and padding rows after them (as in test_grouped_gemm.py): empty experts,
# every row in one expert, one expert, no rows at all, only padding, skew, odd counts.
PARTITIONS = {
    "mixed": ([5, 0, 70, 13], 12),
    "all_in_one": ([0, 0, 77, 0], 0),
    "one_expert": ([45], 3),
    "no_rows": ([0, 0, 0], 0),
    "only_padding": ([0, 0], 9),
    "many_small": ([1, 17, 2, 0, 33, 3, 0, 16], 5),
}
SMALL_TILES = (16, 16, 16)  # (BLOCK_M, BLOCK_N, BLOCK_K): none divides K = 40 or N = 24


@pytest.fixture(autouse=True)
def poisoned_outputs() -> Iterator[None]:
    with poison_outputs():
        yield


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every launch gets 16 x 16 x 16 tiles: several row tiles per expert, partial tiles in M,
    N and K, several K steps. Returns the launches' (m, n, k) as they are asked for."""
    bm, bn, bk = SMALL_TILES
    config = tma.LaunchConfig({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=1)
    asked = []

    def launch_config(m, n, k, n_experts, *, interpreted, dtype):
        asked.append((m, n, k))
        return config

    monkeypatch.setattr(tma, "launch_config", launch_config)
    return asked


def problem(counts: list[int], pad: int, k: int, n: int, dtype: torch.dtype, device: torch.device):
    """Fresh random ``x: [sum(counts) + pad, k]``, ``w: [E, k, n]``, offsets."""
    x = torch.randn(sum(counts) + pad, k).to(device, dtype)
    w = (torch.randn(len(counts), k, n) / k**0.5).to(device, dtype)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return x, w, offsets


def check_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` equals the float64 ``want`` rounded once to ``got``'s dtype: bf16 within one ulp
    (2^-7 relative at most: the kernel sums exact products in fp32, in another order, and rounds
    on the store), fp32 up to the summation order."""
    assert got.dtype in DTYPES
    tol = {"rtol": 2**-7, "atol": 1e-6} if got.dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got.double(), want.to(got.dtype).double(), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(PARTITIONS))
def test_forward_matches_the_loop_reference(name, dtype, small_tiles, device):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 40, 24, dtype, device)
    y = grouped_gemm_tma(x, w, offsets)
    assert y.shape == (x.shape[0], 24) and y.dtype == dtype
    check_close(y, grouped_gemm_reference(x.double(), w.double(), offsets))
    assert torch.all(y[sum(counts):] == 0)  # the padding rows: zeros
    assert small_tiles == ([(sum(counts) + pad, 24, 40)] if x.shape[0] else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mixed", "one_expert", "no_rows", "many_small"])
def test_backward_matches_autograd_on_the_loop(name, dtype, small_tiles, device):
    counts, pad = PARTITIONS[name]
    x, w, offsets = problem(counts, pad, 40, 24, dtype, device)
    x.requires_grad_(), w.requires_grad_()
    y = grouped_gemm_tma(x, w, offsets)
    grad_out = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), grad_out)
    leaves = [t.detach().double().requires_grad_() for t in (x, w)]
    ref = grouped_gemm_reference(*leaves, offsets)
    rdx, rdw = torch.autograd.grad(ref, leaves, grad_out.double())
    assert dx.dtype == dw.dtype == dtype
    check_close(dx, rdx)  # dX = dY·Wᵀ: this kernel with TRANS_W
    check_close(dw, rdw)  # dW: the grouped dW kernel
    assert (24, 40) in [(n, k) for _, n, k in small_tiles] or not x.shape[0]  # dX's launch: N = 40


def test_every_program_count_gives_the_same_bits(small_tiles, device, monkeypatch: pytest.MonkeyPatch):
    # The persistent walk: whatever the grid (1000: capped at the tile count), each tile is
    # computed once, the same way.
    x, w, offsets = problem(*PARTITIONS["many_small"], 40, 24, torch.float32, device)
    monkeypatch.setattr(tma, "default_programs", lambda device: 1)
    one = grouped_gemm_tma(x, w, offsets)
    check_close(one, grouped_gemm_reference(x.double(), w.double(), offsets))
    for programs in (2, 5, 1000):
        monkeypatch.setattr(tma, "default_programs", lambda device, p=programs: p)
        torch.testing.assert_close(grouped_gemm_tma(x, w, offsets), one, rtol=0, atol=0)


def test_transposed_and_strided_operands(small_tiles, device):
    x, w, offsets = problem([7, 0, 30], 11, 40, 24, torch.bfloat16, device)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)  # [E, K, N] stored [E, N, K]: TRANS_W
    x_wide_rows = torch.cat([x, x], dim=1)[:, :40]  # rows 80 apart: read in place
    x_columns = x.t().contiguous().t()  # column-major (48 rows: 16-byte columns): copied, not swapped
    x_odd_rows = torch.cat([x, x[:, :4]], dim=1)[:, :40]  # rows 88 bytes apart (TMA: 16 B): copied
    ref = grouped_gemm_reference(x.double(), w.double(), offsets)
    check_close(grouped_gemm_tma(x_wide_rows, w_t, offsets), ref)
    check_close(grouped_gemm_tma(x_columns, w, offsets), ref)
    check_close(grouped_gemm_tma(x_odd_rows, w, offsets), ref)


def tile_order_host(n_row_tiles: int, n_col_tiles: int, group_m: int) -> list[tuple[int, int]]:
    """The list the kernel walks (`grouped_tile`), as its docstring says it in words: groups of ``group_m``
    row tiles (the last one smaller) by every N tile, the row tile fastest inside a group."""
    out = []
    for g0 in range(0, n_row_tiles, group_m):
        size = min(group_m, n_row_tiles - g0)
        out += [(g0 + i, c) for c in range(n_col_tiles) for i in range(size)]
    return out


def test_no_reduction_dim_gives_zeros(device):
    x, w, offsets = problem([3, 0, 5], 2, 0, 16, torch.bfloat16, device)
    zeros = torch.zeros(10, 16, dtype=torch.bfloat16, device=device)
    assert torch.equal(grouped_gemm_tma(x, w, offsets), zeros)


def test_tile_order_is_grouped_and_the_device_walks_the_host_list(device):
    for rows, cols, group in ((11, 3, 4), (5, 7, 8), (6, 4, 1), (1, 1, 8)):
        order = tile_order_host(rows, cols, group)
        assert sorted(order) == [(r, c) for r in range(rows) for c in range(cols)]  # each tile once
        if group == 1:
            assert order == [(r, c) for r in range(rows) for c in range(cols)]  # N fastest

    @triton.jit
    def walk(out_ptr, n_row_tiles, n_col_tiles, GROUP: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.arange(0, BLOCK)
        ok = t < n_row_tiles * n_col_tiles  # the kernel asks only for tiles of the list
        r, c = grouped_tile(tl.where(ok, t, 0), n_row_tiles, n_col_tiles, GROUP)
        tl.store(out_ptr + 2 * t, r, mask=ok)
        tl.store(out_ptr + 2 * t + 1, c, mask=ok)

    for rows, cols, group in ((11, 3, 4), (5, 7, 8), (6, 4, 1), (1, 1, 8), (9, 2, 8)):
        out = torch.full((2 * rows * cols,), -1, dtype=torch.int32, device=device)
        walk[(1,)](out, rows, cols, group, BLOCK=triton.next_power_of_2(rows * cols))
        assert [tuple(p) for p in out.view(-1, 2).tolist()] == tile_order_host(rows, cols, group)


def test_operands_are_read_in_place_where_tma_can(device):
    # A copy costs a pass over HBM: only where TMA's 16-byte rules refuse the tensor as it is.
    x, w, _ = problem([3, 5], 0, 40, 24, torch.bfloat16, device)
    assert tma._tma_ready(x) == (x, False)
    stored, swapped = tma._tma_ready(w.transpose(1, 2), swap=True)  # dX's weight: read as stored
    assert swapped and stored.data_ptr() == w.data_ptr() and stored.shape == w.shape
    assert not tma._tma_ready(w.transpose(1, 2))[1]  # x is never swapped
    shifted = torch.randn(8 * 40 + 1, device=device).to(torch.bfloat16)[1:].view(8, 40)  # base 2 B off
    copy, swapped = tma._tma_ready(shifted)
    assert not swapped and copy.data_ptr() % 16 == 0 and torch.equal(copy, shifted)


def test_warp_specialised_on_blackwell_only(monkeypatch: pytest.MonkeyPatch):
    for major, expected in ((9, False), (10, True), (12, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        assert tma.warp_specialized(torch.device("cuda")) == expected
        assert not tma.warp_specialized(torch.device("cpu"))


def test_launch_config_and_the_grid(device):
    cfg = tma.launch_config(65536, 7168, 2048, 32, interpreted=False)
    assert (cfg.blocks, cfg.num_warps) == ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 8)
    assert cfg.num_stages >= 3  # TMA loads in flight ahead of the MMA
    fp32 = tma.launch_config(65536, 7168, 2048, 32, interpreted=False, dtype=torch.float32)
    assert fp32.blocks["BLOCK_M"] == 64 and fp32.num_stages >= 3
    assert tma.launch_config(100, 24, 40, 4, interpreted=True).blocks == {
        "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64}
    assert tma.default_programs(torch.device("cpu")) == tma.INTERPRETED_PROGRAMS > 1
    assert not tma.warp_specialized(torch.device("cpu"))


def test_sync_free(device):
    x, w, offsets = problem([5, 0, 20], 3, 16, 16, torch.float32, device)
    x.requires_grad_(), w.requires_grad_()
    out = assert_sync_free(lambda a, b, off: grouped_gemm_tma(a, b, off), x, w, offsets)
    assert out.shape == (28, 16)


@pytest.mark.parametrize("change, match", [
    (lambda x, w, o: (x[:, :12], w[:, :12], o), "K = x.shape.* multiples of 8 .* K=12"),
    (lambda x, w, o: (x, w[..., :12], o), "N=12"),
    (lambda x, w, o: (x, w.float(), o), "w.dtype must equal x.dtype"),
    (lambda x, w, o: (x, w, o[:-1]), r"offsets must be \[E \+ 1 = 3\] int32"),
    (lambda x, w, o: (x, w[0], o), r"w \[E >= 1, K, N\]"),
])
def test_bad_arguments_raise_clear_errors(change, match, device):
    x, w, offsets = problem([3, 4], 0, 16, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match=match):
        grouped_gemm_tma(*change(x, w, offsets))


@pytest.mark.parametrize("dtype", DTYPES)
def test_expert_backend_triton_tma_equals_the_naive_layer(dtype, device):
    c = MoEConfig(d_model=32, n_experts=8, top_k=2, d_expert=24)
    ref = MoELayer(c, "naive").to(device, dtype)
    fast = MoELayer(c, "dropless", "triton_tma").to(device, dtype)
    fast.load_state_dict(ref.state_dict())
    assert fast.experts.backend == "triton_tma"
    assert fast.experts.impl.permute is EXPERT_BACKENDS["triton"].permute  # the Triton kernels' moves
    x = torch.randn(29, c.d_model).to(device, dtype)
    y_ref, y = ref(x), fast(x)
    y_ref = y_ref[0] if isinstance(y_ref, tuple) else y_ref
    y = y[0] if isinstance(y, tuple) else y
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y.float(), y_ref.float(), **tol)
    y.float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fast.experts.parameters())
