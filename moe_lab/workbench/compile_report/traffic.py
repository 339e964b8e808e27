"""The tile-order acceptance table: `moe_lab.perf.traffic`'s modelled HBM bytes over the compulsory
bytes for the grouped GEMM forward, dX and the gather + SwiGLU forward on each GPU the compile
report targets (H200 from ``results/compile/sm_90.json``, B200 from ``sm_100.json``): today's
row-fastest order beside the grouped order the wrappers launch (`moe_lab.kernels.grouped_gemm.tile_group`),
at the tiles `choose_config` picks and the resident blocks per SM the compile report gives, and the
grouped order once more with its waves on expert bounds (`on_expert_bounds`): what it would move if
no lockstep wave straddled two experts. Beside it, the weight gradients (`dw_tables`) and every
other grouped kernel (`kernel_tables`: the fused ones, the SwiGLU backward, the grouped MXFP8
GEMM), old order against new. ``python -m moe_lab.workbench.compile_report.traffic`` prints the
three and writes ``results/compile/traffic.md``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from moe_lab.kernels import fused_moe, fused_mxfp8, grouped_gemm, mx_gemm
from moe_lab.kernels.grouped_gemm import DW_GROUP_K, choose_config, tile_group
from moe_lab.perf.hardware import ARCHS, GPUS, gpu_spec
from moe_lab.perf.traffic import simulate, simulate_dw

# The acceptance launches: (model, routed rows per expert on one rank, experts, d_model,
# d_expert). DeepSeek-V3 at EP8: 256 experts over 8 ranks, 8192 tokens x top-8 = 65,536 routed
# rows per rank over its 32 local experts; GPT-OSS-20B on one rank: 8192 tokens x top-4.
ACCEPTANCE = (("DeepSeek-V3 EP8", 2048, 32, 7168, 2048), ("GPT-OSS-20B", 1024, 32, 2880, 2880))
RESULTS = Path(__file__).resolve().parents[3] / "results" / "compile"
REPORT = RESULTS / "sm_90.json"
# The acceptance table's launches, at `choose_config`'s tiles, as `KERNEL_LAUNCHES` (below) writes
# them.
LAUNCHES = (("forward (down)", "_grouped_gemm_kernel", grouped_gemm, "gemm", "grouped GEMM forward (down",
             "d", "f", dict(b_panels=1)),
            ("dX (down)", "_grouped_gemm_kernel", grouped_gemm, "gemm", "grouped GEMM dX", "f", "d",
             dict(b_panels=1)),
            ("gather + SwiGLU forward", "_gather_swiglu_kernel", grouped_gemm, "swiglu",
             "SwiGLU GEMM forward", "f", "d", dict(b_panels=2)))


@functools.cache
def _simulated(model: Callable, rows: tuple[int, ...], *args: int, **keywords: object):
    """``model`` (`simulate`, `simulate_dw`) once per distinct launch: the tables meet the same one
    more than once (a fused kernel at its unfused kernel's tile and occupancy, the SwiGLU backward
    in both modules), and a notebook or a test asks for them again."""
    return model(list(rows), *args, **keywords)


def _per_gpu(rows_of: Callable, results: Path, *selection: object) -> list[dict]:
    """``rows_of(spec, report, *selection)`` on every compile target's GPU (`reports`)."""
    return [row for gpu, path in reports(results).items()
            for row in rows_of(gpu_spec(gpu), json.loads(Path(path).read_text()), *selection)]


def reports(results: Path = RESULTS) -> dict[str, Path]:
    """The GPU each Hopper or Blackwell compile target stands for (the launches these models
    project; `moe_lab.perf.hardware.ARCHS` rows with TMA) and its compile report in ``results``:
    ``{"H200 SXM": results / "sm_90.json", "B200": results / "sm_100.json"}``."""
    return {a.gpu: Path(results) / f"{arch}.json" for arch, a in ARCHS.items() if a.tma and a.gpu in GPUS}


def blocks_per_sm(report: dict, kernel: str, blocks: dict, warps: int, launch: str | None = None) -> int:
    """Resident blocks per SM of ``kernel`` compiled at ``blocks`` on ``warps`` warps (bf16), as the
    compile report gives them; ``launch``, where given, a piece of the row's label that names the
    launch (``"grouped GEMM dX"``). The fewest, if several rows match."""
    found = [r["blocks_per_sm"] for r in report["rows"] if r["kernel"].endswith(":" + kernel)
             and r["blocks"] == blocks and r["num_warps"] == warps and "bf16" in r["label"]
             and (launch is None or launch in r["label"])]
    if not found:
        raise ValueError(f"the compile report has no bf16 row of {kernel} at {blocks}, {warps} warps"
                         + (f" labelled {launch!r}" if launch else ""))
    return min(found)


