"""Rank functions that check the expert-parallel lesson against its single-process reference.

Each runs on every rank together (inside `moe_lab.workbench.ranks.launch.run_ranks`), builds the
same seeded layer or model on every rank, and returns plain data: the largest differences
between what the expert-parallel code computed and what the single-process layer (or plain
autograd) computes, which the tests and notebook 09 assert on.

- `ep_check_rank`: `moe_lab.parallel.ep.EPMoELayer` (dropless, budgeted, overflowing) against
  the single-process dropless layer;
- `overlap_check_rank`: every schedule of the chunked plan (`moe_lab.parallel.plan.chunked_plan`)
  against autograd;
- `merged_check_rank`: every 1F1B plan of `moe_lab.parallel.merged` against the plain schedule
  (bitwise) and autograd;
- `merged_model_check_rank`: `moe_lab.parallel.merged_model.MergedModelStep` against the plain
  step of the whole model;
- `skewed_routing_rank`: `EPMoELayer` at DeepSeek-like routing (many experts, hot and idle
  ones) against the single-process layer, returning its tensors for a bitwise re-run check.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_lab.config import MoEConfig, preset
from moe_lab.data import SyntheticCorpus
from moe_lab.model import MoETransformer
from moe_lab.moe.layer import MoELayer
from moe_lab.parallel.ep import from_layer, rank_experts, sync_gradients
from moe_lab.parallel.merged import MergedStep, two_microbatch_step
from moe_lab.parallel.merged_model import MergedModelStep
from moe_lab.parallel.plan import SCHEDULES, chunked_plan
from moe_lab.workbench.ranks.harness import OVERLAP_RUNS, layer_and_batches
from moe_lab.workbench.ranks.launch import rank_device

Tensor = torch.Tensor


def _err(a: Tensor, b: Tensor) -> float:
    """``max|a − b|`` (0 for empty tensors)."""
    return float((a.detach() - b.detach()).abs().max()) if a.numel() else 0.0


def _rel(a: Tensor, b: Tensor) -> float:
    """``max|a − b| / max|b|`` (the absolute difference where ``b`` is all zeros)."""
    if not b.numel():
        return 0.0
    diff, scale = float((a - b).abs().max()), float(b.abs().max())
    return diff / scale if scale > 0 else diff


def _layer_pair(cfg: MoEConfig, tokens_per_rank: int, seed: int, bias: dict, confident: bool = False,
                **ep_options: object) -> dict:
    """The same seeded single-process dropless layer and batch on every rank (``bias``: expert
    -> selection bias; ``confident``: router weights drawn N(0, 1), so near-ties are
    improbable), run forward and backward on the whole batch, and the `EPMoELayer` made from
    it (``ep_options``) run on this rank's slice: ``{"ref", "ref_stats", "ep", "stats",
    "mine": {quantity: this rank's tensor}, "errors": {quantity: max abs difference from the
    single-process layer's}, "scale": max |y|}``. The quantities: the output ``"y"``, the
    input gradient ``"dx"``, this rank's expert gradients and the replicated weights'
    gradients (router, shared expert; all-reduced: each rank holds the part of its tokens)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(seed)  # seeds every device: the same layer and batch on every rank
    with torch.device(rank_device()):
        ref = MoELayer(cfg, "dropless", "torch")
        with torch.no_grad():
            if confident:
                ref.router.weight.normal_(0.0, 1.0)
            for expert, value in bias.items():
                ref.router.expert_bias[expert] = value
        x_all = torch.randn(world * tokens_per_rank, cfg.d_model)
        g_all = torch.randn_like(x_all)
    lo, hi = rank * tokens_per_rank, (rank + 1) * tokens_per_rank
    xr = x_all.detach().requires_grad_()
    y_ref, ref_stats = ref(xr)
    y_ref.backward(g_all)
    ep = from_layer(ref, **ep_options)
    ep.zero_grad(set_to_none=True)
    x = x_all[lo:hi].detach().requires_grad_()
    y, stats = ep(x)
    y.backward(g_all[lo:hi])
    replicated = {name: p.grad.clone() for name, p in ep.named_parameters()
                  if not name.startswith("experts.")}
    for grad in replicated.values():
        dist.all_reduce(grad)
    local = rank_experts(cfg.n_experts, world, rank)
    mine = {"y": y.detach(), "dx": x.grad,
            "experts.w_gate_up": ep.experts.w_gate_up.grad,
            "experts.w_down": ep.experts.w_down.grad, **replicated}
    want = {"y": y_ref.detach()[lo:hi], "dx": xr.grad[lo:hi],
            "experts.w_gate_up": ref.experts.w_gate_up.grad[local.start:local.stop],
            "experts.w_down": ref.experts.w_down.grad[local.start:local.stop],
            **{name: ref.get_parameter(name).grad for name in replicated}}
    return {"ref": ref, "ref_stats": ref_stats, "ep": ep, "stats": stats, "mine": mine,
            "errors": {name: _err(mine[name], want[name]) for name in mine},
            "scale": float(y_ref.detach().abs().max())}


def ep_check_rank(cfg_fields: dict, tokens_per_rank: int, seed: int = 0,
                  cases: tuple[tuple[str, float, float], ...] = (("dropless", 0.0, 1.25),
                                                                 ("budget", 0.0, 1.25))) -> dict:
    """EP against the single-process layer.

    For each ``(mode, skew, capacity_factor[, on_overflow])`` in ``cases``: builds the same
    single-process dropless layer on every rank (seeded; ``skew`` > 0 adds that bias to
    expert 0's selection score, so most tokens pick it: an overflow for the budgeted mode),
    draws all ranks' tokens from one seeded batch, runs the EP layer on this rank's slice, and
    compares its output and gradients (input, this rank's expert weights, the all-reduced
    router weight) with the single-process layer on the whole batch.

    Returns ``{"rank", "routing": this rank's topk_ids (first case), "cases": [{"mode",
    "skew", max abs errors "y", "dx", "dw_gate_up", "dw_down", "drouter", "scale",
    "overflow", "reruns", "budget", "a2a_bytes", "dropped"}, ...]}``.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = MoEConfig(**cfg_fields)
    result: dict = {"rank": rank, "cases": []}
    for case in cases:
        mode, skew, capacity_factor = case[:3]
        on_overflow = case[3] if len(case) > 3 else "rerun"
        run = _layer_pair(cfg, tokens_per_rank, seed, {0: skew}, confident=True, mode=mode,
                          capacity_factor=capacity_factor, on_overflow=on_overflow)
        ref, ep, stats, errors = (run[k] for k in ("ref", "ep", "stats", "errors"))
        result.setdefault("routing", stats.routing.topk_ids)
        result["cases"].append({
            "mode": mode, "skew": skew, "capacity_factor": capacity_factor, "on_overflow": on_overflow,
            "y": errors["y"], "dx": errors["dx"], "dw_gate_up": errors["experts.w_gate_up"],
            "dw_down": errors["experts.w_down"], "drouter": errors["router.weight"],
            "scale": run["scale"],
            "overflow": bool(stats.overflow) if stats.overflow is not None else False,
            "reruns": stats.reruns, "budget": stats.budget, "a2a_bytes": stats.a2a_bytes,
            "dropped": int(stats.dropped_tokens),
        })
        # sync_gradients: the mean of the ranks' losses. Experts: the owner's gradient (already
        # summed over ranks) / W; router: the all-reduced partials / W.
        expert_grad = ep.experts.w_gate_up.grad.clone()
        sync_gradients(torch.nn.ModuleList([ep]))
        result["cases"][-1]["sync_gradients"] = max(
            _err(ep.experts.w_gate_up.grad, expert_grad / world),
            _err(ep.router.weight.grad, ref.router.weight.grad / world))
    return result


def overlap_check_rank(cfg_fields: dict, tokens: int, n_chunks: int, seed: int = 0) -> dict:
    """Every schedule of the chunked plan (`OVERLAP_RUNS`), run by `MergedStep`, against autograd
    through `EPMoELayer` (output, input gradient, expert/router/shared weight gradients): the
    largest absolute difference per quantity and schedule, and the number of events and the
    bytes exchanged each run recorded. The first run, ``"default"``, is a fresh step with no options: what a
    user gets (real collectives, not a replay)."""
    ep, (x, grad) = layer_and_batches({"cfg": cfg_fields, "tokens": tokens, "seed": seed}, 2)
    xr = x.detach().requires_grad_()
    y_ref, _ = ep(xr)
    y_ref.backward(grad)
    ref = {name: p.grad.clone() for name, p in ep.named_parameters()}
    errors = {}
    runs = {"default": None, **OVERLAP_RUNS}  # "default": a fresh step run with no options
    step = MergedStep(ep, n_chunks)
    for label, options in runs.items():
        ep.zero_grad(set_to_none=True)
        schedule, delay, replay = options or ("overlap", False, False)
        run = MergedStep(ep, n_chunks) if options is None else step
        mb = run.microbatch(x, grad, "x")
        order = chunked_plan(n_chunks, delay_wgrad=delay)
        timeline = run.run(order, mb, mb, replay, schedule == "sequential")
        errors[label] = {"y": _err(mb.y, y_ref), "dx": _err(mb.dx, xr.grad),
                         **{name: _err(p.grad, ref[name]) for name, p in ep.named_parameters()},
                         "events": len(timeline.events), "comm_bytes": timeline.comm_bytes()}
    return errors


def merged_check_rank(cfg_fields: dict, tokens: int, n_chunks: int, seed: int = 0,
                      skew: float = 0.0, starve: int | None = None) -> dict:
    """The two-micro-batch step under every schedule against the plain one (``sequential``,
    same chunks: must be bitwise equal) and against autograd through `EPMoELayer` on the two
    micro-batches (float32 rounding).

    ``skew`` biases expert 0's selection (uneven routing); ``starve`` is an expert made never
    to be chosen (it receives nothing). Returns, per ``"schedule/chunks"``, ``"bitwise"`` (all
    outputs, input gradients and parameter gradients equal to the plain schedule's), ``"rel"``
    (the largest `_rel` against autograd over every quantity), ``"events"`` and ``"a2a_bytes"``
    (the bytes its timelines say this rank sent), plus the tokens each expert received and the
    bytes the routing says this rank sends (``"a2a_bytes"``)."""
    ep, (x0, x1, g0, g1) = layer_and_batches({"cfg": cfg_fields, "tokens": tokens, "seed": seed})
    with torch.no_grad():
        ep.router.expert_bias[0] = skew
        if starve is not None:
            ep.router.expert_bias[starve] = -1e4
    xs, gs = [x0, x1], [g0, g1]
    # Autograd through the layer: two micro-batches, gradients accumulated.
    ep.zero_grad(set_to_none=True)
    ys_ref, dxs_ref = [], []
    received = torch.zeros(ep.cfg.n_experts, dtype=torch.int64, device=x0.device)
    for x, gr in zip(xs, gs, strict=True):
        xr = x.detach().requires_grad_()
        y, stats = ep(xr)
        y.backward(gr)
        ys_ref.append(y.detach())
        dxs_ref.append(xr.grad)
        received += stats.tokens_per_expert
    local = received.view(ep.ep_size, ep.n_local).clone()  # this rank's rows, by the experts' rank
    dist.all_reduce(received)
    autograd = ys_ref + dxs_ref + [p.grad.clone() for p in ep.parameters()]
    # Rows this rank sends away (its rows for other ranks' experts) and returns (other ranks'
    # rows for its experts), each once forward and once backward.
    kept = local[ep.ep_rank].sum()
    away = local.sum() - kept + received.view_as(local)[ep.ep_rank].sum() - kept
    result: dict = {"received_per_expert": received.tolist(), "schedules": {},
                    "a2a_bytes": 2 * int(away) * x0.shape[1] * x0.element_size()}
    for chunks in sorted({1, n_chunks}):
        step = MergedStep(ep, chunks)
        got = {}
        for schedule in SCHEDULES:  # "sequential" first: the others are compared with it
            ep.zero_grad(set_to_none=True)
            ys, dxs, tls = two_microbatch_step(step, xs, gs, schedule)
            got[schedule] = ys + dxs + [p.grad.clone() for p in ep.parameters()]
            result["schedules"][f"{schedule}/{chunks}"] = {
                "rel": max(_rel(a, b) for a, b in zip(got[schedule], autograd, strict=True)),
                "events": sum(len(t.events) for t in tls),
                "a2a_bytes": sum(e.nbytes for t in tls for e in t.events if e.lane == "comm"),
                "bitwise": all(torch.equal(a, b)
                               for a, b in zip(got[schedule], got["sequential"], strict=True))}
    return result


def merged_model_check_rank(preset_name: str = "tiny", batch: int = 4, n_micro: int = 2,
                            n_chunks: int = 1, seed: int = 0) -> dict:
    """One training step of the ``preset_name`` model (EP over all ranks) as `MergedModelStep`
    on ``"1f1b"`` and on ``"sequential"`` (must be bitwise equal), and as plain autograd over
    the micro-batches (``model(x).loss / n_micro`` backward per micro-batch; float32
    rounding). Returns ``{"bitwise", "rel", "loss", "plain_loss"}``."""
    cfg, device = preset(preset_name), rank_device()
    torch.manual_seed(seed)
    with torch.device(device):
        model = MoETransformer(cfg, dispatcher="dropless", expert_backend="torch")
    for block in model.blocks:
        if isinstance(block.ffn, MoELayer):
            block.ffn = from_layer(block.ffn)
    with torch.device("cpu"):  # the corpus is drawn on the host, then moved
        data = SyntheticCorpus(seq_len=cfg.seq_len, seed=seed).sample(
            batch, generator=torch.Generator().manual_seed(seed + 1 + dist.get_rank()))
    data_x, data_y = data.x.to(device), data.y.to(device)

    def grads() -> list[Tensor]:
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]

    results = {}
    for schedule in ("1f1b", "sequential"):
        model.zero_grad(set_to_none=True)
        loss = MergedModelStep(model, n_chunks, schedule).step(data_x, data_y, n_micro)
        results[schedule] = [loss] + grads()
    model.zero_grad(set_to_none=True)
    losses = []
    for x, y in zip(data_x.chunk(n_micro), data_y.chunk(n_micro), strict=True):
        out = model(x, y)
        (out.loss / n_micro).backward()
        losses.append(out.loss.detach())
    plain = [torch.stack(losses).mean()] + grads()

    return {"bitwise": all(torch.equal(a, b) for a, b in zip(results["1f1b"], results["sequential"],
                                                             strict=True)),
            "rel": max(_rel(a, b) for a, b in zip(results["1f1b"], plain, strict=True)),
            "loss": float(results["1f1b"][0]), "plain_loss": float(plain[0])}


def skewed_routing_rank(cfg_fields: dict, tokens_per_rank: int, hot: tuple[int, ...],
                        idle: tuple[int, ...], seed: int = 0) -> dict:
    """The dropless `EPMoELayer` against the single-process layer under skewed routing: the
    ``hot`` experts' selection bias (+0.5) draws a large share of the tokens, the ``idle``
    ones' (-1e4) keeps them from ever being chosen, so some ranks may own only idle experts.

    Every rank builds the same seeded layer and batch, runs the whole batch through the
    single-process layer and its own slice through the EP layer, forward and backward.
    Returns ``{"rank", "received": tokens per expert over all ranks, "errors": {quantity:
    max abs difference}, "scale": max |y|, "tensors": {quantity: this rank's tensor}}``, the
    tensors (output, input gradient, this rank's expert, router and shared-expert gradients,
    the last two all-reduced) for a caller to compare two runs bit for bit."""
    run = _layer_pair(MoEConfig(**cfg_fields), tokens_per_rank, seed,
                      {**dict.fromkeys(hot, 0.5), **dict.fromkeys(idle, -1e4)})
    return {"rank": dist.get_rank(), "received": run["ref_stats"].tokens_per_expert.tolist(),
            "errors": run["errors"], "scale": run["scale"],
            "tensors": {name: t.detach().cpu() for name, t in run["mine"].items()}}
