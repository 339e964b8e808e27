"""NVIDIA's MLPerf Training v6.0 results, as data.

Source: NVIDIA's Technical Blog post on MLPerf Training v6.0 and MLCommons' result tables
(``[mlperf-blog]`` and ``[mlcommons]`` in the repository's ``docs/references.md``, which gives
the addresses). These are published results, not measurements made here; anything that
shows them says so and names the source.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE = ("NVIDIA Technical Blog, 'NVIDIA Blackwell Tops MLPerf Training 6.0 with Industry-Leading "
          "Scale and Performance' (June 2026), and MLCommons' MLPerf Training v6.0 results "
          "(docs/references.md)")


@dataclass(frozen=True)
class MLPerfResult:
    """One benchmark: time to train to the target quality on ``n_gpus`` of ``system``."""

    benchmark: str
    system: str
    n_gpus: int
    minutes: float
    moe: bool

    @property
    def gpu_hours(self) -> float:
        return self.n_gpus * self.minutes / 60.0


RESULTS: tuple[MLPerfResult, ...] = (
    MLPerfResult("DeepSeek-V3 671B", "GB300 NVL72", 8192, 2.02, True),
    MLPerfResult("GPT-OSS-20B", "GB300 NVL72", 512, 7.43, True),
    MLPerfResult("Llama 3.1 405B", "GB200 NVL72", 8192, 7.07, False),
    MLPerfResult("Llama 3.1 8B", "GB200 NVL72", 1024, 4.46, False),
    MLPerfResult("Llama 2 70B LoRA", "GB300 NVL72", 512, 0.4, False),
    MLPerfResult("FLUX.1", "GB300 NVL72", 512, 17.1, False),
    MLPerfResult("DLRM-dcnv2", "GB300 NVL72", 64, 0.67, False),
)

# DeepSeek-V3 on GB300 over three months of software work (same source).
DEEPSEEK_V3_GB300 = {"tflops_per_gpu_before": 1298.0, "tflops_per_gpu": 1648.0,
                     "tokens_per_s_per_gpu": 6338.0, "seq_len": 4096, "gpu": "GB300"}


def result(benchmark: str) -> MLPerfResult:
    """The row for ``benchmark`` (exact name, case-insensitive)."""
    for row in RESULTS:
        if row.benchmark.lower() == benchmark.lower():
            return row
    raise ValueError(f"benchmark must be one of {[r.benchmark for r in RESULTS]}, got {benchmark!r}")


def results_table() -> str:
    """The results as a markdown table, with the source beneath."""
    from moe_lab.workbench.measure.ledger import markdown_table  # here: it imports torch, mlperf does not

    header = ("benchmark", "system", "GPUs", "minutes", "GPU-hours", "MoE")
    rows = [(r.benchmark, r.system, f"{r.n_gpus:,}", f"{r.minutes:g}", f"{r.gpu_hours:,.1f}",
             "yes" if r.moe else "") for r in RESULTS]
    return markdown_table(header, ["---"] * len(header), rows) + f"\nSource: {SOURCE}."