def on_expert_bounds(expert_tiles: int, in_flight: int) -> int:
    """The largest number of programs in flight, at most ``in_flight``, that divides one expert's
    ``expert_tiles`` output tiles: waves of that many programs start and end on expert bounds (in
    the grouped order an expert's tiles are consecutive programs), so no wave straddles two
    experts and reads both experts' panels at once."""
    return max(d for d in range(1, min(expert_tiles, in_flight) + 1) if expert_tiles % d == 0)


def _models(models: tuple[str, ...] | None):
    """``(model, routed rows per expert, experts, {"d", "f", "2f"} dimensions)`` of the chosen
    `ACCEPTANCE` models (None: every one)."""
    for model, per_expert, experts, d_model, d_expert in ACCEPTANCE:
        if models is None or model in models:
            yield model, per_expert, experts, {"d": d_model, "f": d_expert, "2f": 2 * d_expert}


def tables(results: Path = RESULTS, models: tuple[str, ...] | None = None,
           launches: tuple[str, ...] | None = None) -> list[dict]:
    """Modelled / compulsory bytes of the grouped GEMM forward (down projection), its dX and the
    gather + SwiGLU forward at `ACCEPTANCE`'s shapes on every compile target's GPU's L2: today's
    row-fastest order (``row``), the grouped order `moe_lab.kernels.grouped_gemm.tile_group` picks
    (``grouped``) and the grouped order with ``in_flight`` cut to `on_expert_bounds`
    (``aligned``). Tiles are `choose_config`'s; resident blocks per SM those of the compile
    report in ``results`` of the target that stands for the GPU, for the launch's own row. Each
    row also holds the bytes (``compulsory``, ``row_bytes``, ``grouped_bytes``,
    ``aligned_bytes``) and the programs that have work (``programs``, ``expert_tiles`` of them
    per expert). ``models`` and ``launches``: the `ACCEPTANCE` models and `LAUNCHES` to run
    (default: all)."""
    return _per_gpu(_launch_rows, results, models, launches, LAUNCHES, True)


# The weight gradients: (launch, compile-report label piece, K, N) of dW[e] = X_eᵀ·dY_e, a reduction
# over the expert's rows, with K and N from (d_model, d_expert): the down projection's X is h.
DW_LAUNCHES = (("dW (down)", "dW = Xᵀ·dY per expert (down", "f", "d"),
               ("dW (up/gate)", "dW = Xᵀ·dY per expert (up/gate", "d", "2f"))


