"""The workbook as a site (index + pages that open without a server), the headline figure of
each notebook, and the README gains table printed from the same choice."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import nbformat
import pytest

from moe_lab.workbench.lab import site, workbook

ROOT = Path(__file__).resolve().parents[3]


def _rec(notebook, step, metric, value, unit, time="2026-11-29T10:00:00", hardware="cpu:test x2",
         **extra):
    return {"notebook": notebook, "step": step, "metric": metric, "value": value, "unit": unit,
            "hardware": hardware, "time": time, **extra}


def _executed(path: Path, title: str, error: bool = False) -> None:
    md = nbformat.v4.new_markdown_cell(
        f"# {title}\n\nThis notebook teaches *one* thing with `code`.\n\n**You will learn**\n"
        "- the first lesson;\n- the second lesson.")
    code = nbformat.v4.new_code_cell("print(1)", execution_count=1)
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n")]
    cells = [md, code]
    if error:
        bad = nbformat.v4.new_code_cell("raise KeyError", execution_count=2)
        bad.outputs = [nbformat.v4.new_output("error", ename="KeyError", evalue="x", traceback=[])]
        cells.append(bad)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


# ------------------------------------------------------------------------------ descriptions


def test_describe_a_real_notebook():
    title, summary, learn = site.describe_notebook(
        nbformat.read(ROOT / "notebooks" / "01_naive_moe.ipynb", as_version=4))
    assert title.startswith("01") and "naive" in title
    assert "Mixture-of-Experts" in summary and not summary.startswith("#")
    assert len(learn) >= 3


@pytest.mark.parametrize("name", ["00_lab_bench", "05_fused_router", "06_mxfp8_attention",
                                  "09_expert_parallel_a2a", "10_pipeline_layout"])
def test_learn_bullets_are_whole_where_the_source_wraps(name):
    _, _, learn = site.describe_notebook(nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4))
    assert learn and all(item.rstrip().endswith((";", ".", ":")) for item in learn), learn


def test_bullets_join_wrapped_lines_and_keep_nested_ones():
    lines = ["**You will learn**", "- one bullet that", "  wraps here;", "- a parent:",
             "  - a child", "- last."]
    assert site._bullets(lines) == ["one bullet that wraps here;", "a parent:\n  - a child", "last."]


def test_formulas_become_mathml_outside_code():
    html_text = site._inline_markdown("bubble $(p-1)/(m+p-1)$, `$HOME` and $$y = x^2$$, costs $5")
    assert "<math" in html_text and 'display="block"' in html_text
    assert "<code>$HOME</code>" in html_text and "$5" in html_text
    assert "$(p" not in html_text and "http" not in html_text


def test_third_party_noise_is_left_out_and_our_warnings_kept():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stderr", text=(
        "Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load\n"
        "W1201 torch/utils/_pytree.py:630] <enum 'K'> is an Enum subclass and is now natively "
        "supported. Calling register_constant() on Enum subclasses is deprecated and will be an "
        "error in a future release.\n"
        "moe_lab/kernels/mx_quantize.py:10: UserWarning: MXFP8 is emulated here\n")),
        nbformat.v4.new_output("stream", name="stderr", text="Failed to load /y/torchao/a.so: x\n")]
    prepared = site.prepare_for_site(nb)
    (out,) = prepared.cells[0].outputs
    assert out["text"] == "moe_lab/kernels/mx_quantize.py:10: UserWarning: MXFP8 is emulated here\n"
    assert len(nb.cells[0].outputs) == 2  # the notebook itself is not changed


def test_the_injected_parameters_cell_is_left_off_the_page():
    own = nbformat.v4.new_code_cell('PROFILE = "full"', metadata={"tags": ["parameters"]})
    injected = nbformat.v4.new_code_cell('PROFILE = "smoke"', metadata={"tags": ["injected-parameters"]})
    body = nbformat.v4.new_code_cell("print(PROFILE)")
    nb = nbformat.v4.new_notebook(cells=[own, injected, body])
    prepared = site.prepare_for_site(nb)
    assert [c.source for c in prepared.cells] == ['PROFILE = "full"', "print(PROFILE)"]
    assert len(nb.cells) == 3


# ------------------------------------------------------------------------------ headlines


def test_headline_from_the_table_prefers_full_then_newest():
    records = [
        _rec("12_time_to_train", "optimised vs naive", "time_to_target_speedup", 1.2, "x",
             time="2026-11-29T12:00:00", profile="smoke"),
        _rec("12_time_to_train", "optimised vs naive", "time_to_target_speedup", 1.6, "x",
             time="2026-11-29T09:00:00", profile="full"),
        _rec("12_time_to_train", "optimised vs naive", "time_to_target_speedup", 1.5, "x",
             time="2026-11-29T08:00:00", profile="full"),
    ]
    rec, spec = site.find_headline(records, "12_time_to_train")
    assert rec["value"] == 1.6 and spec.metric == "time_to_target_speedup"
    (row,) = site.headline_rows(records, ["12_time_to_train"])
    assert row["figure"] == "1.600×" and row["command"].endswith("--profile full")
    assert site.find_headline(records, "12_time_to_train", lambda r: r["hardware"] == "H200") is None


def test_the_benchmark_and_the_notebook_compete_for_one_figure():
    records = [
        _rec("12_time_to_train", "optimised vs naive", "time_to_target_speedup", 1.2, "x",
             time="2026-11-29T09:00:00", profile="full"),
        _rec("bench:time-to-train", "optimised vs naive", "time_to_target_speedup", 1.4, "x",
             time="2026-11-29T10:00:00", profile="full"),
        _rec("12_time_to_train", "optimised vs naive", "time_to_target_speedup", 1.1, "x",
             time="2026-11-29T11:00:00", profile="smoke"),
    ]
    (row,) = site.headline_rows(records, ["12_time_to_train"])
    assert row["figure"] == "1.400×"
    assert row["command"] == ("python -m moe_lab bench time-to-train --profile full --seeds 10 --ladder "
                              "--pick-router")


def test_pick_min():
    records = [_rec("09_expert_parallel_a2a", "overlap", "exposed_vs_sequential", 30.0, "%"),
               _rec("09_expert_parallel_a2a", "sequential", "exposed_vs_sequential", 100.0, "%"),
               # an older ledger's bare ratio, smaller still: without a unit it is no headline
               _rec("09_expert_parallel_a2a", "chunked", "exposed_vs_sequential", 0.2, "")]
    rec, _ = site.find_headline(records, "09_expert_parallel_a2a")
    assert rec["step"] == "overlap" and site.format_figure(rec) == "30.00 %"
    assert site.find_headline(records, "99_unknown") is None


def test_a_headline_needs_its_unit():
    bare = _rec("11_network_fabric", "adaptive", "a2a_bandwidth_over_link", 1.0, "",
                hardware="simulated", kind="simulated")
    assert site.find_headline([bare], "11_network_fabric") is None
    rec, _ = site.find_headline([{**bare, "value": 100.0, "unit": "%"}], "11_network_fabric")
    assert site.format_figure(rec) == "100.0 %"
    # "x" and "×" are one unit
    rec, _ = site.find_headline([_rec("12_time_to_train", "optimised vs naive",
                                      "time_to_target_speedup", 1.5, "×")], "12_time_to_train")
    assert site.format_figure(rec) == "1.500×"


def _gpu(notebook="01_naive_moe", metric="syncs_per_step[deepseek_v3 naive]", value=14848,
         unit="syncs", kind="projection", hardware="H200", basis="256 experts x 58 layers", **extra):
    return _rec(notebook, site.GPU_LINE_STEP, metric, value, unit, hardware=hardware, kind=kind,
                basis=basis, **extra)


def test_gpu_line_beside_the_headline():
    records = [_rec("01_naive_moe", "naive", "syncs_per_step", 8, "syncs"), _gpu()]
    (row,) = site.headline_rows(records, ["01_naive_moe"], site.on_cpu_or_machine_free)
    assert row["figure"] == "8 syncs"
    assert row["gpu"]["figure"] == "14,848 syncs" and row["gpu"]["kind"] == "projection"
    # a GPU line is never a CPU headline, and never counts as measured on a GPU
    assert site.on_cpu_or_machine_free(_gpu())
    assert site.find_headline([_gpu()], "01_naive_moe") is None


@pytest.mark.parametrize("broken", [dict(unit=""), dict(kind="measured"), dict(basis=""),
                                    dict(hardware="cpu:test x2"), dict(step="summary"),
                                    dict(metric="another metric")])
def test_a_gpu_line_without_unit_kind_basis_or_gpu_is_none(broken):
    assert site.find_gpu_line([{**_gpu(), **broken}], "01_naive_moe") is None
    assert site.find_gpu_line([_gpu()], "01_naive_moe") is not None


def test_the_index_shows_the_gpu_line_labelled():
    row = site.headline_rows([_rec("01_naive_moe", "naive", "syncs_per_step", 8, "syncs"), _gpu()],
                             ["01_naive_moe"])[0]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 01 · naive\n\ns")])
    path = Path("01_naive_moe.ipynb")
    text = site.index_entry(path, nb, "01_naive_moe.html", row)
    assert "On an H200: <b>14,848 syncs</b>" in text
    assert "(projection: 256 experts x 58 layers)" in text
    row_without = site.headline_rows([_rec("01_naive_moe", "naive", "syncs_per_step", 8, "syncs")],
                                     ["01_naive_moe"])[0]
    assert "No GPU line in the ledger yet" in site.index_entry(path, nb, "01_naive_moe.html", row_without)


def test_cpu_table_keeps_simulations_and_counts():
    sim = _rec("10_pipeline_layout", "searched", "x", 1.0, "%", hardware="simulated",
               kind="simulated")
    gpu = _rec("08_cuda_graphs", "small: graphed vs eager", "speedup", 2.0, "x", hardware="H200")
    assert site.on_cpu_or_machine_free(sim)
    assert site.on_cpu_or_machine_free(_rec("a", "b", "c", 1.0, ""))
    assert not site.on_cpu_or_machine_free(gpu)
    # read off code compiled for a GPU, nothing run on one (the compile report's records)
    compiled = _rec("03_triton_from_zero", "k", "warps_per_sm", 8, "warps",
                    hardware="H200 SXM (sm_90), compiled only", kind="compiled")
    assert site.on_cpu_or_machine_free(compiled)


def test_format_figure():
    assert site.format_figure({"value": 0.25, "unit": "fraction"}) == "25%"
    assert site.format_figure({"value": 3, "unit": "syncs"}) == "3 syncs"
    assert site.format_figure({"value": 1.5, "unit": "x"}) == "1.500×"
    assert (site.format_figure({"value": 1.2, "unit": "x", "min": 0.9, "max": 1.25, "seeds": 3})
            == "1.200× (range 0.9000–1.250 over 3 seeds)")
    # one seed is said in words: a range of one value is no range
    one = site.format_figure({"value": 1.791, "unit": "x", "min": 1.791, "max": 1.791, "seeds": 1})
    assert one == "1.791× (one seed)" and "range" not in one
    assert (site.format_figure({"value": 1.2, "unit": "x", "min": 1.2, "max": 1.2, "seeds": 4})
            == "1.200× (the same over 4 seeds)")
    # warps per SM read off a compile report show their parts and what bounds them
    assert (site.format_figure({"value": 8, "unit": "warps", "blocks_per_sm": 2, "num_warps": 4,
                                "limiter": "registers"})
            == "8 warps (2 blocks × 4 warps, bound by registers)")


# ------------------------------------------------------------------------------ the site


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    workbook = root / "workbook"
    workbook.mkdir()
    _executed(workbook / "01_naive_moe.ipynb", "01 · The naive layer")
    _executed(workbook / "12_time_to_train.ipynb", "12 · Time to train", error=True)
    (workbook / "scratch.ipynb").write_text("{}")  # not part of the workbook
    ledger = root / "results" / "ledger.jsonl"
    ledger.parent.mkdir()
    ledger.write_text(json.dumps(_rec("01_naive_moe", "naive", "syncs_per_step", 24, "syncs")) + "\n"
                      + json.dumps(_rec("01_naive_moe", "naive", "syncs_per_step", 7, "syncs",
                                        time="2026-11-30T10:00:00", source="lab")) + "\n")
    index = site.build_site(workbook, root / "site", ledger)
    return root, index


def test_index_lists_every_notebook_with_its_headline(built):
    root, index = built
    assert index == root / "site" / "index.html"
    page = index.read_text()
    assert "01 · The naive layer" in page and "12 · Time to train" in page
    assert "This notebook teaches <em>one</em> thing with <code>code</code>." in page
    assert "<li>the first lesson;</li>" in page
    assert "24 syncs" in page and "cpu:test x2" in page
    assert "7 syncs" not in page  # a hand-run (Lab) record never reaches the site
    assert page.count(">01<") == 0  # the number once: the title already starts with it
    assert "No figure in the ledger yet" in page  # notebook 12 has none
    assert "a cell failed" in page  # notebook 12 raised
    assert "scratch" not in page


def test_site_opens_without_a_server(built):
    root, index = built
    page = index.read_text()
    links = re.findall(r'href="([^"]+)"', page)
    assert links == ["01_naive_moe.html", "12_time_to_train.html"]
    for link in links:
        assert (root / "site" / link).is_file()
        assert "<html" in (root / "site" / link).read_text()
    assert "http" not in page and "<script" not in page and "<link" not in page
    first, last = ((root / "site" / link).read_text() for link in links)
    for text in (first, last):  # nothing fetched: no script, stylesheet or font from anywhere
        assert not re.search(r"<script[^>]+src=|<link[^>]+href=\"?https?:", text)
        assert "cdnjs" not in text and "mathjax" not in text.lower()
        assert text.count('href="index.html"') == 2  # the navigation bar, top and bottom
    assert re.search(r'<a (?=[^>]*rel="next")(?=[^>]*href="12_time_to_train.html")', first)
    assert re.search(r'<a (?=[^>]*rel="prev")(?=[^>]*href="01_naive_moe.html")', last)


# ------------------------------------------------------------------------------ README table


def _readme_gains():
    spec = importlib.util.spec_from_file_location("readme_gains", ROOT / "scripts" / "readme_gains.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_gains_table(tmp_path):
    gains = _readme_gains()
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("\n".join(json.dumps(r) for r in [
        _rec("01_naive_moe", "naive", "syncs_per_step", 24, "syncs"),
        _rec("01_naive_moe", "naive", "syncs_per_step", 99, "syncs", hardware="H200",
             time="2026-11-30T00:00:00"),
    ]) + "\n")
    gpu = tmp_path / "results" / "NVIDIA_H200"
    gpu.mkdir(parents=True)
    (gpu / "bench.json").write_text(json.dumps([{"bench": "router fwd", "speedup": 5.25}]))
    (gpu / "env.json").write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-11-29"}))
    text = gains.gains_markdown(ledger, tmp_path / "results", ["01_naive_moe", "02_capacity"])
    cpu_part, gpu_part = text.split("### Measured on NVIDIA_H200")
    assert "| 01_naive_moe | host syncs" in cpu_part and "| 24 syncs |" in cpu_part
    assert "99" not in cpu_part  # the GPU's figure never lands in the CPU table
    assert "`python -m moe_lab workbook --only 01_naive_moe`" in cpu_part
    assert "| 02_capacity | not measured yet |" in cpu_part
    assert "| router fwd | speedup 5.25 |" in gpu_part
    assert "`python scripts/gpu_check.py`" in gpu_part


def test_readme_gains_shows_the_gpu_line_beside_the_cpu_headline(tmp_path):
    gains = _readme_gains()
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("\n".join(json.dumps(r) for r in [
        _rec("01_naive_moe", "naive", "syncs_per_step", 24, "syncs"), _gpu()]) + "\n")
    text = gains.gains_markdown(ledger, tmp_path / "results", ["01_naive_moe", "02_capacity"])
    header, _, row_01, row_02 = text.splitlines()[2:6]
    assert "| on a GPU |" in header
    assert "| 24 syncs | 14,848 syncs on H200:" in row_01
    assert "(projection: 256 experts x 58 layers)" in row_01
    assert "| not measured yet | — | — |" in row_02


def test_readme_gains_refuses_a_missing_ledger(tmp_path, capsys):
    """A missing ledger printed a table of "not measured yet" rows with exit status 0."""
    gains = _readme_gains()
    assert gains.main(["--ledger", str(tmp_path / "nope.jsonl"), "--results", str(tmp_path)]) == 1
    assert f"no ledger at {tmp_path / 'nope.jsonl'}" in capsys.readouterr().err


def test_readme_gains_skips_a_hand_edited_value(tmp_path):
    gains = _readme_gains()
    ledger = tmp_path / "ledger.jsonl"
    good = _rec("01_naive_moe", "naive", "syncs_per_step", 24, "syncs")
    ledger.write_text("\n".join([json.dumps(good), json.dumps({**good, "value": "fast",
                                                              "time": "2099-01-01T00:00:00"})]) + "\n")
    with pytest.warns(UserWarning, match="line 2"):
        text = gains.gains_markdown(ledger, tmp_path / "results", ["01_naive_moe"])
    assert "| 24 syncs |" in text and "fast" not in text


# ------------------------------------------------------------------------------ the workbook


@pytest.mark.timeout(300)
def test_the_workbook_builds_the_site(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "moe-lab"\nversion = "0"\n')
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# 00 · A tiny notebook\n\nIt records one figure."),
        nbformat.v4.new_code_cell('PROFILE = "smoke"\nSEED = 0\nSOLUTIONS = True',
                                  metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("print('hello')")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, notebooks / "00_tiny.ipynb")
    runs = workbook.run_workbook(root=tmp_path, results_dir=tmp_path / "build" / "results",
                                 progress=False)
    assert runs[0].ok
    index = tmp_path / "build" / "site" / "index.html"
    assert "00 · A tiny notebook" in index.read_text()
    assert "hello" in (tmp_path / "build" / "site" / "00_tiny.html").read_text()
