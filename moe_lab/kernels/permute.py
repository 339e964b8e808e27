"""Triton token permutation: a row-id map built on the device, then permute and unpermute.

A grouped GEMM wants each expert's tokens in one contiguous block of rows. Token ``t`` goes to
``k`` experts, so the *permuted* buffer has one row per (token, slot), sorted by expert; the
*row-id map* ``row_id_map[t, j]`` says which row holds token ``t``'s copy for its ``j``-th expert
(as TransformerEngine's ``moe_permute`` and Megatron-LM's ``permute``). Building it is a
counting sort whose every size is known from the shapes: a histogram of expert ids per block of
entries (``[n_blocks, E]``, one program a block), prefix sums over experts (``offsets``) and over
blocks, and each entry's rank among its block's entries for the same expert (a cumulative sum
over a one-hot ``[BLOCK, E]`` tile). The order is a stable argsort's, and nothing is read on the
host: the buffer is sized ``T·k`` rows (``+ E·(align − 1)`` when segments are padded).

``permute`` copies each token row to its ``k`` rows; ``unpermute`` gathers them back and sums
with the router weights in float32 (grid: ``(cdiv(T, BLOCK_T), cdiv(d, BLOCK_D))``). Each is the
other's transpose, so each one's backward is the other, and the weights' gradient is a row dot
product ``<dout[t], y[row_id_map[t, j]]>``. Every index that multiplies a stride is int64.
"""

import torch
import triton
import triton.language as tl
from torch._subclasses import FakeTensor
from torch.autograd.function import FunctionCtx

from moe_lab.checks import first_derivative_only, non_negative_int, one_of, positive_int
from moe_lab.kernels.common import INTERPRETED, cast_for_store, check_device, kernel_op
from moe_lab.kernels.launch import LaunchConfig

Tensor = torch.Tensor
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _expert_histogram_kernel(ids_ptr, counts_ptr, N_ENTRIES, E,
                             BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    # ids: [N_ENTRIES] expert ids (flattened topk_ids); counts: [cdiv(N_ENTRIES, BLOCK), E]
    # int32, counts[b, e] = entries of block b routed to expert e. Grid: (n_blocks,).
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + i, mask=i < N_ENTRIES, other=-1)
    experts = tl.arange(0, BLOCK_E)
    hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK, BLOCK_E] one-hot
    tl.store(counts_ptr + pid * E + experts, tl.sum(hit, 0), mask=experts < E)


