"""The compile report: every Triton kernel compiled for Hopper and Blackwell without a GPU.
`specs` says what each kernel module's launches compile, `report` drives it, `worker` compiles
in a child process, `reading` reads the binaries. `check_modules` imports none of them (nor
torch): a command refuses a typo before its first heavy import."""

from __future__ import annotations

from pathlib import Path

SPECS = Path(__file__).resolve().parent / "specs"


def known_modules() -> list[str]:
    """The kernel modules that have compile specs (``specs/<name>.py`` describes
    ``moe_lab.kernels.<name>``), read off the folder: nothing is imported."""
    return sorted(f"moe_lab.kernels.{p.stem}" for p in SPECS.glob("*.py") if p.stem != "__init__")


def check_modules(modules: list[str]) -> None:
    """Refuse, before anything is compiled or written, ``modules`` naming a module without
    compile specs (a typo) or one twice, naming the known ones."""
    known = known_modules()
    unknown = [m for m in modules if m not in known]
    if unknown or not modules:
        names = ", ".join(m.rpartition(".")[2] for m in known)
        raise ValueError(f"modules must name kernel modules with compile specs, got {unknown or modules}; "
                         f"known: {names} (each moe_lab.kernels.<name>)")
    twice = sorted({m for m in modules if modules.count(m) > 1})
    if twice:
        raise ValueError(f"modules names {', '.join(twice)} more than once: every row and ledger "
                         "record would be written twice")
