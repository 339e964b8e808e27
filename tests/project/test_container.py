"""The container route (README, Where to run it): the Dockerfile and the dev container run the
Makefile's own set-up, so `make install` on a fresh clone (what `make workbook` runs first) is
what the image runs. No Docker daemon is needed here: these read the files; the build itself is
the Makefile's, tested on every fresh clone."""

import json
import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]


def _makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [tuple(line.split(None, 1)) for line in lines]


def test_the_image_runs_the_makefiles_set_up_and_serves_jupyterlab():
    steps = _dockerfile_instructions()
    base = [arg for op, arg in steps if op == "FROM"]
    assert len(base) == 1 and base[0].startswith("python:3.11"), base
    runs = [arg for op, arg in steps if op == "RUN"]
    apt = " ".join(r for r in runs if "apt-get install" in r)
    for package in ("make", "g++"):  # set-up, and the CPU plug-in's compiler (OpenMP)
        assert re.search(rf"(^|\s){re.escape(package)}(\s|$)", apt), (package, apt)
    make_runs = [r for r in runs if r.startswith("make ")]
    assert make_runs == ["make install"], runs
    assert "install" in _makefile_targets()
    # make install is the workbook's set-up: the [lab] extra, which brings JupyterLab.
    assert re.search(r"^install: \$\(VENV\)/\.installed-workbook$", (ROOT / "Makefile").read_text(), re.M)
    lab = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    assert any(req.startswith("jupyterlab") for req in lab), lab
    (cmd,) = [arg for op, arg in steps if op == "CMD"]
    argv = json.loads(cmd)
    assert argv[:2] == [".venv/bin/jupyter", "lab"] and "--ip=0.0.0.0" in argv, argv
    assert "--ServerApp.root_dir=notebooks" in argv and (ROOT / "notebooks").is_dir()
    assert ("EXPOSE", "8888") in steps and "--port=8888" in argv


def test_what_the_host_built_stays_out_of_the_image():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".venv-compat", "build"} <= ignored, ignored


def test_the_dev_container_builds_the_image_and_runs_make():
    config = json.loads((ROOT / ".devcontainer" / "devcontainer.json").read_text())
    build = config["build"]
    # Both relative to devcontainer.json's folder.
    assert (ROOT / ".devcontainer" / build["dockerfile"]).resolve() == (ROOT / "Dockerfile").resolve()
    assert (ROOT / ".devcontainer" / build["context"]).resolve() == ROOT.resolve()
    assert 8888 in config["forwardPorts"]
    targets = _makefile_targets()
    for key in ("postCreateCommand", "postAttachCommand"):
        command = config[key].split()
        assert command[0] == "make" and command[1] in targets, (key, command)