@triton.jit
def _row_id_map_kernel(ids_ptr, base_ptr, map_ptr, N_ENTRIES, E,
                       BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    # ids: [N_ENTRIES]; base: [n_blocks, E] int32, first destination row of block b's
    # entries for expert e; map: [N_ENTRIES] int32. Grid: (n_blocks,).
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    ok = i < N_ENTRIES
    ids = tl.load(ids_ptr + i, mask=ok, other=-1)
    hit = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    rank = tl.sum(tl.cumsum(hit, 0) * hit, 1) - 1  # earlier entries of the block, same expert
    valid = ok & (ids >= 0) & (ids < E)
    base = tl.load(base_ptr + pid * E + ids, mask=valid, other=-1)
    tl.store(map_ptr + i, tl.where(valid, base + rank, -1), mask=ok)


@triton.jit
def _permute_kernel(
    x_ptr, map_ptr, w_ptr, y_ptr, T, D, N_ROWS, TOP_K,
    s_xt, s_xd, s_mt, s_mk, s_wt, s_wk, s_yr, s_yd,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
):
    # x: [T, D]; row_id_map: [T, TOP_K] int32; weights: [T, TOP_K] (if HAS_WEIGHTS);
    # y: [N_ROWS, D]; y[row_id_map[t, j]] = x[t] (· weights[t, j]).
    # Grid: (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)).
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    t_ok, d_ok = t < T, d < D
    x = tl.load(x_ptr + t[:, None] * s_xt + d[None, :] * s_xd,
                mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    for j in range(TOP_K):
        row = tl.load(map_ptr + t * s_mt + j * s_mk, mask=t_ok, other=-1).to(tl.int64)
        ok = t_ok & (row >= 0) & (row < N_ROWS)  # memory safety against a bad map
        out = x
        if HAS_WEIGHTS:
            w = tl.load(w_ptr + t * s_wt + j * s_wk, mask=t_ok, other=0.0).to(tl.float32)
            out = x * w[:, None]
        tl.store(y_ptr + row[:, None] * s_yr + d[None, :] * s_yd,
                 cast_for_store(out, y_ptr), mask=ok[:, None] & d_ok[None, :])


@triton.jit
def _unpermute_kernel(
    y_ptr, map_ptr, w_ptr, out_ptr, T, D, N_ROWS, TOP_K,
    s_yr, s_yd, s_mt, s_mk, s_wt, s_wk, s_ot, s_od,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
):
    # y: [N_ROWS, D]; row_id_map: [T, TOP_K] int32; weights: [T, TOP_K] (if HAS_WEIGHTS);
    # out: [T, D], out[t] = Σ_j (weights[t, j] ·) y[row_id_map[t, j]], summed in float32.
    # Grid: (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)).
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    t_ok, d_ok = t < T, d < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
    for j in range(TOP_K):
        row = tl.load(map_ptr + t * s_mt + j * s_mk, mask=t_ok, other=-1).to(tl.int64)
        ok = t_ok & (row >= 0) & (row < N_ROWS)
        v = tl.load(y_ptr + row[:, None] * s_yr + d[None, :] * s_yd,
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            v = v * tl.load(w_ptr + t * s_wt + j * s_wk, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(out_ptr + t[:, None] * s_ot + d[None, :] * s_od, cast_for_store(acc, out_ptr),
             mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _unpermute_weight_grad_kernel(
    y_ptr, map_ptr, dout_ptr, dw_ptr, T, D, N_ROWS, TOP_K,
    s_yr, s_yd, s_mt, s_mk, s_gt, s_gd,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # y: [N_ROWS, D]; row_id_map: [T, TOP_K] int32; dout: [T, D];
    # dw: [T, TOP_K] float32 contiguous, dw[t, j] = <dout[t], y[row_id_map[t, j]]>.
    # Grid: (cdiv(T, BLOCK_T), TOP_K).
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    j = tl.program_id(1)
    t_ok = t < T
    row = tl.load(map_ptr + t * s_mt + j * s_mk, mask=t_ok, other=-1).to(tl.int64)
    ok = t_ok & (row >= 0) & (row < N_ROWS)
    acc = tl.zeros((BLOCK_T,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = (d0 + tl.arange(0, BLOCK_D)).to(tl.int64)
        d_ok = d < D
        g = tl.load(dout_ptr + t[:, None] * s_gt + d[None, :] * s_gd,
                    mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(y_ptr + row[:, None] * s_yr + d[None, :] * s_yd,
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(g * v, 1)
    tl.store(dw_ptr + t * TOP_K + j, acc, mask=t_ok)


# --------------------------------------------------------------------------------------
# Launches (custom ops, `kernel_op`: FakeTensorMode and torch.compile see the shapes, not the kernel)
# --------------------------------------------------------------------------------------


def launch_config(kernel: str, n: int, width: int, *, interpreted: bool) -> LaunchConfig:
    """Blocks, warps and stages of one launch of ``kernel``: "map" (the expert histogram and the
    row-id map, which must cut the entries into the same blocks) or "rows" (permute, unpermute
    and unpermute's weight gradient: row copies and row dot products).

    "map": ``n`` entries (``T·k``) over ``width`` experts; blocks ``BLOCK`` entries per
    program and ``BLOCK_E``, the one-hot tile's expert axis: a power of two >= E, and at
    least 2, so that one expert (``E = 1``) does not make a one-wide tile. "rows": ``n``
    tokens of ``width`` features; blocks ``BLOCK_T`` tokens by ``BLOCK_D`` features.

    Under the interpreter each program is a Python round trip, so blocks are large;
    compiled, a one-hot tile of about 8K elements and 16-token row tiles, 4 warps.
    """
    if kernel == "map":
        block_e = max(2, triton.next_power_of_2(width))
        if interpreted:
            block = min(triton.next_power_of_2(max(n, 16)), max(16, 65536 // block_e))
        else:
            block = max(16, min(128, 8192 // block_e))
        blocks = {"BLOCK": block, "BLOCK_E": block_e}
    else:
        block_t = min(128, max(16, triton.next_power_of_2(n))) if interpreted else 16
        blocks = {"BLOCK_T": block_t, "BLOCK_D": min(256, max(16, triton.next_power_of_2(width)))}
    return LaunchConfig(blocks, num_warps=4, num_stages=1 if interpreted else 3)


@kernel_op("row_id_map")
def _row_id_map_op(ids: Tensor, n_experts: int, align: int) -> tuple[Tensor, Tensor]:
    """The counting sort of `build_row_id_map` over ``ids: [T·k]``: ``(row_id_map [T·k], offsets)``."""
    n = ids.shape[0]
    cfg = launch_config("map", n, n_experts, interpreted=INTERPRETED)
    grid = (triton.cdiv(n, cfg.blocks["BLOCK"]),)
    launch = {**cfg.blocks, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    block_counts = torch.empty((grid[0], n_experts), dtype=torch.int32, device=ids.device)
    row_id_map = torch.empty((n,), dtype=torch.int32, device=ids.device)
    if n and not isinstance(ids, FakeTensor):
        _expert_histogram_kernel[grid](ids, block_counts, n, n_experts, **launch)  # [n_blocks, E]
    counts = block_counts.sum(0, dtype=torch.int32)  # [E] tokens per expert
    if align > 1:
        counts = (counts + (align - 1)) // align * align
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0, dtype=torch.int32)])
    # First row of block b's entries for expert e: the expert's start plus the entries of
    # that expert in the blocks before b.
    base = block_counts.cumsum(0, dtype=torch.int32) - block_counts + offsets[:-1]
    if n and not isinstance(ids, FakeTensor):
        _row_id_map_kernel[grid](ids, base, row_id_map, n, n_experts, **launch)
    return row_id_map, offsets


def _launch_rows(kernel: object, tokens: int, d: int, slots: int | None, *args: object,
                 **flags: object) -> None:
    """``kernel`` at `launch_config`'s "rows" blocks over ``tokens`` token rows of ``d`` features:
    grid ``(cdiv(tokens, BLOCK_T), cdiv(d, BLOCK_D))``, or one program per slot along the second
    axis when ``slots`` is given."""
    cfg = launch_config("rows", tokens, d, interpreted=INTERPRETED)
    grid_y = triton.cdiv(d, cfg.blocks["BLOCK_D"]) if slots is None else slots
    kernel[(triton.cdiv(tokens, cfg.blocks["BLOCK_T"]), grid_y)](
        *args, **cfg.blocks, **flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@kernel_op("permute")
def permute_op(src: Tensor, row_id_map: Tensor, weights: Tensor | None, n_rows: int,
               inverse: bool) -> Tensor:
    """permute: token rows ``src: [T, d]`` (times ``weights``) to their rows of a new
    ``[n_rows, d]``; ``inverse``, unpermute: ``src: [n_rows, d]`` back to ``[T, d]``, each
    token's rows (times ``weights``) summed. Each is the other's transpose. Differentiable in
    ``src`` and ``weights``; unchecked: `permute` and `unpermute` check their arguments and
    call it, and so does the dropless layer once its router has made the map."""
    (tokens, top_k), d = row_id_map.shape, src.shape[1]
    # Padding rows (no (token, slot) maps to them) are zeros; every other row is written.
    padded = not inverse and n_rows > tokens * top_k
    out = (torch.zeros if padded else torch.empty)((tokens if inverse else n_rows, d), dtype=src.dtype,
                                                   device=src.device)
    if tokens and d and not isinstance(src, FakeTensor):
        w_arg = row_id_map if weights is None else weights  # unused without weights
        _launch_rows(_unpermute_kernel if inverse else _permute_kernel, tokens, d, None,
                     src, row_id_map, w_arg, out, tokens, d, n_rows, top_k, *src.stride(),
                     *row_id_map.stride(), *w_arg.stride(), *out.stride(), HAS_WEIGHTS=weights is not None)
    return out


@kernel_op("unpermute_weight_grad")
def _unpermute_weight_grad_op(y: Tensor, row_id_map: Tensor, dout: Tensor) -> Tensor:
    (n_rows, d), (tokens, top_k) = y.shape, row_id_map.shape
    dw = torch.empty((tokens, top_k), dtype=torch.float32, device=y.device)
    if tokens and top_k and not isinstance(y, FakeTensor):
        _launch_rows(_unpermute_weight_grad_kernel, tokens, d, top_k, y, row_id_map, dout, dw,
                     tokens, d, n_rows, top_k, *y.stride(), *row_id_map.stride(), *dout.stride())
    return dw


# --------------------------------------------------------------------------------------
# Autograd and the public wrappers
# --------------------------------------------------------------------------------------


def _permute_setup(ctx: FunctionCtx, inputs: tuple, output: Tensor) -> None:
    src, row_id_map, weights, ctx.n_rows, ctx.inverse = inputs
    ctx.save_for_backward(src if weights is not None else None, row_id_map, weights)


@first_derivative_only("the Triton permute")
def _permute_backward(ctx: FunctionCtx, dout: Tensor) -> tuple[Tensor | None, ...]:
    """Each direction's gradient is the other direction (its transpose), weighted alike; the
    weights' gradient is the row dot products ``<token row t, permuted row row_id_map[t, j]>``
    of the gradient and the input."""
    src, row_id_map, weights = ctx.saved_tensors
    dsrc = dweights = None
    if ctx.needs_input_grad[0]:
        dsrc = permute_op(dout, row_id_map, weights, ctx.n_rows, not ctx.inverse)
    if weights is not None and ctx.needs_input_grad[2]:
        rows, tokens = (src, dout) if ctx.inverse else (dout, src)
        dweights = _unpermute_weight_grad_op(rows, row_id_map, tokens).to(weights.dtype)
    return dsrc, None, dweights, None, None


permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


def permuted_rows(tokens: int, top_k: int, n_experts: int, align: int = 1) -> int:
    """Static size of the permuted buffer: ``T·k``, plus ``E·(align − 1)`` padding rows
    when each expert's segment is rounded up to a multiple of ``align``."""
    return tokens * top_k + n_experts * (align - 1)


def check_rows(name: str, t: Tensor) -> None:
    """``t: [rows, d]`` in one of `KERNEL_DTYPES`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, d], got shape {tuple(t.shape)}")
    one_of(t.dtype, f"{name}.dtype", KERNEL_DTYPES)


def check_map(row_id_map: Tensor, tokens: int | None, n_rows: int) -> None:
    """``row_id_map: [T, k]`` int32 (``T = tokens`` unless None), ``n_rows`` a non-negative int
    with ``T·k <= n_rows`` (the doors of `permute`, `unpermute` and the fused expert MLP)."""
    non_negative_int(n_rows, "n_rows")
    if not isinstance(row_id_map, torch.Tensor):
        raise TypeError(f"row_id_map must be a torch.Tensor, got {type(row_id_map).__name__}")
    expected_t = "T" if tokens is None else f"T = {tokens}"
    if (row_id_map.dim() != 2 or row_id_map.dtype != torch.int32
            or (tokens is not None and row_id_map.shape[0] != tokens)):
        raise ValueError(f"row_id_map must be [{expected_t}, k] int32, "
                         f"got shape {tuple(row_id_map.shape)} {row_id_map.dtype}")
    if n_rows < row_id_map.numel():
        raise ValueError(f"n_rows must be at least T·k = {row_id_map.numel()} (one row per token and slot), "
                         f"got {n_rows}")


def make_row_id_map(topk_ids: Tensor, n_experts: int, *, align: int = 1) -> tuple[Tensor, Tensor]:
    """Where each (token, slot) goes in the expert-sorted buffer, and where experts start.

    Args:
        topk_ids: ``[T, k]`` int64 or int32 expert ids in ``[0, n_experts)`` (checked on the
            device with ``torch._assert_async``: no host read).
        n_experts: ``E``.
        align: pad each expert's segment up to a multiple of ``align`` rows.

    Returns:
        ``row_id_map: [T, k]`` int32, the destination row of each (token, slot), stable by
        (expert, token, slot); ``offsets: [E + 1]`` int32, expert ``e``'s rows are
        ``offsets[e]:offsets[e+1]`` (its tokens first, then zero padding). The buffer
        needs ``permuted_rows(T, k, E, align)`` rows; ``offsets[E]`` is at most that.
    """
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids must be [T, k] int64 or int32, got shape {tuple(topk_ids.shape)} "
                         f"{topk_ids.dtype}")
    positive_int(n_experts, "n_experts")
    positive_int(align, "align")
    check_device("topk_ids", topk_ids.device)
    return build_row_id_map(topk_ids, n_experts, align)


def build_row_id_map(topk_ids: Tensor, n_experts: int, align: int = 1) -> tuple[Tensor, Tensor]:
    """`make_row_id_map` for a caller that made ``topk_ids`` itself (a dispatcher, from the
    router's output): the same counting sort, without the argument checks."""
    flat = topk_ids.reshape(-1).contiguous()
    torch._assert_async(((flat >= 0) & (flat < n_experts)).all(),
                        f"topk_ids must hold expert ids in [0, n_experts = {n_experts})")
    row_id_map, offsets = _row_id_map_op(flat, n_experts, align)
    return row_id_map.view(topk_ids.shape), offsets


def permute(x: Tensor, row_id_map: Tensor, n_rows: int) -> Tensor:
    """Copy token row ``x[t]`` to rows ``row_id_map[t, :]`` of a new ``[n_rows, d]`` buffer.

    ``x: [T, d]`` (float32, bfloat16 or float16, any strides); ``row_id_map: [T, k]``
    int32 from `make_row_id_map`; ``n_rows >= T·k`` (see `permuted_rows`). Rows no
    (token, slot) maps to are zero. Differentiable in ``x``.
    """
    check_rows("x", x)
    check_map(row_id_map, x.shape[0], n_rows)
    check_device("x", x.device, row_id_map=row_id_map)
    return permute_op(x, row_id_map, None, n_rows, False)


def unpermute(y: Tensor, row_id_map: Tensor, weights: Tensor | None = None) -> Tensor:
    """``out[t] = Σ_j weights[t, j] · y[row_id_map[t, j]]``, summed in float32.

    ``y: [n_rows, d]``; ``row_id_map: [T, k]`` int32; ``weights: [T, k]`` floating (any
    float dtype, e.g. the router's float32), or None for a plain sum. Returns ``[T, d]``
    in ``y``'s dtype. Differentiable in ``y`` and ``weights``.
    """
    check_rows("y", y)
    check_map(row_id_map, None, y.shape[0])
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise ValueError(f"weights must be a floating-point tensor or None, got {got}")
        if weights.shape != row_id_map.shape:
            raise ValueError(f"weights must be [T, k] = {tuple(row_id_map.shape)} like row_id_map, "
                             f"got {tuple(weights.shape)}")
    check_device("y", y.device, row_id_map=row_id_map, weights=weights)
    return permute_op(y, row_id_map, weights, y.shape[0], True)


# --------------------------------------------------------------------------------------
# References (plain PyTorch; what the kernels are tested against)
# --------------------------------------------------------------------------------------


def make_row_id_map_reference(topk_ids: Tensor, n_experts: int, align: int = 1
                              ) -> tuple[Tensor, Tensor]:
    """The row-id map from a stable argsort of the flattened expert ids."""
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # sorted position -> entry
    position = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(),
                                                                       device=flat.device))
    counts = torch.bincount(flat, minlength=n_experts)
    unpadded_start = counts.cumsum(0) - counts
    padded = (counts + align - 1) // align * align
    offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    dest = offsets[flat] + position - unpadded_start[flat]
    return dest.view(topk_ids.shape).int(), offsets.int()


def permute_reference(x: Tensor, row_id_map: Tensor, n_rows: int) -> Tensor:
    """``index_copy`` of each token row to its ``k`` destinations; other rows zero."""
    tokens, top_k = row_id_map.shape
    copies = x.unsqueeze(1).expand(tokens, top_k, x.shape[1]).reshape(tokens * top_k, x.shape[1])
    return x.new_zeros((n_rows, x.shape[1])).index_copy(0, row_id_map.reshape(-1).long(), copies)


def unpermute_reference(y: Tensor, row_id_map: Tensor, weights: Tensor | None = None) -> Tensor:
    """``index_select`` of each (token, slot)'s row, weighted sum over slots in float32."""
    tokens, top_k = row_id_map.shape
    rows = y.float().index_select(0, row_id_map.reshape(-1).long()).view(tokens, top_k, y.shape[1])
    if weights is not None:
        rows = rows * weights.float().unsqueeze(-1)
    return rows.sum(1).to(y.dtype)
