"""The workbook as a site: every executed notebook as an HTML page, and an index page.

``build_site()`` reads the executed notebooks (``build/workbook/NN_*.ipynb``, written by
``python -m moe_lab workbook``), renders each to ``build/site/NN_name.html`` with nbconvert,
and writes ``build/site/index.html``: per notebook its title, what it teaches (the first
paragraph of its first markdown cell and its "you will learn" bullets), its headline
figure read from the results ledger (with the hardware and date it was measured on), and a
link. Everything is a plain file linked by relative paths, so the site opens from disk in
any browser, with no server and no network: every page carries its style inline, formulas
are converted to MathML when the page is written (`latex2mathml`; browsers render MathML
natively, so no MathJax is loaded), and the pages load no script from anywhere — nbconvert's
require.js, MathJax, Mermaid and widget-manager tags are left out of the template. The
workbook runs headless, so the explorers draw a static figure and no page holds a widget.
Every page links to the previous and next notebook and to the index. Known third-party
noise on stderr (torchao failing to load a compiled extension, torch's deprecation notes;
the list is `moe_lab.workbench.quiet`) is left out of the pages; moe_lab's own warnings are
kept. A page never shows a ``✓`` that the reference solution earned under an unsolved stub,
shows a progress bar as its last line, and folds an output longer than a screen into
``<details>`` (`moe_lab.workbench.lab.page_outputs`). Records of hand-run notebooks
(`moe_lab.workbench.measure.ledger.lab_session`) never reach the headlines.

The headline figure of each notebook is chosen by `HEADLINES` (a table, one entry per
notebook, in order of preference). Among matching records a ``full``-profile figure is preferred to a
``smoke`` one, then the newest. `headline_rows` is shared with ``scripts/readme_gains.py``,
which prints the README's gains table from the same choice.

Beside each headline stands its GPU line (`GPU_LINES`): what the technique moves on an H200,
B200 or GB300, recorded by the notebook's summary under the step ``"gpu line"`` as a projection
(its assumptions in the record's ``basis``) or a citation (what was measured, by whom, where).
"""

from __future__ import annotations

import copy
import html
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.lab import page_outputs
from moe_lab.workbench.lab.notebook_files import NOTEBOOK_PATTERN, write_text_atomically
from moe_lab.workbench.lab.page_outputs import markdown_to_html
from moe_lab.workbench.measure.ledger import format_value, latest, read, workbook_records
from moe_lab.workbench.quiet import without_known_lines

# --------------------------------------------------------------------------------------
# Which figure is each notebook's headline
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Headline:
    """One candidate headline: the ledger record (``step``, ``metric``) of the notebook the
    entry belongs to, and how to describe it. ``step=None`` matches any step; then
    ``pick="min"`` chooses the least value among the steps' newest records. ``bench``: the
    ledger name and the command of a benchmark that records the same figure; the two compete
    (a full-profile figure, then the newest, wins) and the winner's command reproduces it."""

    metric: str
    label: str
    step: str | None = None
    pick: str = "newest"
    unit: str | None = None  # the unit a matching record must carry (``"x"`` and ``"×"`` are one)
    bench: tuple[str, str] | None = None


def workbook_command(notebook: str, profile: str | None = "smoke") -> str:
    """The command that executes ``notebook`` and records its figures (under ``profile``:
    anything but ``"full"`` is the default, ``smoke``)."""
    flag = " --profile full" if profile == "full" else ""
    return f"python -m moe_lab workbook --only {notebook}{flag}"


def _same_unit(a: object, b: object) -> bool:
    aliases = {"x": "×"}
    a, b = str(a or ""), str(b or "")
    return aliases.get(a, a) == aliases.get(b, b)


