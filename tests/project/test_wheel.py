"""The wheel carries what an install outside the checkout needs: the CPU plug-in's C++ sources,
which it compiles on first use. (`.ci/run` installs the wheel into a fresh environment and runs
a layer through the plug-in: scripts/wheel_check.py.)"""

import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_check():
    spec = importlib.util.spec_from_file_location("wheel_check", ROOT / "scripts" / "wheel_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wheel_holds_the_cpu_plugins_sources(wheel_check, tmp_path):
    wheel = wheel_check.build_wheel(tmp_path)
    assert wheel_check.CPP_SOURCES, "no C++ sources found in moe_lab/workbench/cpu"
    assert any(name.endswith(".h") for name in wheel_check.CPP_SOURCES)
    assert wheel_check.missing_sources(wheel) == []
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        for name in wheel_check.CPP_SOURCES:
            assert archive.read(name) == (ROOT / name).read_bytes(), name
    # The package only: no tests, notebooks or results ride along.
    assert all(name.startswith(("moe_lab/", "moe_lab-")) for name in names), names


def test_a_wheel_without_the_sources_is_caught(wheel_check, tmp_path):
    """The check that guards the wheel fails on the bug it is for (package-data naming the old
    ``cpu/`` folder)."""
    wheel = tmp_path / "moe_lab-0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("moe_lab/__init__.py", "")
    assert wheel_check.missing_sources(wheel) == wheel_check.CPP_SOURCES
