"""The workbook as a site: every executed notebook as an HTML page, and an index page.

``build_site()`` reads the executed notebooks (``build/workbook/NN_*.ipynb``, written by
``python -m moe_lab workbook``), renders each to ``build/site/NN_name.html`` with nbconvert,
and writes ``build/site/index.html``: per notebook its title, what it teaches (the first
paragraph of its first markdown cell and its "you will learn" bullets), its headline
figure read from the results ledger (with the hardware and date it was measured on), and a
link. Everything is a plain file linked by relative paths, so the site opens from disk in
any browser, with no server. The index carries its style inline and loads nothing from the
network; the notebook pages are nbconvert's, whose own styles are inlined too (they may ask
a CDN for MathJax to typeset formulas; without a network formulas show as TeX source and
everything else reads the same).

The headline figure of each notebook is chosen by `HEADLINES` (a table, one entry per
notebook, in order of preference) or, overriding it, by a ledger record carrying the extra
field ``headline=True``. Among matching records a ``full``-profile figure is preferred to a
``smoke`` one, then the newest. `headline_rows` is shared with ``scripts/readme_gains.py``,
which prints the README's gains table from the same choice.
"""

from __future__ import annotations

import html
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from moe_lab.lab.notebook_files import NOTEBOOK_PATTERN, export_html, write_text_atomically
from moe_lab.perf.capabilities import capabilities
from moe_lab.perf.ledger import format_value, latest, read

# --------------------------------------------------------------------------------------
# Which figure is each notebook's headline
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Headline:
    """One candidate headline: the ledger record (``notebook``, ``step``, ``metric``) and
    how to describe and reproduce it. ``step=None`` matches any step; then ``pick`` chooses
    among the steps' newest records (``"min"`` or ``"max"`` value)."""

    metric: str
    label: str
    step: str | None = None
    notebook: str | None = None  # default: the notebook the entry belongs to
    command: str | None = None  # default: the workbook command for that notebook
    pick: str = "newest"


def workbook_command(notebook: str, profile: str = "smoke") -> str:
    """The command that executes ``notebook`` and records its figures."""
    flag = "" if profile == "smoke" else f" --profile {profile}"
    return f"python -m moe_lab workbook --only {notebook}{flag}"


HEADLINES: dict[str, tuple[Headline, ...]] = {
    "00_lab_bench": (
        Headline("matmul_fp32_gflops", "fp32 matmul ceiling of this machine", "ceilings"),),
    "01_naive_moe": (
        Headline("syncs_per_step", "host syncs per forward + backward of the naive MoE layer",
                 "naive"),),
    "02_capacity_and_dropping": (
        Headline("dropped_frac", "share of token assignments dropped at capacity factor 1.0",
                 "capacity cf1"),
        Headline("vs_naive", "capacity dispatch speed vs naive", "capacity cf1"),),
    "03_dropless_sync_free": (
        Headline("vs_naive", "dropless (CPU plug-in's openmp grouped GEMM) MoE layer speed vs naive, "
                 "fine-grained experts", "fine:dropless openmp"),
        Headline("vs_naive", "dropless (torch grouped GEMM) MoE layer speed vs naive, "
                 "fine-grained experts", "fine:dropless torch"),
        Headline("vs_naive", "dropless MoE layer speed vs naive", "coarse:dropless torch"),),
    "04_fused_router": (
        Headline("vs_unfused_fp64", "fused FP32 Triton router vs unfused FP64, DeepSeek-V3 "
                 "shape", "deepseek_v3:triton fp32"),
        Headline("vs_unfused_fp64", "compiled FP32 router vs unfused FP64, DeepSeek-V3 shape",
                 "deepseek_v3:compiled fp32"),),
    "05_mxfp8_attention": (
        # Quality first: measured the same way on every machine (a CPU runs the quantizer
        # kernel interpreted, so its bandwidth there says nothing about the format).
        Headline("eval_loss_gap[MXFP8 attention vs baseline]",
                 "eval loss of a model trained with MXFP8 attention vs the bf16 baseline",
                 "quality"),
        Headline("quantizer_bandwidth", "MX quantizer bandwidth", "quantizer"),),
    "06_cuda_graphs": (
        Headline("speedup", "whole training step, CUDA graph vs eager (small preset)",
                 "small: graphed vs eager"),
        Headline("syncs_per_step", "host syncs per training step, certified",
                 "sync-free step (small)"),),
    "07_expert_parallel_a2a": (
        Headline("exposed_vs_sequential", "exposed all-to-all time vs sequential, best "
                 "schedule", pick="min"),
        Headline("max_abs_difference", "expert-parallel layer vs single process, max |diff|",
                 "ep vs single process"),),
    "08_pipeline_layout": (
        Headline("stage_imbalance_pp16_vpp1", "pipeline stage imbalance, searched layout "
                 "(simulated)", "searched_mxfp8_logits"),
        Headline("stage_imbalance_pp16_vpp2", "pipeline stage imbalance, searched layout "
                 "(simulated)", "searched"),),
    "09_network_fabric": (
        Headline("a2a_bandwidth_over_link", "all-to-all bandwidth over link rate, adaptive "
                 "routing (simulated)", "adaptive"),),
    "10_time_to_train": (
        Headline("time_to_target_speedup", "time to target loss, optimised vs naive stack",
                 "optimised vs naive"),
        Headline("time_to_target_speedup", "time to target loss, optimised vs naive stack",
                 "optimised vs naive", notebook="bench:time-to-train",
                 command=("python -m moe_lab bench time-to-train --profile full --seeds 10 --ladder "
                          "--pick-router")),),
}