# Every entry names its unit: a record without it (an older ledger's bare ratio) is no headline.
HEADLINES: dict[str, tuple[Headline, ...]] = {
    "00_lab_bench": (
        Headline("matmul_fp32_gflops", "fp32 matmul ceiling of this machine", "ceilings",
                 unit="GFLOP/s"),),
    "01_naive_moe": (
        Headline("syncs_per_step", "host syncs per forward + backward of the naive MoE layer",
                 "naive", unit="syncs"),),
    "02_capacity_and_dropping": (
        Headline("dropped_frac", "share of token assignments dropped at capacity factor 1.0",
                 "capacity cf1", unit="fraction"),
        Headline("vs_naive", "capacity dispatch speed vs naive", "capacity cf1", unit="x"),),
    "03_triton_from_zero": (
        # What the reader's own kernel compiles to: read off the compiled code, no GPU run. The
        # figure shows its parts (blocks × warps, and what bounds them); the label says which
        # way is good.
        Headline("warps_per_sm", "warps resident per SM of the notebook's tiled bf16 matmul (3 "
                 "stages) compiled for Hopper; for a large-tile matmul a few are enough, since its "
                 "pipeline stages, not other warps, hide the wait for memory",
                 "<inline>:matmul_kernel bf16, 3 stages", unit="warps"),),
    "04_dropless_sync_free": (
        # The technique's own figure, counted, the same on every machine: the host never
        # waits. (The CPU timings of the benchmark are explained in the notebook; the CPU
        # plug-in's are in its CPU appendix, never a headline.)
        Headline("syncs_per_step", "host syncs per forward + backward of the dropless layer, "
                 "fine-grained experts (the naive loop: at least one per expert), counted",
                 "fine:dropless torch", unit="syncs"),),
    "05_fused_router": (
        Headline("bytes_vs_floor", "bytes a router call moves over the floor (one read of the "
                 "logits), fused FP32 Triton router, DeepSeek-V3 shape, counted",
                 "deepseek_v3:triton fp32", unit="x"),
        # Where Triton is interpreted (a CPU) the kernel is not run by the benchmark; the
        # compiled FP32 chain (torch.compile fusing the same chain) is the fused router there.
        Headline("bytes_vs_floor", "bytes a router call moves over the floor (one read of the "
                 "logits), FP32 chain fused by torch.compile, DeepSeek-V3 shape, counted",
                 "deepseek_v3:compiled fp32", unit="x"),),
    "06_mxfp8_attention": (
        # Counted, the same on every machine: what the format saves in memory traffic. (The
        # eval-loss gap of a short emulated training run is within its noise; it stays in the
        # notebook, not here.)
        Headline("bytes_vs_bf16[mxfp8]", "bytes one attention forward reads and writes with "
                 "MXFP8 operands (E4M3 codes and a scale byte per 32), as a share of bf16, counted",
                 "attention", unit="%"),),
    # What a GPU technique moves, where a CPU timing of it says little: counted bytes (the
    # same on every machine) rather than the interpreter's or the CPU's time.
    "07_fused_grouped_gemm": (
        Headline("saved_vs_unfused", "HBM bytes per MoE layer (fwd + bwd) the gather prologue and "
                 "scatter epilogue save over the unfused chain, GPT-OSS-20B at EP8, counted",
                 "fusion:gpt_oss_20b:scatter_epilogue", unit="fraction"),),
    "08_cuda_graphs": (
        Headline("speedup", "whole training step, CUDA graph vs eager (small preset)",
                 "small: graphed vs eager", unit="x"),
        Headline("syncs_per_step", "host syncs per training step, certified",
                 "sync-free step (small)", unit="syncs"),),
    "09_expert_parallel_a2a": (
        Headline("exposed_vs_sequential", "all-to-all time left exposed by the best schedule, as a "
                 "share of the sequential schedule's (lower is better)", pick="min",
                 unit="%"),),
    "10_pipeline_layout": (
        Headline("stage_imbalance_pp16_vpp1", "pipeline stage imbalance, searched layout "
                 "(simulated)", "searched_mxfp8_logits", unit="%"),
        Headline("stage_imbalance_pp16_vpp2", "pipeline stage imbalance, searched layout "
                 "(simulated)", "searched", unit="%"),),
    "11_network_fabric": (
        Headline("a2a_bandwidth_over_link", "all-to-all bandwidth as a share of the link rate, "
                 "adaptive routing (simulated)", "adaptive", unit="%"),),
    "12_time_to_train": (
        Headline("time_to_target_speedup", "time to target loss, optimised vs naive stack",
                 "optimised vs naive", unit="x",
                 bench=("bench:time-to-train", "python -m moe_lab bench time-to-train --profile full "
                        "--seeds 10 --ladder --pick-router")),),
}


# --------------------------------------------------------------------------------------
# What each headline would be on a GPU
# --------------------------------------------------------------------------------------

