"""What fusing memory-bound work into the grouped GEMMs buys, counted: bytes and launches per MoE layer.

Each variant of one MoE layer's expert path (forward and backward, the routing itself left
out: it is the same in every variant) is a list of kernel launches, and each launch is
charged the bytes of the tensors it reads and writes, once each — an ideal cache for its
own operands, no cache between launches. That is the model behind every "fusion saves a
round trip" argument, and what `moe_lab.kernels.fused_moe` changes:

``unfused``
    permute → GEMM1 → SwiGLU → GEMM2 → weighted unpermute, and their backward.
``swiglu_epilogue``
    SwiGLU in GEMM1's epilogue (`moe_lab.kernels.grouped_gemm`, what the ``triton``
    expert backend runs): the ``[T·k, 2F]`` pre-activation is never written; the backward
    recomputes it.
``gather_prologue``
    + GEMM1 (and its backward's recompute and weight gradient) read the token rows through
    the row source, so the permuted copy of ``x`` is never written (the row source, one
    int32 per row, is built instead); the first GEMM's dX is scattered back to the tokens by
    its epilogue.
``scatter_epilogue``
    + GEMM2 weights its rows and stores them token-major, one sum over the top-k follows
    (deterministic); its backward gathers ``dout`` in its prologue, so the weighted
    permuted gradient and the saved expert output never exist.
``scatter_atomic``
    the same with float32 atomics into ``[T, d]`` (a zeroed accumulator; bfloat16 output
    needs one cast): no ``[T·k, d]`` buffer at all. Atomic traffic is charged at 4 bytes
    per contribution (reductions are done in L2; DRAM sees at most that).
``mxfp8_epilogue``
    forward of the MXFP8 recipe only: GEMM1 writes ``h`` as E4M3 codes + E8M0 scales
    (1 + 1/32 bytes per value) from its epilogue, against ``mxfp8_unfused``, where GEMM1
    writes bfloat16 ``h`` and a quantizer pass reads it and writes the codes.

Gathered reads are charged as many bytes as the rows they read (a token row read by ``k``
tiles counts ``k`` times), the conservative choice. Weights are counted once per GEMM that
reads or writes them, for the experts on one GPU: ``E / EP`` of them under expert
parallelism `EP` (8, the size the DeepEP and HybridEP figures in the seed's
sources are quoted at; an assumption, stated in every table), each GPU receiving on
average ``tokens · k`` routed rows. Activation bytes, the part fusion changes, are
reported apart from weight bytes. The projected
time is bytes over HBM bandwidth (`moe_lab.perf.hardware`): the memory-time floor of the
layer if every launch ran at full bandwidth — a projection from datasheet figures, not a
measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

VARIANTS = ("unfused", "swiglu_epilogue", "gather_prologue", "scatter_epilogue", "scatter_atomic")
MX_VARIANTS = ("mxfp8_unfused", "mxfp8_epilogue")
LABELS = {
    "unfused": "unfused chain",
    "swiglu_epilogue": "+ SwiGLU epilogue",
    "gather_prologue": "+ gather prologue",
    "scatter_epilogue": "+ scatter epilogue (deterministic)",
    "scatter_atomic": "+ scatter epilogue (fp32 atomics)",
    "mxfp8_unfused": "MXFP8 fwd: GEMM1 + quantizer pass",
    "mxfp8_epilogue": "MXFP8 fwd: quantize epilogue",
}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``name``, bytes read and written, ``phase`` ("fwd" or "bwd"),
    and whether the bytes are weights (``weights``) or activations."""

    name: str
    read: float
    written: float
    phase: str
    weights: float = 0.0  # of read + written, the bytes that are expert weights or their grads

    @property
    def bytes(self) -> float:
        return self.read + self.written


