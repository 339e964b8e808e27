"""Benchmark: forward + backward of one MoE layer, every dispatcher on the same inputs.

Providers: ``naive`` (the loop over experts), ``capacity`` at capacity factors 1.0 and 1.25,
``dropless`` with each expert backend that runs compiled on this device (the Triton grouped
GEMM only where Triton compiles; under the interpreter it is checked in the tests, not
timed; on a CPU ``openmp``, the CPU plug-in's grouped GEMM, where `moe_lab.workbench.cpu` builds), and
Hugging Face ``transformers``' Mixtral block with each of its experts
implementations (``eager``, ``batched_mm``, ``grouped_mm``) when ``transformers`` is
installed, and the fused dispatchers (``fused``, ``fused_atomic``: gather prologue and
weighted-scatter epilogue, `moe_lab.kernels.fused_moe`) where Triton compiles. All
providers share one set of weights and one input; their outputs are checked against the
naive layer before anything is timed. Timings are interleaved (``compare``) so
every provider sees the same machine noise.

Shapes: ``fine`` is DeepSeek-like (64 experts, top-8, expert width d_model/2); ``coarse``
is Mixtral-like (8 experts, top-2, expert width 2·d_model).

``fusion_report`` adds what fusing memory-bound work into the grouped GEMMs buys: bytes and
launches per MoE layer for each fusion at DeepSeek-V3's and GPT-OSS-20B's shapes, counted
(`moe_lab.perf.fusion`), their projected memory time at H200 and GB300 bandwidth (a
projection), and, measured here, the interleaved timing of the unfused chain's stages at
the fine shape: on a CPU the fused Triton kernels only run interpreted, so what is timed
is how much of the chain the fusions remove (permute, SwiGLU, weighted unpermute).
"""

from __future__ import annotations

import argparse

import torch

from moe_lab.config import MoEConfig
from moe_lab.memory import check_fits
from moe_lab.moe.dispatch import sort_by_expert
from moe_lab.moe.layer import MoELayer
from moe_lab.perf.capabilities import capabilities
from moe_lab.training.sync import count_syncs
from moe_lab.workbench.benchmarks import untimed_triton
from moe_lab.workbench.benchmarks.ttt.stacks import cpu_plugin_status
from moe_lab.workbench.cli import non_negative_float, positive_int
from moe_lab.workbench.measure import ceilings, ledger
from moe_lab.workbench.measure.timing import compare
from moe_lab.workbench.quiet import library_notes_silenced

DESCRIPTION = "fwd+bwd of one MoE layer: naive / capacity / dropless / Hugging Face Mixtral"

SHAPES = {
    "fine": dict(n_experts=64, top_k=8, d_model=256, d_expert=128),
    "coarse": dict(n_experts=8, top_k=2, d_model=256, d_expert=512),
}
TOKENS = {"smoke": 1024, "full": 4096}
PROVIDERS = ("naive", "capacity cf1.0", "capacity cf1.25", "dropless loop", "dropless torch",
             "dropless openmp", "dropless triton", "fused", "fused_atomic", "hf eager", "hf batched_mm",
             "hf grouped_mm")


def expert_flops(tokens: int, top_k: int, d_model: int, d_expert: int) -> float:
    """Useful expert FLOPs of forward + backward: per assignment, the SwiGLU expert does
    ``2·d·2f + 2·f·d = 6·d·f`` FLOPs forward and twice that backward."""
    return 18.0 * tokens * top_k * d_model * d_expert


def _hf_block(layer: MoELayer, implementation: str):
    # transformers is optional (the [test] extra): imported only for this provider. It imports
    # torchao, whose known import-time notes are silenced (`moe_lab.workbench.quiet`).
    with library_notes_silenced():
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    c = layer.cfg
    config = MixtralConfig(hidden_size=c.d_model, intermediate_size=c.d_expert,
                           num_local_experts=c.n_experts, num_experts_per_tok=c.top_k,
                           router_jitter_noise=0.0)
    config._experts_implementation = implementation
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(layer.experts.w_gate_up.transpose(1, 2))
        block.experts.down_proj.copy_(layer.experts.w_down.transpose(1, 2))
    return block


