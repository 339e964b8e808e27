"""Benchmark: the MoE router after the gating matmul, unfused FP64 and FP32 against fused.

Providers, all on the same logits: ``unfused fp64`` and ``unfused fp32`` — the reference
chain as frameworks run it (``torch.topk``; each step its own kernel), in each precision;
``compiled fp32`` — the reference chain under ``torch.compile`` (Inductor fuses the
elementwise steps; the sorts stay library calls), the fair fused baseline on a CPU; and
``triton fp32`` — the fused kernel (`moe_lab.kernels.fused_router`), only where Triton runs
compiled (on the CPU it is interpreted: checked in the tests, not timed). Each provider
is checked against the reference in its precision before it is timed; timings are
interleaved (`moe_lab.workbench.measure.timing.compare`).

For each: the median time, the speed-up over unfused FP64, the kernels per call and the
estimated bytes they move (`moe_lab.workbench.measure.kernel_count`), and those bytes over the floor — one
read of the FP32 logits plus the ids and weights written. ``ids vs fp64`` is the fraction
of routing decisions that agree with the FP64 chain: lowering the precision moves a few
near-ties.

Shapes: ``small`` is the tiny preset's router (8 experts, top-2, softmax); ``deepseek_v3``
is DeepSeek-V3's (256 experts, top-8, sigmoid, 8 groups / 4 chosen, scaling 2.5: DeepSeek-V3's
published config). Tokens: the seed trains 4096-token sequences, so a GPU
routes 4096 tokens per sequence; the CPU smoke profile scales that down to what times in
seconds.
"""

from __future__ import annotations

import argparse

import torch

from moe_lab.config import MoEConfig
from moe_lab.moe.router import route_from_logits, routing_agreement
from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.benchmarks import untimed_triton
from moe_lab.workbench.cli import non_negative_float, positive_int
from moe_lab.workbench.measure import ledger
from moe_lab.workbench.measure.kernel_count import count_compiled_kernels, count_kernels
from moe_lab.workbench.measure.timing import compare

DESCRIPTION = "the router after the gating matmul: unfused fp64 / fp32, torch.compile, fused Triton"

SHAPES = {
    "small": dict(n_experts=8, top_k=2, score_func="softmax"),
    "deepseek_v3": dict(n_experts=256, top_k=8, score_func="sigmoid", n_groups=8,
                        topk_groups=4, scaling_factor=2.5),
}
# tokens per call: (device, profile) -> {shape: tokens}
TOKENS = {
    ("cpu", "smoke"): {"small": 4096, "deepseek_v3": 1024},
    ("cpu", "full"): {"small": 16384, "deepseek_v3": 4096},
    ("cuda", "smoke"): {"small": 16384, "deepseek_v3": 4096},
    ("cuda", "full"): {"small": 65536, "deepseek_v3": 16384},
}
BASELINE = "unfused fp64"


def floor_bytes(tokens: int, cfg: MoEConfig) -> int:
    """One read of the float32 logits plus the int64 ids and float32 weights written."""
    return tokens * cfg.n_experts * 4 + tokens * cfg.top_k * (8 + 4)


def build_providers(cfg: MoEConfig) -> tuple[dict, list[str]]:
    """``name -> (fn(logits, bias) -> RouterOutput, logits dtype)`` and notes. A compiled
    provider carries its ``torch.compile`` object as ``fn.compiled``."""
    notes: list[str] = []

    def unfused(logits, bias):
        return route_from_logits(logits, cfg, bias, lowest_index_ties=False)

    providers = {
        "unfused fp64": (unfused, torch.float64),
        "unfused fp32": (unfused, torch.float32),
    }
    compiled = torch.compile(route_from_logits, dynamic=False)

    def compiled_fp32(logits, bias):
        return compiled(logits, cfg, bias)

    compiled_fp32.compiled = compiled  # what count_compiled_kernels reads
    providers["compiled fp32"] = (compiled_fp32, torch.float32)
    if capabilities().triton_mode == "compiled":
        # Here, not at the top: the CLI imports this module to build its parser, and that
        # must not import Triton.
        from moe_lab.kernels.fused_router import fused_route_from_logits

        def triton_fp32(logits, bias):
            return fused_route_from_logits(logits, cfg, bias)

        providers["triton fp32"] = (triton_fp32, torch.float32)
    else:
        notes.append(untimed_triton("triton fp32", capabilities().triton_mode))
    notes.append("unfused: torch.topk as frameworks use it; compiled and triton keep the "
                 "lowest-index tie rule (the compiled chain by a top-k of packed keys)")
    return providers, notes


