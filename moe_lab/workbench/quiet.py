"""Third-party messages known to be harmless, silenced where they start: the one list.

A notebook's page shows what its cells print. Some libraries print, on import or inside a
rank, notes that are not about the lesson and need nothing from the reader; each is listed
here, once, with what it is and why it can be left out. Nothing else is silenced: every
other warning, log record and stderr line of every library (and all of moe_lab's own)
still shows. A message whose wording changes stops matching and shows again, which is the
safe way to fail.

None of them is a Python warning, so ``warnings.filterwarnings`` cannot reach them:

- `LOG_RECORDS` are `logging` records: each is dropped by a filter on the one logger that
  emits it, for the duration of `library_notes_silenced` (moe_lab wraps the import that
  triggers them: ``transformers``, which imports ``torchao``). Nothing stays installed.
- `STDERR_LINES` are lines that PyTorch's C++ code writes to a process's stderr: the
  rank launcher (`moe_lab.workbench.ranks.launch.run_ranks`) collects each rank's stderr and
  leaves these lines out when it passes the rest on. A notebook kernel's own cannot be
  stopped where they start without hiding the rest of its stderr.

``moe_lab.workbench.lab.site`` drops the same lines from the pages it renders, should an
executed notebook hold one (a notebook run by hand that imported ``transformers`` itself, a
cell that ran the profiler), and `moe_lab.workbench.lab.page_noise` does not count them.
``tests/workbench/lab/test_page_noise.py`` fails on any other stderr a notebook shows that
is not on its allow-list.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator

# (logger, message pattern): one line per known record.
LOG_RECORDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # torchao's import tries its prebuilt extensions, CUDA kernels for sm_90a and one built
    # for another Python (cpython-310); they cannot load here, and torchao says so per file.
    # Harmless: nothing in the workbook runs them (torchao is imported only because
    # transformers imports its quantizers; the MX checks use torchao's pure-PyTorch code).
    ("torchao", re.compile(r"^Failed to load \S*torchao\S*\.so\b")),
    # torchao's own import registers its Enums (KernelPreference, ScaleCalculationMode) as
    # pytree constants, which torch now deprecates (Enums are native opaque values). The call
    # is torchao's (torchao/utils.py), not ours: moe_lab never calls register_constant.
    # Harmless until a torch release makes it an error, which would then fail at import.
    ("torch.utils._pytree",
     re.compile(r"is an Enum subclass .*register_constant\(\) on Enum subclasses is deprecated")),
)

# stderr lines of a rank or kernel process (PyTorch's C++ logging), one pattern per known line.
STDERR_LINES: tuple[re.Pattern[str], ...] = (
    # c10d's TCP store asks the resolver for the name of each connecting peer, only to
    # write it in its own log lines; on a machine with no DNS for the address (an emulated
    # link's namespace, a sandbox without a resolver) the lookup fails and it says so.
    # Harmless: the connection is made by address and works.
    re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved"),
    # Kineto (torch.profiler's engine) marks each start and stop of a trace for system tracers
    # (USDT probes), printing the mark at every log level. Harmless: the profile is unaffected.
    re.compile(r"^USDT:.*\] profiler_(start|stop)$"),
)


def _keep(pattern: re.Pattern[str], record: logging.LogRecord) -> bool:
    """A logging filter (with ``pattern`` bound): whether ``record`` does not match ``pattern``."""
    return not pattern.search(record.getMessage())


@contextlib.contextmanager
def library_notes_silenced() -> Iterator[None]:
    """Drop the records of `LOG_RECORDS` logged inside the ``with`` block (an import that
    triggers them); every other record passes. The filters are removed on leaving."""
    installed = [(logging.getLogger(name), functools.partial(_keep, pattern))
                 for name, pattern in LOG_RECORDS]
    for logger, drop in installed:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in installed:
            logger.removeFilter(drop)


def without_known_lines(text: str) -> str:
    """``text`` without its known-harmless lines (`LOG_RECORDS` as printed, or
    `STDERR_LINES`); the rest kept as it was."""
    patterns = (*(pattern for _, pattern in LOG_RECORDS), *STDERR_LINES)
    return "".join(line for line in text.splitlines(keepends=True)
                   if not any(pattern.search(line) for pattern in patterns))
