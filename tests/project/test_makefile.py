"""The Makefile's decisions, read off ``make -n -p`` (nothing is installed): which torch set-up uses
and whether the kernels run under Triton's interpreter.

``$(PYTHON)`` is this interpreter without its site-packages (``-S``), shown a stand-in ``torch``
package that says whether it is a CUDA build and sees a device: a CUDA torch gets a venv that
sees it and an install that leaves torch and triton alone, without the CPU plug-in; a CPU torch,
or none, gets today's fast path (the CPU build of torch first, then the project, then the
plug-in). Where no torch answers, ``nvidia-smi`` decides about the interpreter.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

_STAND_IN_TORCH = """
class version:
    cuda = {cuda!r}

class cuda:
    @staticmethod
    def is_available():
        return {device!r}
"""


def _dry_run(tmp_path: Path, torch: dict | None, nvidia_smi: bool = False,
             target: str = "test", **variables: str) -> tuple[str, dict[str, str]]:
    """``make -n -p TARGET`` in the checkout with a venv under ``tmp_path``: the commands it
    would run, and the variables it decided (``NAME := value`` lines)."""
    site = tmp_path / "site"
    site.mkdir(parents=True, exist_ok=True)
    if torch is not None:
        (site / "torch").mkdir(exist_ok=True)
        (site / "torch" / "__init__.py").write_text(_STAND_IN_TORCH.format(**torch))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if nvidia_smi:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: stand-in'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {key: value for key, value in os.environ.items()
           if key not in ("TRITON_INTERPRET", "SYSTEM_TORCH", "MAKEFLAGS", "MFLAGS")}
    env["PYTHONPATH"] = str(site)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if not nvidia_smi and shutil.which("nvidia-smi", path=env["PATH"]):
        pytest.skip("this machine has nvidia-smi: the no-device cases cannot be shown here")
    arguments = [f"PYTHON={sys.executable} -S", f"VENV={tmp_path / 'venv'}", f"COMPAT={tmp_path / 'compat'}"]
    arguments += [f"{name}={value}" for name, value in variables.items()]
    done = subprocess.run(["make", "-n", "-p", "-C", str(ROOT), *arguments, target],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    decided = {}
    for line in done.stdout.splitlines():
        name, sep, value = line.partition(" := ")
        if sep and name in ("SYSTEM_TORCH", "HAS_CUDA", "TRITON_INTERPRET"):
            decided[name] = value
    commands = done.stdout.split("# Make data base", 1)[0]
    return commands, decided


def _install_lines(commands: str) -> list[str]:
    return [line for line in commands.splitlines()
            if ("pip install" in line and "--upgrade pip" not in line) or "moe_lab.workbench.cpu" in line]


def test_a_cuda_torch_is_kept_and_the_cpu_plugin_is_skipped(tmp_path):
    commands, decided = _dry_run(tmp_path, {"cuda": "13.0", "device": True})
    assert decided.get("SYSTEM_TORCH") == "1" and decided.get("HAS_CUDA") == "1", decided
    assert "TRITON_INTERPRET" not in decided, decided  # compiled kernels
    assert "-m venv --system-site-packages" in commands, commands
    installs = _install_lines(commands)
    assert len(installs) == 1 and "-c " in installs[0] and "system-torch.txt" in installs[0], installs
    assert "torch==" not in commands and "triton==" not in commands, installs
    assert "moe_lab.workbench.cpu" not in commands


def test_a_cpu_torch_or_none_takes_the_cpu_fast_path(tmp_path):
    for torch in ({"cuda": None, "device": False}, None):
        commands, decided = _dry_run(tmp_path / str(torch is None), torch)
        assert decided.get("SYSTEM_TORCH") == "" and decided.get("TRITON_INTERPRET") == "1", (torch, decided)
        assert "--system-site-packages" not in commands
        installs = _install_lines(commands)
        assert len(installs) == 3, installs
        assert "torch==2.13.0 triton==3.7.1" in installs[0] and "-e " in installs[1], installs
        assert "-m moe_lab.workbench.cpu" in installs[2], installs


def test_system_torch_is_a_knob_both_ways(tmp_path):
    commands, decided = _dry_run(tmp_path / "on", {"cuda": None, "device": False}, SYSTEM_TORCH="1")
    assert "--system-site-packages" in commands and "torch==" not in commands
    assert decided.get("TRITON_INTERPRET") == "1", decided  # that torch sees no device
    commands, _ = _dry_run(tmp_path / "off", {"cuda": "13.0", "device": True}, SYSTEM_TORCH="0")
    assert "--system-site-packages" not in commands and "torch==2.13.0" in commands


def test_without_torch_nvidia_smi_decides_the_interpreter(tmp_path):
    _, decided = _dry_run(tmp_path / "gpu", None, nvidia_smi=True)
    assert decided.get("HAS_CUDA") == "1" and "TRITON_INTERPRET" not in decided, decided
    _, decided = _dry_run(tmp_path / "cpu", None)
    assert decided.get("HAS_CUDA") == "" and decided.get("TRITON_INTERPRET") == "1", decided
    # a torch that sees no device outweighs nvidia-smi (a CPU build on a GPU machine runs interpreted)
    _, decided = _dry_run(tmp_path / "cpu-torch", {"cuda": None, "device": False}, nvidia_smi=True)
    assert decided.get("TRITON_INTERPRET") == "1", decided


def test_test_compat_holds_pip_to_the_oldest_triton(tmp_path):
    commands, _ = _dry_run(tmp_path, None, target="test-compat")
    installs = _install_lines(commands)
    held = f"-c {tmp_path / 'compat'}/constraints.txt"
    assert installs and all(held in line for line in installs), installs
    assert "torch==2.13.0 triton==3.6.0" in installs[0], installs
    assert "tests/lesson/kernels" in commands and "moe_lab compile --arch sm_90" in commands
