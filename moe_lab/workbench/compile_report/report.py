"""The compile report: every Triton kernel compiled for Hopper and Blackwell, without a GPU.

Triton can compile for a GPU that is not there: ``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))`` runs the whole pipeline to PTX and a cubin with the
``ptxas`` bundled in the Triton wheel. The report compiles each kernel module's specs
(`moe_lab.workbench.compile_report.specs`: a `CompileSpec` is a kernel at the block sizes,
warps and stages its wrapper picks, at DeepSeek-V3's and GPT-OSS-20B's shapes) for each
architecture and reads the result (`moe_lab.workbench.compile_report.reading`): registers per thread,
spilled bytes, shared memory, theoretical occupancy on an H200 (sm_90) or B200 (sm_100) SM,
the tensor-core instruction class, whether operands arrive by async copy, the loop they sit
in, and how long a cold compile took. It is what a kernel's review reads: a GEMM whose PTX
shows no ``wgmma``/``tcgen05.mma`` or no async copies will not reach the tensor cores' speed,
whatever the interpreter says about its numerics.

Compiling needs the kernels made compiled, which on a machine without CUDA means
``TRITON_INTERPRET=0`` before they are defined (moe_lab's rule,
`moe_lab.perf.capabilities.interprets_triton`; a notebook's own kernels are interpreted there);
so every compile runs in a child process (`moe_lab.workbench.compile_report.worker`), which works
the same from the command line, from ``make`` and from a notebook. Registers, stack and static
shared memory are read off the cubin by ``cuobjdump -res-usage`` and compared with ptxas's own
log of the same compile (``agree``).

How a spec mirrors a launch: a CUDA launch specializes the kernel on its arguments and the
compile must see the same. Pointers are taken as 16-byte aligned (as every tensor torch
allocates is); an integer a launch sees divisible by 16 is written ``"i32:16"`` in the spec's
signature (the notation of Triton's ahead-of-time compiler); an integer equal to 1 (a unit
stride) is a constexpr, as a launch makes it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
from pathlib import Path
from typing import Any, TextIO

from moe_lab.kernels.launch import LaunchConfig
from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.compile_report import known_modules
from moe_lab.workbench.compile_report.worker import SCALARS, parse_archs
from moe_lab.workbench.measure import ledger

DEFAULT_ARCHS = ("sm_90", "sm_100")
# The fields of a row a ledger record carries besides its figure (theoretical warps per SM).
LEDGER_FIELDS = ("kernel", "label", "arch", "blocks", "num_warps", "num_stages", "registers", "spill_bytes",
                 "shared_bytes", "blocks_per_sm", "limiter", "mma_class", "mma_kinds", "async_copy",
                 "compile_s", "agree")


def run_in_child(request: dict[str, Any], timeout_s: float = 1800.0,
                 progress: TextIO | None = None) -> dict[str, Any]:
    """Run ``request`` (`moe_lab.workbench.compile_report.worker.run_request`) in a child process with
    ``TRITON_INTERPRET=0``, a fresh Triton cache, every kernel recompiled and ptxas's log
    on; the child's progress lines are copied to ``progress`` as they come (default: this
    process's stderr, so a command's standard output holds only its report)."""
    import moe_lab

    with tempfile.TemporaryDirectory(prefix="moe_lab_compile_") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        root = str(Path(moe_lab.__file__).resolve().parents[1])
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(Path(tmp) / "cache"),
               "TRITON_ALWAYS_COMPILE": "1", "TRITON_DUMP_PTXAS_LOG": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        code = "from moe_lab.workbench.compile_report.worker import main; main()"
        child = subprocess.Popen([sys.executable, "-c", code, str(request_path), str(result_path)],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout_s, child.kill)
        timer.start()
        tail: list[str] = []
        try:
            for line in child.stdout:
                (progress or sys.stderr).write(line)
                tail = (tail + [line])[-40:]
            child.wait()
        finally:
            timer.cancel()
            if child.poll() is None:  # interrupted (Ctrl-C, an error here): no orphaned compile
                child.kill()
                child.wait()
        if child.returncode != 0 or not result_path.exists():
            raise RuntimeError(f"the compile process exited with code {child.returncode} "
                               f"(timeout_s={timeout_s}); its last lines:\n" + "".join(tail))
        return json.loads(result_path.read_text())


def compile_report(archs: tuple[str, ...] = DEFAULT_ARCHS,
                   modules: list[str] | None = None) -> dict[str, Any]:
    """The report of ``modules`` (default: every kernel module with compile specs,
    `moe_lab.workbench.compile_report.known_modules`) for ``archs`` (checked: `parse_archs`):
    ``{"archs", "triton", "limits", "rows", "compiled_on"}``, one row per spec × arch, and an
    error row for what fails (a module without specs, a failed compile)."""
    jobs = [module_job(m) for m in (known_modules() if modules is None else modules)]
    result = run_in_child({"archs": list(archs), "jobs": jobs})
    return {**result, "compiled_on": capabilities().hardware_label()}


def _portable_globals(fn: Any) -> dict[str, list]:
    """The globals an inline kernel refers to, in a form the compile process can rebuild (which
    gives it ``triton`` and ``tl``, what its ``@triton.jit`` decorator needs)."""
    out: dict[str, list] = {}
    scope = fn.fn.__globals__
    for name in fn.fn.__code__.co_names:
        if name not in scope:
            continue
        value = scope[name]
        if isinstance(value, types.ModuleType):
            out[name] = ["module", value.__name__]
        elif isinstance(value, SCALARS):
            out[name] = ["value", value]
        else:
            raise ValueError(f"global {name!r} of kernel {fn.fn.__name__!r} cannot be sent to the compile "
                             f"process (a {type(value).__name__}); make it an argument or a constexpr")
    return out


def kernel_job(kernel: str | Any, signature: dict[str, str], constexprs: dict[str, Any] | None = None,
               config: LaunchConfig | None = None, label: str | None = None) -> dict[str, Any]:
    """A compile job for one kernel (for `compile_jobs`).

    ``kernel``: ``"module:function"``, or a ``@triton.jit`` function; one defined outside
    moe_lab (in a notebook) travels to the compile process as its source, with the modules and
    plain values it refers to. ``signature``, ``constexprs``, ``config``:
    as in `moe_lab.workbench.compile_report.specs.CompileSpec` (``config`` default: 4 warps,
    3 stages).
    """
    inline = None
    if not isinstance(kernel, str):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        if not isinstance(kernel, (JITFunction, InterpretedFunction)):  # compiled or interpreted
            raise ValueError(f"kernel must be 'module:function' or a @triton.jit function, got {kernel!r}")
        module, name = kernel.fn.__module__, kernel.fn.__name__
        if module.startswith("moe_lab.") and getattr(sys.modules.get(module), name, None) is kernel:
            kernel = f"{module}:{name}"  # a moe_lab kernel (an exercise's solution): imported by name
        else:
            inline = {"name": name, "source": textwrap.dedent(inspect.getsource(kernel.fn)),
                      "globals": _portable_globals(kernel)}
            kernel = f"<inline>:{name}"
    spec = {"kernel": kernel, "label": label or kernel.partition(":")[2], "signature": dict(signature),
            "constexprs": dict(constexprs or {}), "config": dataclasses.asdict(config or LaunchConfig())}
    return {"spec": spec, "inline": inline}


def module_job(module: str | types.ModuleType, kernel: str | None = None, label_contains: str | None = None,
               limit: int | None = None) -> dict[str, Any]:
    """A compile job for a kernel module's specs (`moe_lab.workbench.compile_report.specs`) —
    the kernels at the configurations their wrappers pick (for `compile_jobs`) — narrowed to ``kernel`` (a
    function name) and labels containing ``label_contains``, then to the first ``limit``."""
    name = module if isinstance(module, str) else module.__name__
    return {"module": name, "select": {"kernel": kernel, "label_contains": label_contains, "limit": limit}}


def compile_jobs(*jobs: dict[str, Any], archs: str | list[str] | tuple[str, ...] = DEFAULT_ARCHS,
                 cubin_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Compile `kernel_job`s and `module_job`s for each of ``archs`` (in one child process)
    and return the report rows, in job order; keep the cubins in ``cubin_dir`` when given.
    The progress lines (one per compiled row) go to this process's standard output: in a
    notebook they are output, not an error."""
    request = {"archs": list(parse_archs(archs)), "jobs": list(jobs),
               "cubin_dir": None if cubin_dir is None else str(cubin_dir)}
    return run_in_child(request, progress=sys.stdout)["rows"]


