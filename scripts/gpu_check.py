#!/usr/bin/env python
"""GPU truth: run every Triton kernel compiled against its torch reference, then time them.

Every kernel in moe_lab is tested on the CPU under Triton's interpreter; compiled on a GPU it
can behave differently (bf16 arithmetic, float8 casts, masking, races). This script is the
one place where that is checked and where the workbook's GPU speed figures come from.

    python scripts/gpu_check.py                 # on a CUDA machine: checks + benchmarks
    python scripts/gpu_check.py --cpu-smoke     # tiny shapes, interpreted: tests the script

(a) checks: each kernel's output (outputs poisoned with NaN before the kernel runs, so an
    unwritten element fails) against its reference on fresh random inputs, at a small
    shape and at DeepSeek-V3 shapes; forward and backward where there is one;
(b) the training step captured as a CUDA graph and replayed, its loss checked against eager;
(c) benchmarks with CUDA events (warm-up, median): grouped GEMM vs ``torch._grouped_mm``,
    fused FP32 router vs unfused FP64, quantizer GB/s vs the measured copy bandwidth,
    MXFP8 attention vs bf16 SDPA, graphed vs eager step;
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
    """Median seconds of ``fn``: CUDA events via triton.testing.do_bench, else moe_lab.perf.bench."""
    if cuda:
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    from moe_lab.perf import bench

    return lambda fn: bench(fn, warmup=1, min_time_s=0.05).median_s


# ----------------------------------------------------------------------------- sections


def section_grouped_gemm(torch, dev, rep: Report, shapes: dict) -> None:
    from moe_lab.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference, grouped_gemm_swiglu
    from moe_lab.moe.experts import swiglu

    for label, (E, M, K, N) in shapes.items():
        for dtype, tol in ((torch.float32, 5e-3), (torch.bfloat16, 2e-2)):
            g = torch.Generator(device=dev).manual_seed(0)
            counts = torch.multinomial(torch.ones(E, device=dev), M, replacement=True, generator=g)
            counts = torch.bincount(counts, minlength=E)
            counts[0] = 0  # an idle expert
            offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
            m = int(offsets[-1])
            x = (torch.randn(m, K, device=dev, generator=g) / K**0.25).to(dtype).requires_grad_()
            w = (torch.randn(E, K, N, device=dev, generator=g) / K**0.25).to(dtype).requires_grad_()
            dy = torch.randn(m, N, device=dev, generator=g).to(dtype)
            name = f"grouped_gemm {str(dtype)[6:]}"
            with poisoned_outputs(torch):
                y = grouped_gemm(x, w, offsets)
                gx, gw = torch.autograd.grad(y, (x, w), dy)
            xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
            yr = grouped_gemm_reference(xr, wr, offsets)
            gxr, gwr = torch.autograd.grad(yr, (xr, wr), dy.double())
            rep.check(name + " fwd", label, rel_error(y, yr), tol)
            rep.check(name + " dX", label, rel_error(gx, gxr), tol)
            rep.check(name + " dW", label, rel_error(gw, gwr), tol)
            w2 = (torch.randn(E, K, 2 * N, device=dev, generator=g) / K**0.25).to(dtype)
            with poisoned_outputs(torch):
                h = grouped_gemm_swiglu(x.detach(), w2, offsets)
            hr = swiglu(grouped_gemm_reference(x.detach().double(), w2.double(), offsets))
            rep.check(f"grouped_gemm_swiglu {str(dtype)[6:]} fwd", label, rel_error(h, hr), tol)


def section_permute(torch, dev, rep: Report, shapes: dict) -> None:
    from moe_lab.kernels import permute as P

    for label, (T, k, E, d) in shapes.items():
        ids = torch.randint(0, E, (T, k), device=dev)
        x = torch.randn(T, d, device=dev)
        wts = torch.rand(T, k, device=dev)
        with poisoned_outputs(torch):
            rmap, offsets = P.make_row_id_map(ids, E)
            y = P.permute(x, rmap, T * k)
            back = P.unpermute(y, rmap, wts)
        rmap_ref, off_ref = P.make_row_id_map_reference(ids, E)
        rep.exact("row_id_map", label, torch.equal(rmap.long(), rmap_ref.long())
                  and torch.equal(offsets.long(), off_ref.long()))
        rep.exact("permute", label, torch.equal(y, P.permute_reference(x, rmap_ref, T * k)))
        rep.check("unpermute (weighted)", label,
                  rel_error(back, P.unpermute_reference(y, rmap_ref, wts)), 1e-5)


def section_mx(torch, dev, rep: Report, shapes: dict, time_fn, copy_gbps: float | None) -> None:
    from moe_lab.kernels.mx import mx_quantize
    from moe_lab.quant.mx import quantize

    for label, (M, K) in shapes.items():
        x = (torch.randn(M, K, device=dev) * torch.logspace(-3, 3, K, device=dev)).to(torch.bfloat16)
        with poisoned_outputs(torch):
            row, col = mx_quantize(x)
        ref_r, ref_c = quantize(x, dim=-1, scale_mode="rceil"), quantize(x, dim=-2, scale_mode="rceil")
        same = (torch.equal(row.data.view(torch.uint8), ref_r.data.view(torch.uint8))
                and torch.equal(row.scale.view(torch.uint8), ref_r.scale.view(torch.uint8)))
        rep.exact("mx_quantize rowwise", label, same)
        def as_bytes(t):
            return t.view(torch.uint8).contiguous()

        same = (torch.equal(as_bytes(col.data), as_bytes(ref_c.data))
                and torch.equal(as_bytes(col.scale), as_bytes(ref_c.scale)))
        rep.exact("mx_quantize colwise", label, same)
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
                  note="the kernel scales each 32-block inside the tile loop; native MX matrix "
                       "units (tl.dot_scaled) exist on SM100+ only")


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
    from moe_lab.config import MoEConfig
    from moe_lab.moe.router import ROUTER_IMPLS, route

    if "triton" not in ROUTER_IMPLS:
        raise RuntimeError("ROUTER_IMPLS has no 'triton' entry (fused router not built)")
    fused = ROUTER_IMPLS["triton"]
    for label, (T, D, E, k, G, TG) in shapes.items():
        cfg = MoEConfig(d_model=D, n_experts=E, top_k=k, d_expert=64, n_groups=G, topk_groups=TG,
                        score_func="sigmoid", scaling_factor=2.5)
        x = torch.randn(T, D, device=dev)
        w = (torch.randn(E, D, device=dev) / D**0.5).requires_grad_()
        bias = torch.randn(E, device=dev) * 0.01
        with poisoned_outputs(torch):
            got = fused(x, w, cfg, bias)
        want = route(x, w, cfg, bias)
        rep.exact("fused router ids", label, torch.equal(got.topk_ids, want.topk_ids))
        rep.check("fused router weights", label, rel_error(got.topk_weights, want.topk_weights), 1e-5)
        rep.exact("fused router counts", label, torch.equal(got.tokens_per_expert, want.tokens_per_expert))
        g = torch.randn_like(want.topk_weights)
        (gw_f,) = torch.autograd.grad((got.topk_weights * g).sum() + got.aux_loss, (w,))
        (gw_r,) = torch.autograd.grad((want.topk_weights * g).sum() + want.aux_loss, (w,))
        rep.check("fused router grad", label, rel_error(gw_f, gw_r), 1e-4)
    if time_fn is not None:
        T, D, E, k, G, TG = list(shapes.values())[-1]
        logits_shape = f"T={T} E={E} top{k} groups {TG}/{G}"
        x = torch.randn(T, D, device=dev)
        w = torch.randn(E, D, device=dev) / D**0.5
        times = {}
        for dtype in ("fp64", "fp32"):
            cfg = MoEConfig(d_model=D, n_experts=E, top_k=k, d_expert=64, n_groups=G, topk_groups=TG,
                            score_func="sigmoid", scaling_factor=2.5, router_dtype=dtype)
            times[f"unfused_{dtype}_ms"] = time_fn(lambda c=cfg: route(x, w, c)) * 1e3
        cfg = cfg.replace(router_dtype="fp32")
        times["fused_fp32_ms"] = time_fn(lambda: fused(x, w, cfg, None)) * 1e3
        rep.timed("router fwd", shape=logits_shape, **times,
                  speedup_vs_unfused_fp64=times["unfused_fp64_ms"] / times["fused_fp32_ms"])


def section_graphs(torch, dev, rep: Report, quick: bool) -> None:
    from moe_lab.training import graphs

    fn = getattr(graphs, "graphed_vs_eager", None)
    if fn is None:
        raise RuntimeError("moe_lab.training.graphs has no graphed_vs_eager()")
    result = fn("small", batch_size=2 if quick else 4, steps=3 if quick else 20)
    rep.check("graphed step loss vs eager", "small", float(result.get("loss_rel_diff", float("nan"))), 1e-3)
    rep.timed("training step (small)", **{k: v for k, v in result.items() if k != "loss_rel_diff"})


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
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import moe_lab  # noqa: F401  (sets TRITON_INTERPRET where there is no CUDA)

    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    env = gpu_env(torch)
    print(json.dumps(env), flush=True)
    rep = Report()
    small = args.cpu_smoke
    time_fn = None if args.no_bench else timer(torch, cuda)
    copy_gbps = None
    if time_fn is not None:
        from moe_lab.perf import ceilings

        copy = ceilings.copy_bandwidth(nbytes=2**24 if small else 2**31, device=dev)
        peak = ceilings.matmul_peak(torch.bfloat16, n=512 if small else 8192, device=dev)
        copy_gbps = copy.giga
        rep.timed("ceilings", copy_gbps=copy.giga, bf16_matmul_tflops=peak.giga / 1e3)

    # DeepSeek-V3 experts: d_model 7168, expert width 2048 (gate+up 4096); 32 local experts.
    gg_shapes = {"small E=4 M=200": (4, 200, 64, 96)}
    pm_shapes = {"T=64 k=2 E=8 d=64": (64, 2, 8, 64)}
    mx_shapes = {"128x256": (128, 256)}
    at_shapes = {"1x2x64x32": (1, 2, 64, 32)}
    rt_shapes = {"T=64 E=16 top4 g4/2": (64, 32, 16, 4, 4, 2)}
    if not small:
        gg_shapes["dsv3 down E=32 M=8192"] = (32, 8192, 2048, 7168)
        gg_shapes["dsv3 gate_up E=32 M=8192"] = (32, 8192, 7168, 2048)
        pm_shapes["dsv3 T=4096 k=8 E=256 d=7168"] = (4096, 8, 256, 7168)
        mx_shapes["dsv3 8192x7168"] = (8192, 7168)
        at_shapes["4x16x4096x128"] = (4, 16, 4096, 128)
        rt_shapes["dsv3 T=16384 E=256 top8 g8/4"] = (16384, 7168, 256, 8, 8, 4)

    sections = [
        ("grouped GEMM", lambda: section_grouped_gemm(torch, dev, rep, gg_shapes)),
        ("permute", lambda: section_permute(torch, dev, rep, pm_shapes)),
        ("MX quantizer", lambda: section_mx(torch, dev, rep, mx_shapes, time_fn, copy_gbps)),
        ("MXFP8 attention", lambda: section_attention(torch, dev, rep, at_shapes, time_fn)),
        ("fused router", lambda: section_router(torch, dev, rep, rt_shapes, time_fn)),
        ("CUDA graph step", lambda: section_graphs(torch, dev, rep, small)),
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