def _profile_rank(record: dict) -> int:
    return 1 if record.get("profile") == "full" else 0


def _best(records: Sequence[dict], pick: str = "newest") -> dict | None:
    if not records:
        return None
    if pick in ("min", "max"):
        newest = latest(records, keys=("notebook", "step", "metric", "hardware"))
        choose = min if pick == "min" else max
        return choose(newest, key=lambda r: (float(r["value"]), str(r.get("time", ""))))
    return max(records, key=lambda r: (_profile_rank(r), str(r.get("time", ""))))


# Figures that no machine measured: simulations and counts. A CPU table shows them too.
MACHINE_FREE_KINDS = ("simulated", "calculation")


def on_cpu_or_machine_free(record: dict) -> bool:
    """True for a figure measured on a CPU, or one no machine measured (a simulation, a
    count): what a table of "this CPU's" figures may show."""
    hardware = str(record.get("hardware", ""))
    return (hardware.startswith("cpu:") or hardware == "simulated"
            or record.get("kind") in MACHINE_FREE_KINDS)


def _matches_hardware(record: dict, hardware) -> bool:
    if hardware is None:
        return True
    if callable(hardware):
        return bool(hardware(record))
    return str(record.get("hardware", "")).startswith(hardware)


def find_headline(records: Iterable[dict], notebook: str,
                  hardware=None) -> tuple[dict, Headline] | None:
    """The headline record of ``notebook`` (and the `Headline` that chose it), or ``None``.

    ``hardware``: a label prefix (``"cpu:"``: any CPU) or a predicate on the record
    (`on_cpu_or_machine_free`); ``None`` takes every record. A record with
    ``headline=True`` wins over the `HEADLINES` table.
    """
    records = [r for r in records if _matches_hardware(r, hardware)]
    flagged = [r for r in records if r.get("notebook") == notebook and r.get("headline") is True]
    if flagged:
        rec = _best(flagged)
        return rec, Headline(rec["metric"], str(rec.get("label") or rec["metric"]), rec.get("step"))
    # Entries naming the same figure (metric and step) from different sources — a notebook
    # and the benchmark command behind it — compete: the full-profile, then the newest, wins.
    # Different figures keep the table's order of preference.
    groups: dict[tuple, list[Headline]] = {}
    for spec in HEADLINES.get(notebook, ()):
        groups.setdefault((spec.metric, spec.step, spec.pick), []).append(spec)
    for specs in groups.values():
        found = []
        for spec in specs:
            source = spec.notebook or notebook
            matches = [r for r in records if r.get("notebook") == source
                       and r.get("metric") == spec.metric
                       and (spec.step is None or r.get("step") == spec.step)]
            rec = _best(matches, spec.pick)
            if rec is not None:
                found.append((rec, spec))
        if found:
            return max(found, key=lambda item: (_profile_rank(item[0]), str(item[0].get("time", ""))))
    return None


def format_figure(record: dict) -> str:
    """``"1.420×"``, ``"0 syncs"``, ``"91.30 GFLOP/s"``: value and unit as a table shows them,
    with the range when the record carries one (``min``, ``max``: e.g. over seeds)."""
    value = format_value(record.get("value"))
    unit = str(record.get("unit") or "")
    if unit in ("x", "×"):
        text = f"{value}×"
    elif unit == "fraction":
        text = f"{100 * float(record['value']):.3g}%"
    else:
        text = f"{value} {unit}".strip()
    low, high = record.get("min"), record.get("max")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
        seeds = record.get("seeds")
        over = f" over {seeds} seeds" if isinstance(seeds, int) else ""
        text += f" (range {format_value(float(low))}–{format_value(float(high))}{over})"
    return text


