"""Builds moe_lab's C++ CPU kernels once per machine and hands out the module.

One extension holds them all: the grouped GEMM and fused expert MLP of the ``openmp``
expert backend (``cpu_grouped_gemm.cpp``, wrapped by `moe_lab.workbench.cpu.grouped`), the
fused causal attention (``cpu_attention.cpp``, wrapped by `moe_lab.workbench.cpu.attention`),
the dropless layout's token permutation (``cpu_permute.cpp``, wrapped by
`moe_lab.workbench.cpu.permute`) and the clipped AdamW step (``cpu_optim.cpp``, wrapped by
`moe_lab.workbench.cpu.optim`); ``cpu_module.cpp`` binds them, ``cpu_bf16.h`` holds the
bfloat16 GEMM helpers the attention and the expert MLP share. ``torch.utils.cpp_extension``
compiles them on first use (about 80 s on 2 cores) and caches the result under
``~/.cache/moe_lab/extensions`` (or ``$TORCH_EXTENSIONS_DIR``), keyed by the sources, the
torch version and installation (each environment its own folder) and the compiler flags:
the vector instruction set ATen uses on this CPU
(``torch.backends.cpu.get_cpu_capability()``: the kernels' elementwise loops are compiled for
it) and whether it has AVX512_BF16 (`_flags`), so a cache shared by different machines
never hands one a build it cannot run. ``make install`` builds it ahead
(``python -m moe_lab.workbench.cpu``). A build, or a rebuild over an old one (ninja finds a
source or a torch header newer than it: `rebuild_reason`), is announced, with its reason,
before it starts.

It needs a C++ compiler with OpenMP, the same one ``torch.compile`` needs on a CPU. Without
one, `unavailable_reason` says why, `extension` raises with it, and every caller has a
plain-PyTorch path (the ``torch`` expert backend, the ``sdpa`` attention). Setting
``MOE_LAB_NO_CPU_EXTENSION`` switches the extension off, to try those paths.

Builds and loads hold an operating-system lock on the build folder (`build_guard`).
``torch.utils.cpp_extension`` guards the folder with a plain ``lock`` file that a killed
build leaves behind, after which every later load waits on it forever without a word; the
operating system drops our lock when its holder dies, so a ``lock`` file found while holding
it is stale and is removed. Waiting on a live builder is reported, and given up after
`WAIT_LIMIT_S`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from moe_lab.perf.capabilities import cpuinfo
from moe_lab.workbench.filelock import file_lock

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("cpu_grouped_gemm.cpp", "cpu_attention.cpp", "cpu_permute.cpp",
                                         "cpu_optim.cpp", "cpu_module.cpp"))
# Headers the sources include: not compiled on their own, but part of the cache key.
HEADERS = (HERE / "cpu_bf16.h",)

# Compiler flags for ATen's vector types (at::vec) per CPU capability, as ATen builds its
# own kernels; anything else gets the portable scalar fallback of at::vec.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}

# How long a load waits for another live process that is building in the same folder.
WAIT_LIMIT_S = 900.0

_lock = threading.Lock()
_ext = None
_error: str | None = None


def _flags() -> list[str]:
    """The compiler flags: those of the vector instruction set ATen dispatches to on this CPU
    (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...), and ``-mavx512bf16`` where the CPU has the
    AVX512_BF16 instructions (``avx512_bf16`` among Linux's ``/proc/cpuinfo`` flags, as
    `moe_lab.perf.capabilities` reads them): the kernels then round float32 to bfloat16 with
    them (one instruction per 32 values; see ``cpu_bf16.h``), elsewhere ATen's conversion serves."""
    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(capability, [])]
    if capability == "AVX512" and "avx512_bf16" in cpuinfo()[1]:
        flags.append("-mavx512bf16")
    return flags


def _name_and_dir() -> tuple[str, Path]:
    key = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key += torch.__version__.encode() + " ".join(_flags()).encode()
    # The environment too: two virtual environments with the same torch compile against
    # different include paths, and torch rebuilds whenever its build command changes, so a
    # shared folder would be rebuilt by each in turn (under the lock, for minutes).
    key += str(Path(torch.__file__).resolve().parent).encode()
    # And where the sources are: two checkouts of the same sources (a worktree, a scratch
    # copy) give ninja other paths to compile, so one folder would be rebuilt by each in turn.
    key += str(SOURCES[0].resolve().parent).encode()
    name = f"moe_lab_cpu_kernels_{hashlib.sha1(key).hexdigest()[:12]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "moe_lab" / "extensions"
    return name, Path(root) / name


@contextlib.contextmanager
def build_guard(build_dir: Path) -> Iterator[None]:
    """Hold an exclusive operating-system lock on ``build_dir`` (`moe_lab.workbench.filelock`
    on ``moe_lab.lock`` inside it, which then names this process) for a build or load there,
    and remove the stale ``lock`` file of ``torch.utils.cpp_extension`` that a killed build
    left behind.

    Waits for another process holding the lock, naming it after 2 s and every 30 s; raises
    ``TimeoutError`` naming the folder after `WAIT_LIMIT_S`."""
    path = build_dir / "moe_lab.lock"

    def refuse(holder: str) -> TimeoutError:
        return TimeoutError(f"{holder} has been holding {path} for over {WAIT_LIMIT_S:.0f} s while it builds "
                            f"or loads moe_lab's CPU kernels; wait for it to end or stop it")

    with file_lock(path, refuse, WAIT_LIMIT_S, f"{path} while it builds or loads the CPU kernels"):
        baton = build_dir / "lock"
        if baton.exists():
            print(f"moe_lab: removing {baton}, left behind by a build that was killed",
                  file=sys.stderr, flush=True)
            baton.unlink(missing_ok=True)
        yield