def build_providers(cfg: MoEConfig, include_hf: bool = True, device: str = "cpu",
                    dtype: torch.dtype = torch.float32,
                    only: list[str] | None = None) -> tuple[dict, list[str]]:
    """name -> module taking ``x: [tokens, d]`` and returning ``(y, aux)``; and notes.

    ``only``: keep just these providers (``naive`` is always kept: it is the reference)."""
    notes: list[str] = []
    naive = MoELayer(cfg, "naive").to(device=device, dtype=dtype)
    providers: dict[str, torch.nn.Module] = {"naive": naive}

    def clone(dispatcher: str, backend: str = "loop", **changes) -> MoELayer:
        layer = MoELayer(cfg.replace(**changes) if changes else cfg, dispatcher, backend)
        layer.to(device=device, dtype=dtype).load_state_dict(naive.state_dict())
        return layer

    providers["capacity cf1.0"] = clone("capacity", capacity_factor=1.0)
    providers["capacity cf1.25"] = clone("capacity", capacity_factor=1.25)
    if cfg.n_experts <= 8:  # the loop backend does n_experts times the work: coarse only
        providers["dropless loop"] = clone("dropless", "loop")
    providers["dropless torch"] = clone("dropless", "torch")
    if device == "cpu":
        why = cpu_plugin_status()
        if why is None:
            providers["dropless openmp"] = clone("dropless", "openmp")
        else:
            notes.append(f"dropless openmp: the CPU plug-in's grouped GEMM is not available here ({why})")
    if capabilities().triton_mode == "compiled":
        providers["dropless triton"] = clone("dropless", "triton")
        providers["fused"] = clone("fused")
        providers["fused_atomic"] = clone("fused_atomic")
    else:
        notes.append(untimed_triton("dropless triton, fused, fused_atomic", capabilities().triton_mode))
    if include_hf:
        try:
            for impl in ("eager", "batched_mm", "grouped_mm"):
                providers[f"hf {impl}"] = _hf_block(naive, impl).to(device=device, dtype=dtype)
        except ImportError:
            notes.append("hf: transformers is not installed (pip install -e '.[test]')")
    if only is not None:
        providers = {k: v for k, v in providers.items() if k == "naive" or k in only}
    return providers, notes


def _step_fn(module: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor):
    # the provider's fwd+bwd step, and its output on x
    is_hf = not isinstance(module, MoELayer)

    def step() -> None:
        xi = x.detach().requires_grad_()
        if is_hf:
            module(xi.unsqueeze(0)).squeeze(0).backward(grad)
        else:
            y, stats = module(xi)
            torch.autograd.backward([y, stats.aux_loss], [grad, torch.ones_like(stats.aux_loss)])

    with torch.no_grad():
        y = module(x.unsqueeze(0)).squeeze(0) if is_hf else module(x)[0]
    return step, y


def _device_dtype() -> tuple[str, torch.dtype]:
    # bf16 on a GPU (what its grouped GEMMs run), fp32 on the CPU (the eager reference).
    return ("cuda", torch.bfloat16) if capabilities().device == "cuda" else ("cpu", torch.float32)


