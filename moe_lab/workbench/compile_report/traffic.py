"""The tile-order acceptance table: `moe_lab.perf.traffic`'s modelled HBM bytes over the compulsory
bytes for the grouped GEMM forward, dX and the gather + SwiGLU forward, today's row-fastest order
beside the grouped order the wrappers launch (`moe_lab.kernels.common.tile_group`), at the tiles
`choose_config` picks and the resident blocks per SM the compile report (``results/compile/sm_90.json``)
gives. ``python -m moe_lab.workbench.compile_report.traffic`` prints it and writes
``results/compile/traffic.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_lab.kernels.common import tile_group
from moe_lab.kernels.grouped_gemm import choose_config
from moe_lab.perf.hardware import gpu_spec
from moe_lab.perf.traffic import simulate

# The acceptance launches: (model, routed rows per expert on one rank, experts, d_model,
# d_expert). DeepSeek-V3 at EP8: 256 experts over 8 ranks, 8192 tokens x top-8 = 65,536 routed
# rows per rank over its 32 local experts; GPT-OSS-20B on one rank: 8192 tokens x top-4.
ACCEPTANCE = (("DeepSeek-V3 EP8", 2048, 32, 7168, 2048), ("GPT-OSS-20B", 1024, 32, 2880, 2880))
REPORT = Path(__file__).resolve().parents[3] / "results" / "compile" / "sm_90.json"


def blocks_per_sm(report: dict, kernel: str, blocks: dict, warps: int) -> int:
    """Resident blocks per SM of ``kernel`` compiled at ``blocks`` on ``warps`` warps (bf16), as the
    compile report gives them (the fewest, if several rows match)."""
    found = [r["blocks_per_sm"] for r in report["rows"] if r["kernel"].endswith(":" + kernel)
             and r["blocks"] == blocks and r["num_warps"] == warps and "bf16" in r["label"]]
    if not found:
        raise ValueError(f"the compile report has no bf16 row of {kernel} at {blocks}, {warps} warps")
    return min(found)


def acceptance(gpu: str = "H200", report_path: Path = REPORT) -> list[dict]:
    """Modelled / compulsory bytes of the grouped GEMM forward (down projection), its dX and the
    gather + SwiGLU forward at `ACCEPTANCE`'s shapes on ``gpu``'s L2: today's row-fastest order
    and the grouped order `moe_lab.kernels.common.tile_group` picks. Tiles are `choose_config`'s,
    resident blocks the compile report's (``report_path``)."""
    spec, report = gpu_spec(gpu), json.loads(Path(report_path).read_text())
    out = []
    for model, per_expert, experts, d, f in ACCEPTANCE:
        m = per_expert * experts
        for launch, kind, kernel, n, k, panels in (
                ("forward (down)", "gemm", "_grouped_gemm_kernel", d, f, 1),
                ("dX (down)", "gemm", "_grouped_gemm_kernel", f, d, 1),
                ("gather + SwiGLU forward", "swiglu", "_gather_swiglu_kernel", f, d, 2)):
            cfg = choose_config(kind, m, n, k, experts, torch.bfloat16)
            b = cfg.blocks
            in_flight = spec.sms * blocks_per_sm(report, kernel, b, cfg.num_warps)
            group = tile_group(m, experts, b["BLOCK_M"])
            ratios = [simulate([per_expert] * experts, n, k, b["BLOCK_M"], b["BLOCK_N"], b["BLOCK_K"],
                               in_flight=in_flight, l2_bytes=spec.l2_bytes, order=order,
                               b_panels=panels).ratio for order in ("row", group)]
            # The least one wave touches over its K sweep (g row tiles x in_flight / g N tiles): above
            # the L2, nothing a wave reads survives to the next, whatever the order.
            wave = min(k * 2 * (g * b["BLOCK_M"] + -(-in_flight // g) * b["BLOCK_N"] * panels)
                       for g in (1 << i for i in range(in_flight.bit_length())))
            out.append(dict(model=model, launch=launch, n=n, k=k, tiles="x".join(map(str, b.values())),
                            in_flight=in_flight, group_m=group, wave_l2=wave / spec.l2_bytes,
                            row=ratios[0], grouped=ratios[1]))
    return out


def markdown(rows: list[dict], gpu: str = "H200") -> str:
    """`acceptance`'s rows as the table of ``results/compile/traffic.md``."""
    lines = [f"# Modelled HBM bytes / compulsory bytes, {gpu} L2",
             "", "`python -m moe_lab.workbench.compile_report.traffic` writes this file.",
             "", "A model (`moe_lab.perf.traffic`), not a measurement.", "",
             "Least wave / L2: the fewest bytes one wave of programs reads over K, any wave shape, "
             "over the L2 (above 1, no order keeps data from one wave to the next).", "",
             "| model | launch | N | K | tile MxNxK | in flight | least wave / L2 | GROUP_M "
             "| row-fastest (old) | grouped (new) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['launch']} | {r['n']} | {r['k']} | {r['tiles']} | {r['in_flight']} "
              f"| {r['wave_l2']:.2f} | {r['group_m']} | {r['row']:.3f} | {r['grouped']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    table = markdown(acceptance())
    print(table, end="")
    (REPORT.parent / "traffic.md").write_text(table)



__all__ = ["ACCEPTANCE", "REPORT", "acceptance", "blocks_per_sm", "markdown"]