# The step under which a notebook's summary records its GPU line: what the technique moves on
# an H200, B200 or GB300, as a number with a unit, either published (``kind="citation"``: what
# was measured, by whom, where) or projected (``kind="projection"``: the assumptions stated).
#
#     ledger.record(NOTEBOOK, "gpu line", METRIC, value, UNIT, hardware="H200",
#                   kind="projection", basis="<assumptions, or the citation with its address>")
GPU_LINE_STEP = "gpu line"
GPU_LINE_KINDS = ("projection", "citation")
GPU_LINE_HARDWARE = ("H200", "B200", "GB300")


@dataclass(frozen=True)
class GpuLine:
    """A notebook's GPU line: what it says (``label``) and the metric its summary records
    under `GPU_LINE_STEP` (``None``: whichever metric it records there)."""

    label: str
    metric: str | None = None


GPU_LINES: dict[str, GpuLine] = {
    "00_lab_bench": GpuLine("DeepSeek-V3 training throughput per GPU, MLPerf Training v6.0",
                            "tflops_per_gpu[deepseek_v3 training]"),
    "01_naive_moe": GpuLine("host syncs per forward + backward of a DeepSeek-V3 step with the naive "
                            "loop in every MoE layer", "syncs_per_step[deepseek_v3 naive]"),
    "02_capacity_and_dropping": GpuLine("tensor-core time per MoE layer (fwd + bwd) spent on empty "
                                        "capacity slots at capacity factor 1.0, DeepSeek-V3",
                                        "padding_ms_per_layer[deepseek_v3 cf1]"),
    "03_triton_from_zero": GpuLine("tokens an expert needs before its GEMM stops being bound by "
                                   "memory, DeepSeek-V3 expert shape",
                                   "ridge_tokens[deepseek_v3 expert gemm]"),
    "04_dropless_sync_free": GpuLine("what the dropless, sync-free layer moves on a GPU"),
    "05_fused_router": GpuLine("router kernel speed-up from fusion and FP64 → FP32, DeepSeek-V3",
                               "router_speedup[fusion + fp32]"),
    "06_mxfp8_attention": GpuLine("one GPT-OSS-20B attention forward, MXFP8 vs bf16",
                                  "attention_fwd_speedup[gpt_oss_20b mxfp8 vs bf16]"),
    "07_fused_grouped_gemm": GpuLine("time per GPT-OSS-20B MoE layer (fwd + bwd) the fusions save "
                                     "at EP8", "saved_ms_per_layer[gpt_oss_20b scatter_epilogue]"),
    "08_cuda_graphs": GpuLine("what CUDA graphs move on a GPU"),
    "09_expert_parallel_a2a": GpuLine("end-to-end gain of 1F1B all-to-all overlap, DeepSeek-V3",
                                      "end_to_end_gain[1f1b a2a overlap]"),
    "10_pipeline_layout": GpuLine("end-to-end gain of the balanced pipeline layout, DeepSeek-V3",
                                  "end_to_end_gain[pipeline layout]"),
    "11_network_fabric": GpuLine("all-to-all bandwidth per GPU adaptive routing adds over ECMP",
                                 "a2a_gain_per_gpu[adaptive vs ecmp]"),
    "12_time_to_train": GpuLine("DeepSeek-V3 throughput per GPU from three months of software "
                                "work, MLPerf Training v6.0", "software_speedup[deepseek_v3]"),
}


def find_gpu_line(records: Iterable[dict], notebook: str) -> dict | None:
    """The GPU line of ``notebook``: its newest record under `GPU_LINE_STEP` (a full-profile one
    first) that is a projection or a citation, on an H200/B200/GB300, with a unit and a basis;
    ``None`` when there is none."""
    spec = GPU_LINES.get(notebook)
    matches = [r for r in records if r.get("notebook") == notebook
               and r.get("step") == GPU_LINE_STEP
               and (spec is None or spec.metric is None or r.get("metric") == spec.metric)
               and r.get("kind") in GPU_LINE_KINDS and str(r.get("unit") or "").strip()
               and str(r.get("basis") or "").strip()
               and str(r.get("hardware", "")).startswith(GPU_LINE_HARDWARE)]
    return _best(matches)


def _best(records: Sequence[dict], pick: str = "newest") -> dict | None:
    if not records:
        return None
    if pick == "min":
        return min(latest(records), key=lambda r: (float(r["value"]), str(r.get("time", ""))))
    return max(records, key=lambda r: (r.get("profile") == "full", str(r.get("time", ""))))


# Figures that no machine measured: simulations, counts, code compiled but not run, and the
# GPU lines (projections and citations). A CPU table shows them too.
MACHINE_FREE_KINDS = ("simulated", "calculation", "compiled", "projection", "citation")


