"""Project hygiene: notebook conventions, pins kept in step, the two commands, lint.

These read files rather than run code: committed notebooks carry no outputs and follow
the skeleton (a literal ``parameters`` cell, an ``exercise`` cell, ``check_…`` calls),
``environment.yml`` states what ``pyproject.toml`` states (torch and triton as ranges, the
Makefile's versions inside them), the README and CI use
``make workbook`` / ``make test``, no file holds an absolute path of the machine it was
written on, and ``ruff`` is clean.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
ALL_NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
# The workbook's NN_name and NNb_name notebooks (moe_lab.workbench.lab.notebook_files.NOTEBOOK_PATTERN).
WORKBOOK_NOTEBOOKS = sorted([*NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"),
                             *NOTEBOOKS_DIR.glob("[0-9][0-9][a-z]_*.ipynb")])
REQUIRED_PARAMETERS = ("PROFILE", "SEED", "SOLUTIONS")
# The oldest torch and triton moe_lab supports: ranges, so it installs beside a machine's own.
TESTED_RANGES = {"torch": ">=2.11", "triton": ">=3.6"}


def _ids(path: Path) -> str:
    return path.stem


def _read(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def _tags(cell: nbformat.NotebookNode) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _parse_code(source: str) -> ast.Module:
    """A code cell as Python, IPython magics (``%time``, ``!ls``) turned into calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return ast.parse(TransformerManager().transform_cell(source))


