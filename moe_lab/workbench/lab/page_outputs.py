"""What a cell's outputs become on the site: exercises said honestly, progress bars collapsed,
long outputs folded.

The site (`moe_lab.workbench.lab.site`) shows an executed notebook as it ran, with three
exceptions, each made by one function here on the notebook before it is exported:

- `honest_exercises`: ``make workbook`` runs every notebook with ``SOLUTIONS=True`` (in a
  cell papermill injects, which the page leaves out), so an exercise's check checks the
  reference solution and prints ``✓``. Under the learner's stub, still unsolved, that ``✓``
  would say the stub is right. Each ``✓`` line of a check that ran the reference becomes
  ``◻ name: not done — the reference ran in its place`` (or, under an answer that is written,
  that the reference ran instead and the answer was not checked).
- progress bars: a text progress bar (tqdm's) redraws its line with carriage returns; on
  the page only the last state of each line is kept (`final_states`), and consecutive
  outputs of one stream are one block, as in JupyterLab (the site joins them).
- `folded`: an output longer than a screen (more than `FOLD_LINES` lines) is folded into a
  ``<details>`` element whose summary says how long it is and shows its first line; a click
  opens it.

The site applies them in that order (`moe_lab.workbench.lab.site.prepare_for_site`), each
output once; the checks in ``tests/workbench/lab/test_page_outputs.py`` hold the rendered
pages to them.
"""

from __future__ import annotations

import html
import re

#: An output longer than this many lines is folded on the page.
FOLD_LINES = 60

# What an unsolved stub holds: ``return not_done()``, or a Triton stub's
# ``tl.static_assert(False, "exercise not solved yet")`` (the `NOT_DONE` message of
# `moe_lab.workbench.exercises`, spelled out: importing that package imports torch).
NOT_DONE = "exercise not solved yet"
_STUB = re.compile(r"\bnot_done\(\)|" + re.escape(NOT_DONE))
# A check called in learner or reference mode: ``check_x(answer, ..., solutions=SOLUTIONS)``.
_CHECK_CALL = re.compile(r"\bcheck_\w+\s*\(")
_SOLUTIONS_ARG = re.compile(r"\bsolutions\s*=\s*SOLUTIONS\b")
_SOLUTIONS_SET = re.compile(r"^\s*SOLUTIONS\s*=\s*(True|False)\b", re.M)
_PASSED = re.compile(r"^✓\s*([A-Za-z_][\w.]*)?:?(.*)$")

_CARRIAGE_RETURN = re.compile(r"[^\n]*\r(?=[^\n])")
_BACKSPACE = re.compile(r"[^\n]\x08")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _text(value: object) -> str:
    return value if isinstance(value, str) else "".join(value or ())


def run_solutions(nb) -> bool | None:
    """The ``SOLUTIONS`` the notebook ``nb`` ran with: the value papermill injected (the cell
    tagged ``injected-parameters``), else the value of its ``parameters`` cell, else ``None``."""
    for tag in ("injected-parameters", "parameters"):
        for cell in nb.cells:
            if cell.cell_type == "code" and tag in cell.get("metadata", {}).get("tags", []):
                found = _SOLUTIONS_SET.findall(_text(cell.source))
                if found:
                    return found[-1] == "True"
    return None


def is_unsolved_stub(source: str) -> bool:
    """True when ``source`` (a cell's code) still holds an exercise's stub."""
    return bool(_STUB.search(source))


def honest_exercises(nb) -> None:
    """Rewrite, in place, each ``✓`` line that a check printed for the reference solution:
    in every exercise cell (one that calls a check in the notebook's mode,
    ``check_…(…, solutions=SOLUTIONS)``: that check ran the reference solution, not the answer
    above it) of a notebook run with ``SOLUTIONS=True``,
    and in every cell that still holds a stub (which can never pass its own check) whatever
    the mode. Under a stub it says "not done", under a written answer "not checked"."""
    solutions = run_solutions(nb)
    for cell in nb.cells:  # only a code cell has outputs
        source = _text(cell.source)
        stub = is_unsolved_stub(source)
        exercise = _CHECK_CALL.search(source) and _SOLUTIONS_ARG.search(source)
        if not (stub or (solutions is True and exercise)):
            continue
        said = ("not done — the reference ran in its place (this page was run with SOLUTIONS=True; "
                "run the notebook yourself to have your answer checked)" if stub
                else "not checked — the reference ran in place of the answer above (this page was run "
                "with SOLUTIONS=True)")
        for out in cell.get("outputs", []):
            if out.get("output_type") != "stream":
                continue
            lines = _text(out.get("text", "")).split("\n")
            for i, line in enumerate(lines):
                match = _PASSED.match(line)
                if not match:
                    continue
                who = f"{match.group(1)}: " if match.group(1) else ""
                lines[i] = f"◻ {who}{said}"
            out["text"] = "\n".join(lines)


