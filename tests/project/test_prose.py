"""No measured figure is typed into a notebook's prose.

A figure this workbook measures (a time, a speed-up, a share, a rate, a step count) is
printed by a cell or read from the ledger, so it is always the one of the run the reader
sees. This scans every markdown cell of every notebook, sentence by sentence, for a typed
figure ("1.5 ms", "3.2x", "0.74 %", "370 steps", "91 GFLOP/s") in a sentence that speaks of
a measurement or a result of this workbook ("measured", "here", "took", "median", ...).
A sentence that names its source (the seed write-up, NVIDIA's reported result, a paper, a
datasheet, DeepEP's README) or says it is an illustration or a hypothesis ("if", "say",
"e.g.") may carry figures: those are not this machine's. Code spans and formulas are not
prose and are skipped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*.ipynb"))

_NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s*[–-]\s*\d[\d,]*(?:\.\d+)?)?"
FIGURE = re.compile(
    _NUMBER + r"\s*(?:"
    r"(?:ms|µs|us|ns|s|seconds?|minutes?|min)\b"      # a time
    r"|(?<=\d)[x×](?![\w])|×(?!\s)"                    # a speed-up ("3.2x", "3 ×", not "3 × F")
    r"|%"                                              # a share or a gap
    r"|(?:[GT]FLOP/s|TFLOPS|GB/s|tok(?:ens)?/s)\b"     # a rate
    r"|steps?\b"                                       # a step count
    r")")
MEASUREMENT = re.compile(
    r"\b(measur\w*|took|takes|ran|gave|median\w*|on this machine|here\b|reference machine|"
    r"this run|our\b|we\b|faster|slower|costs?|saved|saves|spread|paired|lands|left is)",
    re.I)
SOURCE = re.compile(
    r"(seed(?:'s| write-up| reports)|write-up|reported|NVIDIA|paper|datasheet|published|README|"
    r"FACTS|blog|DeepEP|HybridEP|"
    r"MLPerf|Megatron|third-party|documented|illustrat|made-up|drawn|schematic|not measured|"
    r"DeepSeek|GB[23]00|H[12]00|B200|\bif\b|\bsay\b|e\.g\.|for example|such as)", re.I)

_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.S)


def sentences(markdown: str) -> list[str]:
    """The prose of ``markdown`` (code and formulas removed) cut into sentences."""
    text = _MATH.sub(" ", _CODE.sub(" ", markdown))
    text = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.!?;:])\s+(?=[A-Z*(\"'])|\s+-\s+", text) if s.strip()]


def typed_figures(markdown: str) -> list[str]:
    """The sentences of ``markdown`` that type a measured figure, with the figure."""
    found = []
    for sentence in sentences(markdown):
        figures = [m.group(0) for m in FIGURE.finditer(sentence)]
        if figures and MEASUREMENT.search(sentence) and not SOURCE.search(sentence):
            found.append(f"{', '.join(figures)}  <- {sentence[:160]}")
    return found


def test_the_scan_finds_typed_figures():
    assert typed_figures("Padding cost 1.5–1.9 ms a step here.")
    assert typed_figures("The optimised stack needed a median of 370 steps.")
    assert typed_figures("With MXFP8 logits every stage count lands at **0.74 %**.")
    assert typed_figures("It ran 3.2x faster on this machine.")
    assert typed_figures("A median of 370 steps over ten seeds (280–400).")
    assert not typed_figures("The seed reports 1,648 TFLOPS per GPU, measured by NVIDIA.")
    assert not typed_figures("If the naive stack runs at half the ceiling, it is at most 2× faster.")
    assert not typed_figures("The cell above prints what it measured: `f'{t:.1f} ms'`.")
    assert not typed_figures("Here $x = 3\\%$ is a formula.")
    assert not typed_figures("Training costs 3 × forward here.")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_measured_figure_is_typed_into_prose(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    hits = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        hits += [f"cell {index}: {hit}" for hit in typed_figures(source)]
    assert not hits, (f"{path.name} types measured figures into its prose; print them from a "
                      "cell or read them from the ledger:\n" + "\n".join(hits))


FINALE_WORDS = 1_500  # the time-to-train finale is read in one sitting


def test_the_finale_stays_short():
    """Notebook 12 gathers the workbook's results; its prose (markdown cells, words as
    whitespace-separated tokens) stays within a budget so that it reads as a finale."""
    path = ROOT / "notebooks" / "12_time_to_train.ipynb"
    cells = json.loads(path.read_text())["cells"]
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    assert words <= FINALE_WORDS, f"{path.name} has {words} words of prose (budget {FINALE_WORDS})"