def on_cpu_or_machine_free(record: dict) -> bool:
    """True for a figure measured on a CPU, or one no machine measured (a simulation, a
    count, a figure read off code compiled for a GPU without running it): what a table of
    "this CPU's" figures may show."""
    hardware = str(record.get("hardware", ""))
    return (hardware.startswith("cpu:") or hardware == "simulated"
            or record.get("kind") in MACHINE_FREE_KINDS)


def find_headline(records: Iterable[dict], notebook: str,
                  hardware: Callable[[dict], bool] | None = None) -> tuple[dict, Headline] | None:
    """The headline record of ``notebook`` (and the `Headline` that chose it), or ``None``.

    ``hardware``: a predicate on the record (`on_cpu_or_machine_free`); ``None`` takes every
    record.
    """
    if hardware is not None:
        records = [r for r in records if hardware(r)]
    for spec in HEADLINES.get(notebook, ()):  # in the table's order of preference
        sources = (notebook, spec.bench[0]) if spec.bench else (notebook,)
        matches = [r for r in records if r.get("notebook") in sources
                   and r.get("metric") == spec.metric
                   and (spec.step is None or r.get("step") == spec.step)
                   and (spec.unit is None or _same_unit(r.get("unit"), spec.unit))]
        rec = _best(matches, spec.pick)
        if rec is not None:
            return rec, spec
    return None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_figure(record: dict) -> str:
    """``"1.420×"``, ``"0 syncs"``, ``"91.30 GFLOP/s"``: value and unit as a table shows them,
    with the range when the record carries one (``min``, ``max``: e.g. over seeds). A figure
    of one seed says so in words — a range of one value is no range. Warps per SM read off a
    compile report show their parts: blocks × warps per block, and the resource that bounds them."""
    value = format_value(record.get("value"))
    unit = str(record.get("unit") or "")
    if unit in ("x", "×"):
        text = f"{value}×"
    elif unit == "fraction":
        text = f"{100 * float(record['value']):.3g}%"
    else:
        text = f"{value} {unit}".strip()
    blocks, warps = record.get("blocks_per_sm"), record.get("num_warps")
    if unit == "warps" and _is_number(blocks) and _is_number(warps):
        bound = f", bound by {record['limiter']}" if record.get("limiter") else ""
        text += f" ({blocks} block{'s' if blocks != 1 else ''} × {warps} warps{bound})"
    seeds = record.get("seeds")
    low, high = record.get("min"), record.get("max")
    if seeds == 1 and not isinstance(seeds, bool):
        text += " (one seed)"
    elif _is_number(low) and _is_number(high) and low != high:
        over = f" over {seeds} seeds" if isinstance(seeds, int) and not isinstance(seeds, bool) else ""
        text += f" (range {format_value(float(low))}–{format_value(float(high))}{over})"
    elif isinstance(seeds, int) and not isinstance(seeds, bool) and seeds > 1:
        text += f" (the same over {seeds} seeds)"
    return text


def headline_rows(records: Sequence[dict], notebooks: Sequence[str],
                  hardware: Callable[[dict], bool] | None = None) -> list[dict]:
    """One row per notebook: its headline figure (or ``None``), what it is, where and when
    it was measured, and the command that reproduces it."""
    rows = []
    for name in notebooks:
        gpu_rec = find_gpu_line(records, name)
        gpu = None if gpu_rec is None else {  # the record, with its figure and label
            **gpu_rec, "figure": format_figure(gpu_rec),
            "label": GPU_LINES[name].label if name in GPU_LINES else str(gpu_rec["metric"])}
        row = {"notebook": name, "record": None, "label": None, "figure": None, "hardware": None,
               "date": None, "command": workbook_command(name), "gpu": gpu}
        found = find_headline(records, name, hardware)
        if found is not None:
            rec, spec = found
            step = f" ({rec['step']})" if spec.step is None and rec.get("step") else ""
            bench = rec.get("notebook") != name  # the benchmark's figure won (`Headline.bench`)
            row.update(record=rec, label=spec.label + step, figure=format_figure(rec),
                       hardware=rec.get("hardware"), date=str(rec.get("time", ""))[:10],
                       profile=rec.get("profile"),
                       command=spec.bench[1] if bench else workbook_command(name, rec.get("profile")))
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------
# What each notebook teaches
# --------------------------------------------------------------------------------------


