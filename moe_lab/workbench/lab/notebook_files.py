"""The files the workbook runner and the site both write: which notebooks belong to the
workbook (``NN_name.ipynb``, or ``NNb_name.ipynb`` for one slotted in after ``NN``), and how a
file is written so no reader sees it half-written.

`moe_lab.workbench.lab.workbook` executes the notebooks and `moe_lab.workbench.lab.site` renders them; both
import this module, and the runner imports the site, never the other way round.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

# The number: two digits and an optional letter (``02b``), which sorts after ``02_...``.
NOTEBOOK_PATTERN = re.compile(r"^(\d{2}[a-z]?)_(.+)\.ipynb$")


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place (mode 0644)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):  # mkstemp makes it private; RESULTS.md and HTML are shared
            os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
