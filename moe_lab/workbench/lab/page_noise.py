"""Noise on an executed notebook's page: stderr output, a cell whose value is a raw dict or list,
and a markdown table that will not render as one.

A page is read by a learner, so what a cell shows should be meant: a table, a figure, a
sentence. Three things never are: text on stderr (a library's note, a crash log nobody
explains; it renders on a red background), a cell that ends in an expression whose value is
a dict or a list, which Jupyter prints as its raw ``repr`` (a ledger record, a list of
matplotlib artists), and a markdown table with a row of more or fewer cells than its header
(a ``|`` inside a cell's code splits it, in JupyterLab as on GitHub, unless escaped with a
backslash), which renders with its columns shifted, or as a paragraph. `scan` finds all three
in an executed notebook; `unexpected` leaves out the ones `ALLOWED` accepts, each entry with
its reason. ``tests/workbench/lab/test_notebooks.py`` scans every notebook it executes and
fails on anything else, so no notebook is executed twice for it;
``tests/workbench/lab/test_page_noise.py`` tests the scanner and the list.

Known third-party notes are silenced where they start (`moe_lab.workbench.quiet`), not here; the
lines of its list that a kernel's C++ code printed are not counted.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moe_lab.workbench.quiet import without_known_lines

# The repr of a dict or a list (and of the dict and list types a cell is likely to end in).
_RAW = re.compile(r"^\s*(\{|\[|(defaultdict|OrderedDict|Counter)\()")
# A markdown table's cell boundary: a pipe not escaped, code spans included (as GitHub's rule is).
_PIPE = re.compile(r"(?<!\\)\|")
RICH = ("text/html", "text/markdown", "text/latex", "image/png", "image/svg+xml",
        "application/vnd.jupyter.widget-view+json")


@dataclass(frozen=True)
class Noise:
    """One noisy output: the notebook (stem), the cell's index in the executed notebook, the
    kind (``"stderr"``, ``"raw value"`` or ``"table"``), the output's text and the cell's first line."""

    notebook: str
    cell: int
    kind: str
    text: str
    first_line: str = ""

    def describe(self) -> str:
        """One line: ``09_expert_parallel_a2a cell 11 (stderr): [rank0]:[E...] ... | for info in ...``."""
        text = " ".join(self.text.split())
        text = text if len(text) <= 160 else text[:157] + "..."
        return f"{self.notebook} cell {self.cell} ({self.kind}): {text}  <- {self.first_line}"


# What a page may show of the two, and why: (notebook stem or ``"*"`` for any, kind, a text the
# output contains, the reason). Keep it short: an entry is a decision that the reader is better
# served by the output than by its absence.
ALLOWED: tuple[tuple[str, str, str, str], ...] = (
    ("*", "stderr", "left behind by a build that was killed",
     "the CPU plug-in found the lock file of a killed build of its kernels and removed "
     "it (moe_lab.workbench.cpu.build.build_guard): a past failure, said once, on stderr "
     "as a warning should be; it appears only after a build was killed"),
)


def _first_line(source: str) -> str:
    return next((line.strip() for line in source.splitlines()
                 if line.strip() and not line.lstrip().startswith("#")), "")


def _broken_table(markdown: str) -> bool:
    """Whether a table of ``markdown`` (its rows: consecutive lines starting with ``|``) has
    rows of different numbers of cells."""
    rows = [len(_PIPE.findall(line)) if line.lstrip().startswith("|") else 0
            for line in markdown.splitlines()]
    return any(len(set(table)) > 1 for is_table, table in itertools.groupby(rows, key=bool) if is_table)


def scan(notebook, name: str) -> list[Noise]:
    """Every stderr output, every ``execute_result`` whose only form is a dict's or a list's
    ``repr``, and every markdown output holding a broken table (kind ``"table"``), of the
    executed ``notebook`` (an ``nbformat`` node or its dict); ``name`` labels them (the
    notebook's stem)."""
    found = []
    for index, cell in enumerate(notebook["cells"]):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell.get("source", ""))  # a string, or the list of its lines
        for out in cell.get("outputs", []):
            kind = out.get("output_type")
            if kind == "stream" and out.get("name") == "stderr":
                text = without_known_lines("".join(out.get("text", "")))  # moe_lab.workbench.quiet's list
                if text.strip():
                    found.append(Noise(name, index, "stderr", text, _first_line(source)))
            markdown = "".join(out.get("data", {}).get("text/markdown", ""))
            if markdown and _broken_table(markdown):
                found.append(Noise(name, index, "table", markdown, _first_line(source)))
            if kind == "execute_result":
                data = out.get("data", {})
                plain = "".join(data.get("text/plain", ""))
                if _RAW.match(plain) and not any(mime in data for mime in RICH):
                    found.append(Noise(name, index, "raw value", plain, _first_line(source)))
    return found


def unexpected(noise: Iterable[Noise], allowed: Sequence[tuple[str, str, str, str]]) -> list[Noise]:
    """The items of ``noise`` that no entry of ``allowed`` (as `ALLOWED`) accepts."""
    return [item for item in noise
            if not any(notebook in ("*", item.notebook) and kind == item.kind and contains in item.text
                       for notebook, kind, contains, _reason in allowed)]