# ------------------------------------------------------------------------------ showing it

COLUMNS = ("kernel", "arch", "regs", "spill B", "shared KB", "blocks/SM", "warps/SM", "limit",
           "tensor cores", "async copy", "TMA / mbarriers", "grid", "stages", "compile s")


def _short_kernel(row: dict[str, Any]) -> str:
    module, _, name = row["kernel"].partition(":")
    return f"{module.rsplit('.', 1)[-1]}:{name}" if name else module


def table_cells(row: dict[str, Any], label_width: int | None = None) -> list[str]:
    """One row of the table (`COLUMNS`), the label cut to ``label_width`` characters when
    given; an error row says so in the third cell."""
    label = row["label"]
    if label_width is not None and len(label) > label_width:
        label = label[: label_width - 1] + "…"
    head = [f"{_short_kernel(row)} — {label}", row.get("arch") or "all"]
    if row.get("error"):
        return head + [f"ERROR: {row['error'].splitlines()[0][:160]}"] + [""] * (len(COLUMNS) - 3)
    mma = "; ".join(row["mma_kinds"]) or "none (CUDA cores)"
    upcasts = row.get("fp8_upcasts", 0)  # FP8 operands widened to 16 bits before the MMA
    pending = row["copies"]["max_pending_groups"]
    copy = row["async_copy"] + (f", {pending} group(s) in flight" if pending else "")
    return head + [
        str(row["registers"]), str(row["spill_bytes"]), f"{row['shared_bytes'] / 1024:.1f}",
        str(row["blocks_per_sm"]), str(row["warps_per_sm"]), row["limiter"],
        f"{mma} (+{upcasts} FP8 upcast cvt)" if upcasts else mma,
        "none" if row["async_copy"] == "none" else copy,
        f"{row['copies'].get('tma', 0)} / {row['copies'].get('mbarrier_inits', 0)}",
        "persistent" if row.get("persistent") else "a program per tile", str(row["num_stages"]),
        f"{row['compile_s']:.2f}",
    ]