def run_shape(shape: str, tokens: int, min_time_s: float = 0.5, include_hf: bool = True,
              seed: int = 0, only: list[str] | None = None) -> dict:
    """Benchmark one shape; returns ``{"rows": [...], "notes": [...], ...}``.

    Runs on the GPU in bf16 where there is one, else on the CPU in fp32. ``only`` limits
    the providers (``naive`` is always timed: the ratios are to it)."""
    torch.manual_seed(seed)
    s = SHAPES[shape]
    cfg = MoEConfig(**s)
    device, dtype = _device_dtype()
    providers, notes = build_providers(cfg, include_hf, device, dtype, only)
    x = torch.randn(tokens, cfg.d_model, device=device, dtype=dtype)
    grad = torch.randn(tokens, cfg.d_model, device=device, dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    steps, syncs, reference = {}, {}, None
    for name, module in providers.items():
        step, y = _step_fn(module, x, grad)
        if reference is None:
            reference = y
        elif not name.startswith("capacity"):  # capacity drops tokens by design
            torch.testing.assert_close(y, reference, rtol=tol, atol=tol,
                                       msg=lambda m, n=name: f"{n} differs from naive: {m}")
        syncs[name] = sum(count_syncs(step)[1].values())
        steps[name] = step
    timings = compare(steps, min_time_s=min_time_s)
    flops = expert_flops(tokens, cfg.top_k, cfg.d_model, cfg.d_expert)
    naive_s = timings["naive"].median_s
    rows = [{"shape": shape, "provider": name, "median_ms": t.median_s * 1e3,
             "tokens_per_s": tokens / t.median_s, "vs_naive": naive_s / t.median_s,
             "syncs_per_step": syncs[name], "expert_gflops": flops / t.median_s / 1e9}
            for name, t in timings.items()]
    return {"shape": shape, "tokens": tokens, "config": s, "device": device,
            "dtype": str(dtype).replace("torch.", ""), "rows": rows, "notes": notes}


def expert_compute_vs_floor(shape: str, tokens: int, ceiling_gflops: float | None = None,
                            min_time_s: float = 0.5, ceiling_n: int = 1024,
                            backend: str = "torch") -> dict:
    """Time the dropless expert compute alone (grouped GEMMs and SwiGLU, fwd+bwd, expert
    ``backend``) and compare with the floor ``FLOPs / measured matmul ceiling``.

    The ceiling (a square ``[n, n] @ [n, n]`` matmul) is timed in the same rounds as the
    expert compute (`compare`, alternating), so both see the same machine: on a shared CPU a
    ceiling measured a minute earlier can be far off in either direction. ``ceiling_gflops``, if
    given, is reported alongside as the run's separately measured figure.

    ``ceiling_disturbed`` is True when the ceiling of these rounds cannot be right: below 3/4
    of the separately measured one, or so low that the expert compute would beat the floor
    (a ratio under 1, which no code can reach). The ratio of such a run says nothing; rerun.
    """
    cfg = MoEConfig(**SHAPES[shape])
    device, dtype = _device_dtype()
    layer = MoELayer(cfg, "dropless", backend).to(device=device, dtype=dtype)
    x = torch.randn(tokens, cfg.d_model, device=device, dtype=dtype)
    ids = layer.router(x).topk_ids
    order, offsets = sort_by_expert(ids, cfg.n_experts)
    xs = x.index_select(0, order // cfg.top_k)
    grad = torch.randn_like(xs)
    a, b, out = ceilings.matmul_operands(dtype, ceiling_n, device=device)

    def experts_only() -> None:
        # As in a training step after zero_grad(set_to_none=True): the weight gradients are
        # written, not accumulated into the previous round's.
        layer.zero_grad(set_to_none=True)
        xi = xs.detach().requires_grad_()
        layer.experts.grouped_forward(xi, offsets).backward(grad)

    def ceiling() -> None:
        torch.matmul(a, b, out=out)

    times = compare({"ceiling": ceiling, "experts": experts_only}, min_time_s=min_time_s)
    t = times["experts"]
    ceiling_now = 2.0 * ceiling_n**3 / times["ceiling"].median_s / 1e9
    flops = expert_flops(tokens, cfg.top_k, cfg.d_model, cfg.d_expert)
    floor_s = flops / (ceiling_now * 1e9)
    ratio = t.median_s / floor_s
    disturbed = ratio < 1.0 or (ceiling_gflops is not None and ceiling_now < 0.75 * ceiling_gflops)
    return {"shape": shape, "backend": backend, "tokens": tokens, "median_ms": t.median_s * 1e3,
            "floor_ms": floor_s * 1e3, "ratio_to_floor": ratio,
            "achieved_gflops": flops / t.median_s / 1e9, "ceiling_gflops": ceiling_now,
            "ceiling_gflops_separate": ceiling_gflops, "ceiling_disturbed": disturbed}


def floor_backends(device: str) -> list[str]:
    """The grouped-GEMM expert backends that run here (the floor comparison's subjects)."""
    return ["torch", "openmp"] if device == "cpu" and cpu_plugin_status() is None else ["torch"]


# The stages each fusion removes from the chain (the SwiGLU epilogue, the gather prologue,
# the scatter epilogue); the GEMMs stay.
REMOVED_BY = {"SwiGLU": "swiglu_epilogue", "permute": "gather_prologue",
              "weighted unpermute": "scatter_epilogue"}


def chain_stage_timing(shape: str = "fine", tokens: int = 1024, min_time_s: float = 0.3,
                       seed: int = 0) -> dict:
    """Forward + backward of each stage of the unfused dropless chain, timed interleaved
    (`compare`) on the same inputs: the permute (a row gather), the two grouped GEMMs,
    SwiGLU and the weighted unpermute (an ``index_add``), in PyTorch eager on this device
    (float32 on a CPU, bfloat16 on a GPU). Each grouped GEMM is one matmul per expert on
    its rows, the expert bounds read to the host once before the timing: the plain
    library GEMM, so that the copies are compared with GEMMs at this machine's speed.

    Returns ``{"stages": [{"stage", "median_ms", "share", "removed_by"}], "removable_share",
    ...}``: ``removable_share`` is the fraction of the chain's time in the stages a fusion
    deletes — the most the fusions can save of this chain here."""
    from moe_lab.moe.experts import swiglu

    device, dtype = _device_dtype()
    s = SHAPES[shape]
    e, k, d, f = s["n_experts"], s["top_k"], s["d_model"], s["d_expert"]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, k, generator=gen).softmax(-1).to(device, dtype)
    x = torch.randn(tokens, d, generator=gen).to(device, dtype)
    w1 = (torch.randn(e, d, 2 * f, generator=gen) / d**0.5).to(device, dtype).requires_grad_()
    w2 = (torch.randn(e, f, d, generator=gen) / f**0.5).to(device, dtype).requires_grad_()
    order, offsets = sort_by_expert(ids, e)
    token_of = order // k
    bounds = offsets.tolist()  # once, before the timing

    def grouped_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # unbind: one backward op for all experts (indexing w[i] would add a full-size
        # zero tensor per expert to the weight gradient)
        return torch.cat([a[bounds[i]:bounds[i + 1]] @ wi for i, wi in enumerate(w.unbind(0))])

    xs = x.index_select(0, token_of)
    pre = grouped_mm(xs, w1.detach())
    h = swiglu(pre)
    y = grouped_mm(h, w2.detach())
    wflat = weights.reshape(-1).index_select(0, order).unsqueeze(1)

    def stage(fn, *inputs):
        with torch.no_grad():
            grad = torch.randn_like(fn(*inputs))  # the gradient of the stage's output

        def run() -> None:
            fn(*[t.detach().requires_grad_() for t in inputs]).backward(grad)
        return run

    stages = {
        "permute": stage(lambda a: a.index_select(0, token_of), x),
        "GEMM1": stage(grouped_mm, xs, w1),
        "SwiGLU": stage(swiglu, pre),
        "GEMM2": stage(grouped_mm, h, w2),
        "weighted unpermute": stage(lambda a, wt: a.new_zeros(tokens, d).index_add(0, token_of, a * wt),
                                    y, wflat),
    }
    timings = compare(stages, min_time_s=min_time_s)
    total = sum(t.median_s for t in timings.values())
    rows = [{"stage": name, "median_ms": t.median_s * 1e3, "share": t.median_s / total,
             "removed_by": REMOVED_BY.get(name, "")} for name, t in timings.items()]
    return {"shape": shape, "tokens": tokens, "device": device, "dtype": str(dtype).replace("torch.", ""),
            "stages": rows, "removable_share": sum(r["share"] for r in rows if r["removed_by"]),
            "chain_ms": total * 1e3}


def fusion_report(tokens: int = 1024, min_time_s: float = 0.3, notebook: str = "bench:moe-layer") -> dict:
    """Bytes and launches per MoE layer, unfused and each fusion, at DeepSeek-V3's and
    GPT-OSS-20B's shapes (`moe_lab.perf.fusion.fusion_table`; the projected milliseconds at
    H200 and GB300 bandwidth are projections), and `chain_stage_timing` at the fine shape,
    measured here; the counts and the timing go to the ledger."""
    from moe_lab.perf.fusion import fusion_table

    table = fusion_table()
    timing = chain_stage_timing("fine", tokens, min_time_s)
    for row in table:
        step = f"fusion:{row['preset']}:{row['variant']}"
        ledger.record(notebook, step, "bytes_per_layer", row["bytes"], "B", counted=True,
                      ep=row["ep"], tokens=row["tokens"])
        ledger.record(notebook, step, "launches_per_layer", row["launches"], "launches", counted=True)
    for row in timing["stages"]:
        ledger.record(notebook, f"fusion:fine:chain {row['stage']}", "median_ms", row["median_ms"], "ms",
                      tokens=tokens)
    ledger.record(notebook, "fusion:fine:chain", "removable_share", timing["removable_share"], "fraction",
                  tokens=tokens)
    return {"table": table, "chain_timing": timing,
            "note": ("bytes and launches counted from the tensors each launch reads and writes "
                     "(moe_lab.perf.fusion); projected_ms_* = bytes / HBM bandwidth from datasheet "
                     "figures, a projection, not a measurement; chain_timing measured on this machine")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="all", choices=["all", *SHAPES])
    parser.add_argument("--profile", default="smoke", choices=list(TOKENS))
    parser.add_argument("--tokens", type=positive_int, help="tokens per step (overrides profile)")
    parser.add_argument("--min-time", type=non_negative_float, default=0.5,
                        help="seconds of timing per provider")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face blocks")
    parser.add_argument("--only", nargs="+", default=None, metavar="PROVIDER",
                        help="time only these providers besides naive (e.g. 'dropless torch')")
    parser.add_argument("--notebook", default="bench:moe-layer", help="ledger 'notebook' field")


def run(args: argparse.Namespace) -> dict:
    # --tokens and --min-time are checked at the door (their argparse types).
    unknown = sorted(set(args.only or ()) - set(PROVIDERS))
    if unknown:  # before the slow part (the CPU plug-in's build, the ceiling's timing)
        raise ValueError(f"--only: unknown providers {unknown}; known {list(PROVIDERS)}")
    tokens = TOKENS[args.profile] if args.tokens is None else args.tokens
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    device, dtype = _device_dtype()
    # A lower bound: the input and its gradient, and each token's top-k expert activations.
    widest = max(SHAPES[s]["top_k"] * SHAPES[s]["d_expert"] + 2 * SHAPES[s]["d_model"] for s in shapes)
    check_fits(f"--tokens {tokens}", tokens * widest * 4, "use fewer --tokens", device)
    ceiling_n = 1024 if args.profile == "smoke" else 2048
    ceiling = ceilings.matmul_peak(dtype, n=ceiling_n, device=device)
    result: dict = {"tokens": tokens, "matmul_ceiling_gflops": ceiling.giga, "rows": [],
                    "notes": [], "floor": []}
    for shape in shapes:
        r = run_shape(shape, tokens, args.min_time, include_hf=not args.no_hf, only=args.only)
        result["rows"] += r["rows"]
        result["notes"] += [n for n in r["notes"] if n not in result["notes"]]
        for backend in floor_backends(device):
            result["floor"].append(expert_compute_vs_floor(shape, tokens, ceiling.giga, args.min_time,
                                                           ceiling_n=ceiling_n, backend=backend))
    for row in result["rows"]:
        step = f"{row['shape']}:{row['provider']}"
        ledger.record(args.notebook, step, "tokens_per_s", row["tokens_per_s"], "tok/s", tokens=tokens)
        ledger.record(args.notebook, step, "vs_naive", row["vs_naive"], "x", tokens=tokens)
        ledger.record(args.notebook, step, "syncs_per_step", row["syncs_per_step"], "syncs")
    for f in result["floor"]:
        if f["ceiling_disturbed"]:
            result["notes"].append(
                f"{f['shape']} {f['backend']}: the matmul ceiling timed in the same rounds "
                f"({f['ceiling_gflops']:.0f} GFLOP/s, against {ceiling.giga:.0f} measured apart) "
                f"was disturbed, so its ratio to the floor ({f['ratio_to_floor']:.2f}x) means "
                f"nothing: rerun; it is not written to the ledger")
            continue
        ledger.record(args.notebook, f"{f['shape']}:dropless {f['backend']} experts", "ratio_to_floor",
                      f["ratio_to_floor"], "x", tokens=tokens)
    result["fusion"] = fusion_report(tokens, args.min_time, args.notebook)
    return result
