"""``python -m moe_lab bench mxfp8``: what MXFP8 costs and saves, measured where it can be.

Four kinds of rows, each labelled in its ``kind`` column:

* ``measured`` — the MX quantizer's bandwidth (bytes read + written per second) for the
  Triton kernel (one pass, row-wise and column-wise copies) and for the PyTorch reference
  (two passes), against this machine's measured copy ceiling; attention forward time,
  bf16 SDPA against the Triton MXFP8 kernel, *only where Triton runs compiled* (under
  the interpreter a kernel's time says nothing about the kernel); the MXFP8 attention
  error against float32 on random inputs.
* ``computed`` — bytes one attention forward moves in bf16 and in MXFP8 (Q, K, V read
  once and the output written once, the flash-attention best case), for the measured
  shape and for one GPT-OSS-20B attention layer (64 query heads, 8 KV heads, head_dim 64,
  4,096 tokens).
* ``projection`` — the GB300 roofline for that GPT-OSS-20B layer in bf16 and in MXFP8,
  from third-party figures (`moe_lab.perf.hardware`): a projection, not a measurement.

Every row is appended to the results ledger (notebook ``06_mxfp8_attention``) unless
``--no-record`` is given.
"""

from __future__ import annotations

import argparse
import math

import torch

from moe_lab.attention import causal_attention
from moe_lab.perf.capabilities import capabilities
from moe_lab.perf.hardware import gpu_spec, roofline
from moe_lab.quant.mx import quantize
from moe_lab.workbench.cli import positive_int
from moe_lab.workbench.measure import ledger
from moe_lab.workbench.measure.ceilings import copy_bandwidth
from moe_lab.workbench.measure.timing import bench

DESCRIPTION = "MXFP8: quantizer bandwidth, attention bytes/time/error, GB300 projection"
NOTEBOOK = "06_mxfp8_attention"

# profile -> Triton mode -> (quantizer [M, K], attention [B, H, T, d], copy bytes)
SIZES = {
    "smoke": {"interpreted": ((512, 512), (1, 2, 128, 64), 64 * 2**20),
              "compiled": ((4096, 4096), (4, 16, 2048, 128), 512 * 2**20)},
    "full": {"interpreted": ((1024, 1024), (1, 4, 256, 64), 256 * 2**20),
             "compiled": ((8192, 8192), (4, 32, 4096, 128), 2 * 2**30)},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=sorted(SIZES), default="smoke",
                        help="problem sizes (default: smoke)")
    parser.add_argument("--size", type=positive_int, nargs=2, metavar=("M", "K"),
                        help="quantizer input [M, K] (bf16); default from the profile")
    parser.add_argument("--attention", type=positive_int, nargs=4, metavar=("B", "H", "T", "D"),
                        help="attention shape [batch, heads, seq, head_dim]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true", help="do not append to the ledger")