def headline_rows(records: Sequence[dict], notebooks: Sequence[str],
                  hardware=None) -> list[dict]:
    """One row per notebook: its headline figure (or ``None``), what it is, where and when
    it was measured, and the command that reproduces it."""
    rows = []
    for name in notebooks:
        found = find_headline(records, name, hardware)
        if found is None:
            rows.append({"notebook": name, "record": None, "label": None, "figure": None,
                         "hardware": None, "date": None, "command": workbook_command(name)})
            continue
        rec, spec = found
        profile = rec.get("profile") or "smoke"
        command = spec.command or workbook_command(name, profile if profile == "full" else "smoke")
        label = spec.label
        if spec.step is None and rec.get("step"):
            label = f"{label} ({rec['step']})"
        rows.append({"notebook": name, "record": rec, "label": label,
                     "figure": format_figure(rec), "hardware": rec.get("hardware"),
                     "date": str(rec.get("time", ""))[:10], "profile": rec.get("profile"),
                     "command": command})
    return rows


# --------------------------------------------------------------------------------------
# What each notebook teaches
# --------------------------------------------------------------------------------------


@dataclass
class NotebookPage:
    """One notebook of the site: its name, what it teaches, its page and its headline."""

    name: str
    number: str
    title: str
    summary: str
    learn: list[str] = field(default_factory=list)
    href: str = ""
    status: str = "ok"  # "ok", "error" (a cell raised), "not executed"
    headline: dict | None = None


def describe_notebook(notebook) -> tuple[str, str, list[str]]:
    """``(title, summary, learn)`` from the first markdown cell of ``notebook`` (a path or an
    nbformat node): the first heading, the first paragraph after it, and the bullets of its
    "you will learn" list."""
    import nbformat  # slow to import (jsonschema); only reading a notebook needs it

    nb = notebook if not isinstance(notebook, (str, os.PathLike)) else nbformat.read(
        notebook, as_version=4)
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if cell is None:
        return "", "", []
    lines = cell.source.splitlines()
    title = ""
    for line in lines:
        if line.lstrip().startswith("#"):
            title = line.lstrip("# ").strip()
            break
    paragraphs, current = [], []
    for line in lines:
        if line.lstrip().startswith("#"):
            continue
        if not line.strip():
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(line.strip())
    if current:
        paragraphs.append(" ".join(current))
    summary = next((p for p in paragraphs if not p.startswith(("-", "*", "**"))), "")
    learn = [line.strip()[2:].strip() for line in lines if line.strip().startswith(("- ", "* "))]
    return title, summary, learn


def _status(nb) -> str:
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                return "error"
    code = [c for c in nb.cells if c.cell_type == "code"]
    if code and all(c.get("execution_count") is None for c in code):
        return "not executed"
    return "ok"


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def _inline_markdown(text: str) -> str:
    """Markdown of one paragraph or bullet as HTML (mistune, nbconvert's own renderer)."""
    import mistune  # nbconvert's renderer, installed with it; only the index needs it

    rendered = mistune.html(text).strip()
    if rendered.startswith("<p>") and rendered.endswith("</p>") and rendered.count("<p>") == 1:
        rendered = rendered[3:-4]
    return rendered


def export_page(notebook: Path, target: Path) -> Path:
    """Render one executed notebook to ``target`` (reusing an HTML export beside it when it
    is at least as new as the notebook)."""
    beside = notebook.with_suffix(".html")
    if beside.exists() and beside.stat().st_mtime >= notebook.stat().st_mtime:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(beside, target)
        return target
    export_html(notebook, target)
    return target


_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
       color: #1d1d1f; background: #fafafa; }
