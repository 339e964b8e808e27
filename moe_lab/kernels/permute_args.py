"""The argument checks and the buffer size the two token-permutation backends share: the
Triton kernels (`moe_lab.kernels.permute`) and the C++ CPU kernels
(the CPU plug-in's `moe_lab.workbench.cpu.permute`). Plain PyTorch, no Triton import: each backend adds its
own device check on top."""

from __future__ import annotations

import torch

from moe_lab.checks import non_negative_int, one_of, positive_int

Tensor = torch.Tensor
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def permuted_rows(tokens: int, top_k: int, n_experts: int, align: int = 1) -> int:
    """Static size of the permuted buffer: ``T·k``, plus ``E·(align − 1)`` padding rows
    when each expert's segment is rounded up to a multiple of ``align``."""
    return tokens * top_k + (n_experts * (align - 1) if align > 1 else 0)


def check_topk(topk_ids: Tensor, n_experts: int, align: int) -> None:
    """``topk_ids: [T, k]`` int64 or int32; ``n_experts`` and ``align`` positive ints."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"topk_ids must be [T, k] int64 or int32, got shape {tuple(topk_ids.shape)} "
            f"{topk_ids.dtype}"
        )
    positive_int(n_experts, "n_experts")
    positive_int(align, "align")


def check_rows(name: str, t: Tensor) -> None:
    """``t: [rows, d]`` in one of `KERNEL_DTYPES`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, d], got shape {tuple(t.shape)}")
    one_of(t.dtype, f"{name}.dtype", KERNEL_DTYPES)


def check_map(row_id_map: Tensor, tokens: int | None, n_rows: int) -> None:
    """``row_id_map: [T, k]`` int32 (``T = tokens`` unless None), ``n_rows`` a non-negative int
    with ``T·k <= n_rows``."""
    non_negative_int(n_rows, "n_rows")
    if not isinstance(row_id_map, torch.Tensor):
        raise TypeError(f"row_id_map must be a torch.Tensor, got {type(row_id_map).__name__}")
    expected_t = "T" if tokens is None else f"T = {tokens}"
    if (row_id_map.dim() != 2 or row_id_map.dtype != torch.int32
            or (tokens is not None and row_id_map.shape[0] != tokens)):
        raise ValueError(
            f"row_id_map must be [{expected_t}, k] int32, "
            f"got shape {tuple(row_id_map.shape)} {row_id_map.dtype}"
        )
    if n_rows < row_id_map.numel():
        raise ValueError(
            f"n_rows must be at least T·k = {row_id_map.numel()} (one row per token and slot), "
            f"got {n_rows}"
        )


def check_weights(weights: Tensor | None, row_id_map: Tensor) -> None:
    """``weights``: None, or a floating ``[T, k]`` like ``row_id_map``."""
    if weights is None:
        return
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a floating-point tensor or None, got {got}")
    if weights.shape != row_id_map.shape:
        raise ValueError(
            f"weights must be [T, k] = {tuple(row_id_map.shape)} like row_id_map, "
            f"got {tuple(weights.shape)}"
        )