def extension():
    """The built extension module; built on first use.

    Raises ``RuntimeError`` naming the cause when it cannot be built (and remembers that, so
    it is tried once per process)."""
    global _ext, _error
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is not None:
            return _ext
        if _error is not None:
            raise RuntimeError(_error)
        if os.environ.get("MOE_LAB_NO_CPU_EXTENSION"):
            _error = ("moe_lab's CPU kernels are switched off (MOE_LAB_NO_CPU_EXTENSION is set); "
                      "use expert_backend='torch' and attention_impl='sdpa'")
            raise RuntimeError(_error)
        from torch.utils.cpp_extension import load

        name, build_dir = _name_and_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            with build_guard(build_dir):
                # Asked under the lock: a build another process just finished is loaded, not redone.
                _say_what_the_load_builds(name, build_dir)
                _ext = load(name, [str(path) for path in SOURCES], extra_cflags=_flags(),
                            extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        except Exception as exc:  # compiler missing, no OpenMP, another build that never ends...
            reason = str(exc).strip().splitlines()
            _error = (f"moe_lab's CPU kernels could not be built ({type(exc).__name__}: "
                      f"{reason[-1] if reason else ''}); they need a C++ compiler with OpenMP. "
                      f"Use expert_backend='torch' and attention_impl='sdpa' instead")
            raise RuntimeError(_error) from exc
        return _ext


def kernel_op(name: str, entry: str, fake: Callable, *constants: object,
              mutates_args: tuple[str, ...] = ()):
    """The extension's function ``entry`` as the custom op ``moe_lab::<name>``: its signature
    and fake implementation (output shapes, for ``torch.compile`` and the sync detector) are
    ``fake``'s; ``constants`` are passed after the op's own arguments; ``mutates_args`` names
    the arguments it writes in place; the list the C++ side returns for several tensors comes
    back as a tuple."""

    def kernel(*args):
        out = getattr(extension(), entry)(*args, *constants)
        return tuple(out) if isinstance(out, list) else out

    schema = torch.library.infer_schema(fake, mutates_args=mutates_args)
    op = torch.library.custom_op(f"moe_lab::{name}", kernel, mutates_args=mutates_args, schema=schema)
    op.register_fake(fake)
    return op


def _say_what_the_load_builds(name: str, build_dir: Path) -> None:
    """Say, before it starts, that loading will compile for a minute or more, and why: no
    build yet, or one that ninja will redo (`rebuild_reason`). Progress, not a problem:
    stdout (a failed build raises, naming its cause)."""
    if not any(build_dir.glob(f"{name}*.so")):
        print("moe_lab: building the CPU kernels (C++/OpenMP, once per machine, about a minute)...",
              flush=True)
    elif (reason := rebuild_reason(build_dir)) is not None:
        print(f"moe_lab: rebuilding the CPU kernels in {build_dir} ({reason}; about a minute)...",
              flush=True)


def rebuild_reason(build_dir: Path) -> str | None:
    """Why ninja would compile again in ``build_dir``, which holds an earlier build (a source
    or a torch header newer than it, say after a reinstall or a checkout), in words; None
    where it has nothing to do or cannot tell. Asks ninja itself (``ninja -n -d explain``: a
    dry run, nothing built), so the answer is the build's own."""
    ninja = shutil.which("ninja")
    if ninja is None or not (build_dir / "build.ninja").exists():
        return None
    try:
        dry = subprocess.run([ninja, "-n", "-d", "explain", "-C", str(build_dir)],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if dry.returncode != 0 or "no work to do" in dry.stdout:
        return None
    notes = [line.removeprefix("ninja explain: ") for line in dry.stderr.splitlines()
             if line.startswith("ninja explain: ")]
    for note in notes:  # "output X older than most recent input Y (t1 vs t2)"
        if (match := re.match(r"output (\S+) older than most recent input (\S+)", note)):
            return f"{match[2]} is newer than the {match[1]} built from it"
    return notes[0] if notes else "ninja has work to do"


@torch.compiler.assume_constant_result
def bf16_gemms() -> bool:
    """Whether ATen's bfloat16 GEMMs (oneDNN's micro-kernels for this CPU's instruction set)
    run here: where they do, the attention and the expert MLP take bfloat16 operands as they
    are; where not, they widen them to float32 or use ATen's GEMM. Asked of the built kernels
    once; a constant to ``torch.compile`` (the extension's own call would break the graph)."""
    global _bf16_gemms
    if _bf16_gemms is None:
        _bf16_gemms = bool(extension().bf16_gemms())
    return _bf16_gemms


_bf16_gemms: bool | None = None


def compiler() -> str | None:
    """The C++ compiler ``torch.utils.cpp_extension`` would call (``$CXX`` or ``c++``), or None."""
    return shutil.which(os.environ.get("CXX", "c++"))


def unavailable_reason() -> str | None:
    """Why the C++ kernels are not available here, or None when they are (builds them if
    need be)."""
    try:
        extension()
    except RuntimeError as exc:
        return str(exc)
    return None


def main() -> int:
    """Build ahead (``make install``); a failure is reported, not fatal: the plain-PyTorch
    paths still work."""
    reason = unavailable_reason()
    if reason is None:
        print(f"moe_lab: CPU kernels ready ({_name_and_dir()[1]}, {torch.backends.cpu.get_cpu_capability()})")
    else:
        print(f"moe_lab: {reason} (the 'torch' expert backend and 'sdpa' attention still work)",
              file=sys.stderr)
    return 0