main { max-width: 960px; margin: 0 auto; padding: 2rem 1.2rem 4rem; }
h1 { font-size: 1.8rem; margin-bottom: .2rem; }
.sub { color: #555; margin-top: 0; }
ol.notebooks { list-style: none; padding: 0; }
ol.notebooks li { background: #fff; border: 1px solid #ddd; border-radius: 8px;
                  padding: .9rem 1.1rem; margin: .8rem 0; }
.num { font-family: ui-monospace, monospace; color: #777; margin-right: .4rem; }
h2 { font-size: 1.15rem; margin: 0 0 .3rem; }
h2 a { color: #0b5cad; text-decoration: none; }
h2 a:hover { text-decoration: underline; }
.summary { margin: .3rem 0; }
ul.learn { margin: .2rem 0 .4rem 1.1rem; padding: 0; color: #333; font-size: .93rem; }
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


def render_index(pages: Sequence[NotebookPage], *, title: str = "moe_lab workbook",
                 machine: str = "", generated: str = "") -> str:
    """The index page as one self-contained HTML string (inline CSS, no scripts)."""
    esc = html.escape
    items = []
    for page in pages:
        status = ""
        if page.status == "error":
            status = '<span class="status error">a cell failed</span>'
        elif page.status == "not executed":
            status = '<span class="status missing">not executed</span>'
        heading = (f'<a href="{esc(page.href)}">{esc(page.title or page.name)}</a>' if page.href
                   else esc(page.title or page.name))
        learn = "".join(f"<li>{_inline_markdown(b)}</li>" for b in page.learn)
        learn_html = f'<ul class="learn">{learn}</ul>' if learn else ""
        if page.headline and page.headline.get("figure"):
            h = page.headline
            figure = (f'<div class="figure">Headline: <b>{esc(h["figure"])}</b> — '
                      f'{esc(h["label"] or "")} <span class="meta">(measured on '
                      f'{esc(str(h["hardware"]))}, {esc(str(h["date"]))}; reproduce: '
                      f'<code>{esc(h["command"])}</code>)</span></div>')
        else:
            figure = ('<div class="figure meta">No figure in the ledger yet: run '
                      f'<code>{esc(workbook_command(page.name))}</code>.</div>')
        items.append(
            f'<li id="{esc(page.name)}"><h2><span class="num">{esc(page.number)}</span>'
            f'{heading}{status}</h2><p class="summary">{_inline_markdown(page.summary)}</p>'
            f'{learn_html}{figure}</li>')
    machine_html = f"<p class=\"sub\">Executed on {esc(machine)}.</p>" if machine else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n<main>\n"
        f"<h1>{esc(title)}</h1>\n<p class=\"sub\">How Mixture-of-Experts training is made "
        "fast, one measured step at a time. Every figure below is read from the results "
        "ledger; none is typed by hand.</p>\n"
        f"{machine_html}\n<ol class=\"notebooks\">\n" + "\n".join(items) +
        "\n</ol>\n<footer>Generated by <code>python -m moe_lab workbook</code>"
        + (f" on {esc(generated)}" if generated else "") + ".</footer>\n</main>\n</body>\n</html>\n")


def build_site(workbook_dir: str | os.PathLike[str], out: str | os.PathLike[str],
               ledger_path: str | os.PathLike[str] | None = None, *,
               title: str = "moe_lab workbook") -> Path:
    """Render every executed notebook in ``workbook_dir`` to ``out`` and write
    ``out/index.html``; return the index's path.

    ``ledger_path``: the results ledger for the headline figures (default: the ledger's
    usual place, `moe_lab.perf.ledger.ledger_path`). A notebook whose page cannot be
    rendered is still listed, without a link.
    """
    import nbformat

    source = Path(workbook_dir)
    if not source.is_dir():
        raise ValueError(f"workbook_dir must be a directory of executed notebooks, got "
                         f"{str(source)!r}")
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    records = read(ledger_path) if ledger_path is not None else read()
    notebooks = sorted(p for p in source.iterdir() if p.is_file() and NOTEBOOK_PATTERN.match(p.name))
    pages = []
    for path in notebooks:
        number = NOTEBOOK_PATTERN.match(path.name).group(1)
        try:
            nb = nbformat.read(path, as_version=4)
            title_, summary, learn = describe_notebook(nb)
            status = _status(nb)
        except Exception:  # an unreadable notebook is still listed
            title_, summary, learn, status = path.stem, "", [], "not executed"
        href = ""
        try:
            export_page(path, target / f"{path.stem}.html")
            href = f"{path.stem}.html"
        except Exception:
            href = ""
        rows = headline_rows(records, [path.stem])
        pages.append(NotebookPage(name=path.stem, number=number, title=title_, summary=summary,
                                  learn=learn, href=href, status=status,
                                  headline=rows[0] if rows[0]["record"] else None))
    try:
        machine = capabilities().summary()
    except Exception:
        machine = ""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    index = target / "index.html"
    write_text_atomically(index, render_index(pages, title=title, machine=machine,
                                               generated=stamp))
    return index


__all__ = ["HEADLINES", "MACHINE_FREE_KINDS", "Headline", "NotebookPage", "build_site", "describe_notebook",
           "export_page", "find_headline", "format_figure", "headline_rows",
           "on_cpu_or_machine_free", "render_index",
           "workbook_command"]
