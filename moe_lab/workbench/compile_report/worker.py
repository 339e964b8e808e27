"""The compile process of the compile report: it compiles kernels for a GPU and reads them.

`moe_lab.workbench.compile_report.report` starts this in a child process whose environment says
``TRITON_INTERPRET=0`` (so moe_lab's kernels, and a notebook's ``@triton.jit`` ones, are
compilable even on a machine without CUDA), with a fresh Triton cache and
``TRITON_ALWAYS_COMPILE`` (so the compile time is a cold compile's) and ``ptxas``'s log
switched on (so ptxas's own account of registers, stack and shared memory can be compared
with ``cuobjdump``'s).

A request names the kernel modules whose specs to compile
(`moe_lab.workbench.compile_report.specs`), or one kernel (its source included when it was
defined in a notebook), and the architectures. Every spec × architecture gives one row: the
figures, or an error row saying what failed — a module without specs, a selection that
matches none, a compile that fails. (That every launched kernel has a spec is the tests'
check: ``tests/workbench/compile_report``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import re
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from moe_lab.kernels.launch import LaunchConfig
from moe_lab.perf.hardware import ARCHS, gpu_arch
from moe_lab.workbench.compile_report import reading
from moe_lab.workbench.compile_report.specs import CompileSpec, for_module

SCALARS = (int, float, bool, str, type(None))


def parse_archs(text: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """``"sm_90,sm_100"`` (or a list of names) → ``("sm_90", "sm_100")``, each checked."""
    names = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a.strip()]
    if not names:
        raise ValueError(f"arch must name at least one of {sorted(ARCHS)}, got {text!r}")
    for name in names:
        gpu_arch(name)
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"arch names {', '.join(twice)} more than once ({text!r}): every row and ledger "
                         "record would be written twice")
    return tuple(names)


def triton_signature(fn: Any, kernel: str, signature: dict[str, str], constexprs: dict[str, Any]
                     ) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int], list], list[str]]:
    """What ``ASTSource`` takes for ``fn``: the signature (every argument in order,
    constexprs as ``"constexpr"``), the constexpr values (the kernel's defaults filled in),
    the divisibility attributes (pointers, and integers written ``"i32:16"``), and the
    names of the arguments taken as divisible by 16."""
    params = inspect.signature(fn.fn).parameters
    unknown = sorted((set(signature) | set(constexprs)) - set(params))
    if unknown:
        raise ValueError(f"CompileSpec of {kernel} names {unknown}, which are not arguments of it")
    sig, values, attrs, divisible = {}, dict(constexprs), {}, []
    for index, (name, param) in enumerate(params.items()):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in signature:
            ty, _, hint = signature[name].partition(":")
            if hint not in ("", "16"):
                raise ValueError(f"CompileSpec.signature[{name!r}] of {kernel} must be a Triton type, "
                                 f"optionally with ':16', got {signature[name]!r}")
            sig[name] = ty
            if ty.startswith("*") or hint == "16":
                attrs[(index,)] = [["tt.divisibility", 16]]
                divisible.append(name)
        elif param.default is not inspect.Parameter.empty:
            sig[name], values[name] = "constexpr", param.default
        else:
            raise ValueError(f"CompileSpec of {kernel} gives no type or constexpr value "
                             f"for argument {name!r}")
    return sig, values, attrs, divisible


def identity(spec: CompileSpec, arch: str) -> dict[str, Any]:
    """The fields of a row that say what was compiled, for which architecture, how."""
    return {
        "kernel": spec.kernel, "label": spec.label, "arch": arch, "gpu": gpu_arch(arch).gpu,
        "blocks": {k: spec.constexprs_for(arch).get(k, v) for k, v in spec.config_for(arch).blocks.items()},
        "num_warps": spec.config_for(arch).num_warps,
        "num_stages": spec.config_for(arch).num_stages, "note": spec.note,
        "constexprs": {k: v if isinstance(v, SCALARS) else str(v)
                       for k, v in spec.constexprs_for(arch).items()},
    }


def compile_spec(fn: Any, spec: CompileSpec, arch: str, cubin_dir: str | None = None) -> dict[str, Any]:
    """Compile ``spec`` (its kernel ``fn``, a compiled ``@jit`` function) for ``arch`` in this
    process and read the result into one report row; keep the cubin in ``cubin_dir`` when
    given. Triton must have been imported here with ``TRITON_INTERPRET=0`` and
    ``TRITON_DUMP_PTXAS_LOG=1``."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    limits = gpu_arch(arch)
    config = spec.config_for(arch)
    sig, constexprs, attrs, divisible = triton_signature(fn, spec.kernel, spec.signature,
                                                          spec.constexprs_for(arch))
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):  # where Triton prints ptxas's -v log
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", limits.capability, 32),
                                  options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    seconds = time.perf_counter() - start
    meta, ptx = compiled.metadata, compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:  # cuobjdump -res-usage reads the cubin from a file
        cubin = Path(cubin_dir or tmp) / f"{arch}-{meta.name}-{meta.hash[:12]}.cubin"
        cubin.parent.mkdir(parents=True, exist_ok=True)
        cubin.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", str(cubin)],
                             capture_output=True, text=True, check=True).stdout
    res = reading.parse_res_usage(out)[meta.name]
    ptxas = reading.parse_ptxas_log(log.getvalue())
    # On sm_90 and later ptxas places the system's reserved kilobyte in the cubin of a kernel
    # that uses shared memory, and leaves it out of its log: the difference must be that or 0.
    reserved = res["SHARED"] - ptxas["shared_bytes"]
    # A warp-specialised loop adds its partitions' warps to the block (Triton rounds it up to
    # whole warpgroups): a launch runs meta.num_warps warps, as the PTX's .reqntid says, and
    # the occupancy counts those; without it they are the config's.
    specialised = "ttg.warp_specialize" in compiled.asm["ttgir"]
    threads = re.search(r"\.reqntid (\d+)", ptx)
    checks = {  # [what the report shows (cuobjdump, the spec), the second account (ptxas, metadata)]
        "registers": [res["REG"], ptxas["registers"]],
        "stack_bytes": [res["STACK"], ptxas["stack_bytes"]],
        "shared_reserved": [reserved, limits.reserved_shared_per_block if reserved else 0],
        "num_warps": [config.num_warps, min(meta.num_warps, config.num_warps) if specialised
                      else meta.num_warps],
        "block_threads": [meta.num_warps * 32, int(threads.group(1)) if threads else None],
        "num_stages": [config.num_stages, meta.num_stages],
    }
    mma = reading.mma_instructions(ptx)
    copies = reading.async_copies(ptx)
    return {
        **identity(spec, arch), "registers": res["REG"], "spill_bytes": ptxas["spill_store_bytes"],
        "stack_bytes": res["STACK"], "local_bytes": res["LOCAL"], "shared_static": res["SHARED"],
        "shared_dynamic": meta.shared,
        "shared_bytes": res["SHARED"] + meta.shared,  # static (in the cubin) + dynamic (at launch)
        "tmem_columns": getattr(meta, "tmem_size", 0), "block_warps": meta.num_warps,
        "warp_specialized": specialised,
        # A persistent grid: a loop of the kernel steps by the number of programs (each program
        # walks tiles pid, pid + programs, ...); reading the number alone (a rasterisation) is not.
        "persistent": any(re.search(rf"scf\.for [^\n]* step {re.escape(v)}\b", compiled.asm["ttir"])
                          for v in re.findall(r"(%\w+) = tt\.get_num_programs", compiled.asm["ttir"])),
        **reading.occupancy(res["REG"], ptxas["shared_bytes"] + meta.shared, meta.num_warps, limits),
        "mma_class": mma["class"], "mma_kinds": mma["kinds"], "mma_count": mma["count"],
        "block_scaled": mma["block_scaled"], "fp8_upcasts": mma["fp8_upcasts"],
        # A matrix product in the kernel's Triton IR (``tt.dot`` or ``tt.dot_scaled``): what
        # makes it GEMM-like, whatever instruction it became.
        "has_dot": "tt.dot" in compiled.asm["ttir"],
        "async_copy": copies["kind"], "copies": copies, "loop": reading.loop_sketch(ptx),
        "divisible_by_16": divisible, "compile_s": round(seconds, 3), "ptxas": ptxas, "checks": checks,
        "agree": all(a == b for a, b in checks.values()),
        "cubin": str(cubin) if cubin_dir is not None else None, "error": None,
    }


