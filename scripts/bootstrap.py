"""Set moe_lab up in a hosted notebook with a GPU: a Linux machine that brings its own PyTorch
and Jupyter. From a notebook cell, with this checkout beside the notebook:

    !python moe_lab/scripts/bootstrap.py

1. read the torch and triton this Python has, and stop where torch is missing or older than
   moe_lab supports (pyproject.toml's ranges);
2. install moe_lab from this checkout (editable) with the notebooks' tooling (the ``notebooks``
   extra; ``--lab`` adds JupyterLab), pip held to the installed torch and triton by a
   constraints file written from their metadata: neither is reinstalled nor replaced;
3. check that the torch found afterwards is the one found before, and report the machine and
   the path each notebook takes on it (its Triton cells compiled for this GPU, interpreted, or
   labelled where Triton is absent; MXFP8 on native tensor cores or emulated).

Exit 0 when moe_lab is ready, 1 with the reason otherwise. Then open ``moe_lab/notebooks``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run in a fresh Python once moe_lab is installed: what this machine gives each notebook.
REPORT = r"""
import json, re, sys
from pathlib import Path
from moe_lab.perf.capabilities import capabilities

caps = capabilities()
arch = f"sm_{caps.cuda_capability[0]}{caps.cuda_capability[1]}" if caps.cuda_capability else None
triton = {"compiled": f"Triton kernels compiled for {arch}",
          "interpreted": "Triton kernels interpreted on the CPU (correct, not fast)",
          "absent": "Triton cells labelled and skipped (Triton is not installed)"}[caps.triton_mode]
print(caps.summary())
for path in sorted(Path(sys.argv[1]).glob("[0-9][0-9]_*.ipynb")):
    code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                     if c["cell_type"] == "code")
    ways = []
    if re.search(r"^\s*(import triton|from moe_lab\.kernels\b|# needs Triton)", code, re.M):
        ways.append(triton)
    if "mxfp8" in code.lower():
        ways.append("MXFP8 on native tensor cores" if caps.native_mxfp8 else "MXFP8 emulated")
    ways.append(f"PyTorch on {caps.device}")
    print(f"  {path.stem:<28} {'; '.join(ways)}")
"""


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def _lowest(name: str) -> str:
    """The ``>=`` bound pyproject.toml gives ``name`` in the runtime requirements."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(rf'"{name}>=([\d.]+)', text)
    if match is None:
        raise SystemExit(f"bootstrap: pyproject.toml names no lower bound for {name}")
    return match[1]


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def torch_file(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__file__)"], check=True,
                          capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lab", action="store_true", help="install JupyterLab too (the lab extra)")
    args = parser.parse_args(argv)

    torch_version, triton_version = installed("torch"), installed("triton")
    if torch_version is None:
        print("bootstrap: this Python has no torch. A hosted GPU notebook brings one; elsewhere use "
              "`make workbook` (README, Where to run it)", file=sys.stderr)
        return 1
    for name, version in (("torch", torch_version), ("triton", triton_version)):
        if version is not None and _version_tuple(version) < _version_tuple(_lowest(name)):
            print(f"bootstrap: {name} {version} is older than moe_lab supports ({name}>={_lowest(name)}); "
                  f"pick a newer runtime image", file=sys.stderr)
            return 1
    before = torch_file(sys.executable)
    print(f"1. torch {torch_version}" + (f", triton {triton_version}" if triton_version else ", no triton")
          + f" ({Path(before).parent})")

    extras = "lab" if args.lab else "notebooks"
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pins:
        pins.write(f"torch=={torch_version}\n" + (f"triton=={triton_version}\n" if triton_version else ""))
    # editable_mode=compat: the checkout goes on sys.path, so that a notebook beside the clone (a
    # folder named moe_lab in its working directory) imports the package, not the clone's folder.
    command = [sys.executable, "-m", "pip", "install", "--quiet", "-c", pins.name,
               "--config-settings", "editable_mode=compat", "-e", f"{ROOT}[{extras}]"]
    print("2. " + " ".join(command[2:]))
    if subprocess.run(command).returncode != 0:
        print("bootstrap: pip could not install moe_lab beside this torch (see above)", file=sys.stderr)
        return 1

    after = torch_file(sys.executable)
    if after != before or installed("torch") != torch_version:
        print(f"bootstrap: torch changed during the install ({before} -> {after})", file=sys.stderr)
        return 1
    print("3. torch untouched; what each notebook runs on here:")
    return subprocess.run([sys.executable, "-c", REPORT, str(ROOT / "notebooks")], text=True).returncode


if __name__ == "__main__":
    sys.exit(main())