def describe_notebook(nb) -> tuple[str, str, list[str]]:
    """``(title, summary, learn)`` from the first markdown cell of the notebook ``nb`` (an
    nbformat node): the first heading, the first paragraph after it, and the bullets of its
    "you will learn" list; ``("", "", [])`` for a notebook without markdown."""
    lines = next((c.source for c in nb.cells if c.cell_type == "markdown"), "").splitlines()
    title = next((line.lstrip("# ").strip() for line in lines if line.lstrip().startswith("#")), "")
    # Paragraphs: runs of non-blank lines, headings left out, each joined into one line.
    body = "\n".join(line.strip() for line in lines if not line.lstrip().startswith("#"))
    paragraphs = [" ".join(block.split("\n")) for block in re.split(r"\n{2,}", body.strip("\n"))]
    summary = next((p for p in paragraphs if p and not p.startswith(("-", "*", "**"))), "")
    return title, summary, _bullets(lines)


def _bullets(lines: Sequence[str]) -> list[str]:
    """The top-level bullets of ``lines``, each whole: a line that continues a bullet where
    the source wraps is joined to it, and a nested bullet stays nested (as Markdown)."""
    items: list[str] = []
    open_item = False
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            open_item = False  # a blank line or a heading ends the list item
            continue
        bullet = stripped.startswith(("- ", "* "))
        if bullet and not line[:1].isspace():
            items.append(stripped[2:].strip())
            open_item = True
        elif open_item and bullet:
            items[-1] += "\n  - " + stripped[2:].strip()
        elif open_item:
            items[-1] += " " + stripped
    return items


def _status_badge(nb) -> str:
    """The badge beside a notebook's title on the index: a cell failed, or none was executed;
    ``""`` when it ran."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    if any(out.get("output_type") == "error" for c in code for out in c.get("outputs", [])):
        return '<span class="status error">a cell failed</span>'
    if code and all(c.get("execution_count") is None for c in code):
        return '<span class="status missing">not executed</span>'
    return ""


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def _inline_markdown(text: str) -> str:
    """Markdown of one paragraph or bullet as HTML (`markdown_to_html`), without its ``<p>``."""
    rendered = markdown_to_html(text).strip()
    if rendered.startswith("<p>") and rendered.endswith("</p>") and rendered.count("<p>") == 1:
        rendered = rendered[3:-4]
    return rendered


def prepare_for_site(nb):
    """A copy of the executed notebook ``nb`` ready to export: known third-party stderr noise
    dropped (a stream left empty is dropped too) and the cell papermill injects (tagged
    ``injected-parameters``: the run's settings, repeated from the notebook's own parameters
    cell) left out. The outputs are then made honest and short
    (`moe_lab.workbench.lab.page_outputs`): a check's ``✓`` earned by the reference under an
    unsolved stub says "not done — the reference ran in its place", a progress bar is one
    line, and an output longer than a screen is folded into ``<details>``."""
    nb = copy.deepcopy(nb)
    page_outputs.honest_exercises(nb)  # before the injected cell goes: it says how the run ran
    nb.cells = [cell for cell in nb.cells
                if "injected-parameters" not in cell.get("metadata", {}).get("tags", [])]
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs: list = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text = "".join(out.get("text", ""))
                if out.get("name") == "stderr":
                    # Known third-party lines (`moe_lab.workbench.quiet`, the one list), in case an
                    # executed notebook still holds one: silenced where they start, a run has none.
                    text = without_known_lines(text)
                    if not text.strip():
                        continue
                if outputs and outputs[-1].get("output_type") == "stream" and outputs[-1].name == out.name:
                    outputs[-1]["text"] += text  # one block per stream, as in JupyterLab
                    continue
                out["text"] = text
            outputs.append(out)
        cell.outputs = [page_outputs.folded(out) for out in outputs]
    return nb


# nbconvert's lab template without the tags that fetch scripts (require.js, MathJax,
# Mermaid, the widget manager), with a navigation bar at the top and the bottom.
_PAGE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_css -%}<style>{{ resources.moe_nav_css }}</style>{%- endblock html_head_css -%}
{%- block body_header -%}{{ super() }}{{ resources.moe_nav }}{%- endblock body_header -%}
{% block body_footer %}{{ resources.moe_nav }}{{ super() }}{% endblock body_footer %}
"""

