"""A rebuild of the CPU kernels over an old build says so, and why, before it starts (issue 47:
it compiled for minutes without a word when ninja found a source or a torch header newer).
Tested on a one-rule ninja file: nothing is compiled."""

import os
import shutil
import subprocess

import pytest
import torch.utils.cpp_extension

from moe_lab.workbench.cpu import build

pytestmark = pytest.mark.skipif(shutil.which("ninja") is None, reason="no ninja")

NAME = "moe_lab_cpu_kernels_test"


def _old_build(folder):
    """A finished build in ``folder`` (``NAME.so`` from ``src.cpp``), then a source newer than it."""
    (folder / "build.ninja").write_text(f"rule copy\n  command = cp $in $out\n"
                                        f"build {NAME}.so: copy src.cpp\n")
    (folder / "src.cpp").write_text("// a source\n")
    subprocess.run(["ninja", "-C", str(folder)], check=True, capture_output=True)
    assert build.rebuild_reason(folder) is None  # built: nothing to do
    so = os.stat(folder / f"{NAME}.so").st_mtime
    os.utime(folder / "src.cpp", (so + 10, so + 10))


def test_the_reason_names_the_newer_input(tmp_path):
    _old_build(tmp_path)
    assert build.rebuild_reason(tmp_path) == f"src.cpp is newer than the {NAME}.so built from it"
    assert build.rebuild_reason(tmp_path / "elsewhere") is None  # no build.ninja: cannot tell


def test_a_rebuild_is_announced_before_it_starts(tmp_path, monkeypatch, capsys):
    _old_build(tmp_path)
    said_before_load = []

    def load(name, sources, **kwargs):
        said_before_load.append(capsys.readouterr().out)
        return "the module"

    monkeypatch.setattr(build, "_name_and_dir", lambda: (NAME, tmp_path))
    monkeypatch.setattr(build, "_ext", None)
    monkeypatch.setattr(build, "_error", None)
    monkeypatch.delenv("MOE_LAB_NO_CPU_EXTENSION", raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    assert build.extension() == "the module"
    assert said_before_load == [f"moe_lab: rebuilding the CPU kernels in {tmp_path} (src.cpp is newer "
                                f"than the {NAME}.so built from it; about a minute)...\n"]
