"""Build moe_lab's wheel and use it as a user would, away from the checkout (`.ci/run` runs it).

    python scripts/wheel_check.py [--out build/wheel-check]

1. build the wheel from a copy of the project files (``pip wheel``, no dependencies, no network):
   the checkout is not touched;
2. check that it holds every C++ source of the CPU plug-in (``moe_lab/workbench/cpu``);
3. make a fresh virtual environment beside the torch this Python runs (a ``.pth`` line to its
   site-packages: nothing is reinstalled) and install the wheel into it, with no index;
4. in a folder outside the checkout, with the C++ build cache empty: build the CPU plug-in from
   the wheel's sources, register it, and run one MoE layer on its ``openmp`` backend against the
   ``torch`` backend, forward and backward.

Exit 0 with one line per step, or 1 with the step that failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import site
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_DIR = ROOT / "moe_lab" / "workbench" / "cpu"
CPP_SOURCES = sorted(p.relative_to(ROOT).as_posix() for p in CPU_DIR.glob("*") if p.suffix in (".cpp", ".h"))

# Run by the environment's Python in an empty folder: the wheel's moe_lab, not the checkout's.
SMOKE = """
import sys, torch
import moe_lab
from moe_lab import MoELayer, preset
from moe_lab.workbench import cpu
assert moe_lab.__file__.startswith(sys.prefix), f"moe_lab imported from {moe_lab.__file__}"
assert cpu.register(), cpu.status()
cfg = preset("tiny").moe
torch.manual_seed(0)
plugin = MoELayer(cfg, dispatcher="dropless", expert_backend="openmp")
plain = MoELayer(cfg, dispatcher="dropless", expert_backend="torch")
plain.load_state_dict(plugin.state_dict())
x = torch.randn(64, cfg.d_model)
xs = [x.clone().requires_grad_() for _ in range(2)]
outs = [layer(xi)[0] for layer, xi in zip((plugin, plain), xs)]
torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
for out in outs:
    out.square().sum().backward()
torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-4, atol=1e-5)
print(f"one MoE layer on the wheel's CPU plug-in (openmp) equals the torch backend, forward and "
      f"backward; moe_lab from {moe_lab.__file__}")
"""


def build_wheel(out: Path) -> Path:
    """The wheel of the project's files copied to a scratch folder (the checkout untouched)."""
    with tempfile.TemporaryDirectory() as scratch:
        src = Path(scratch) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "moe_lab", src / "moe_lab", ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                        "--wheel-dir", str(out), str(src)], check=True)
    (wheel,) = out.glob("moe_lab-*.whl")
    return wheel


def env_beside_this_python(env: Path) -> tuple[Path, Path]:
    """A fresh virtual environment at ``env`` that sees this Python's packages (torch, triton,
    pip) through a ``.pth`` line to their site-packages, as a GPU image's Python sees its own:
    ``(its python, its own site-packages)``."""
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.run([str(python), "-c", ask], check=True, capture_output=True,
                                  text=True).stdout.strip())
    (purelib / "beside.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python, purelib


def missing_sources(wheel: Path) -> list[str]:
    """The plug-in's C++ sources the wheel does not hold."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    return [name for name in CPP_SOURCES if name not in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "wheel-check",
                        help="folder for the wheel, the environment and the build cache (emptied first)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out == ROOT or (ROOT in out.parents and out.relative_to(ROOT).parts[0] != "build"):
        parser.error(f"--out: must lie outside the checkout or under its build/, got {args.out}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)

    wheel = build_wheel(out / "dist")
    print(f"1. built {wheel.name}")
    missing = missing_sources(wheel)
    if missing:
        print(f"2. FAILED: the wheel lacks {missing}", file=sys.stderr)
        return 1
    print(f"2. the wheel holds the plug-in's {len(CPP_SOURCES)} C++ sources")

    env = out / "venv"
    env_python, _ = env_beside_this_python(env)
    subprocess.run([str(env_python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    print(f"3. installed into a fresh environment beside this Python's torch ({env})")

    run = out / "run"
    run.mkdir()
    env_vars = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "MOE_LAB_NO_CPU_EXTENSION")}
    env_vars["TORCH_EXTENSIONS_DIR"] = str(out / "cache")  # built here from the wheel's sources
    smoke = subprocess.run([str(env_python), "-c", SMOKE], cwd=run, capture_output=True, text=True,
                           env=env_vars)
    if smoke.returncode != 0:
        print(f"4. FAILED:\n{smoke.stdout}{smoke.stderr}", file=sys.stderr)
        return 1
    print(f"4. {smoke.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