def _dw_acceptance(spec, report: dict):
    for model, per_expert, experts, dims in _models(None):
        for launch, label, k_dim, n_dim in DW_LAUNCHES:
            k, n = dims[k_dim], dims[n_dim]
            cfg = choose_config("dw", per_expert * experts, n, k, experts, torch.bfloat16)
            b = cfg.blocks
            in_flight = spec.sms * blocks_per_sm(report, "_grouped_gemm_dw_kernel", b, cfg.num_warps, label)
            traffic = {name: _simulated(simulate_dw, (per_expert,) * experts, k, n, b["BLOCK_M"],
                                        b["BLOCK_K"], b["BLOCK_N"], in_flight=in_flight,
                                        l2_bytes=spec.l2_bytes, order=order)
                       for name, order in (("row", "expert_fastest"), ("grouped", DW_GROUP_K))}
            yield dict(gpu=spec.name, model=model, launch=launch, per_expert=per_expert, experts=experts,
                       n=n, k=k, panels=1, tiles="x".join(map(str, b.values())), in_flight=in_flight,
                       group_k=DW_GROUP_K, programs=experts * -(-k // b["BLOCK_K"]) * -(-n // b["BLOCK_N"]),
                       compulsory=traffic["row"].compulsory,
                       **{f"{name}_bytes": t.total for name, t in traffic.items()},
                       **{name: t.ratio for name, t in traffic.items()})


def dw_tables(results: Path = RESULTS) -> list[dict]:
    """The grouped GEMM weight gradients (`DW_LAUNCHES`) at `ACCEPTANCE`'s shapes on every compile
    target's GPU (`moe_lab.perf.traffic.simulate_dw`): ``row`` the old grid's order, the expert
    fastest; ``grouped`` the kernels' order today, expert after expert with ``DW_GROUP_K`` K tiles
    per group (`moe_lab.kernels.common.expert_tile_order`). Rows shaped as `tables`' for
    `moe_lab.workbench.compile_report.roofline`, at `choose_config`'s tile and the compile report's
    resident blocks for the launch's own row."""
    return _per_gpu(_dw_acceptance, results)


# The other grouped kernels, each over expert after expert's rows in `tile_order`: (launch, kernel,
# the kernel module whose launch_config picks its tile, its kind there, compile-report label piece,
# N, K, traffic keywords of `moe_lab.perf.traffic.simulate`), N and K from (d_model, d_expert). The
# label piece finds the kernel's row at the launch's tile in either preset's part of the report
# (occupancy depends on the compile, not on the routed rows). A gather prologue reads the routed
# rows of its token rows (counted as routed rows: a token's rows for its top-k experts are read
# apart); a scatter epilogue writes the token-major [T·k, N] rows, as many as the routed rows.
KERNEL_LAUNCHES = (
    ("dX (up/gate)", "_grouped_gemm_kernel", grouped_gemm, "gemm",
     "dX = dY·Wᵀ (the forward kernel on a transposed W; up/gate", "d", "2f", {}),
    ("SwiGLU backward", "_grouped_gemm_swiglu_kernel", grouped_gemm, "swiglu", "SwiGLU backward", "f", "d",
     dict(b_panels=2, c_bytes=4, epilogue_bytes=2)),
    ("fused down + weighted scatter", "_gemm_scatter_kernel", fused_moe, "gemm",
     "down projection + weighted scatter (the combine), token-major", "d", "f", {}),
    ("fused dX (up/gate) + scatter", "_gemm_scatter_kernel", fused_moe, "gemm",
     "dX of the up/gate projection + scatter to tokens, token-major", "d", "2f", {}),
    ("fused combine backward", "_gather_gemm_kernel", fused_moe, "gemm", "combine backward", "f", "d",
     dict(epilogue_bytes=2)),
    ("fused gather + SwiGLU backward", "_gather_swiglu_kernel", fused_moe, "swiglu", "SwiGLU GEMM backward",
     "f", "d", dict(b_panels=2, c_bytes=4, epilogue_bytes=2)),
    ("MXFP8 grouped GEMM (up/gate)", "_grouped_mx_gemm_kernel", mx_gemm, None, "grouped MXFP8 GEMM", "2f",
     "d", dict(a_bytes=1, b_bytes=1, scaled="ab")),
    ("MXFP8 grouped GEMM (down)", "_grouped_mx_gemm_kernel", mx_gemm, None, "grouped MXFP8 GEMM", "d", "f",
     dict(a_bytes=1, b_bytes=1, scaled="ab")),
    ("fused gather + SwiGLU + MXFP8 quantize", "_gather_swiglu_mx_kernel", fused_mxfp8, "swiglu",
     "MXFP8-quantize epilogue", "f", "d", dict(b_panels=2, c_bytes=1, scaled="c")),
    ("fused MXFP8 down + weighted scatter", "_gemm_scatter_mx_kernel", fused_mxfp8, "gemm",
     "A as MXFP8 codes", "d", "f", dict(a_bytes=1, scaled="a")),
)


def _launch_rows(spec, report: dict, models: tuple[str, ...] | None, launches: tuple[str, ...] | None,
                 table: tuple, acceptance: bool):
    """The rows of ``table`` (`LAUNCHES`: ``acceptance``, or `KERNEL_LAUNCHES`) on one GPU: the
    row-fastest and grouped orders at the launch's tile (its module's ``launch_config``) and the
    compile report's resident blocks (``kernel`` at the row whose label holds the launch's label
    piece); the grouped order with its waves on expert bounds — always for ``acceptance``,
    otherwise only where the grouped order is above compulsory and its waves straddle experts
    (``aligned`` None otherwise); and the least bytes one wave touches over its K sweep."""
    for model, per_expert, experts, dims in _models(models):
        for launch, kernel, source, kind, label, n_dim, k_dim, keywords in table:
            if launches is not None and launch not in launches:
                continue
            n, k = dims[n_dim], dims[k_dim]
            # The tile a CUDA launch takes: its kernel module's own launch_config in bfloat16; the
            # grouped MXFP8 GEMM's by the MX_MMA the GPU compiles (block-scaled where it has MXFP8
            # tensor cores, fp8_promote on Hopper).
            if source is mx_gemm:
                mma = "scaled" if spec.native_mxfp8 else "fp8_promote"
                cfg = mx_gemm.launch_config(per_expert * experts, n, k, interpreted=False, mma=mma)
            else:
                cfg = source.launch_config(kind, per_expert * experts, n, k, experts, interpreted=False)
            b = cfg.blocks
            in_flight = spec.sms * blocks_per_sm(report, kernel, b, cfg.num_warps, label)
            group = tile_group(per_expert * experts, experts, b["BLOCK_M"])
            expert_tiles = -(-per_expert // b["BLOCK_M"]) * -(-n // b["BLOCK_N"])
            aligned = on_expert_bounds(expert_tiles, in_flight)
            run = functools.partial(_simulated, simulate, (per_expert,) * experts, n, k, b["BLOCK_M"],
                                    b["BLOCK_N"], b["BLOCK_K"], in_flight=in_flight, l2_bytes=spec.l2_bytes,
                                    **keywords)
            traffic = {"row": run(order="row"), "grouped": run(order=group)}
            if acceptance or (traffic["grouped"].ratio > 1.005 and aligned != in_flight):
                traffic["aligned"] = run(order=group, in_flight=aligned)
            panels = keywords.get("b_panels", 1)
            # The least one wave touches over its K sweep (g row tiles x in_flight / g N tiles): above
            # the L2, nothing a wave reads survives to the next, whatever the order.
            wave = min(k * 2 * (g * b["BLOCK_M"] + -(-in_flight // g) * b["BLOCK_N"] * panels)
                       for g in (1 << i for i in range(in_flight.bit_length())))
            yield {"model": model, "launch": launch, "kernel": kernel,
                   "mma": "8-bit" if source is mx_gemm else "bf16", "num_warps": cfg.num_warps,
                   "gpu": spec.name, "per_expert": per_expert, "experts": experts, "n": n, "k": k,
                   "panels": panels, "tiles": "x".join(map(str, b.values())), "in_flight": in_flight,
                   "programs": expert_tiles * experts, "expert_tiles": expert_tiles,
                   "aligned_in_flight": aligned, "group_m": group, "compulsory": traffic["row"].compulsory,
                   "aligned": None, "aligned_bytes": None,
                   **{f"{name}_bytes": t.total for name, t in traffic.items()},
                   **{name: t.ratio for name, t in traffic.items()}, "wave_l2": wave / spec.l2_bytes}


def kernel_tables(results: Path = RESULTS, models: tuple[str, ...] | None = None,
                  launches: tuple[str, ...] | None = None) -> list[dict]:
    """Modelled / compulsory bytes of the other grouped kernels (`KERNEL_LAUNCHES`: the dX of the
    up/gate projection, the SwiGLU backward, the fused kernels, the grouped MXFP8 GEMM and the fused
    MXFP8 kernels) at `ACCEPTANCE`'s shapes on every compile target's GPU: ``row`` their old 2-D
    grid's order (row tile fastest), ``grouped`` `tile_order` with `tile_group`'s ``GROUP_M``, as
    they launch today. Tiles are each kernel's own launch config (its module's ``launch_config``), resident
    blocks per SM the compile report's row of the kernel at that tile; ``mma`` says whether the
    kernel multiplies bf16 tiles (the fused MXFP8 kernels decode or quantize in registers around
    a bf16 MMA) or 8-bit ones (the grouped MXFP8 GEMM). ``models`` and
    ``launches``: the `ACCEPTANCE` models and `KERNEL_LAUNCHES` to run (default: all)."""
    return _per_gpu(_launch_rows, results, models, launches, KERNEL_LAUNCHES, False)


def straddle_sentence(rows: list[dict], tolerance: float = 0.005) -> str:
    """The table's one-sentence reading of the expert-bound column, from ``rows``: where the grouped
    order moves more than it does with its waves on expert bounds, and by how much."""
    worse = [r for r in rows if r["grouped"] > r["aligned"] + tolerance]
    if not worse:
        return ("With waves on expert bounds no launch moves fewer bytes than the grouped order: "
                "no wave straddles two experts in a way that costs HBM traffic here.")
    cases = "; ".join(f"{r['gpu']} {r['model']} {r['launch']}: in flight {r['in_flight']} does not divide "
                      f"an expert's {r['expert_tiles']} tiles, {r['grouped']:.3f} → {r['aligned']:.3f} "
                      f"at {r['aligned_in_flight']} in flight" for r in worse)
    return ("Straddling waves: where the programs in flight do not divide an expert's output tiles, a "
            "lockstep wave spans two experts and reads both experts' panels at once, more than the L2 "
            f"keeps, and waves on expert bounds move fewer bytes ({cases}).")


def markdown(rows: list[dict], dw_rows: list[dict], kernel_rows: list[dict]) -> str:
    """`tables`' rows (any GPUs), `dw_tables`' and `kernel_tables`' as the tables of
    ``results/compile/traffic.md``."""
    gpus = list(dict.fromkeys(r["gpu"] for r in rows))
    lines = [f"# Modelled HBM bytes / compulsory bytes, {' and '.join(gpus)} L2",
             "", "`python -m moe_lab.workbench.compile_report.traffic` writes this file "
             "(`python -m moe_lab compile` too, after the compile reports).",
             "", "A model (`moe_lab.perf.traffic`), not a measurement.", "",
             "Least wave / L2: the fewest bytes one wave of programs reads over K, any wave shape, "
             "over the L2 (above 1, no order keeps data from one wave to the next). On expert bounds: "
             "the grouped order with the programs in flight cut to the largest divisor of one "
             "expert's output tiles, so that every wave starts and ends on an expert bound.", "",
             straddle_sentence(rows), "",
             "| GPU | model | launch | N | K | tile MxNxK | in flight | least wave / L2 | GROUP_M "
             "| row-fastest (old) | grouped (new) | in flight on expert bounds | grouped, on expert bounds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['gpu']} | {r['model']} | {r['launch']} | {r['n']} | {r['k']} | {r['tiles']} "
              f"| {r['in_flight']} | {r['wave_l2']:.2f} | {r['group_m']} | {r['row']:.3f} "
              f"| {r['grouped']:.3f} "
              f"| {r['aligned_in_flight']} | {r['aligned']:.3f} |" for r in rows]
    lines += ["", "## Weight gradients", "",
              "dW[e] = X_eᵀ·dY_e: a program owns one K x N tile of one expert's dW and reduces over "
              "the expert's rows (`moe_lab.perf.traffic.simulate_dw`). Old: the grid's first axis, "
              "the one walked fastest, was the expert, so consecutive programs read different "
              "experts' rows. New: expert after expert, GROUP_K K tiles taking every N tile "
              "(`moe_lab.kernels.common.expert_tile_order`).", "",
              "| GPU | model | launch | K | N | tile MxNxK | in flight | GROUP_K | expert fastest (old) "
              "| expert after expert (new) |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['gpu']} | {r['model']} | {r['launch']} | {r['k']} | {r['n']} | {r['tiles']} "
              f"| {r['in_flight']} | {r['group_k']} | {r['row']:.3f} | {r['grouped']:.3f} |"
              for r in dw_rows]
    lines += ["", "## The other grouped kernels", "",
              "The dX of the up/gate projection, the SwiGLU backward, the fused kernels of "
              "`moe_lab.kernels.fused_moe` and `fused_mxfp8`, and the grouped MXFP8 GEMM, each at its "
              "own launch's tile (the grouped MXFP8 GEMM's per GPU: FP8 wgmma steps of one 32-wide "
              "K block on the H200, block-scaled MMAs on the B200). Old: the 2-D grid with the row "
              "tile fastest; new: `tile_order` at `tile_group`'s GROUP_M. MXFP8 operands count one "
              "E8M0 byte per 32 elements beside their 1-byte codes; an epilogue's read of a tensor "
              "of the output's shape (`dh`, `h`) counts once in both the modelled and the compulsory "
              "bytes. Gathered rows count as routed rows, scattered rows as the token-major rows "
              "the kernel writes; the combine backward's per-row partial sums (rows x N tiles, "
              "float32) and the routing vectors are left out.", "",
              straddle_sentence([r for r in kernel_rows if r["aligned"] is not None]), "",
              "| GPU | model | launch | kernel | N | K | tile MxNxK | warps | in flight | GROUP_M "
              "| compulsory MB | row-fastest (old) | grouped (new) | grouped, on expert bounds |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['gpu']} | {r['model']} | {r['launch']} | `{r['kernel']}` | {r['n']} | {r['k']} "
              f"| {r['tiles']} | {r['num_warps']} | {r['in_flight']} | {r['group_m']} "
              f"| {r['compulsory'] / 1e6:,.1f} | {r['row']:.3f} | {r['grouped']:.3f} "
              # on expert bounds: a dash where the grouped order is at compulsory or its waves already are
              + ("| — |" if r["aligned"] is None else
                 f"| {r['aligned']:.3f} at {r['aligned_in_flight']} in flight |")
              for r in kernel_rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    table = markdown(tables(), dw_tables(), kernel_tables())
    print(table, end="")
    (RESULTS / "traffic.md").write_text(table)
