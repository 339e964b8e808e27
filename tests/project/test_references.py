"""The repository carries its own references: every source a notebook or module cites is in
``docs/references.md`` (with a public address), and nothing cites a file outside the
repository (the project's background notes) or a write-up a reader cannot open."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCES = ROOT / "docs" / "references.md"
CITED = re.compile(r"\[([a-z0-9][a-z0-9-]*)\]`? in `?docs/references\.md")
OUTSIDE = re.compile(r"FACTS\.md|shared/background|seed write-up|the write-up this project", re.I)


def _texts() -> list[Path]:
    files = [*sorted((ROOT / "notebooks").glob("*.ipynb")), *sorted((ROOT / "moe_lab").rglob("*.py")),
             ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    return [f for f in files if f.is_file()]


def _keys() -> dict[str, str]:
    """Each reference's key and its entry's text (up to the next entry)."""
    text = REFERENCES.read_text(encoding="utf-8")
    entries = re.split(r"\n- \*\*(?=\[)", text)[1:]
    return {re.match(r"\[([^\]]+)\]", e).group(1): e for e in entries}


def test_every_reference_has_a_public_address():
    keys = _keys()
    assert len(keys) >= 20
    for key, entry in keys.items():
        assert re.search(r"<https://[^>]+>", entry), f"[{key}] gives no address"


@pytest.mark.parametrize("path", _texts(), ids=lambda p: p.name)
def test_citations_resolve_and_stay_inside_the_repository(path):
    text = path.read_text(encoding="utf-8")
    keys = _keys()
    missing = sorted(set(CITED.findall(text)) - set(keys))
    assert not missing, f"{path.name} cites {missing}, which docs/references.md does not list"
    outside = sorted({m.group(0) for m in OUTSIDE.finditer(text)})
    assert not outside, f"{path.name} cites {outside}: a source a reader of the repository cannot open"


def test_the_scan_catches_a_bad_citation():
    assert CITED.findall("see `[nope]` in `docs/references.md`") == ["nope"]
    assert OUTSIDE.search("third-party figures, `FACTS.md`)")