# ------------------------------------------------------------------------------ notebooks


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_ids)
def test_notebook_is_committed_without_outputs(path):
    notebook = _read(path)
    nbformat.validate(notebook)
    dirty = [
        index
        for index, cell in enumerate(notebook.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert dirty == [], (
        f"{path.name}: cells {dirty} hold outputs or execution counts; "
        "clear them (Kernel > Restart and Clear Outputs) before committing"
    )
    # nbformat 4.5 gives every cell an id (a cell added by a script must get one too).
    ids = [cell.get("id") for cell in _raw_cells(path)]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: cells without an id or sharing one"


def _raw_cells(path) -> list[dict]:
    import json

    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _is_literal(node: ast.AST) -> bool:
    """A constant, a signed number, or a list/tuple/set/dict built only of those."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        operand = node.operand
        return (
            isinstance(operand, ast.Constant)
            and isinstance(operand.value, (int, float, complex))
            and not isinstance(operand.value, bool)
        )
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(_is_literal(element) for element in node.elts)
    if isinstance(node, ast.Dict):
        return all(key is not None and _is_literal(key) for key in node.keys) and all(
            _is_literal(value) for value in node.values
        )
    return False


def parameter_assignments(source: str) -> dict[str, object]:
    """The names a parameters cell assigns and their values; ``ValueError`` if not literal."""
    assigned: dict[str, object] = {}
    for statement in ast.parse(source).body:
        if isinstance(statement, ast.Assign):
            targets, value = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            targets, value = [statement.target], statement.value
        else:
            raise ValueError(f"line {statement.lineno}: only `NAME = literal` lines are allowed")
        if not all(isinstance(target, ast.Name) for target in targets):
            raise ValueError(f"line {statement.lineno}: assign to plain names only")
        if not _is_literal(value):
            raise ValueError(
                f"line {statement.lineno}: {ast.unparse(value)!r} is not a literal; "
                "derived values go in the next cell"
            )
        for target in targets:
            assigned[target.id] = ast.literal_eval(value)
    return assigned


@pytest.mark.parametrize(
    "source",
    [
        'PROFILE = "smoke"\nSEED = 0\nSOLUTIONS = True\n',
        "X: int = -3\nY = (1, 2.5, 'a')\nZ = {'a': [1, -2]}\nA = B = None\n",
    ],
)
def test_literal_parameters_are_accepted(source):
    assert parameter_assignments(source)


@pytest.mark.parametrize(
    "source",
    [
        "N = 2 * 3",
        "import math",
        "X = math.pi",
        "X = [n for n in range(3)]",
        "X = f(1)",
        "a.b = 1",
        "X += 1",
        "X = -y",
        'print("hi")',
    ],
)
def test_non_literal_parameters_are_rejected(source):
    with pytest.raises(ValueError):
        parameter_assignments(source)


@pytest.mark.parametrize("path", WORKBOOK_NOTEBOOKS, ids=_ids)
def test_notebook_has_one_literal_parameters_cell(path):
    cells = [cell for cell in _read(path).cells if "parameters" in _tags(cell)]
    assert len(cells) == 1, f"{path.name}: {len(cells)} cells tagged 'parameters', expected 1"
    (cell,) = cells
    assert cell.cell_type == "code", f"{path.name}: the 'parameters' cell must be a code cell"
    try:
        values = parameter_assignments(cell.source)
    except ValueError as exc:
        pytest.fail(f"{path.name}: parameters cell: {exc}")
    missing = [name for name in REQUIRED_PARAMETERS if name not in values]
    assert missing == [], f"{path.name}: parameters cell lacks {missing}"
    assert values["PROFILE"] in ("smoke", "full"), f"{path.name}: PROFILE={values['PROFILE']!r}"
    assert isinstance(values["SOLUTIONS"], bool), f"{path.name}: SOLUTIONS must be True/False"
    assert isinstance(values["SEED"], int) and not isinstance(values["SEED"], bool)


def _check_calls(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name.startswith("check_"):
                names.append(name)
    return names


@pytest.mark.parametrize("path", WORKBOOK_NOTEBOOKS, ids=_ids)
def test_notebook_has_exercises_with_checks(path):
    notebook = _read(path)
    exercises = [cell for cell in notebook.cells if "exercise" in _tags(cell)]
    assert exercises, f"{path.name}: no cell tagged 'exercise' (the first exercise's code cell)"
    assert all(cell.cell_type == "code" for cell in exercises)
    calls = []
    for cell in notebook.cells:
        if cell.cell_type == "code":
            calls += _check_calls(_parse_code(cell.source))
    assert len(calls) >= 2, f"{path.name}: {len(calls)} calls to check_… functions, expected >= 2"


def test_check_calls_are_counted():
    tree = _parse_code("%matplotlib inline\nfrom m import check_a\ncheck_a(f)\nm.check_b(g)\n")
    assert _check_calls(tree) == ["check_a", "check_b"]


# ------------------------------------------------------------------------------ pins


def _pyproject_requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    requirements = [Requirement(line) for line in lines]
    return {canonicalize_name(req.name): req for req in requirements}


def _environment_pip_requirements() -> dict[str, Requirement]:
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    sections = [
        item["pip"]
        for item in environment["dependencies"]
        if isinstance(item, dict) and "pip" in item
    ]
    assert len(sections) == 1, "environment.yml: expected one pip: section"
    requirements = [Requirement(line) for line in sections[0] if not line.startswith("-")]
    return {canonicalize_name(req.name): req for req in requirements}


def test_environment_pins_match_pyproject():
    pyproject = _pyproject_requirements()
    environment = _environment_pip_requirements()
    shared = sorted(set(pyproject) & set(environment))
    assert shared, "environment.yml and pyproject.toml share no packages"
    mismatched = {
        name: (str(environment[name].specifier), str(pyproject[name].specifier))
        for name in shared
        if environment[name].specifier != pyproject[name].specifier
    }
    assert mismatched == {}, f"environment.yml vs pyproject.toml pins differ: {mismatched}"
    for name, spec in TESTED_RANGES.items():
        assert pyproject[name].specifier == SpecifierSet(spec), f"pyproject.toml: expected {name}{spec}"
        assert environment[name].specifier == SpecifierSet(spec), f"environment.yml: expected {name}{spec}"


def _constraints() -> dict[str, str]:
    """``name -> version`` of requirements/ci.txt, the tested set (every line ``name==version``)."""
    lines = [line.strip() for line in (ROOT / "requirements" / "ci.txt").read_text().splitlines()]
    pins = {}
    for line in lines:
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
        assert match, f"requirements/ci.txt: expected name==version, got {line!r}"
        pins[canonicalize_name(match[1])] = match[2]
    return pins


def _makefile_versions() -> dict[str, str]:
    text = (ROOT / "Makefile").read_text()
    versions = dict(re.findall(r"^(TORCH_VERSION|TRITON_VERSION|TRITON_OLDEST)\s*:=\s*(.+?)\s*$", text, re.M))
    # The versions set-up installs are the tested set's, read from it.
    pins = _constraints()
    for variable, name in (("TORCH_VERSION", "torch"), ("TRITON_VERSION", "triton")):
        assert versions.get(variable) == f"$(shell sed -n 's/^{name}==//p' $(CONSTRAINTS))", versions
        versions[variable] = pins[name]
    return versions


def test_the_makefile_installs_versions_inside_the_ranges_and_tests_the_oldest_triton():
    versions = _makefile_versions()
    assert set(versions) == {"TORCH_VERSION", "TRITON_VERSION", "TRITON_OLDEST"}, versions
    pyproject = _pyproject_requirements()
    packages = {"TORCH_VERSION": "torch", "TRITON_VERSION": "triton", "TRITON_OLDEST": "triton"}
    for variable, name in packages.items():
        specifier = pyproject[name].specifier
        assert specifier.contains(versions[variable]), (variable, versions[variable], str(specifier))
    # make test-compat runs the release the range starts from (3.6 -> 3.6.x), not a later one
    (lowest,) = [spec.version for spec in pyproject["triton"].specifier if spec.operator == ">="]
    assert versions["TRITON_OLDEST"].split(".")[:2] == lowest.split(".")[:2], (versions, lowest)


# What only the notebooks use: a project that imports moe_lab's layers must not get it.
NOTEBOOK_TOOLING = {"matplotlib", "ipywidgets", "ipykernel", "papermill", "nbconvert", "nbformat",
                    "jupyterlab", "tqdm", "latex2mathml"}


def test_runtime_requirements_are_ranges_without_notebook_tooling():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [Requirement(line) for line in project["dependencies"]]
    assert {canonicalize_name(r.name) for r in runtime} == {"torch", "triton", "numpy"}, runtime
    pinned = [str(r) for r in runtime if any(spec.operator in ("==", "===") for spec in r.specifier)]
    assert pinned == [], f"exact pins in the runtime requirements: {pinned}"
    # Triton publishes Linux wheels only: elsewhere the install goes on without it.
    (triton,) = [r for r in runtime if r.name == "triton"]
    assert triton.marker is not None
    assert triton.marker.evaluate({"platform_system": "Linux"})
    assert not triton.marker.evaluate({"platform_system": "Darwin"})
    assert not triton.marker.evaluate({"platform_system": "Windows"})
    extras = project["optional-dependencies"]
    notebooks = {canonicalize_name(Requirement(line).name) for line in extras["notebooks"]}
    assert notebooks <= NOTEBOOK_TOOLING and {"papermill", "ipykernel", "matplotlib"} <= notebooks


def test_the_tested_set_pins_every_package_inside_the_ranges():
    """requirements/ci.txt: one version of each package `make test` installs, each inside the
    range pyproject.toml states for it, and no pin of moe-lab itself."""
    pins = _constraints()
    pyproject = _pyproject_requirements()
    assert "moe-lab" not in pins
    # The [gpu] extra (Transformer Engine, for Blackwell) is not installed where the tests run.
    tested = set(pyproject) - {"moe-lab", "transformer-engine"}
    missing = sorted(name for name in tested if name not in pins)
    assert missing == [], f"requirements/ci.txt does not pin {missing}"
    outside = {name: (pins[name], str(req.specifier)) for name, req in pyproject.items()
               if name in pins and not req.specifier.contains(pins[name], prereleases=True)}
    assert outside == {}, f"requirements/ci.txt pins outside pyproject.toml's ranges: {outside}"


def test_environment_python_satisfies_requires_python():
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    pythons = [
        item.split("=", 1)[1].lstrip("=")
        for item in environment["dependencies"]
        if isinstance(item, str) and re.match(r"python\s*=", item)
    ]
    assert len(pythons) == 1, f"environment.yml: expected one python=X.Y, got {pythons}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(pythons[0]), (pythons[0], requires)


# ------------------------------------------------------------------------------ commands


def test_readme_names_the_two_commands():
    readme = ROOT / "README.md"
    assert readme.is_file(), "README.md is missing"
    text = readme.read_text(encoding="utf-8")
    for command in ("make workbook", "make test"):
        assert command in text, f"README.md does not mention `{command}`"


def test_ci_runs_make_test():
    script = ROOT / ".ci" / "run"
    commands = [
        line.strip()
        for line in script.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert any(re.match(r"make\s+test(\s|$)", command) for command in commands), commands
    # the second supported stack (the oldest triton) is tested in CI too
    assert any(re.match(r"make\s+test-compat(\s|$)", command) for command in commands), commands
    assert os.access(script, os.X_OK), ".ci/run must be executable"


# ------------------------------------------------------------------------------ files


def _project_files() -> list[Path]:
    """Tracked files, and new files git does not ignore (so a leak is caught before commit)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return [ROOT / name for name in sorted(set(listing.split("\0"))) if name]


# The workspace and home directories of the machines this was written on. Not preceded
# by a word character, so a URL path segment (".../owner/" + "work/...") does not count.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root)/")


def test_absolute_path_pattern():
    assert ABSOLUTE_PATH.search("cd " + "/" + "work/main")
    assert ABSOLUTE_PATH.search('"' + "/" + "root/.cache")
    assert not ABSOLUTE_PATH.search("https://example.org/team/" + "work/page")
    assert not ABSOLUTE_PATH.search("notebooks/" + "work/x")


def test_no_file_holds_an_absolute_path_of_this_machine():
    offenders = []
    for path in _project_files():
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
            if ABSOLUTE_PATH.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert offenders == [], "absolute paths in project files:\n" + "\n".join(offenders)


def test_ruff_is_clean():
    targets = [name for name in ("moe_lab", "tests", "scripts") if (ROOT / name).exists()]
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *targets],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
