"""The workbook's parameters, checked where a notebook starts.

Every notebook takes ``PROFILE``, ``SEED`` and ``SOLUTIONS`` as papermill parameters.
``PROFILE`` is ``"smoke"`` (each notebook in 90 s or less on a 2-core CPU) or ``"full"`` (a
GPU or a patient reader): a notebook that tested ``PROFILE == "smoke"`` alone would run the
full profile for a typo (``-p PROFILE smok``). ``papermill -p`` turns only ``True``,
``False``, ``None`` and numbers into Python values; ``-p SOLUTIONS false`` injects the string
``"false"``, which is truthy, and would silently replace the learner's answers by the
reference. A ``SEED`` outside `SEED_RANGE` (``-p SEED -1``) would pass the setup cell and
fail in the middle of the notebook, where a seeded config refuses it. So each notebook's
setup cell calls `check_parameters` first.
"""

from __future__ import annotations

from moe_lab.checks import int_in, integer, non_negative_int

PROFILES = ("smoke", "full")
# The seeds a notebook takes: non-negative, and with room above for the ones it derives
# (``SEED + 1``, ``SEED + 2``, ...), each within the training loop's own range (``[0, 2**32 - 1]``,
# `moe_lab.workbench.training.loop.MAX_SEED`).
SEED_RANGE = (0, 2**31 - 1)


def check_parameters(profile: object, seed: object, solutions: object, **counts: object) -> None:
    """Refuse, in one line naming the parameter, a ``PROFILE`` not in `PROFILES`, a ``SEED``
    that is not an integer in `SEED_RANGE`, a ``SOLUTIONS`` that is not a bool, and any other
    parameter given by keyword (``THREADS=THREADS``) that is not an integer ``>= 0``."""
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ValueError(f"PROFILE must be one of {', '.join(map(repr, PROFILES))}, "
                         f"got {profile!r}")
    integer(seed, "SEED")
    int_in(seed, "SEED", *SEED_RANGE)
    if not isinstance(solutions, bool):
        hint = (f" (papermill -p passes {solutions!r} as a string: write -p SOLUTIONS "
                f"{str(solutions).strip().capitalize()})" if isinstance(solutions, str) else "")
        raise ValueError(f"SOLUTIONS must be True or False, got {solutions!r}{hint}")
    for name, value in counts.items():
        non_negative_int(value, name)