_NAV_CSS = """
nav.moe-nav { display: flex; gap: 1.2rem; justify-content: space-between; align-items: center;
  max-width: 1100px; margin: .6rem auto; padding: .5rem 1rem; font: 14px/1.4 system-ui, sans-serif;
  background: #f4f6f8; border: 1px solid #dde; border-radius: 6px; }
nav.moe-nav a { color: #0b5cad; text-decoration: none; }
nav.moe-nav a:hover { text-decoration: underline; }
nav.moe-nav .none { color: #999; }
math { font-size: 1.1em; }
math[display="block"] { margin: .6em 0; }
"""


def navigation(prev: tuple[str, str] | None, nxt: tuple[str, str] | None) -> str:
    """The bar every page carries: ``(href, title)`` of the previous and next notebook
    (``None`` at either end) and the index."""
    esc = html.escape
    left = (f'<a rel="prev" href="{esc(prev[0])}">← {esc(prev[1])}</a>' if prev
            else '<span class="none">← (first notebook)</span>')
    right = (f'<a rel="next" href="{esc(nxt[0])}">{esc(nxt[1])} →</a>' if nxt
             else '<span class="none">(last notebook) →</span>')
    return (f'<nav class="moe-nav">{left}<a rel="index" href="index.html">Index of the workbook</a>'
            f'{right}</nav>')


def render_page(nb, nav: str = "") -> str:
    """One executed notebook (an nbformat node) as a page that needs no network: formulas
    as MathML (`markdown_to_html`), no script tags, third-party stderr noise left out, ``nav``
    at top and bottom."""
    import jinja2
    from nbconvert import HTMLExporter  # slow to import; only a page export needs it

    exporter = HTMLExporter(extra_loaders=[jinja2.DictLoader({"moe_site.html.j2": _PAGE_TEMPLATE})],
                            template_file="moe_site.html.j2", filters={"markdown2html": markdown_to_html})
    body, _ = exporter.from_notebook_node(
        prepare_for_site(nb), resources={"moe_nav": nav, "moe_nav_css": _NAV_CSS + page_outputs.FOLD_CSS})
    return body



_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
       color: #1d1d1f; background: #fafafa; }
