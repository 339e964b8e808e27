"""The workbook's profiles, checked where a notebook starts.

Every notebook takes ``PROFILE`` as a papermill parameter: ``"smoke"`` (each notebook in
90 s or less on a 2-core CPU) or ``"full"`` (a GPU or a patient reader). A notebook that
tested ``PROFILE == "smoke"`` alone would run the full profile for a typo
(``-p PROFILE smok``), so each one's setup cell calls `check_profile` first.
"""

from __future__ import annotations

__all__ = ["PROFILES", "check_profile"]

PROFILES = ("smoke", "full")


def check_profile(profile: object) -> str:
    """``profile`` if it names one of `PROFILES`; else a ``ValueError`` naming it."""
    if not isinstance(profile, str) or profile not in PROFILES:
        raise ValueError(f"PROFILE must be one of {', '.join(map(repr, PROFILES))}, "
                         f"got {profile!r}")
    return profile
