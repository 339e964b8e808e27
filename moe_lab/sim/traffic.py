"""Traffic matrices for the fabric simulator: who sends how many bytes to whom.

A traffic matrix is ``[n_gpus, n_gpus]`` bytes: entry ``[i, j]`` is what GPU ``i`` sends to
GPU ``j`` in one transfer (the diagonal never enters the network). Each non-zero
off-diagonal entry becomes one flow in :func:`moe_lab.sim.fabric.simulate`. The matrices
here: a uniform all-to-all, the dispatch of one MoE layer with Zipf-skewed expert
popularity (a few hot experts draw most tokens), and incast (many senders, one receiver).
"""

from __future__ import annotations

import numpy as np


def check_traffic(traffic: np.ndarray, n_hosts: int | None = None) -> np.ndarray:
    """``traffic`` as a float ``[n, n]`` array of bytes; ``ValueError`` if it is not one."""
    arr = np.asarray(traffic, dtype=float)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ValueError(f"traffic must be a square [n_gpus, n_gpus] matrix, got shape {arr.shape}")
    if n_hosts is not None and arr.shape[0] != n_hosts:
        raise ValueError(f"traffic is {arr.shape[0]} × {arr.shape[0]} but the fabric has {n_hosts} hosts")
    if not np.all(np.isfinite(arr)):
        raise ValueError("traffic must hold finite byte counts, got NaN or inf")
    if np.any(arr < 0):
        i, j = np.argwhere(arr < 0)[0]
        raise ValueError(f"traffic must be >= 0 bytes everywhere, got {float(arr[i, j])!r} at [{i}, {j}]")
    return arr


def uniform_traffic(n_gpus: int, bytes_per_pair: float) -> np.ndarray:
    """Every GPU sends ``bytes_per_pair`` to every other GPU: ``[n_gpus, n_gpus]``."""
    if not isinstance(n_gpus, int) or n_gpus < 2:
        raise ValueError(f"n_gpus must be an integer >= 2, got {n_gpus!r}")
    out = np.full((n_gpus, n_gpus), float(bytes_per_pair))
    np.fill_diagonal(out, 0.0)
    return out


def moe_traffic(n_gpus: int, *, experts_per_gpu: int = 4, tokens_per_gpu: int = 4096, top_k: int = 8,
                bytes_per_token: float = 7168 * 2, zipf_s: float = 0.0,
                rng: np.random.Generator | None = None) -> np.ndarray:
    """The dispatch all-to-all of one MoE layer with Zipf-skewed expert popularity.

    Each GPU routes ``tokens_per_gpu × top_k`` token copies; the expert of each copy is
    drawn with popularity ∝ ``1 / rank^zipf_s``, the ranks shuffled over the experts
    (``zipf_s = 0``: uniform; a multinomial draw: the top-k of one token may repeat an expert
    here, a negligible difference for the byte counts). Expert ``e`` lives on GPU
    ``e // experts_per_gpu``; what a GPU sends to itself stays on the diagonal (it never enters
    the network). Default sizes: DeepSeek-V3's hidden 7168 in bf16 per token copy.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    n_experts = n_gpus * experts_per_gpu
    weights = 1.0 / np.arange(1, n_experts + 1) ** float(zipf_s)
    weights = weights[rng.permutation(n_experts)]
    tokens = rng.multinomial(tokens_per_gpu * top_k, weights / weights.sum(), size=n_gpus)
    per_gpu = tokens.astype(float).reshape(n_gpus, n_gpus, experts_per_gpu).sum(axis=2)
    return per_gpu * float(bytes_per_token)


def incast_traffic(n_gpus: int, n_senders: int, bytes_per_sender: float, *,
                   rng: np.random.Generator | None = None) -> np.ndarray:
    """``n_senders`` of the other GPUs (chosen at random) each send ``bytes_per_sender`` to GPU 0."""
    if not isinstance(n_senders, int) or not 1 <= n_senders < n_gpus:
        raise ValueError(f"n_senders must be in [1, n_gpus - 1 = {n_gpus - 1}], got {n_senders!r}")
    rng = rng if rng is not None else np.random.default_rng(0)
    out = np.zeros((n_gpus, n_gpus))
    senders = rng.choice(np.arange(1, n_gpus), size=n_senders, replace=False)
    out[senders, 0] = float(bytes_per_sender)
    return out
