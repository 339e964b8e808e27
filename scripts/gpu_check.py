#!/usr/bin/env python
"""GPU truth: run every Triton kernel compiled against its torch reference, then time them.

Every kernel in moe_lab is tested on the CPU under Triton's interpreter; compiled on a GPU it
can behave differently (bf16 arithmetic, float8 casts, masking, races). This script is the
one place where that is checked and where the workbook's GPU speed figures come from.

    python scripts/gpu_check.py                 # on a CUDA machine: checks + benchmarks
    python scripts/gpu_check.py --cpu-smoke     # tiny shapes, interpreted: tests the script

(a) checks: each kernel's output (outputs poisoned with NaN before the kernel runs, so an
    unwritten element fails) against its plain PyTorch reference on fresh random inputs, at
    a small shape and at DeepSeek-V3 shapes, forward and backward: the grouped GEMM and the
    fused SwiGLU (packed and padded expert segments), the row-id map, permute and unpermute
    (padded too; the router weights' gradient included), the MX quantizer bit for bit
    (bfloat16 and float32 input, E4M3 and E5M2, ``rceil`` and ``floor`` scales), MXFP8
    attention and the MXFP8 GEMM (both through ``tl.dot_scaled``), and the fused router
    (its per-sequence statistics included);
(b) the training step captured as a CUDA graph and replayed, its losses checked against the
    eager step over the reference implementations (naive dispatch, a loop over experts,
    the reference router) from the same weights on the same batches;
(c) benchmarks with CUDA events (warm-up, median): grouped GEMM vs ``torch._grouped_mm``,
    fused FP32 router vs unfused FP64, quantizer GB/s vs the measured copy bandwidth,
    MXFP8 attention vs bf16 SDPA, MXFP8 GEMM vs bf16 matmul, graphed vs eager step;
(d) writes ``results/<gpu-name>/{env,checks,bench}.json`` and ``summary.md`` (GPU name,
    driver, torch and Triton versions included), and a copy under ``$OUT`` when set.

A section that fails is recorded with its error and the script goes on; the exit code is
non-zero when any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------------------- helpers


def gpu_env(torch) -> dict:
    env = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gb=round(p.total_memory / 2**30, 1),
                   sms=p.multi_processor_count, cuda=torch.version.cuda)
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            env["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError, IndexError):
            env["driver"] = None
    else:
        env.update(gpu="cpu (interpreted smoke run)", driver=None, capability=None)
    return env


@contextlib.contextmanager
def poisoned_outputs(torch):
    """Every ``torch.empty``/``empty_like`` inside the block returns NaN (floats) or -7
    (integers): a kernel that leaves an element unwritten is caught by the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool and not t.is_complex():
            t.fill_(-7)
        return t

    def empty(*args, **kwargs):
        return fill(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return fill(real_empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = empty, empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real_empty, real_empty_like


def randn(torch, g, size: tuple[int, ...], dtype=None, scale: float = 1.0):
    """Normal numbers from the generator ``g``, on its device, times ``scale``, in ``dtype``
    (default float32)."""
    return (torch.randn(*size, generator=g, device=g.device) * scale).to(dtype or torch.float32)


def rel_error(got, want) -> float:
    got, want = got.double(), want.double()
    if not bool(got.isfinite().all() == want.isfinite().all()) or got.isnan().any():
        return float("nan")
    denom = want.norm().item()
    return (got - want).norm().item() / denom if denom else (got - want).norm().item()


class Report:
    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.bench: list[dict] = []

    def check(self, name: str, shape: str, err: float, tol: float, **extra) -> None:
        ok = math.isfinite(err) and err <= tol
        self.checks.append({"check": name, "shape": shape, "rel_error": err, "tol": tol,
                            "ok": ok, **extra})
        print(f"  [{'ok' if ok else 'FAIL'}] {name:<34} {shape:<22} rel.err {err:.2e} (tol {tol:.0e})",
              flush=True)

    def exact(self, name: str, shape: str, equal: bool, **extra) -> None:
        self.checks.append({"check": name, "shape": shape, "rel_error": 0.0 if equal else float("nan"),
                            "tol": 0.0, "ok": bool(equal), **extra})
        print(f"  [{'ok' if equal else 'FAIL'}] {name:<34} {shape:<22} bit-exact: {bool(equal)}", flush=True)

    def failed(self, name: str, error: BaseException) -> None:
        self.checks.append({"check": name, "shape": "-", "ok": False,
                            "error": f"{type(error).__name__}: {error}"})
        print(f"  [FAIL] {name}: {type(error).__name__}: {error}", flush=True)
        traceback.print_exc(limit=4)

    def timed(self, name: str, **fields) -> None:
        self.bench.append({"bench": name, **fields})
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
        print(f"  {name}: {shown}", flush=True)


def timer(torch, cuda: bool):
    """Median seconds of ``fn``: CUDA events via triton.testing.do_bench, else
    moe_lab.workbench.measure.timing."""
    if cuda:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    from moe_lab.workbench.measure.timing import bench

    return lambda fn: bench(fn, warmup=1, min_time_s=0.05).median_s


# ----------------------------------------------------------------------------- sections


def section_grouped_gemm(torch, dev, rep: Report, shapes: dict) -> None:
    """Grouped GEMM forward, dX, dW and the fused SwiGLU's forward and backward, on packed
    offsets and on a padded layout (segments rounded up to 16 rows, rows past the last
    segment), each against the textbook loop in float64."""
    from moe_lab.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference, grouped_gemm_swiglu

    align = 16
    for label, (E, M, K, N) in shapes.items():
        for dtype, tol in ((torch.float32, 5e-3), (torch.bfloat16, 2e-2)):
            for padded in (False, True):
                g = torch.Generator(device=dev).manual_seed(0)
                counts = torch.bincount(torch.randint(0, E, (M,), generator=g, device=dev), minlength=E)
                counts[0] = 0  # an idle expert
                if padded:
                    counts = (counts + align - 1) // align * align
                offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
                # the padded layout's buffer is sized from the static bound, as the layer's is
                m = M + E * (align - 1) if padded else int(counts.sum())
                shape = f"{label}, padded to {align}" if padded else label
                x, w, w2, dy, dh = (randn(torch, g, size, dtype, K**-0.25)
                                    for size in ((m, K), (E, K, N), (E, K, 2 * N), (m, N), (m, N)))
                name = f"grouped_gemm {str(dtype)[6:]}"
                xg, wg, w2g = (t.clone().requires_grad_() for t in (x, w, w2))
                with poisoned_outputs(torch):
                    y = grouped_gemm(xg, wg, offsets)
                    gx, gw = torch.autograd.grad(y, (xg, wg), dy)
                    h = grouped_gemm_swiglu(xg, w2g, offsets)
                    hx, hw = torch.autograd.grad(h, (xg, w2g), dh)
                xr, wr, w2r = (t.double().requires_grad_() for t in (x, w, w2))
                yr = grouped_gemm_reference(xr, wr, offsets)
                gxr, gwr = torch.autograd.grad(yr, (xr, wr), dy.double())
                hr = swiglu_reference(grouped_gemm_reference(xr, w2r, offsets))
                hxr, hwr = torch.autograd.grad(hr, (xr, w2r), dh.double())
                for what, got, want in (("fwd", y, yr), ("dX", gx, gxr), ("dW", gw, gwr)):
                    rep.check(f"{name} {what}", shape, rel_error(got, want), tol)
                for what, got, want in (("fwd", h, hr), ("dX", hx, hxr), ("dW", hw, hwr)):
                    rep.check(f"grouped_gemm_swiglu {str(dtype)[6:]} {what}", shape,
                              rel_error(got, want), tol)


def swiglu_reference(h):
    """``silu(gate) * up`` of the two halves of ``h``'s last dim: the textbook SwiGLU."""
    import torch.nn.functional as F

    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def section_permute(torch, dev, rep: Report, shapes: dict) -> None:
    """The row-id map, permute and unpermute, forward and backward (the gradient of the
    router weights included), packed and with each expert's rows padded to 16."""
    from moe_lab.kernels import permute as P

    for label, (T, k, E, d) in shapes.items():
        for align in (1, 16):
            g = torch.Generator(device=dev).manual_seed(align)
            ids = torch.randint(0, E, (T, k), generator=g, device=dev)
            n_rows = P.permuted_rows(T, k, E, align)
            rmap_ref, off_ref = P.make_row_id_map_reference(ids, E, align)
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
                shape = f"{label} {str(dtype)[6:]}" + (f", padded to {align}" if align > 1 else "")
                x, y_in, dy, dout = (randn(torch, g, size, dtype)
                                     for size in ((T, d), (n_rows, d), (n_rows, d), (T, d)))
                wts = torch.rand(T, k, generator=g, device=dev)
                xg, yg, wg = (t.clone().requires_grad_() for t in (x, y_in, wts))
                with poisoned_outputs(torch):
                    rmap, offsets = P.make_row_id_map(ids, E, align=align)
                    y = P.permute(xg, rmap, n_rows)
                    (dx,) = torch.autograd.grad(y, xg, dy)
                    back = P.unpermute(yg, rmap, wg)
                    d_y, d_w = torch.autograd.grad(back, (yg, wg), dout)
                rep.exact("row_id_map", shape, torch.equal(rmap.long(), rmap_ref.long())
                          and torch.equal(offsets.long(), off_ref.long()))
                rep.exact("permute", shape, torch.equal(y, P.permute_reference(x, rmap_ref, n_rows)))
                xr, yr, wr = (t.double().requires_grad_() for t in (x, y_in, wts))
                (dxr,) = torch.autograd.grad(P.permute_reference(xr, rmap_ref, n_rows), xr, dy.double())
                back_r = P.unpermute_reference(yr, rmap_ref, wr)
                d_yr, d_wr = torch.autograd.grad(back_r, (yr, wr), dout.double())
                for name, got, want in (("permute backward dX", dx, dxr),
                                        ("unpermute (weighted)", back, back_r),
                                        ("unpermute backward dY", d_y, d_yr),
                                        ("unpermute backward d(router weights)", d_w, d_wr)):
                    rep.check(name, shape, rel_error(got, want), tol)


def section_mx(torch, dev, rep: Report, shapes: dict, time_fn, copy_gbps: float | None) -> None:
    """The MX quantizer bit for bit against `moe_lab.quant.mx.quantize`: bfloat16 and float32
    input, E4M3 and E5M2 elements, ``rceil`` and ``floor`` scales, row- and column-wise."""
    from moe_lab.kernels.mx_quantize import mx_quantize
    from moe_lab.quant.mx import quantize

    def as_bytes(t):
        return t.view(torch.uint8).contiguous()

    def same(a, b) -> bool:
        return torch.equal(as_bytes(a.data), as_bytes(b.data)) and torch.equal(as_bytes(a.scale),
                                                                                as_bytes(b.scale))

    for label, (M, K) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(M + K)
        base = randn(torch, g, (M, K)) * torch.logspace(-3, 3, K, device=dev)
        for in_dtype in (torch.bfloat16, torch.float32):
            x = base.to(in_dtype)
            for elem, elem_name in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
                for mode in ("rceil", "floor"):
                    shape = f"{label} {str(in_dtype)[6:]}->{elem_name} {mode}"
                    with poisoned_outputs(torch):
                        row, col = mx_quantize(x, elem_dtype=elem, scale_mode=mode)
                    ref_r = quantize(x, elem, dim=-1, scale_mode=mode)
                    ref_c = quantize(x, elem, dim=-2, scale_mode=mode)
                    rep.exact("mx_quantize rowwise", shape, same(row, ref_r))
                    rep.exact("mx_quantize colwise", shape, same(col, ref_c))
    if time_fn is not None:
        M, K = list(shapes.values())[-1]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        t = time_fn(lambda: mx_quantize(x))
        nbytes = x.numel() * 2 + 2 * (x.numel() + x.numel() // 32)
        gbps = nbytes / t / 1e9
        rep.timed("mx_quantize (row+col)", shape=f"{M}x{K}", ms=t * 1e3, gbps=gbps,
                  copy_gbps=copy_gbps, fraction_of_copy=gbps / copy_gbps if copy_gbps else None)


def section_attention(torch, dev, rep: Report, shapes: dict, time_fn) -> None:
    import torch.nn.functional as F

    from moe_lab.attention import mxfp8_reference_attention
    from moe_lab.kernels.mx_attention import mx_attention_forward, quantize_qkv

    for label, (B, H, T, D) in shapes.items():
        q, k, v = (torch.randn(B, H, T, D, device=dev) for _ in range(3))
        with poisoned_outputs(torch):
            out = mx_attention_forward(*quantize_qkv(q, k, v))
        ref = mxfp8_reference_attention(q, k, v)
        rep.check("mxfp8 attention vs emulation", label, rel_error(out, ref), 5e-2)
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        rep.check("mxfp8 attention vs fp64", label, rel_error(out, exact), 1e-1)
    if time_fn is not None:
        B, H, T, D = list(shapes.values())[-1]
        q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        qm, km, vm = quantize_qkv(q, k, v)
        t_mx = time_fn(lambda: mx_attention_forward(qm, km, vm))
        t_bf = time_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        flops = 4 * B * H * T * T * D / 2
        rep.timed("attention fwd", shape=f"{B}x{H}x{T}x{D}", mxfp8_triton_ms=t_mx * 1e3,
                  bf16_sdpa_ms=t_bf * 1e3, mxfp8_tflops=flops / t_mx / 1e12,
                  sdpa_tflops=flops / t_bf / 1e12, speedup=t_bf / t_mx,
                  note="QK^T and PV through tl.dot_scaled: block-scaled tcgen05.mma on sm_100, "
                       "upcast to bf16 wgmma on sm_90")


def section_mx_gemm(torch, dev, rep: Report, shapes: dict, time_fn) -> None:
    """The MXFP8 GEMM (`moe_lab.kernels.mx_gemm`, ``tl.dot_scaled``) against its float64
    reference on operands quantized by the reference quantizer, fp32 and bf16 out; timed
    against a bf16 ``torch.matmul`` of the same shape. Block-scaled MMA is native on sm_100;
    on sm_90 Triton upcasts the tiles to bf16 (the compile report shows which)."""
    from moe_lab.kernels.mx_gemm import mx_gemm, mx_gemm_reference
    from moe_lab.quant.mx import quantize

    for label, (M, N, K) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(M + N + K)
        a, b = quantize(randn(torch, g, (M, K))), quantize(randn(torch, g, (N, K)))
        want = mx_gemm_reference(a.data, a.scale, b.data, b.scale)
        for out_dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            with poisoned_outputs(torch):
                got = mx_gemm(a.data, a.scale, b.data, b.scale, out_dtype=out_dtype)
            rep.check(f"mx_gemm {str(out_dtype)[6:]} out vs float64", label, rel_error(got, want), tol)
    if time_fn is not None:
        M, N, K = list(shapes.values())[-1]
        x, w = torch.randn(M, K, device=dev), torch.randn(N, K, device=dev)
        a, b = quantize(x), quantize(w)
        xb, wb = x.bfloat16(), w.bfloat16()
        t_mx = time_fn(lambda: mx_gemm(a.data, a.scale, b.data, b.scale, out_dtype=torch.bfloat16))
        t_bf = time_fn(lambda: xb @ wb.T)
        flops = 2 * M * N * K
        rep.timed("MXFP8 GEMM", shape=f"{M}x{N}x{K}", mx_gemm_ms=t_mx * 1e3, bf16_matmul_ms=t_bf * 1e3,
                  mx_tflops=flops / t_mx / 1e12, bf16_tflops=flops / t_bf / 1e12, speedup=t_bf / t_mx,
                  note="tl.dot_scaled: block-scaled tcgen05.mma on sm_100; upcast to bf16 wgmma on sm_90")


def section_grouped_gemm_bench(torch, dev, rep: Report, time_fn, E: int, M: int, K: int, N: int) -> None:
    from moe_lab.kernels.grouped_gemm import grouped_gemm

    counts = torch.full((E,), M // E, device=dev)
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
    flops = 2 * M * K * N
    t_tr = time_fn(lambda: grouped_gemm(x, w, offsets))
    row = {"shape": f"E={E} M={M} K={K} N={N} bf16", "triton_ms": t_tr * 1e3,
           "triton_tflops": flops / t_tr / 1e12}
    if hasattr(torch, "_grouped_mm"):
        t_ref = time_fn(lambda: torch._grouped_mm(x, w, offs=offsets[1:]))
        row.update(torch_grouped_mm_ms=t_ref * 1e3, torch_tflops=flops / t_ref / 1e12,
                   ratio_triton_to_torch=t_ref / t_tr)
    rep.timed("grouped GEMM fwd", **row)


def section_router(torch, dev, rep: Report, shapes: dict, time_fn) -> None:
    """The fused router (``ROUTER_IMPLS["triton"]``) against the reference chain: ids,
    weights, counts, the per-sequence statistics (counts and score sums of each sequence,
    the sequence aux loss; sequences not a multiple of a program's tokens, so programs
    straddle them) and the gradient of the gate weight through all the losses."""
    import torch.nn.functional as F

    from moe_lab.config import MoEConfig
    from moe_lab.kernels.fused_router import fused_router
    from moe_lab.moe.router import ROUTER_IMPLS, route

    if "triton" not in ROUTER_IMPLS:
        raise RuntimeError("ROUTER_IMPLS has no 'triton' entry (fused router not built)")
    fused = ROUTER_IMPLS["triton"]
    for label, (T, seq_len, moe) in shapes.items():
        cfg = MoEConfig(d_expert=64, **moe)
        D, E, n_seqs = cfg.d_model, cfg.n_experts, T // seq_len
        g = torch.Generator(device=dev).manual_seed(T)
        x = randn(torch, g, (T, D))
        w = randn(torch, g, (E, D), scale=D**-0.5).requires_grad_()
        bias = randn(torch, g, (E,), scale=0.01)
        with poisoned_outputs(torch):
            got = fused(x, w, cfg, bias, seq_len=seq_len)
            _, _, counts, prob_sums, _ = fused_router(got.logits.detach(), cfg, bias, seq_len=seq_len)
        want = route(x, w, cfg, bias, seq_len=seq_len)
        rep.exact("fused router ids", label, torch.equal(got.topk_ids, want.topk_ids))
        rep.check("fused router weights", label, rel_error(got.topk_weights, want.topk_weights), 1e-5)
        rep.exact("fused router counts", label, torch.equal(got.tokens_per_expert, want.tokens_per_expert))
        seq_counts = F.one_hot(want.topk_ids, E).sum(1).view(n_seqs, seq_len, E).sum(1)
        rep.exact("fused router counts per sequence", label, torch.equal(counts.long(), seq_counts))
        scores = want.scores.detach().double()
        seq_probs = (scores / scores.sum(-1, keepdim=True)).view(n_seqs, seq_len, E).sum(1)
        rep.check("fused router score sums per sequence", label, rel_error(prob_sums, seq_probs), 1e-5)
        for name in ("aux_loss", "seq_aux_loss", "z_loss"):
            rep.check(f"fused router {name}", label,
                      rel_error(getattr(got, name).detach(), getattr(want, name).detach()), 1e-5)
        dw = randn(torch, g, (T, cfg.top_k))
        grads = []
        for r in (got, want):
            loss = (r.topk_weights * dw).sum() + r.aux_loss + 3.0 * r.seq_aux_loss + 0.1 * r.z_loss
            grads.append(torch.autograd.grad(loss, (w,))[0])
        rep.check("fused router grad", label, rel_error(*grads), 1e-4)
    if time_fn is not None:
        T, _, moe = list(shapes.values())[-1]
        cfg = MoEConfig(d_expert=64, **moe)
        D, E = cfg.d_model, cfg.n_experts
        logits_shape = f"T={T} E={E} top{cfg.top_k} groups {cfg.topk_groups}/{cfg.n_groups}"
        x = torch.randn(T, D, device=dev)
        w = torch.randn(E, D, device=dev) / D**0.5
        times = {}
        for dtype in ("fp64", "fp32"):
            c = cfg.replace(router_dtype=dtype)
            times[f"unfused_{dtype}_ms"] = time_fn(lambda c=c: route(x, w, c)) * 1e3
        times["fused_fp32_ms"] = time_fn(lambda: fused(x, w, cfg, None)) * 1e3
        rep.timed("router fwd", shape=logits_shape, **times,
                  speedup_vs_unfused_fp64=times["unfused_fp64_ms"] / times["fused_fp32_ms"])


def section_graphs(torch, dev, rep: Report, quick: bool, time_fn) -> None:
    """The graphed step (`moe_lab.training.graphs.GraphedStep` over the fast implementations
    of this device: on CUDA the Triton kernels) against the *eager reference*: the same
    sync-free step, not captured, over the plain PyTorch implementations (naive dispatch, a
    loop over experts, the reference router), from the same weights on the same batches.
    The first step's loss differs by the kernels alone; the mean over the steps also by
    how the differences grow through training."""
    from moe_lab.config import preset
    from moe_lab.model import ModelImpls
    from moe_lab.training.build import build_model, default_impls, random_batch
    from moe_lab.training.graphs import GraphedStep
    from moe_lab.training.steps import StepConfig, SyncFreeStep
    from moe_lab.workbench.demos.graphed_vs_eager import graphed_vs_eager

    model_cfg = preset("small")
    batch_size, steps = (2, 3) if quick else (4, 20)
    cfg = StepConfig(read_every=1, warmup_steps=min(5, steps), steps=steps)
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(model_cfg, batch_size, dev, gen) for _ in range(steps)]
    ref_model, ref_opt = build_model(model_cfg, ModelImpls(), device=dev, seed=0, lr=cfg.lr)
    reference = SyncFreeStep(ref_model, ref_opt, batches[0], cfg)
    fast = default_impls(dev)
    model, optimizer = build_model(model_cfg, fast, device=dev, seed=0, lr=cfg.lr)
    model.load_state_dict(ref_model.state_dict())  # the same weights, whatever the impls
    graphed = GraphedStep(model, optimizer, batches[0], cfg, warmup=3, quiet=True)
    losses = [(reference(b)["loss"], graphed(b)["loss"]) for b in batches]
    impls = {"graphed": f"{graphed.mode}: {fast}", "reference": f"eager: {ModelImpls()}"}

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(a), 1e-12)

    rep.check("graphed step loss vs eager reference (step 1)", "small",
              rel(*losses[0]), 1e-4, **impls)
    mean_ref, mean_graphed = (sum(col) / steps for col in zip(*losses, strict=True))
    rep.check(f"graphed step loss vs eager reference (mean of {steps})", "small",
              rel(mean_ref, mean_graphed), 1e-3, **impls)
    if time_fn is not None:
        result = graphed_vs_eager("small", batch_size=batch_size, steps=steps)
        rep.timed("training step (small), graphed vs eager", **result)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results folder (default results/<gpu-name>)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the interpreter")
    ap.add_argument("--no-bench", action="store_true", help="checks only")
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("no CUDA device: run with --cpu-smoke to exercise the script under the interpreter")
        return 2
    if not cuda:  # this script owns its process: its own test kernels run interpreted too
        os.environ.setdefault("TRITON_INTERPRET", "1")

    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    env = gpu_env(torch)
    print(json.dumps(env), flush=True)
    rep = Report()
    small = args.cpu_smoke
    time_fn = None if args.no_bench else timer(torch, cuda)
    copy_gbps = None
    if time_fn is not None:
        from moe_lab.workbench.measure import ceilings

        copy = ceilings.copy_bandwidth(nbytes=2**24 if small else 2**31, device=dev)
        peak = ceilings.matmul_peak(torch.bfloat16, n=512 if small else 8192, device=dev)
        copy_gbps = copy.giga
        rep.timed("ceilings", copy_gbps=copy.giga, bf16_matmul_tflops=peak.giga / 1e3)

    # DeepSeek-V3 experts: d_model 7168, expert width 2048 (gate+up 4096); 32 local experts.
    gg_shapes = {"small E=4 M=200": (4, 200, 64, 96)}
    pm_shapes = {"T=64 k=2 E=8 d=64": (64, 2, 8, 64)}
    mx_shapes = {"128x256": (128, 256), "96x320": (96, 320)}  # 320: a second K tile
    at_shapes = {"1x2x64x32": (1, 2, 64, 32)}
    mg_shapes = {"M=96 N=80 K=96": (96, 80, 96)}  # ragged against the tiles
    # router: tokens, sequence length (not a multiple of a program's tokens), MoEConfig fields
    rt_shapes = {
        "T=64 E=16 top4 g4/2 sigmoid, seqs of 16": (64, 16, dict(
            d_model=32, n_experts=16, top_k=4, n_groups=4, topk_groups=2, score_func="sigmoid",
            scaling_factor=2.5)),
        "T=48 E=8 top2 softmax, seqs of 6": (48, 6, dict(d_model=32, n_experts=8, top_k=2)),
    }
    if not small:
        gg_shapes["dsv3 down E=32 M=8192"] = (32, 8192, 2048, 7168)
        gg_shapes["dsv3 gate_up E=32 M=8192"] = (32, 8192, 7168, 2048)
        pm_shapes["dsv3 T=4096 k=8 E=256 d=7168"] = (4096, 8, 256, 7168)
        mx_shapes["dsv3 8192x7168"] = (8192, 7168)
        at_shapes["4x16x4096x128"] = (4, 16, 4096, 128)
        mg_shapes["dsv3 up/gate 8192x4096x7168"] = (8192, 4096, 7168)
        rt_shapes["gpt-oss T=8190 E=32 top4 softmax, seqs of 1365"] = (8190, 1365, dict(
            d_model=2880, n_experts=32, top_k=4))
        rt_shapes["dsv3 T=16380 E=256 top8 g8/4, seqs of 4095"] = (16380, 4095, dict(
            d_model=7168, n_experts=256, top_k=8, n_groups=8, topk_groups=4, score_func="sigmoid",
            scaling_factor=2.5))

    sections = [
        ("grouped GEMM", lambda: section_grouped_gemm(torch, dev, rep, gg_shapes)),
        ("permute", lambda: section_permute(torch, dev, rep, pm_shapes)),
        ("MX quantizer", lambda: section_mx(torch, dev, rep, mx_shapes, time_fn, copy_gbps)),
        ("MXFP8 attention", lambda: section_attention(torch, dev, rep, at_shapes, time_fn)),
        ("MXFP8 GEMM", lambda: section_mx_gemm(torch, dev, rep, mg_shapes, time_fn)),
        ("fused router", lambda: section_router(torch, dev, rep, rt_shapes, time_fn)),
        ("CUDA graph step", lambda: section_graphs(torch, dev, rep, small, time_fn)),
    ]
    if time_fn is not None:
        E, M, K, N = (4, 256, 64, 128) if small else (32, 32768, 7168, 4096)
        sections.insert(1, ("grouped GEMM bench",
                            lambda: section_grouped_gemm_bench(torch, dev, rep, time_fn, E, M, K, N)))
    for name, run in sections:
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            run()
        except Exception as exc:  # record and go on: one broken section must not hide the rest
            rep.failed(name, exc)
        print(f"   ({time.perf_counter() - start:.1f} s)", flush=True)

    out = Path(args.out) if args.out else ROOT / "results" / re.sub(r"[^A-Za-z0-9_.-]+", "_", env["gpu"])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("env", env), ("checks", rep.checks), ("bench", rep.bench)):
        (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(summary_markdown(env, rep))
    if os.environ.get("OUT"):
        for f in out.iterdir():
            shutil.copy(f, Path(os.environ["OUT"]) / f.name)
    n_bad = sum(not c["ok"] for c in rep.checks)
    print(f"\n{len(rep.checks) - n_bad}/{len(rep.checks)} checks passed; results in {out}")
    print(summary_markdown(env, rep))
    return 1 if n_bad else 0


def summary_markdown(env: dict, rep: Report) -> str:
    lines = [f"# GPU check: {env.get('gpu')}", "",
             f"Measured {env.get('date')}; driver {env.get('driver')}, CUDA {env.get('cuda')}, "
             f"torch {env.get('torch')}, Triton {env.get('triton')}.", "",
             "## Checks", "", "| check | shape | rel. error | tol | ok |", "|---|---|---:|---:|---|"]
    for c in rep.checks:
        err = c.get("rel_error")
        lines.append(f"| {c['check']} | {c['shape']} | {err if err is None else f'{err:.2e}'} | "
                     f"{c.get('tol', '-')} | {'✓' if c['ok'] else '✗ ' + c.get('error', '')} |")
    lines += ["", "## Benchmarks", ""]
    for b in rep.bench:
        fields = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in b.items() if k != "bench")
        lines.append(f"- **{b['bench']}**: {fields}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
