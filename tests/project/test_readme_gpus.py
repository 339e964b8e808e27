"""The README's "Which GPU runs what" table is the one the architecture table generates."""

from pathlib import Path

from moe_lab.workbench.figures.gpu_paths import gpu_paths_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_holds_the_generated_gpu_table():
    table = gpu_paths_markdown()
    stale = "README's GPU table is stale: python -m moe_lab.workbench.figures.gpu_paths"
    assert table in README.read_text(), stale
    assert table.count("\n") == 2 + 6  # a header, a rule, and a row per architecture
