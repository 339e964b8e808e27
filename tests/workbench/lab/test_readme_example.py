"""The README's "Using the package" example runs as written, and its claim about the sync count
is code that holds, not a comment inviting ``syncs >= 8`` on the `Counter` that `count_syncs`
returns (issue 47)."""

import re
from pathlib import Path

import pytest

from moe_lab.training.sync import SyncError

ROOT = Path(__file__).resolve().parents[3]


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [block for block in blocks if "count_syncs(" in block]
    assert len(found) == 1, "one README example calls count_syncs"
    return found[0]


def test_the_count_syncs_example_checks_the_count_it_promises():
    example = _example()
    claims = [line for line in example.splitlines()
              if line.startswith("assert ") and ".values()" in line]
    assert claims, f"the example states the sync count as an assert on the counts:\n{example}"
    namespace: dict = {}
    # Its last line shows assert_sync_free refusing the "naive" layer; every line before it,
    # the claim included, has run by then.
    assert example.rstrip().splitlines()[-1].startswith("assert_sync_free(")
    with pytest.raises(SyncError):
        exec(compile(example, "README.md", "exec"), namespace)
    assert sum(namespace["counts"].values()) >= namespace["cfg"].n_experts