main { max-width: 960px; margin: 0 auto; padding: 2rem 1.2rem 4rem; }
h1 { font-size: 1.8rem; margin-bottom: .2rem; }
.sub { color: #555; margin-top: 0; }
ol.notebooks { list-style: none; padding: 0; }
ol.notebooks > li { background: #fff; border: 1px solid #ddd; border-radius: 8px;
                  padding: .9rem 1.1rem; margin: .8rem 0; }
.num { font-family: ui-monospace, monospace; color: #777; margin-right: .4rem; }
h2 { font-size: 1.15rem; margin: 0 0 .3rem; }
h2 a { color: #0b5cad; text-decoration: none; }
h2 a:hover { text-decoration: underline; }
.summary { margin: .3rem 0; }
ul.learn { margin: .2rem 0 .4rem 1.1rem; padding: 0; color: #333; font-size: .93rem; list-style: disc; }
ul.learn ul { margin: .1rem 0 .1rem 1.1rem; padding: 0; list-style: circle; }
math { font-size: 1.1em; }
.figure { margin-top: .4rem; font-size: .93rem; }
.figure b { font-size: 1.05rem; }
.meta { color: #666; font-size: .85rem; }
.status { font-size: .8rem; padding: 0 .4rem; border-radius: 4px; margin-left: .4rem; }
.status.error { background: #fde2e1; color: #a40e0e; }
.status.missing { background: #eee; color: #555; }
code { font-family: ui-monospace, monospace; font-size: .9em; background: #f0f0f0;
       padding: 0 .2em; border-radius: 3px; }
footer { color: #777; font-size: .85rem; margin-top: 2rem; }
"""


def index_entry(path: Path, nb, href: str, row: dict) -> str:
    """The index's entry (an ``<li>``) of the executed notebook ``nb`` read from ``path``: its
    number and title, a link to ``href`` (its page; none when empty), what it teaches
    (`describe_notebook`), and its headline figure and GPU line (``row``, from `headline_rows`)."""
    esc = html.escape
    name, number = path.stem, NOTEBOOK_PATTERN.match(path.name).group(1)
    title, summary, learn = describe_notebook(nb)
    badge = _status_badge(nb)
    heading = f'<a href="{esc(href)}">{esc(title or name)}</a>' if href else esc(title or name)
    learn_html = "".join(f"<li>{_inline_markdown(b)}</li>" for b in learn)
    learn_html = f'<ul class="learn">{learn_html}</ul>' if learn_html else ""
    record = row["record"]
    if record is not None:
        where = ("simulated" if record.get("kind") == "simulated" or row["hardware"] == "simulated"
                 else "calculated" if record.get("kind") == "calculation"
                 else f"measured on {row['hardware']}")
        figure = (f'<div class="figure">Headline: <b>{esc(row["figure"])}</b> — '
                  f'{esc(row["label"] or "")} <span class="meta">({esc(where)}, '
                  f'{esc(str(row["date"]))}; reproduce: <code>{esc(row["command"])}</code>)</span></div>')
    else:
        figure = ('<div class="figure meta">No figure in the ledger yet: run '
                  f'<code>{esc(workbook_command(name))}</code>.</div>')
    gpu = row["gpu"]
    if gpu:
        # `GPU_LINE_HARDWARE` read out: an H200 ("aitch"), a B200, a GB300
        article = "an" if gpu["hardware"].startswith("H") else "a"
        kind = "projection" if gpu["kind"] == "projection" else "published"
        figure += (f'<div class="figure gpu">On {article} '
                   f'{esc(gpu["hardware"])}: <b>{esc(gpu["figure"])}</b> — {esc(gpu["label"])} '
                   f'<span class="meta">({kind}: {esc(str(gpu["basis"] or ""))})</span></div>')
    elif record is not None or not badge:
        figure += ('<div class="figure meta">No GPU line in the ledger yet: the notebook\'s '
                   'summary records it.</div>')
    number_html = "" if (title or "").startswith(number) else f'<span class="num">{esc(number)}</span>'
    return (f'<li id="{esc(name)}"><h2>{number_html}{heading}{badge}</h2>'
            f'<p class="summary">{_inline_markdown(summary)}</p>{learn_html}{figure}</li>')


def render_index(entries: Sequence[str], machine: str, generated: str) -> str:
    """The index page, its ``entries`` (`index_entry`) in order, as one self-contained HTML
    string (inline CSS, no scripts)."""
    esc = html.escape
    title = "moe_lab workbook"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n"
        f"<h1>{esc(title)}</h1>\n<p class=\"sub\">How Mixture-of-Experts training is made "
        "fast, one measured step at a time. Every figure below is read from the results "
        "ledger; none is typed by hand.</p>\n"
        f"<p class=\"sub\">Executed on {esc(machine)}.</p>\n<ol class=\"notebooks\">\n"
        + "\n".join(entries) + "\n</ol>\n<footer>Generated by <code>python -m moe_lab workbook</code>"
        f" on {esc(generated)}.</footer>\n</main>\n</body>\n</html>\n")


def build_site(workbook_dir: str | os.PathLike[str], out: str | os.PathLike[str],
               ledger_path: str | os.PathLike[str]) -> Path:
    """Render every executed notebook in ``workbook_dir`` to ``out`` and write
    ``out/index.html``; return the index's path.

    ``ledger_path``: the results ledger for the headline figures. A notebook whose page
    cannot be rendered is still listed, without a link.
    """
    import nbformat

    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    records = workbook_records(read(ledger_path))
    paths = sorted(p for p in Path(workbook_dir).iterdir() if p.is_file() and NOTEBOOK_PATTERN.match(p.name))
    # The runner renames each executed notebook into place whole, so every one here reads.
    executed = [nbformat.read(path, as_version=4) for path in paths]
    links = [(f"{path.stem}.html", describe_notebook(nb)[0] or path.stem)
             for path, nb in zip(paths, executed, strict=True)]
    entries = []
    for i, (path, nb) in enumerate(zip(paths, executed, strict=True)):
        nav = navigation(links[i - 1] if i > 0 else None, links[i + 1] if i + 1 < len(links) else None)
        href = ""
        try:
            write_text_atomically(target / links[i][0], render_page(nb, nav))
            href = links[i][0]
        except Exception as exc:  # listed without a link; say why on the build's stderr
            print(f"site: {path.name} could not be rendered: {type(exc).__name__}: {exc}", file=sys.stderr)
        entries.append(index_entry(path, nb, href, headline_rows(records, [path.stem])[0]))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    index = target / "index.html"
    write_text_atomically(index, render_index(entries, capabilities().summary(), stamp))
    return index