def error_row(kernel: str, label: str, arch: str | None, message: str) -> dict[str, Any]:
    """A row that says what could not be compiled, and why."""
    return {"kernel": kernel, "label": label, "arch": arch, "error": message}


def inline_kernel(inline: dict[str, Any]) -> Any:
    """Re-create a kernel defined in a notebook from its source and the globals it uses, in
    a file of its own so that Triton can read its source back."""
    import triton
    import triton.language as tl

    path = Path(tempfile.mkdtemp(prefix="moe_lab_inline_")) / f"{inline['name']}.py"
    path.write_text(inline["source"])
    module = types.ModuleType(f"moe_lab_inline_{inline['name']}")
    module.__file__ = str(path)
    module.__dict__.update(triton=triton, tl=tl)
    for name, (kind, value) in inline["globals"].items():  # a module (by its name) or a plain value
        module.__dict__[name] = importlib.import_module(value) if kind == "module" else value
    sys.modules[module.__name__] = module
    exec(compile(inline["source"], str(path), "exec"), module.__dict__)
    return module.__dict__[inline["name"]]


def _collect(job: dict[str, Any]) -> tuple[list[tuple[Any, CompileSpec]], list[dict[str, Any]]]:
    """One job of a request → (kernel, spec) pairs to compile, and error rows."""
    if "spec" in job:
        raw = job["spec"]
        try:
            spec = CompileSpec(raw["kernel"], raw["label"], raw["signature"], raw["constexprs"],
                               LaunchConfig(**raw["config"]), raw.get("note", ""))
            return [(inline_kernel(job["inline"]) if job.get("inline") else None, spec)], []
        except Exception as exc:  # a kernel that cannot be rebuilt is a row of the report, not its end
            return [], [error_row(raw["kernel"], raw["label"], None, f"{type(exc).__name__}: {exc}")]
    # A kernel module's specs (`moe_lab.workbench.compile_report.specs.for_module`), narrowed by
    # the job's ``select`` (``kernel``: a function name, ``label_contains``, then the first
    # ``limit``), or an error row: no specs, a broken module, none selected.
    module_name, select = job["module"], job["select"]
    try:
        specs = for_module(module_name)
    except Exception as exc:  # no specs, or a broken module: a row of the report, not its end
        why = str(exc) if isinstance(exc, ValueError) else f"{module_name}: {type(exc).__name__}: {exc}"
        return [], [error_row(module_name, "(module)", None, why)]
    specs = [s for s in specs if select["kernel"] in (None, s.kernel.partition(":")[2])
             and (select["label_contains"] or "") in s.label][: select["limit"]]
    if not specs:
        why = f"no CompileSpec of {module_name} matches {select}"
        return [], [error_row(module_name, "(module)", None, why)]
    return [(None, spec) for spec in specs], []


