"""Traffic matrices for the fabric simulator: who sends how many bytes to whom.

A traffic matrix is ``[n_gpus, n_gpus]`` bytes: entry ``[i, j]`` is what GPU ``i`` sends to
GPU ``j`` in one transfer (the diagonal never enters the network). Each non-zero
off-diagonal entry becomes one flow in :func:`moe_lab.sim.fabric.simulate`. The matrices
here: a uniform all-to-all, the dispatch of one MoE layer with Zipf-skewed expert
popularity (a few hot experts draw most tokens), and incast (many senders, one receiver).
"""

from __future__ import annotations

import numpy as np

from moe_lab.checks import positive_int


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
    if not bytes_per_pair > 0:
        raise ValueError(f"bytes_per_pair must be > 0, got {bytes_per_pair!r}")
    out = np.full((n_gpus, n_gpus), float(bytes_per_pair))
    np.fill_diagonal(out, 0.0)
    return out


def zipf_expert_probs(n_experts: int, s: float, rng: np.random.Generator) -> np.ndarray:
    """Expert popularity ∝ 1 / rank^s, the ranks shuffled over the experts (``s = 0``: uniform)."""
    positive_int(n_experts, "n_experts")
    if not (isinstance(s, (int, float)) and s >= 0):
        raise ValueError(f"zipf exponent s must be >= 0, got {s!r}")
    weights = 1.0 / np.arange(1, n_experts + 1) ** float(s)
    weights = weights[rng.permutation(n_experts)]
    return weights / weights.sum()


def traffic_from_expert_loads(tokens: np.ndarray, experts_per_gpu: int, bytes_per_token: float) -> np.ndarray:
    """GPU × GPU bytes of one dispatch from per-source expert loads.

    ``tokens[g, e]``: token copies GPU ``g`` sends to expert ``e``; expert ``e`` lives on
    GPU ``e // experts_per_gpu``. Traffic a GPU sends to itself stays on the diagonal (it
    never enters the network).
    """
    loads = np.asarray(tokens, dtype=float)
    if loads.ndim != 2:
        raise ValueError(f"tokens must be [n_gpus, n_experts], got shape {loads.shape}")
    if np.any(loads < 0):
        raise ValueError("tokens must be >= 0 everywhere")
    n_gpus, n_experts = loads.shape
    positive_int(experts_per_gpu, "experts_per_gpu")
    if n_experts != n_gpus * experts_per_gpu:
        raise ValueError(f"tokens has {n_experts} experts; expected n_gpus × experts_per_gpu = "
                         f"{n_gpus} × {experts_per_gpu} = {n_gpus * experts_per_gpu}")
    per_gpu = loads.reshape(n_gpus, n_gpus, experts_per_gpu).sum(axis=2)
    return per_gpu * float(bytes_per_token)


def moe_traffic(n_gpus: int, *, experts_per_gpu: int = 4, tokens_per_gpu: int = 4096, top_k: int = 8,
                bytes_per_token: float = 7168 * 2, zipf_s: float = 0.0,
                rng: np.random.Generator | None = None) -> np.ndarray:
    """The dispatch all-to-all of one MoE layer with Zipf-skewed expert popularity.

    Each GPU routes ``tokens_per_gpu × top_k`` token copies; the expert of each copy is
    drawn from :func:`zipf_expert_probs` (a multinomial draw: the top-k of one token may
    repeat an expert here, a negligible difference for the byte counts). Default sizes:
    DeepSeek-V3's hidden 7168 in bf16 per token copy.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    n_experts = n_gpus * experts_per_gpu
    probs = zipf_expert_probs(n_experts, zipf_s, rng)
    tokens = rng.multinomial(tokens_per_gpu * top_k, probs, size=n_gpus)
    return traffic_from_expert_loads(tokens, experts_per_gpu, bytes_per_token)


def incast_traffic(n_gpus: int, n_senders: int, bytes_per_sender: float, *, receiver: int = 0,
                   background_bytes: float = 0.0, rng: np.random.Generator | None = None) -> np.ndarray:
    """``n_senders`` GPUs (chosen at random) each send ``bytes_per_sender`` to ``receiver``,
    on top of an optional uniform all-to-all of ``background_bytes`` per pair."""
    if not isinstance(n_senders, int) or not 1 <= n_senders < n_gpus:
        raise ValueError(f"n_senders must be in [1, n_gpus - 1 = {n_gpus - 1}], got {n_senders!r}")
    if not 0 <= receiver < n_gpus:
        raise ValueError(f"receiver must be in [0, {n_gpus - 1}], got {receiver!r}")
    rng = rng if rng is not None else np.random.default_rng(0)
    out = uniform_traffic(n_gpus, background_bytes) if background_bytes > 0 else np.zeros((n_gpus, n_gpus))
    others = np.delete(np.arange(n_gpus), receiver)
    senders = rng.choice(others, size=n_senders, replace=False)
    out[senders, receiver] += float(bytes_per_sender)
    return out