def run_shape(shape: str, tokens: int, min_time_s: float = 0.5, seed: int = 0) -> dict:
    """Benchmark one shape on this machine's device; returns ``{"rows": [...], "notes": [...], ...}``."""
    device = capabilities().device
    cfg = MoEConfig(d_model=64, d_expert=64, **SHAPES[shape])  # d_model: unused after the matmul
    g = torch.Generator().manual_seed(seed)
    logits64 = (torch.randn(tokens, cfg.n_experts, generator=g, dtype=torch.float64) * 2).to(device)
    bias = (torch.randn(cfg.n_experts, generator=g) * 0.01).to(device)
    inputs = {torch.float64: logits64, torch.float32: logits64.float()}
    providers, notes = build_providers(cfg)
    want = {dt: route_from_logits(x, cfg, bias) for dt, x in inputs.items()}

    kernels, ids_vs_fp64, calls = {}, {}, {}
    for name, (fn, dtype) in providers.items():
        logits = inputs[dtype]
        if hasattr(fn, "compiled"):  # compiles it, and reads the code it generated
            kernels[name] = count_compiled_kernels(fn.compiled, logits, cfg, bias)
        else:
            kernels[name] = count_kernels(fn, logits, bias)
        out = fn(logits, bias)
        agree = routing_agreement(out.topk_ids, want[dtype].topk_ids)
        if agree < 0.999:  # exact up to rounding of near-ties between implementations
            raise AssertionError(f"{shape}: {name} disagrees with the reference on "
                                 f"{1 - agree:.2%} of routing decisions")
        torch.testing.assert_close(out.tokens_per_expert.sum(), want[dtype].tokens_per_expert.sum())
        calls[name] = (lambda fn=fn, logits=logits: fn(logits, bias))
        ids_vs_fp64[name] = routing_agreement(out.topk_ids, want[torch.float64].topk_ids)
    timings = compare(calls, min_time_s=min_time_s)
    base = timings[BASELINE].median_s
    rows = [{"shape": shape, "provider": name, "median_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3,
             "iqr_ms": t.iqr_s * 1e3, "vs_unfused_fp64": base / t.median_s, "kernels": kernels[name].ops,
             "bytes": kernels[name].bytes, "bytes_vs_floor": kernels[name].bytes / floor_bytes(tokens, cfg),
             "gb_per_s": kernels[name].bytes / t.median_s / 1e9, "ids_vs_fp64": ids_vs_fp64[name]}
            for name, t in timings.items()]
    return {"shape": shape, "tokens": tokens, "config": SHAPES[shape], "device": device,
            "floor_bytes": floor_bytes(tokens, cfg), "rows": rows, "notes": notes}


def record(result: dict, notebook: str) -> None:
    """Append one shape's figures to the ledger."""
    tokens = result["tokens"]
    for row in result["rows"]:
        step = f"{row['shape']}:{row['provider']}"
        extra = {"tokens": tokens, "spread_ms": row["iqr_ms"]}
        ledger.record(notebook, step, "median_ms", row["median_ms"], "ms", **extra)
        ledger.record(notebook, step, "vs_unfused_fp64", row["vs_unfused_fp64"], "x", **extra)
        ledger.record(notebook, step, "kernels_per_call", row["kernels"], "kernels", tokens=tokens)
        ledger.record(notebook, step, "bytes_per_call", row["bytes"], "B", tokens=tokens)
        ledger.record(notebook, step, "bytes_vs_floor", row["bytes_vs_floor"], "x", tokens=tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="all", choices=["all", *SHAPES])
    parser.add_argument("--profile", default="smoke", choices=["smoke", "full"])
    parser.add_argument("--tokens", type=positive_int, help="tokens per call (overrides profile)")
    parser.add_argument("--min-time", type=non_negative_float, default=0.5,
                        help="seconds of timing per provider")
    parser.add_argument("--notebook", default="bench:router", help="ledger 'notebook' field")


def run(args: argparse.Namespace) -> dict:
    device = capabilities().device
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    result: dict = {"device": device, "rows": [], "notes": [], "tokens": {}}
    for shape in shapes:
        tokens = args.tokens or TOKENS[(device, args.profile)][shape]
        r = run_shape(shape, tokens, args.min_time)
        record(r, args.notebook)
        result["tokens"][shape] = tokens
        result["rows"] += r["rows"]
        result["notes"] += [n for n in r["notes"] if n not in result["notes"]]
    return result