def _compile_row(fn: Any, spec: CompileSpec, arch: str, cubin_dir: str | None, count: str) -> dict[str, Any]:
    """`compile_spec`, or an error row when it fails; a progress line either way."""
    try:
        module_name, _, name = spec.kernel.partition(":")  # the compiled @triton.jit function it names
        row = compile_spec(fn or getattr(importlib.import_module(module_name), name), spec, arch, cubin_dir)
    except Exception as exc:  # a failed compile is a row of the report, not its end
        row = {**identity(spec, arch),
               **error_row(spec.kernel, spec.label, arch, f"{type(exc).__name__}: {str(exc)[:2000]}")}
    done = (f"FAILED {row['error'][:300]}" if row["error"] else f"{row['registers']} registers, "
            f"{row['mma_class']}, {row['async_copy']}, {row['compile_s']:.1f} s")
    print(f"{count} {arch:<6} {spec.kernel} ({spec.label}): {done}", file=sys.stderr, flush=True)
    return row


def run_request(request: dict[str, Any]) -> dict[str, Any]:
    """Carry out one compile request in this process, for each of its ``archs``. Its
    ``jobs``: ``{"module": name, "select": {...}}`` (a kernel module's specs, see `_collect`)
    or ``{"spec": {...}, "inline": {...}}`` (one kernel; ``inline`` its source when it was
    defined outside moe_lab). The cubins are kept in ``cubin_dir`` when the request names one."""
    import triton

    archs = request["archs"]  # checked by the caller (`parse_archs`)
    collected = [_collect(job) for job in request["jobs"]]
    total = sum(len(pairs) for pairs, _ in collected) * len(archs)
    rows: list[dict[str, Any]] = []
    refused: list[dict[str, str]] = []  # what a launch there refuses: not compiled
    number = 0
    for pairs, errors in collected:  # rows in job order: a job's errors, then its compiles
        rows += errors
        for fn, spec in pairs:
            for arch in archs:
                number += 1
                if not getattr(gpu_arch(arch), spec.needs):
                    refused.append({"kernel": spec.kernel, "label": spec.label, "arch": arch,
                                    "needs": spec.needs})
                    continue
                rows.append(_compile_row(fn, spec, arch, request.get("cubin_dir"), f"[{number}/{total}]"))
    return {"archs": list(archs), "triton": triton.__version__,
            "limits": {arch: dataclasses.asdict(gpu_arch(arch)) for arch in archs}, "rows": rows,
            "refused": refused}


def main() -> None:
    """``python -c "…main()" REQUEST.json RESULT.json``: read a request, write the result."""
    result = run_request(json.loads(Path(sys.argv[1]).read_text()))
    Path(sys.argv[2]).write_text(json.dumps(result))