def quantizer_bytes(m: int, k: int, in_bytes: int = 2) -> int:
    """Bytes one row-wise + column-wise MXFP8 quantization of ``[m, k]`` moves: the input
    read once, two 1-byte copies and their scales (one byte per 32 values) written."""
    return m * k * in_bytes + 2 * m * k + 2 * (m * k // 32)


# One GPT-OSS-20B attention layer (its published config): [batch, q heads, kv heads, seq,
# head_dim].
GPT_OSS_LAYER = (1, 64, 8, 4096, 64)


def attention_bytes(b: int, h: int, h_kv: int, t: int, d: int, fmt: str) -> int:
    """Bytes of one flash-attention forward: Q, K, V read once, O (bf16) written once.
    ``fmt="bf16"``: 2 bytes per value; ``"mxfp8"``: 1 byte + a 1-byte scale per 32."""
    per_value = {"bf16": 2.0, "mxfp8": 1.0 + 1.0 / 32}[fmt]
    return int((h + 2 * h_kv) * b * t * d * per_value + 2 * b * h * t * d)


def attention_flops(b: int, h: int, t: int, d: int) -> float:
    """FLOPs of a causal attention forward: QKᵀ and PV, ``2·T²·d`` each, halved by the mask."""
    return 2 * 2.0 * b * h * t * t * d / 2


def _row(what: str, provider: str, value: float, unit: str, kind: str, note: str = "") -> dict:
    return {"what": what, "provider": provider, "value": float(value), "unit": unit,
            "kind": kind, "note": note}


def run(args: argparse.Namespace) -> dict:
    # The Triton kernels load here, not at the top: the CLI imports every benchmark module
    # to build its parser, and that must not import Triton.
    from moe_lab.kernels.mx_attention import mx_attention_forward, quantize_qkv
    from moe_lab.kernels.mx_quantize import mx_quantize

    caps = capabilities()
    mode = caps.triton_mode
    m_k, attn_shape, copy_nbytes = SIZES[args.profile][mode]
    m, k = args.size or m_k
    b, h, t, d = args.attention or attn_shape
    device = caps.device
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[dict] = []

    # Quantizer bandwidth: the Triton kernel (one read, two copies) vs the reference (two).
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
    moved = quantizer_bytes(m, k)
    repeat = 3 if mode == "interpreted" else None
    kernel = bench(mx_quantize, x, warmup=1, repeat=repeat)
    rows.append(_row("quantizer", f"triton ({mode})", moved / kernel.median_s / 1e9, "GB/s",
                     "measured", f"[{m}, {k}] bf16, row+col, median of {kernel.n}"))

    def reference_both(t_: torch.Tensor) -> None:
        quantize(t_, dim=-1, scale_mode="rceil")
        quantize(t_, dim=0, scale_mode="rceil")

    ref = bench(reference_both, x, warmup=1, repeat=repeat)
    rows.append(_row("quantizer", "torch reference", moved / ref.median_s / 1e9, "GB/s",
                     "measured", f"two passes, median of {ref.n}"))
    ceiling = copy_bandwidth(copy_nbytes, device=device, min_time_s=0.2)
    rows.append(_row("quantizer", "copy ceiling", ceiling.value / 1e9, "GB/s", "measured",
                     f"{copy_nbytes // 2**20} MiB copy, read + write"))

    # Attention: error always; time only compiled; bytes computed; GB300 projected.
    q, kk, v = (torch.randn(b, h, t, d, generator=gen).to(device) for _ in range(3))
    exact = causal_attention(q, kk, v, "reference")
    for impl in ("sdpa", "mxfp8", "mxfp8_triton"):
        dtype = torch.bfloat16 if impl == "sdpa" else torch.float32
        out = causal_attention(q.to(dtype), kk.to(dtype), v.to(dtype), impl).float()
        err = ((out - exact).norm() / exact.norm()).item()
        label = "bf16 sdpa" if impl == "sdpa" else impl
        rows.append(_row("attention rel. error vs fp32", label, err, "", "measured",
                         f"[{b}, {h}, {t}, {d}] randn"))
    if mode == "compiled":
        qb, kb, vb = q.bfloat16(), kk.bfloat16(), v.bfloat16()
        mx_in = quantize_qkv(qb, kb, vb)
        for label, fn, fn_args in (
            ("bf16 sdpa", lambda *a: causal_attention(*a, "sdpa"), (qb, kb, vb)),
            ("mxfp8_triton (quantize + kernel)", lambda *a: causal_attention(*a, "mxfp8_triton"),
             (qb, kb, vb)),
            ("mxfp8_triton (kernel only)", mx_attention_forward, mx_in),
        ):
            r = bench(fn, *fn_args, warmup=3)
            rows.append(_row("attention fwd time", label, r.median_s * 1e3, "ms", "measured",
                             f"{caps.hardware_label()}, median of {r.n}"))
    gpt_oss = "GPT-OSS-20B layer [1, 64 (8 kv), 4096, 64]"
    for fmt in ("bf16", "mxfp8"):
        rows.append(_row("attention fwd bytes", f"{fmt}, [{b}, {h}, {t}, {d}]",
                         attention_bytes(b, h, h, t, d, fmt) / 2**20, "MiB", "computed",
                         "Q, K, V read once, O written once"))
        rows.append(_row("attention fwd bytes", f"{fmt}, GPT-OSS-20B layer",
                         attention_bytes(*GPT_OSS_LAYER, fmt) / 2**20, "MiB", "computed", gpt_oss))
    gb300 = gpu_spec("GB300")
    pb, ph, _, pt, pd = GPT_OSS_LAYER
    flops = attention_flops(pb, ph, pt, pd)
    for fmt in ("bf16", "mxfp8"):
        intensity = flops / attention_bytes(*GPT_OSS_LAYER, fmt)
        attainable = roofline(gb300.peak_flops(fmt), gb300.bandwidth, intensity)
        rows.append(_row("attention fwd time", f"GB300 {fmt}", flops / attainable * 1e3, "ms",
                         "projection", f"{gpt_oss}; roofline from {gb300.source} figures"))

    result = {
        "hardware": caps.hardware_label(),
        "triton": mode,
        "quantizer_fraction_of_copy": rows[0]["value"] * 1e9 / ceiling.value,
        "rows": rows,
    }
    if mode != "compiled":
        result["note"] = ("attention timing skipped: Triton runs interpreted here, so a "
                          "kernel's time would measure the interpreter")
    for row in rows:
        if not args.no_record and math.isfinite(row["value"]):
            ledger.record(NOTEBOOK, "bench", f"{row['what']} [{row['provider']}]", row["value"], row["unit"],
                          hardware=HARDWARE_OF_KIND.get(row["kind"], caps.hardware_label()), kind=row["kind"],
                          note=row["note"], source="bench mxfp8")
    return result


# The hardware a row's figure holds for, by its kind (a measured row: this machine's).
HARDWARE_OF_KIND = {"projection": "GB300 (projection)", "computed": "any (computed)"}