@dataclass(frozen=True)
class Shape:
    """One MoE layer's expert path: ``tokens`` on the GPU, ``top_k``, ``n_experts``,
    ``d`` (d_model), ``f`` (d_expert), ``b`` bytes per activation/weight element."""

    tokens: int
    top_k: int
    n_experts: int
    d: int
    f: int
    b: int = 2

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k


def launches(variant: str, s: Shape) -> list[Launch]:
    """The launches of ``variant`` (one of `VARIANTS` or `MX_VARIANTS`) at shape ``s``."""
    r, d, f, b, w1 = s.rows, s.d, s.f, s.b, s.n_experts * s.d * 2 * s.f * s.b
    if variant in MX_VARIANTS:
        mx = r * f + r * f // 32  # codes + scales
        if variant == "mxfp8_unfused":
            return [Launch("GEMM1+SwiGLU (writes bf16 h)", r * d * b + w1, r * f * b, "fwd", w1),
                    Launch("MXFP8 quantizer", r * f * b, mx, "fwd")]
        return [Launch("GEMM1+SwiGLU+MXFP8 epilogue", r * d * b + w1, mx, "fwd", w1)]
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS + MX_VARIANTS}, got {variant!r}")
    return _chain(VARIANTS.index(variant), s)


def _chain(level: int, s: Shape) -> list[Launch]:
    """The forward launches, then the backward ones, of fusion ``level`` (an index of `VARIANTS`)."""
    t, r, d, f, b = s.tokens, s.rows, s.d, s.f, s.b
    swiglu_fused, gather, scatter, atomic = level >= 1, level >= 2, level >= 3, level == 4
    # Bytes of the row-id map, the row source, the router weights, W1, W2 and GEMM1's input.
    map_b, src_b, wt_b = t * s.top_k * 4, r * 4, t * s.top_k * 4
    w1, w2 = s.n_experts * d * 2 * f * b, s.n_experts * f * d * b
    x_in = r * d * b + (src_b if gather else 0)  # gathered token rows read the row source
    if gather:
        out = [Launch("row source (fill)", 0, src_b, "fwd"),
               Launch("row source (scatter)", map_b, src_b, "fwd")]
    else:
        out = [Launch("permute", t * d * b + map_b, r * d * b, "fwd")]
    if swiglu_fused:
        name = "GEMM1" + (" (gather)" if gather else "") + "+SwiGLU"
        out.append(Launch(name, x_in + w1, r * f * b, "fwd", w1))
    else:
        out += [Launch("GEMM1", x_in + w1, r * 2 * f * b, "fwd", w1),
                Launch("SwiGLU", r * 2 * f * b, r * f * b, "fwd")]
    if atomic:
        out += [Launch("zero fp32 accumulator", 0, t * d * 4, "fwd"),
                Launch("GEMM2+weighted atomic scatter", r * f * b + w2 + src_b + wt_b, r * d * 4, "fwd", w2)]
        if b != 4:
            out.append(Launch("cast fp32 -> output", t * d * 4, t * d * b, "fwd"))
    elif scatter:
        out += [Launch("GEMM2+weighted scatter (token-major)", r * f * b + w2 + src_b + wt_b, r * d * b,
                       "fwd", w2),
                Launch("sum over top-k", r * d * b, t * d * b, "fwd")]
    else:
        out += [Launch("GEMM2", r * f * b + w2, r * d * b, "fwd", w2),
                Launch("unpermute (weighted)", r * d * b + map_b + wt_b, t * d * b, "fwd")]
    if scatter:  # the backward: the combine and GEMM2
        n_tiles = max(1, -(-f // 64))
        out += [Launch("dout gather·W2ᵀ, dh + dweight epilogue",
                       r * d * b + src_b + wt_b + w2 + r * f * b, r * f * b + r * n_tiles * 4, "bwd", w2),
                Launch("dweights: sum partials + index_copy", r * n_tiles * 4 + src_b, wt_b, "bwd"),
                Launch("dW2 (gathered weighted dout)", r * f * b + r * d * b + src_b + wt_b, w2, "bwd", w2)]
    else:
        out += [Launch("unpermute bwd: weighted permute", t * d * b + map_b + wt_b, r * d * b, "bwd"),
                Launch("unpermute bwd: dweights", r * d * b + t * d * b + map_b, wt_b, "bwd"),
                Launch("GEMM2 dX", r * d * b + w2, r * f * b, "bwd", w2),
                Launch("GEMM2 dW", r * f * b + r * d * b, w2, "bwd", w2)]
    if swiglu_fused:  # SwiGLU and GEMM1
        out.append(Launch("GEMM1 recompute+SwiGLU bwd" + (" (gather)" if gather else ""),
                          x_in + w1 + r * f * b, r * 2 * f * b, "bwd", w1))
    else:
        out.append(Launch("SwiGLU bwd", r * 2 * f * b + r * f * b, r * 2 * f * b, "bwd"))
    if gather:
        return out + [
            Launch("GEMM1 dX+scatter (token-major)", r * 2 * f * b + w1 + src_b, r * d * b, "bwd", w1),
            Launch("dx: sum over top-k", r * d * b, t * d * b, "bwd"),
            Launch("GEMM1 dW (gather)", x_in + r * 2 * f * b, w1, "bwd", w1)]
    return out + [Launch("GEMM1 dX", r * 2 * f * b + w1, r * d * b, "bwd", w1),
                  Launch("GEMM1 dW", r * d * b + r * 2 * f * b, w1, "bwd", w1),
                  Launch("permute bwd: unpermute", r * d * b + map_b, t * d * b, "bwd")]


def summary(variant: str, s: Shape) -> dict:
    """Totals of `launches`: bytes (all, activations, weights; forward and backward), launches."""
    ls = launches(variant, s)
    total = sum(x.bytes for x in ls)
    weights = sum(x.weights for x in ls)
    return {"variant": variant, "label": LABELS[variant], "launches": len(ls),
            "launches_fwd": sum(x.phase == "fwd" for x in ls), "bytes": total,
            "activation_bytes": total - weights, "weight_bytes": weights,
            "bytes_fwd": sum(x.bytes for x in ls if x.phase == "fwd")}


EP = 8  # the expert parallelism the tables assume (see the module doc)
GPUS = ("H200", "GB300")  # the projected times' GPUs


def preset_shape(name: str) -> Shape:
    """A `moe_lab.config.preset`'s MoE layer on one GPU: `moe_lab.kernels.launch.TOKENS_PER_GPU`
    tokens (the compile report's load), its ``E / EP`` local experts, bfloat16."""
    from moe_lab.config import preset
    from moe_lab.kernels.launch import TOKENS_PER_GPU

    m = preset(name).moe
    return Shape(TOKENS_PER_GPU, m.top_k, m.n_experts // EP, m.d_model, m.d_expert)


def fusion_table(presets: tuple[str, ...] = ("deepseek_v3", "gpt_oss_20b")) -> list[dict]:
    """One row per (preset, variant): `summary` plus ``saved_vs_unfused`` (fraction of the
    unfused chain's bytes) and the projected memory time ``projected_ms_<gpu>`` = bytes /
    HBM bandwidth on each of `GPUS` (a projection from the datasheet bandwidth, not a
    measurement)."""
    from moe_lab.perf.hardware import gpu_spec

    rows = []
    for name in presets:
        s = preset_shape(name)
        for variant in VARIANTS + MX_VARIANTS:
            row = {"preset": name, "tokens": s.tokens, "ep": EP, "local_experts": s.n_experts,
                   **summary(variant, s)}
            base = summary("mxfp8_unfused" if variant in MX_VARIANTS else "unfused", s)["bytes"]
            row["saved_vs_unfused"] = 1.0 - row["bytes"] / base
            for gpu in GPUS:
                row[f"projected_ms_{gpu}"] = row["bytes"] / gpu_spec(gpu).bandwidth * 1e3
            rows.append(row)
    return rows