def format_table(rows: list[dict[str, Any]], label_width: int | None = 60) -> str:
    """The rows as an aligned text table, one line per kernel × arch (labels cut to
    ``label_width`` characters; ``None``: whole)."""
    cells = [list(COLUMNS)] + [table_cells(row, label_width) for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def format_rows_with_loop(rows: list[dict[str, Any]]) -> str:
    """Each row's figures and its inner loop's PTX (the operand moves and the MMAs), for a
    notebook."""
    parts = []
    for row in rows:
        if row.get("error"):
            parts.append(f"{_short_kernel(row)} [{row.get('arch')}]: ERROR {row['error']}")
            continue
        parts += [format_table([row]).splitlines()[-1], f"  inner loop on {row['arch']} ({row['gpu']}):"]
        parts += [f"    {line}" for line in row["loop"] or ["(no loop with an MMA or an async copy)"]]
    return "\n".join(parts)


def off_target(row: dict[str, Any]) -> list[str]:
    """What keeps a row off the report's targets: spilled bytes, a GEMM-like kernel (one
    with a ``tl.dot``) on CUDA cores, no async copy feeding its MMAs; empty when on target
    or failed."""
    if row.get("error"):
        return []
    misses = []
    if row["spill_bytes"]:
        misses.append(f"{row['spill_bytes']} B spilled")
    if row.get("has_dot") and not row["mma_kinds"]:
        misses.append("no tensor cores")
    if row["mma_kinds"] and row["async_copy"] == "none":
        misses.append("no async copy")
    return misses


def exceptions_markdown(rows: list[dict[str, Any]]) -> str:
    """The rows off target grouped under the reason their specs give (``note``), as a list."""
    groups: dict[str, list[str]] = {}
    for row in rows:
        misses = off_target(row)
        if misses:
            reason = row.get("note") or "**no reason recorded**"
            groups.setdefault(reason, []).append(
                f"  - {_short_kernel(row)} — {row['label'][:110]} [{row['arch']}]: {', '.join(misses)}")
    if not groups:
        return "Every row meets the targets (no spills; tensor cores and async copies for every GEMM).\n"
    return "\n".join(f"- {reason}\n" + "\n".join(items) for reason, items in groups.items()) + "\n"


def refused_markdown(refused: list[dict[str, str]]) -> str:
    """The launches a target refuses (its `moe_lab.perf.hardware.ARCHS` row lacks what the
    kernel needs), not compiled there, as a list; nothing when none was."""
    if not refused:
        return ""
    by_need: dict[tuple[str, str], list[str]] = {}
    for r in refused:
        by_need.setdefault((r["kernel"].split(":")[-1], r["needs"]), []).append(r["arch"])
    return "\n## Refused before compiling\n\n" + "".join(
        f"- {kernel} needs {needs}: refused on {', '.join(sorted(set(archs)))}\n"
        for (kernel, needs), archs in by_need.items())


def summary_markdown(report: dict[str, Any]) -> str:
    """``results/compile/summary.md``: what was compiled, with what, and the table."""
    limits = "; ".join(f"{arch}: {lim['gpu']}, {lim['registers_per_sm']:,} registers, "
                       f"{lim['max_warps_per_sm']} warps, {lim['max_blocks_per_sm']} blocks, "
                       f"{lim['shared_per_sm'] // 1024} KB shared per SM"
                       for arch, lim in report["limits"].items())
    errors = sum(1 for row in report["rows"] if row.get("error"))
    rows = [table_cells(row) for row in report["rows"]]
    table = ledger.markdown_table(COLUMNS, ["---"] * len(COLUMNS), rows)
    return (
        "# Compile report\n\n"
        f"Every Triton kernel of moe_lab at the configurations a CUDA launch picks, compiled with "
        f"Triton {report['triton']} for {', '.join(report['archs'])} on {report.get('compiled_on', '?')} "
        "(`python -m moe_lab compile`; no kernel was run), each as its module's compile specs "
        "describes the launch (pointers 16-byte aligned, integer arguments typed as the spec types "
        "them). Registers, stack and static shared memory "
        "from `cuobjdump -res-usage` on the cubins, checked against ptxas's log of the same compile, "
        "which gives the spilled bytes; shared memory is static + dynamic per block; blocks and "
        "warps per SM are the theoretical occupancy from the "
        f"per-SM limits ({limits}); tensor cores and async copies as found in the PTX; "
        "'group(s) in flight' is the largest N of `cp.async.wait_group N`; 'TMA / mbarriers' counts "
        "`cp.async.bulk.tensor` and `mbarrier.init` instructions in the PTX; a persistent grid is "
        "one whose kernel has a loop over tiles strided by the number of programs.\n\n"
        + (f"**{errors} row(s) failed** (see ERROR).\n\n" if errors else "")
        + table
        + "\n## Off target, and why\n\n" + exceptions_markdown(report["rows"])
        + refused_markdown(report.get("refused", []))
    )


def write_results(report: dict[str, Any], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write ``<arch>.json`` for each arch and ``summary.md`` into ``out_dir``; returns the paths.

    A report is replaced whole or not at all: every file is written beside its target first
    and renamed into place only once all are written (a full disk or a Ctrl-C leaves the old
    report and no temporaries). A report with failed rows never replaces one (a broken
    toolchain would lose good figures): it is written as ``<arch>.failed.json`` and
    ``summary.failed.md`` instead, which the next report without failed rows removes."""
    out = Path(out_dir)
    failed = ".failed" if any(row.get("error") for row in report["rows"]) else ""
    texts = {}
    for arch in report["archs"]:
        part = {**report, "archs": [arch], "limits": {arch: report["limits"][arch]},
                "rows": [row for row in report["rows"] if row.get("arch") in (arch, None)]}
        texts[out / f"{arch}{failed}.json"] = json.dumps(part, indent=1) + "\n"
    texts[out / f"summary{failed}.md"] = summary_markdown(report)
    out.mkdir(parents=True, exist_ok=True)
    beside = {path: path.with_name(f".{path.name}.{os.getpid()}.tmp") for path in texts}
    try:
        for path, text in texts.items():
            beside[path].write_text(text, encoding="utf-8")
        for path, tmp in beside.items():
            os.replace(tmp, path)
    finally:
        for tmp in beside.values():  # those not renamed: a later write failed
            tmp.unlink(missing_ok=True)
    if not failed:  # the good report replaces the failed one beside it
        for path in texts:
            path.with_name(f"{path.stem}.failed{path.suffix}").unlink(missing_ok=True)
    return list(texts)


def record(rows: list[dict[str, Any]], notebook: str = "compile") -> int:
    """Append one ledger record per compiled row (error rows have no figure): theoretical
    warps per SM, with the rest of the row as extra fields. Returns the number recorded."""
    compiled_on = capabilities().hardware_label()
    compiled = [row for row in rows if not row.get("error")]
    for row in compiled:
        ledger.record(notebook, f"{_short_kernel(row)} {row['label']}", "warps_per_sm", row["warps_per_sm"],
                      "warps", hardware=f"{row['gpu']} ({row['arch']}), compiled only",
                      kind="compiled", compiled_on=compiled_on, **{key: row[key] for key in LEDGER_FIELDS})
    return len(compiled)


def default_out_dir() -> Path:
    """``<project root>/results/compile`` (``./results/compile`` outside a checkout)."""
    root = ledger.find_project_root()
    return (root if root is not None else Path.cwd()) / "results" / "compile"