def final_states(text: str) -> str:
    """``text`` as a terminal leaves it: each line's last state after carriage returns (a
    progress bar's redraws), backspaces applied; a line ended by ``\\r\\n`` is kept."""
    text = text.replace("\r\n", "\n")
    previous = None
    while previous != text:
        previous, text = text, _BACKSPACE.sub("", text)
    return _CARRIAGE_RETURN.sub("", text).replace("\r", "")


def _folded(text: str, what: str = "output", markdown: bool = False) -> dict:
    """``text`` (Markdown when ``markdown``, else plain text with ANSI colours) as the
    ``data`` of an HTML output: a ``<details>`` element whose summary says it is so many lines
    of ``what`` and shows the first line."""
    from nbconvert.filters.ansi import ansi2html  # escapes the text; keeps colours

    first_line = next((line for line in text.split("\n") if line.strip()), "")
    first = html.escape(_ANSI.sub("", first_line).strip())
    if len(first) > 100:
        first = first[:99] + "…"
    head = f" — <code>{first}</code>" if first else ""
    body = markdown_to_html(text) if markdown else f'<pre class="moe-fold-text">{ansi2html(text)}</pre>'
    return {"text/html": f'<details class="moe-fold"><summary>{_line_count(text)} lines of '
                         f"{html.escape(what)} (folded; click to open){head}</summary>{body}</details>"}


def _line_count(text: str) -> int:
    return len(text.rstrip("\n").split("\n")) if text.strip() else 0


def folded(out: dict) -> dict:
    """One output as the page shows it: a stream's lines at their final state (`final_states`:
    a progress bar is one line), and a stream, plain-text result or Markdown output longer than
    `FOLD_LINES` lines folded into ``<details>`` (a new HTML output for a stream)."""
    import nbformat

    data = out.get("data", {})
    if out.get("output_type") == "stream":
        out["text"] = final_states(_text(out.get("text", "")))
        if _line_count(out["text"]) > FOLD_LINES:
            what = "output" if out.get("name") == "stdout" else f"{out.get('name')} output"
            return nbformat.v4.new_output("display_data", data=_folded(out["text"], what))
    elif "text/markdown" in data and _line_count(_text(data["text/markdown"])) > FOLD_LINES:
        out["data"] = _folded(_text(data["text/markdown"]), markdown=True)
    elif set(data) == {"text/plain"} and _line_count(_text(data["text/plain"])) > FOLD_LINES:
        out["data"] = _folded(_text(data["text/plain"]))
    return out


#: Style of the folds, added to every page's CSS.
FOLD_CSS = """
details.moe-fold { margin: .3em 0; }
details.moe-fold > summary { cursor: pointer; color: #0b5cad; font: 13px/1.5 system-ui, sans-serif; }
details.moe-fold > pre { margin: .3em 0 0; white-space: pre; overflow-x: auto; }
"""


def latex_to_mathml(tex: str, display: bool = False) -> str:
    """One formula as MathML (rendered natively by browsers; no script, no network). Without
    ``latex2mathml`` (the ``lab`` extra) the TeX is shown as code, and a warning says so."""
    try:
        from latex2mathml.converter import convert  # the lab/test extras; only the site needs it
    except ImportError:
        import warnings

        warnings.warn("latex2mathml is not installed (pip install -e '.[lab]'): the site shows "
                      "formulas as TeX", stacklevel=2)
        return f'<code class="tex">{html.escape(tex)}</code>'
    try:
        mathml = convert(tex.strip(), display="block" if display else "inline")
    except Exception:  # TeX the converter does not know: shown as TeX, the page still renders
        return f'<code class="tex">{html.escape(tex)}</code>'
    return mathml.replace(' xmlns="http://www.w3.org/1998/Math/MathML"', "")


def markdown_to_html(markdown: str) -> str:
    """Markdown as HTML, parsed as nbconvert parses a notebook's (a formula is found where
    Jupyter finds one: never inside code), each formula written as MathML (`latex_to_mathml`)
    where nbconvert would leave its TeX for MathJax."""
    from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

    class MathMLRenderer(IPythonRenderer):
        def block_math(self, body: str) -> str:
            return latex_to_mathml(body, display=True)

        def inline_math(self, body: str) -> str:
            return latex_to_mathml(body)

    rendered = MarkdownWithMath(renderer=MathMLRenderer(escape=False)).render(markdown)
    # GitHub's rule, which mistune lacks: in a table cell, code spans included, ``\|`` is a pipe.
    return re.sub(r"<t([dh])\b[^>]*>.*?</t\1>", lambda cell: cell[0].replace("\\|", "|"), rendered,
                  flags=re.S)
