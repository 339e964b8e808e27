#!/usr/bin/env python
"""GPU truth: run every Triton kernel compiled against its torch reference, then time them.

Every kernel in moe_lab is tested on the CPU under Triton's interpreter; compiled on a GPU it
can behave differently (bf16 arithmetic, float8 casts, masking, races). This script is the
one place where that is checked and where the workbook's GPU speed figures come from. It is
sized for one call of about ten minutes on an H200 and runs from the checkout with only
torch and triton installed (``python3 scripts/gpu_check.py``: nothing to install, no numpy).

    python scripts/gpu_check.py --preflight     # what the compiled path needs, in seconds
    python scripts/gpu_check.py                 # on a CUDA machine: checks + benchmarks
    python scripts/gpu_check.py --budget-s 300  # stop cleanly after about 300 s
    python scripts/gpu_check.py --resume        # the sections the last run did not finish
    python scripts/gpu_check.py --cpu-smoke     # tiny shapes, interpreted: tests the script

A preflight stops the run at once, with the reason in ``env.json``, where the compiled path
cannot work (`preflight`: ``TRITON_INTERPRET`` set beside a GPU, no C compiler, no
``Python.h``, an unwritable Triton cache).

Checks (outputs poisoned with NaN before each kernel runs, so an unwritten element fails),
each against its plain PyTorch reference on fresh random inputs, at a small shape and at the
production shapes of `PRODUCTION`: DeepSeek-V3 at EP8 (32 local experts, 16,384 routed rows,
d_model 7,168, expert width 2,048) and GPT-OSS-20B (32 experts, top-4, width 2,880), where
each expert gets at least ``MANY_ROWS`` rows, so that the configs `choose_config` returns
for production layers are the ones launched:

- the grouped GEMM forward, dX, dW and the fused SwiGLU forward and backward (packed and
  padded expert segments); every fused expert MLP of `moe_lab.kernels.fusions.FUSIONS`
  against its unfused chain; the row-id map, permute and unpermute; the MX quantizer bit
  for bit; the MXFP8 GEMM and the grouped MXFP8 GEMM (in Hopper's ``fp8_promote`` mode
  within `moe_lab.workbench.measure.mx_bounds.fp8_promote_bound`, its measured error recorded); MXFP8
  attention at head dims 64, 128 and 192; the fused router forward and backward; the
  training step captured as a CUDA graph against the eager reference; each sync-free path
  under CUDA's own sync detector (`section_sync_debug`); the device branches of notebooks 03
  and 04.
- Router ids: the fused kernel computes ``exp`` and the sigmoid with fast approximate
  instructions, so where the reference's top-k margin (the smallest gap between the
  selection scores it ranks, expert or group, at the top-k cut and inside it) is below
  `ROUTER_TIE_ULPS` float32 ulps, a differing id is counted and reported as a near-tie, not
  failed; every other token's ids must be exact, and the statistics that depend on the ids
  are compared with a tolerance widened by the share of near-tie tokens (stated per row).

Isolation: kernels that have never executed on hardware (the persistent TMA grouped GEMM, the
MXFP8 kernels, CUDA-graph capture) and the sync detector run after the core checks, each in
a child process of its own with ``--section-timeout-s``: a crash, a sticky device fault or a
hang in a device wait costs that section (recorded as ``crashed`` or ``hung``, with the
checks it finished), not the run (``tests/workbench/scripts/test_gpu_check.py`` rehearses
exactly that with a stand-in child that hangs and one that aborts).

Figures (CUDA events, warm-up, median): each notebook's headline gain measured on the GPU
(04 dispatch vs naive, 07 fused vs unfused, 05 fused router vs the unfused chain, 06 MXFP8
attention and GEMM vs bf16, 08 graphed vs eager, 12 tokens/s of the optimised training
step), each only after the checks of its kernels passed, the grouped GEMM against
``torch._grouped_mm``, the quantizer against the copy bandwidth; and the registers and
spills the driver reports for every launched kernel (Triton's compiled kernel: ``n_regs``,
``n_spills``) beside the compile report's figures (``results/compile/sm_*.json``). Then the
tuner (`bench_tuning`), whose table goes to the run's folder after every launch tuned.

Budget: ``--budget-s`` (default 480) stops the run cleanly: a section still running when the
budget runs out is cut (what it had checked is kept), the later ones are named as not run.
Before and after every section the results are written to ``results/<gpu-name>/`` (or
``--out``; the smoke run: under ``build/``): ``env.json``, ``checks.json``, ``bench.json``,
``gains.json``, ``kernels.json``, ``sections.json`` and ``summary.md`` (and copied under
``$OUT`` when set); a section is ``running`` while it runs, so a call killed from outside
still returns what finished and names where it died.
``--sections``/``--skip`` choose sections, and a call with them (or ``--resume``) keeps the
earlier call's results for the others. Exit code: 0 all sections ran and passed, 1 a check
failed, 2 refused (bad arguments, the preflight), 3 the budget stopped the run before the
end (nothing failed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Float32 ulps below which the reference's top-k margin makes a differing router id a
#: near-tie (counted, not failed): the fast ``exp``/sigmoid/division of the fused kernel are
#: each within a few ulps, so two scores closer than this may be ranked either way.
ROUTER_TIE_ULPS = 16

#: The production shapes the checks run at (`--cpu-smoke` shrinks them): experts on one GPU,
#: tokens routed to it, top-k, d_model, expert width. Both give 16,384 routed rows over 32
#: experts, 512 an expert: `MANY_ROWS`, where `choose_config` switches to its 128-row tiles.
PRODUCTION = {
    "dsv3-ep8": dict(n_experts=32, tokens=2048, top_k=8, d_model=7168, d_expert=2048),
    "gpt-oss-20b": dict(n_experts=32, tokens=4096, top_k=4, d_model=2880, d_expert=2880),
}
SMOKE = {  # the same roles at interpreter sizes
    "small": dict(n_experts=4, tokens=48, top_k=2, d_model=64, d_expert=32),
}


# ----------------------------------------------------------------------------- helpers


def gpu_env(torch) -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "gpu": "cpu (interpreted smoke run)", "driver": None, "capability": None}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gb=round(p.total_memory / 2**30, 1),
                   sms=p.multi_processor_count, cuda=torch.version.cuda)
        with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):  # driver: None
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=True)
            env["driver"] = smi.stdout.split()[0]
    return env


@contextlib.contextmanager
def poisoned(torch):
    """Every ``torch.empty``/``empty_like`` inside the block returns NaN (floats) or -7
    (integers): a kernel that leaves an element unwritten is caught by the comparison."""
    real = torch.empty, torch.empty_like

    def poisoning(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype != torch.bool and not t.is_complex():
                t.fill_(-7)
            return t
        return made

    torch.empty, torch.empty_like = map(poisoning, real)
    try:
        yield
    finally:
        torch.empty, torch.empty_like = real


def randn(torch, g, size: tuple[int, ...], dtype=None, scale: float = 1.0):
    """Normal numbers from the generator ``g``, on its device, times ``scale``, in ``dtype``
    (default float32)."""
    return (torch.randn(*size, generator=g, device=g.device) * scale).to(dtype or torch.float32)


def rel_error(got, want) -> float:
    got, want = got.double(), want.double()
    if not bool(got.isfinite().all() == want.isfinite().all()) or got.isnan().any():
        return float("nan")
    denom = want.norm().item()
    return (got - want).norm().item() / denom if denom else (got - want).norm().item()


def vs_reference(torch, fn, ref, inputs: tuple, dout, *args, ref_dtype=None) -> list[float]:
    """The relative errors of ``fn`` on copies of ``inputs`` (its outputs poisoned) against
    ``ref`` on copies in ``ref_dtype`` (default float64), each given ``args`` after them: the
    output's, then each input's gradient through ``dout`` (a tensor, or a call that draws it
    for the reference's output)."""
    mine = [t.detach().clone().requires_grad_() for t in inputs]
    refs = [t.detach().to(ref_dtype or torch.float64).requires_grad_() for t in inputs]
    with poisoned(torch):
        y = fn(*mine, *args)
    r = ref(*refs, *args)
    dout = dout(r) if callable(dout) else dout
    with poisoned(torch):
        got = torch.autograd.grad(y, mine, dout.to(y.dtype))
    want = torch.autograd.grad(r, refs, dout.to(r.dtype))
    return [rel_error(a, b) for a, b in zip((y, *got), (r, *want), strict=True)]


class BudgetExceeded(BaseException):
    """Raised in the running section when ``--budget-s`` runs out (a BaseException, so that
    a section's own ``except Exception`` cannot swallow it)."""


class Section(NamedTuple):
    """One part of the run. ``isolated``: it runs in a child process of its own (a fresh
    interpreter, what multiprocessing's ``spawn`` starts) with ``timeout_s``, so a kernel that
    has never run on this hardware can crash the process, leave a sticky device fault or hang
    in a device wait and cost this section only. ``needs``: a section whose checks must all
    have passed in this run first (a benchmark of a kernel the checks have not cleared would
    risk what the isolation protected)."""

    name: str
    run: Callable[[], None]
    isolated: bool = False
    needs: str | None = None


RECORDS = ("checks", "bench", "gains", "kernels", "launched")
#: Seconds a child gets past its own timeout to stop by itself (its interpreter starts first),
#: at most half the timeout.
CHILD_GRACE_S = 10.0
CHILD_START_S = 120.0  # a child's start-up (Python, torch, the device) before its section's clock runs


class Report:
    """What the run found, section by section: checks, benchmark rows, headline gains, the
    compiled kernels' registers; written to disk before and after every section (`write`).

    In a child process (``sink`` set) the report writes only its records, to ``sink``, after
    every record: whatever the child checked before it died is what the parent keeps.

    ``earlier``: start from the sections and records of the earlier run in ``out`` (its
    ``*.json``): a second call that runs only some sections writes one result with the first's
    (`run` replaces the entry and the records of each section it runs again)."""

    def __init__(self, out: Path, env: dict, budget_s: float, sink: Path | None = None,
                 earlier: bool = False) -> None:
        self.out, self.env, self.budget_s, self.sink = out, env, budget_s, sink
        self.start = time.monotonic()
        self.current = "-"
        # one list each: checks, bench, gains, kernels, launched (the compiled kernels the child
        # processes read) and the sections' entries
        for key in (*RECORDS, "sections"):
            path = out / f"{key}.json"
            setattr(self, key, json.loads(path.read_text()) if earlier and path.exists() else [])

    # -- recording
    def _recorded(self) -> None:
        if self.sink is not None:
            put(self.sink, dump({k: getattr(self, k) for k in (*RECORDS, "sections")}))

    def _add(self, records: str, row: dict, line: str) -> None:
        """``row`` (of the running section) onto the list ``records``, ``line`` printed."""
        getattr(self, records).append({"section": self.current, **row})
        print(f"  {line}", flush=True)
        self._recorded()

    def check(self, name: str, shape: str, err: float, tol: float, **extra: object) -> None:
        ok = math.isfinite(err) and err <= tol
        self._add("checks", {"check": name, "shape": shape, "rel_error": err, "tol": tol, "ok": ok, **extra},
                  f"[{'ok' if ok else 'FAIL'}] {name:<40} {shape:<28} rel.err {err:.2e} (tol {tol:.0e})")

    def exact(self, name: str, shape: str, equal: bool, **extra: object) -> None:
        """A check that must hold exactly: its error 0, or NaN where it does not hold."""
        self.check(name, shape, 0.0 if equal else float("nan"), 0.0, **extra)

    def failed(self, name: str, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._add("checks", {"check": name, "shape": "-", "ok": False, "error": text},
                  f"[FAIL] {name}: {text}")
        if not isinstance(error, str):
            traceback.print_exc(limit=4)

    def timed(self, name: str, **fields: object) -> None:
        self._add("bench", {"bench": name, **fields}, f"{name}: {figures(fields)}")

    def gain(self, notebook: str, what: str, value: float, unit: str, basis: str) -> None:
        """A notebook's headline figure as measured here: ``value`` in ``unit`` (e.g. ``x``
        for a speedup), ``basis`` what it compares."""
        self._add("gains", {"notebook": notebook, "what": what, "value": value, "unit": unit, "basis": basis},
                  f"headline {notebook}: {what} = {value:.4g} {unit} ({basis})")

    def note(self, text: str) -> None:
        """A word on the running section (why it checked nothing, say), kept in its entry (the
        last: `run` puts it there)."""
        self.sections[-1]["note"] = text
        print(f"  note: {text}", flush=True)
        self._recorded()

    # -- the budget
    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def run(self, section: Section, child_args: list[str] | None = None, timeout_s: float = 0.0) -> None:
        """Run one section under what is left of the budget, in this process or (``isolated``
        and ``child_args`` given: the script's own arguments) in a child; write everything
        before it starts (its status ``running``: a run killed from outside names the section
        it died in) and after it ends."""
        name, left = section.name, self.left_s()
        entry = {"section": name, "status": "running", "seconds": 0.0}
        if left <= 0:
            entry["status"] = "not run (budget spent)"
        elif section.needs and not any(s["section"] == section.needs and s["status"] == "done"
                                       for s in self.sections):  # ran (or was resumed) and passed
            entry["status"] = f"not run: needs '{section.needs}' passed"
        self.sections = [s for s in self.sections if s["section"] != name] + [entry]
        for key in RECORDS:  # an earlier run's records of this section give way to this run's
            setattr(self, key, [r for r in getattr(self, key) if r.get("section") != name])
        in_child = section.isolated and child_args is not None
        print(f"== {name}  ({left:.0f} s of the budget left{'; in a child process' if in_child else ''}): "
              f"{entry['status']}", flush=True)
        self.write()
        if entry["status"] != "running":
            return
        self.current = name
        t0 = time.monotonic()
        entry["status"] = (self._run_child(section, child_args, min(left, timeout_s)) if in_child
                           else self._run_here(section, left))
        self.current = "-"
        entry["seconds"] = round(time.monotonic() - t0, 2)
        if entry["status"] == "done" and not all(c["ok"] for c in self.checks if c["section"] == name):
            entry["status"] = "done, checks failed"
        print(f"   ({entry['seconds']:.1f} s, {entry['status']})", flush=True)
        self.write()

    def _run_here(self, section: Section, left: float) -> str:
        def out_of_time(signum, frame):  # noqa: ARG001 (the signal handler's signature)
            raise BudgetExceeded(section.name)

        previous = signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, left)
        try:
            section.run()
            return "done"
        except (Exception, BudgetExceeded) as exc:
            # the alarm fires only once the budget is spent (it was set to what was left): an error
            # before that is the section's own; record it and go on (one broken section must not
            # hide the rest)
            if self.left_s() > 0:
                self.failed(section.name, exc)
                return "failed"
            # the budget's interrupt, itself or turned into another error by a library that caught
            # it (Triton's interpreter re-raises what a kernel's Python raises)
            print(f"   budget of {self.budget_s:g} s spent during {section.name}: cut", flush=True)
            return "cut at the budget"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def _run_child(self, section: Section, child_args: list[str], timeout_s: float) -> str:
        """The section in a fresh interpreter running this script with ``--child``; its
        records come back through a file it rewrites after each one, so a crash or a kill
        keeps what it had checked. Killed (its whole process group) ``timeout_s`` after it has
        started (its marker file: a loaded machine may take seconds to import torch)."""
        sink = self.out / "children" / f"{slug(section.name)}.json"
        started = sink.with_suffix(".started")
        sink.parent.mkdir(parents=True, exist_ok=True)
        sink.unlink(missing_ok=True)
        started.unlink(missing_ok=True)
        cmd = [sys.executable, str(Path(__file__).resolve()), *child_args, "--child", section.name,
               "--child-sink", str(sink), "--child-of", str(os.getpid()), "--budget-s", f"{timeout_s:.3f}"]
        proc = subprocess.Popen(cmd, start_new_session=True)  # its own group: killed as one
        try:
            start_by = time.monotonic() + min(CHILD_START_S, max(self.left_s() - timeout_s, 1.0))
            while proc.poll() is None and not started.exists() and time.monotonic() < start_by:
                time.sleep(0.05)
            rc = proc.wait(timeout=timeout_s + min(CHILD_GRACE_S, timeout_s / 2))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        except BaseException:  # Ctrl-C or a kill of this process: take the child with it
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        records = json.loads(sink.read_text()) if sink.exists() else {}
        for key in RECORDS:
            getattr(self, key).extend(records.get(key, []))
        budget_cut = timeout_s >= self.left_s() - 1
        if rc is None:
            status = "cut at the budget" if budget_cut else f"hung: killed after {timeout_s:.0f} s"
        elif rc == 0:
            mine = next(s for s in records["sections"] if s["section"] == section.name)
            status = mine["status"]
            if "note" in mine:
                self.note(mine["note"])
            if status == "cut at the budget" and not budget_cut:  # its own alarm, at the timeout
                status = f"timed out after {timeout_s:.0f} s"
        else:
            died = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
            status = f"crashed ({died})"
        if status.startswith(("hung", "crashed", "timed out")):
            self.failed(section.name, f"child process {status}; the checks it finished are kept")
        return status

    def unfinished(self) -> list[str]:
        return [s["section"] for s in self.sections
                if s["status"] in ("running", "cut at the budget", "not run (budget spent)")]

    # -- output
    def write(self) -> None:
        """Every file, as of now (atomically each: a kill mid-write leaves the last one); in a
        child, its records to its sink."""
        if self.sink is not None:
            self._recorded()
            return
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("env", *RECORDS, "sections"):
            put(self.out / f"{name}.json", dump(getattr(self, name)))
        put(self.out / "summary.md", summary_markdown(self))
        if os.environ.get("OUT"):
            shutil.copytree(self.out, os.environ["OUT"], dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("*.tmp"))


def slug(name: str) -> str:
    """A section's or a GPU's file name, as the GPU's folder is named: ``"MXFP8 kernels"`` ->
    ``"mxfp8_kernels"`` (`moe_lab.workbench.measure.autotune.gpu_slug`)."""
    from moe_lab.workbench.measure.autotune import gpu_slug

    return gpu_slug(name)


def put(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a kill mid-write leaves the previous file)."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def dump(data: object) -> str:
    return json.dumps(data, indent=1, default=str) + "\n"


def figures(row: dict, skip: tuple[str, ...] = ()) -> str:
    """``"name value, ..."`` of ``row``'s fields but ``skip``, floats to 4 digits."""
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in row.items() if k not in skip)


def md_table(title: str, head: str, rows: list[list]) -> list[str]:
    """The lines of a markdown section ``title`` holding a table: columns ``head`` (``" | "``
    between names), one line per row."""
    return ["", f"## {title}", "", f"| {head} |", "|" + "---|" * len(head.split(" | ")),
            *(f"| {' | '.join(map(str, row))} |" for row in rows)]


def summary_markdown(rep: Report) -> str:
    env = rep.env
    lines = [f"# GPU check: {env.get('gpu')}", "",
             f"Measured {env.get('date')}; driver {env.get('driver')}, CUDA {env.get('cuda')}, "
             f"torch {env.get('torch')}, Triton {env.get('triton')}; budget {rep.budget_s:g} s.", ""]
    unfinished = rep.unfinished()
    if unfinished:
        lines += [f"**Stopped at the budget: unfinished sections: {', '.join(unfinished)}.**", ""]
    lines.append(f"{sum(c['ok'] for c in rep.checks)}/{len(rep.checks)} checks passed.")
    lines += md_table("Sections", "section | status | seconds | note",
                      [[s["section"], s["status"], f"{s['seconds']:.1f}", s.get("note", "")]
                       for s in rep.sections])
    if rep.gains:
        lines += md_table("Headline gains (measured here)", "notebook | figure | value | basis",
                          [[g["notebook"], g["what"], f"{g['value']:.4g} {g['unit']}", g["basis"]]
                           for g in rep.gains])
    shown = ("near_ties", "differing_tokens", "measured_rel_error", "cuda_syncs", "counted_syncs", "note")
    lines += md_table("Checks", "section | check | shape | rel. error | tol | ok | notes",
                      [[c["section"], c["check"], c["shape"],
                        f"{c['rel_error']:.2e}" if "rel_error" in c else None, c.get("tol", "-"),
                        "✓" if c["ok"] else "✗ " + c.get("error", ""),
                        "; ".join(f"{k} {c[k]}" for k in shown if c.get(k) not in (None, ""))]
                       for c in rep.checks])
    if rep.kernels:
        columns = ("kernel", "config", "registers", "spills", "report_registers", "report_spill_bytes")
        lines += md_table("Registers and spills of the launched kernels",
                          "kernel | config | registers | spills | compile report: registers | spill bytes",
                          [[k[c] for c in columns] for k in rep.kernels])
    lines += ["", "## Benchmarks", ""]
    lines += [f"- **{b['bench']}**: {figures(b, ('bench', 'section'))}" for b in rep.bench]
    return "\n".join(lines) + "\n"


def seconds(fn: Callable[[], object]) -> float:
    """Median seconds of ``fn``: on a GPU ``triton.testing.do_bench`` (CUDA events, the L2 cache
    flushed between calls, launches queued back to back), else the workbook's timer
    (`moe_lab.workbench.measure.timing.bench`)."""
    import torch

    if torch.cuda.is_available():
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    from moe_lab.workbench.measure.timing import bench

    return bench(fn, warmup=1, min_time_s=0.02).median_s


# ----------------------------------------------------------------------------- sections: checks


def layer_launches(d: int, f: int) -> list[tuple[str, int, int, bool]]:
    """The grouped GEMM launches of one MoE layer's experts (``d_model`` ``d``, expert width
    ``f``), forward and backward, as ``(kernel, n, k, transposed)`` over the layer's rows and
    experts: the down projection (forward, dX, dW), the SwiGLU up/gate projection (forward)
    and its dX, dW. ``transposed``: the weight operand is the transposed view of the stored
    weight (``[E, N, K]`` read as ``[E, K, N]``: the dX launches)."""
    return [("gemm", d, f, False), ("gemm", f, d, True), ("dw", d, f, False),
            ("swiglu", f, d, False), ("gemm", d, 2 * f, True), ("dw", 2 * f, d, False)]


def describe_config(blocks: dict, warps: int, stages: int) -> str:
    return (f"{blocks.get('BLOCK_M')}x{blocks.get('BLOCK_N')}x{blocks.get('BLOCK_K')}, "
            f"{warps} warps, {stages} stages")


def compiled_kernels() -> list[dict]:
    """Every kernel Triton compiled and launched in this process, from each `JITFunction`'s
    cache (of every kernel module loaded: a kernel launched was loaded): its constexprs, warps,
    stages and what the driver reports (``n_regs``, ``n_spills``). Empty under the interpreter
    (nothing is compiled)."""
    from triton.runtime.jit import JITFunction

    rows = []
    for modname, module in sorted(sys.modules.items()):
        if not modname.startswith("moe_lab.kernels."):
            continue
        for attr, fn in sorted(vars(module).items()):
            if not isinstance(fn, JITFunction):
                continue
            for entry in list(getattr(fn, "device_caches", {}).values()):
                cache = entry[0] if isinstance(entry, tuple) and entry else {}
                for compiled in list(getattr(cache, "values", dict().values)()):
                    with contextlib.suppress(Exception):
                        compiled._init_handles()  # loads the binary: sets n_regs and n_spills
                    src = getattr(compiled, "src", None)
                    names = list(getattr(getattr(src, "fn", None), "arg_names", []))
                    constexprs = {}
                    for key, value in dict(getattr(src, "constants", {}) or {}).items():
                        idx = key[0] if isinstance(key, tuple) and len(key) == 1 else key
                        if isinstance(idx, int) and idx < len(names):
                            constexprs[names[idx]] = value
                        elif isinstance(idx, str):
                            constexprs[idx] = value
                    meta = compiled.metadata
                    rows.append({"kernel": f"{modname}:{attr}", "constexprs": constexprs,
                                 "num_warps": meta.num_warps, "num_stages": meta.num_stages,
                                 "registers": getattr(compiled, "n_regs", None),
                                 "spills": getattr(compiled, "n_spills", None)})
    return rows


def grouped_layouts(torch, dev, shapes: dict, seed: int, idle: int, align: int = 16):
    """Per layer of ``shapes``, fp32 and bf16 (with their tolerances), packed and padded: the
    routed counts of ``tokens x top_k`` random picks over the experts, expert ``idle`` given
    none; padded, each count rounded up to ``align`` rows and the buffer sized from the
    static bound ``M + E (align - 1)`` as the layer's is (rows past the last segment). Yields
    ``(layer, m, dtype, tol, offsets, shape, generator)``: the layer's entry of ``shapes``,
    ``m`` rows, ``offsets`` (``[E + 1]`` int32, on the device), ``shape`` the check's label,
    ``generator`` (which drew the routing, from ``seed``) to draw the inputs next."""
    for label, s in shapes.items():
        E, M = s["n_experts"], s["tokens"] * s["top_k"]
        for dtype, tol in ((torch.float32, 5e-3), (torch.bfloat16, 2e-2)):
            for padded in (False, True):
                g = torch.Generator(device=dev).manual_seed(seed)
                counts = torch.bincount(torch.randint(0, E, (M,), generator=g, device=dev), minlength=E)
                counts[idle] = 0  # an idle expert
                if padded:
                    counts = (counts + align - 1) // align * align
                offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
                m = M + E * (align - 1) if padded else int(counts.sum())
                shape = f"{label} M={m}" + (f", padded to {align}" if padded else "")
                yield s, m, dtype, tol, offsets, shape, g


def section_grouped_gemm(torch, dev, rep: Report, shapes: dict, tma: bool = False) -> None:
    """Grouped GEMM forward (the down projection), dX, dW and the fused SwiGLU's forward and
    backward (the up/gate projection); ``tma``: the persistent TMA grouped GEMM
    (``expert_backend="triton_tma"``) instead, its forward, dX (the kernel on W transposed) and
    dW. On packed offsets with an idle expert and on a padded layout (segments rounded up to 16
    rows, rows past the last segment), bf16 and fp32, each against the textbook loop in float64."""
    from moe_lab.kernels import grouped_gemm as gg

    def swiglu_reference(x, w, offsets):  # silu(gate) * up of the textbook loop's two halves
        gate, up = gg.grouped_gemm_reference(x, w, offsets).chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    for s, m, dtype, tol, offsets, shape, g in grouped_layouts(torch, dev, shapes, seed=int(tma),
                                                               idle=-1 if tma else 0):
        E, d, f = s["n_experts"], s["d_model"], s["d_expert"]
        if tma:  # imported here: the core checks' process never loads the TMA kernel
            from moe_lab.kernels.grouped_gemm_tma import grouped_gemm_tma

            h, w = randn(torch, g, (m, f), dtype), randn(torch, g, (E, f, d), dtype, f ** -0.5)
            cases = [("grouped_gemm_tma", grouped_gemm_tma, gg.grouped_gemm_reference, (h, w),
                      randn(torch, g, (m, d), dtype))]
        else:
            h_in, w, x, w2 = (randn(torch, g, size, dtype, size[-2] ** -0.25 if len(size) == 3 else 1.0)
                              for size in ((m, f), (E, f, d), (m, d), (E, d, 2 * f)))
            dy, dh = randn(torch, g, (m, d), dtype), randn(torch, g, (m, f), dtype)
            cases = [("grouped_gemm", gg.grouped_gemm, gg.grouped_gemm_reference, (h_in, w), dy),
                     ("grouped_gemm_swiglu", gg.grouped_gemm_swiglu, swiglu_reference, (x, w2), dh)]
        for name, fn, ref, inputs, dout in cases:
            errors = vs_reference(torch, fn, ref, inputs, dout, offsets)
            for what, err in zip(("fwd", "dX", "dW"), errors, strict=True):
                rep.check(f"{name} {str(dtype)[6:]} {what}", shape, err, tol)


def section_fused_moe(torch, dev, rep: Report, shapes: dict, mxfp8: bool) -> None:
    """Every entry of `moe_lab.kernels.fusions.FUSIONS` against its unfused chain (float32
    copies of the same values): output and, for the differentiable ones, the gradient of
    every input; bf16 and fp32 (the MXFP8 entries in fp32, where their chain is exact up to
    summation order: their codes are the quantizer's of the same values). ``mxfp8``: the
    MXFP8 entries only, else the others. An entry this script has no inputs for fails, so a
    new fusion cannot go unchecked. Routing: random top-k ids, expert 0 idle."""
    from moe_lab.kernels import permute as P
    from moe_lab.kernels.fusions import FUSIONS

    families = {"gather_prologue": "gather", "mxfp8_epilogue": "gather",
                "scatter_epilogue": "scatter", "scatter_epilogue_atomic": "scatter",
                "fused_mlp": "mlp", "mxfp8_mlp_forward": "mlp", "mxfp8_mlp_forward_native": "mlp"}
    for name in sorted(set(FUSIONS) - set(families)):
        if name.startswith("mxfp8") == mxfp8:
            rep.failed(f"fused_moe {name}", RuntimeError("gpu_check has no inputs for this fusion"))
    for label, s in shapes.items():
        T, k, d, f, E = s["tokens"], s["top_k"], s["d_model"], s["d_expert"], s["n_experts"]
        for name, entry in sorted(FUSIONS.items()):
            family = families.get(name)
            mx = name.startswith("mxfp8")
            if family is None or mx != mxfp8:
                continue
            for dtype in ((torch.float32,) if mx else (torch.float32, torch.bfloat16)):
                for align in ((1, 16) if name == "fused_mlp" else (1,)):
                    g = torch.Generator(device=dev).manual_seed(align)
                    ids = torch.argsort(torch.rand(T, E - 1, generator=g, device=dev), dim=-1)[:, :k] + 1
                    rmap, offsets = P.make_row_id_map(ids, E, align=align)
                    n_rows = P.permuted_rows(T, k, E, align)
                    wts = torch.rand(T, k, generator=g, device=dev)
                    x = randn(torch, g, (T, d), dtype)
                    w1 = randn(torch, g, (E, d, 2 * f), dtype, d**-0.5)
                    w2 = randn(torch, g, (E, f, d), dtype, f**-0.5)
                    if family == "scatter":  # the fused second GEMM: the SwiGLU output h in
                        inputs = (randn(torch, g, (n_rows, f), dtype), w2, wts)
                    else:
                        inputs = (x, w1) if family == "gather" else (x, w1, w2, wts)
                    # fn(x, w1, rmap, offsets, n_rows=), fn(h, w2, rmap, offsets, wts),
                    # fn(x, w1, w2, rmap, offsets, wts, n_rows=): the routing after 2 or 3 operands
                    lead = 3 if family == "mlp" else 2
                    extra = {} if family == "scatter" else {"n_rows": n_rows}

                    def call(fn, *operands, lead=lead, routed=(rmap, offsets), extra=extra):
                        return fn(*operands[:lead], *routed, *operands[lead:], **extra)
                    if mx:  # float32 in, no gradients
                        with poisoned(torch):
                            y = call(entry.fused, *inputs)
                        r = call(entry.unfused, *inputs)
                        if isinstance(y, tuple):  # MXFP8 codes and scales: compare the values
                            y, r = (c.float() * sc.float().repeat_interleave(32, dim=-1) for c, sc in (y, r))
                        errors = [rel_error(y, r)]
                    else:
                        errors = vs_reference(torch, partial(call, entry.fused), partial(call, entry.unfused),
                                              inputs, lambda r, g=g: randn(torch, g, tuple(r.shape)),
                                              ref_dtype=torch.float32)
                    tol = 1e-3 if mx else (1e-4 if dtype == torch.float32 else 2e-2)
                    shape = f"{label} {str(dtype)[6:]}" + (f", padded to {align}" if align > 1 else "")
                    for i, err in enumerate(errors):
                        rep.check(f"fused_moe {name} {f'grad {i - 1}' if i else 'fwd'}", shape, err, tol)


def section_permute(torch, dev, rep: Report, shapes: dict) -> None:
    """The row-id map, permute and unpermute, forward and backward (the gradient of the
    router weights included), packed and with each expert's rows padded to 16."""
    from moe_lab.kernels import permute as P

    for label, (T, k, E, d) in shapes.items():
        for align in (1, 16):
            g = torch.Generator(device=dev).manual_seed(align)
            ids = torch.randint(0, E, (T, k), generator=g, device=dev)
            n_rows = P.permuted_rows(T, k, E, align)
            rmap_ref, off_ref = P.make_row_id_map_reference(ids, E, align)
            for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
                shape = f"{label} {str(dtype)[6:]}" + (f", padded to {align}" if align > 1 else "")
                x, y_in, dy, dout = (randn(torch, g, size, dtype)
                                     for size in ((T, d), (n_rows, d), (n_rows, d), (T, d)))
                wts = torch.rand(T, k, generator=g, device=dev)
                with poisoned(torch):
                    rmap, offsets = P.make_row_id_map(ids, E, align=align)
                    y = P.permute(x, rmap, n_rows)
                rep.exact("row_id_map", shape, torch.equal(rmap.long(), rmap_ref.long())
                          and torch.equal(offsets.long(), off_ref.long()))
                rep.exact("permute", shape, torch.equal(y, P.permute_reference(x, rmap_ref, n_rows)))
                _, dx = vs_reference(torch, lambda x, m=rmap, n=n_rows: P.permute(x, m, n),
                                     lambda x, m=rmap_ref, n=n_rows: P.permute_reference(x, m, n), (x,), dy)
                errors = vs_reference(torch, lambda y, w, m=rmap: P.unpermute(y, m, w),
                                      lambda y, w, m=rmap_ref: P.unpermute_reference(y, m, w),
                                      (y_in, wts), dout)
                for name, err in zip(("permute backward dX", "unpermute (weighted)", "unpermute backward dY",
                                      "unpermute backward d(router weights)"), (dx, *errors), strict=True):
                    rep.check(name, shape, err, tol)


def section_mx(torch, dev, rep: Report, shapes: dict) -> None:
    """The MX quantizer bit for bit against `moe_lab.quant.mx.quantize`: bfloat16 and float32
    input, E4M3 and E5M2 elements, ``rceil`` and ``floor`` scales, row- and column-wise."""
    from moe_lab.kernels.mx_quantize import mx_quantize
    from moe_lab.quant.mx import quantize

    def same(a, b) -> bool:  # codes and scales, byte for byte
        return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                   for x, y in ((a.data, b.data), (a.scale, b.scale)))

    for label, (M, K) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(M + K)
        base = randn(torch, g, (M, K)) * torch.logspace(-3, 3, K, device=dev)
        for in_dtype in (torch.bfloat16, torch.float32):
            x = base.to(in_dtype)
            for elem, elem_name in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
                for mode in ("rceil", "floor"):
                    shape = f"{label} {str(in_dtype)[6:]}->{elem_name} {mode}"
                    with poisoned(torch):
                        row, col = mx_quantize(x, elem_dtype=elem, scale_mode=mode)
                    ref_r = quantize(x, elem, dim=-1, scale_mode=mode)
                    ref_c = quantize(x, elem, dim=-2, scale_mode=mode)
                    rep.exact("mx_quantize rowwise", shape, same(row, ref_r))
                    rep.exact("mx_quantize colwise", shape, same(col, ref_c))


def topk_margin_ulps(torch, logits, cfg, bias):
    """Per token, the reference's top-k margin in float32 ulps: the smallest gap between
    the selection scores it ranks — the ``top_k + 1`` best experts (allowed groups only) and,
    with groups, the group scores at the ``topk_groups`` cut — over the spacing of float32
    numbers at the larger of the two. A gap this small may be ranked either way by a kernel
    whose ``exp``/sigmoid is a few ulps off."""
    scores = logits.float().softmax(-1) if cfg.score_func == "softmax" else logits.float().sigmoid()
    sel = (scores if bias is None else scores + bias.float()).double()
    T, E = sel.shape

    def ulps(a, b):
        big = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(torch.float32).tiny)
        spacing = torch.exp2(torch.floor(torch.log2(big)) - 23)
        gap = ((a - b).abs() / spacing)
        return torch.where(torch.isfinite(gap), gap, torch.full_like(gap, float("inf")))

    margins = []
    if cfg.n_groups > 1:
        grouped = sel.view(T, cfg.n_groups, E // cfg.n_groups)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        ranked_groups = group_scores.sort(dim=-1, descending=True)
        if cfg.topk_groups < cfg.n_groups:
            g = ranked_groups.values
            margins.append(ulps(g[:, cfg.topk_groups - 1], g[:, cfg.topk_groups]))
        keep = torch.zeros(T, cfg.n_groups, dtype=torch.bool, device=sel.device)
        keep.scatter_(1, ranked_groups.indices[:, :cfg.topk_groups], True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // cfg.n_groups, dim=1), float("-inf"))
    ranked = sel.topk(min(cfg.top_k + 1, E), dim=-1).values
    margins.append(ulps(ranked[:, :-1], ranked[:, 1:]).min(dim=-1).values)
    return torch.stack(margins, dim=-1).min(dim=-1).values


def section_router(torch, dev, rep: Report, shapes: dict) -> None:
    """The fused router (``ROUTER_IMPLS["triton"]``) against the reference chain: ids (near
    ties aside, see `ROUTER_TIE_ULPS`), weights, counts, the per-sequence statistics (counts
    and score sums of each sequence, the sequence aux loss; sequences not a multiple of a
    program's tokens, so programs straddle them) and the gradient of the gate weight
    through all the losses. With ``n`` near-tie tokens of ``T`` the statistics that depend
    on the ids get ``4·n/T`` more tolerance (the gradient ``4·sqrt(n/T)``), and the counts
    are checked against the kernel's own ids instead of the reference's."""
    import torch.nn.functional as F

    from moe_lab.config import MoEConfig
    from moe_lab.kernels.fused_router import fused_router
    from moe_lab.moe.router import ROUTER_IMPLS, route

    for label, (T, seq_len, moe) in shapes.items():
        cfg = MoEConfig(d_expert=64, **moe)
        D, E, n_seqs = cfg.d_model, cfg.n_experts, T // seq_len
        g = torch.Generator(device=dev).manual_seed(T)
        x = randn(torch, g, (T, D))
        w = randn(torch, g, (E, D), scale=D**-0.5).requires_grad_()
        bias = randn(torch, g, (E,), scale=0.01)
        with poisoned(torch):
            got = ROUTER_IMPLS["triton"](x, w, cfg, bias, seq_len=seq_len)
            _, _, counts, prob_sums, _ = fused_router(got.logits.detach(), cfg, bias, seq_len=seq_len)
        want = route(x, w, cfg, bias, seq_len=seq_len)
        margin = topk_margin_ulps(torch, want.logits.detach(), cfg, bias)
        differ = (got.topk_ids != want.topk_ids).any(dim=-1)
        near = margin < ROUTER_TIE_ULPS
        n_tied = int((differ & near).sum())
        rep.exact("fused router ids", label, not bool((differ & ~near).any()),
                  near_ties=n_tied, differing_tokens=int(differ.sum()),
                  note=f"{int(near.sum())} of {T} tokens have a margin under {ROUTER_TIE_ULPS} ulps")
        same = ~differ
        rep.check("fused router weights", label,
                  rel_error(got.topk_weights[same], want.topk_weights[same]), 1e-5)
        own = F.one_hot(got.topk_ids, E).sum(1)  # [T, E] slots of each token, the kernel's ids
        rep.exact("fused router counts", label,
                  torch.equal(got.tokens_per_expert.long(), own.sum(0).long())
                  and (n_tied > 0 or torch.equal(got.tokens_per_expert, want.tokens_per_expert)))
        ids_for_seq = got.topk_ids if n_tied else want.topk_ids
        seq_counts = F.one_hot(ids_for_seq, E).sum(1).view(n_seqs, seq_len, E).sum(1)
        rep.exact("fused router counts per sequence", label, torch.equal(counts.long(), seq_counts))
        scores = want.scores.detach().double()
        seq_probs = (scores / scores.sum(-1, keepdim=True)).view(n_seqs, seq_len, E).sum(1)
        rep.check("fused router score sums per sequence", label, rel_error(prob_sums, seq_probs), 1e-5)
        widen = n_tied / T
        for name, tol in (("aux_loss", 1e-5 + 4 * widen), ("seq_aux_loss", 1e-5 + 4 * widen),
                          ("z_loss", 1e-5)):
            rep.check(f"fused router {name}", label,
                      rel_error(getattr(got, name).detach(), getattr(want, name).detach()), tol)
        dw = randn(torch, g, (T, cfg.top_k))
        grads = []
        for r in (got, want):
            loss = (r.topk_weights * dw).sum() + r.aux_loss + 3.0 * r.seq_aux_loss + 0.1 * r.z_loss
            grads.append(torch.autograd.grad(loss, (w,))[0])
        rep.check("fused router grad", label, rel_error(*grads), 1e-4 + 4 * math.sqrt(widen))


def bound_ratio(torch, got, want, bound) -> float:
    """The largest ``|got - want| / bound`` over the elements (where ``bound`` is 0 the two
    must be equal): at most 1 is within the bound; NaN where only one side is finite."""
    got, want = got.double(), want.double()
    if not bool((got.isfinite() == want.isfinite()).all()):
        return float("nan")
    finite = want.isfinite()
    err, bound = (got - want).abs()[finite], bound[finite]
    ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, float("inf"), 0.0))
    return float(ratio.max()) if ratio.numel() else 0.0


def section_mx_gemm(torch, dev, rep: Report, shapes: dict, grouped_shapes: dict) -> None:
    """The MXFP8 GEMM and the grouped MXFP8 GEMM (`moe_lab.kernels.mx_gemm`) against their
    float64 references on operands quantized by the reference quantizer, fp32 and bf16 out;
    the grouped one at the production layers' down projection (an idle expert, ragged
    segments). On a GPU in the arch's mode (`mx_mma_mode`); interpreted, the emulated and the
    fp8_promote modes (the latter's checks named "(fp8_promote)"), within the IEEE fp32
    summation bound as relative errors. Compiled in ``fp8_promote`` (sm_90), Hopper's FP8
    ``wgmma`` sums each 32-wide block in a narrow accumulator: each element is checked
    against `fp8_promote_bound` instead (the check's figure is the largest error over the
    bound, at most 1), and the relative error it measured is recorded beside it — the figure
    notebook 06 has had to leave unmeasured."""
    from moe_lab.kernels.common import INTERPRETED
    from moe_lab.kernels.mx_gemm import (
        grouped_mx_gemm,
        grouped_mx_gemm_reference,
        mx_gemm,
        mx_gemm_reference,
        mx_mma_mode,
    )
    from moe_lab.quant.mx import quantize
    from moe_lab.workbench.measure.mx_bounds import fp8_promote_bound

    modes = (None, "fp8_promote") if INTERPRETED else (None,)  # None: the device's own
    hardware_mode = None if INTERPRETED else mx_mma_mode(False, torch.device(dev))

    def cases():  # (name, kernel, reference, shape, operands, (offsets,) or ()), the plain GEMMs first
        for label, (M, N, K) in shapes.items():
            g = torch.Generator(device=dev).manual_seed(M + N + K)
            a, b = quantize(randn(torch, g, (M, K))), quantize(randn(torch, g, (N, K)))
            yield "mx_gemm", mx_gemm, mx_gemm_reference, label, (a.data, a.scale, b.data, b.scale), ()
        for label, s in grouped_shapes.items():
            E, M, N, K = s["n_experts"], s["tokens"] * s["top_k"], s["d_model"], s["d_expert"]
            g = torch.Generator(device=dev).manual_seed(E + M)
            counts = torch.bincount(torch.randint(1, E, (M,), generator=g, device=dev), minlength=E)
            offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
            a, b = quantize(randn(torch, g, (M, K))), quantize(randn(torch, g, (E, N, K)))
            yield ("grouped_mx_gemm", grouped_mx_gemm, grouped_mx_gemm_reference,
                   f"{label} M={M} N={N} K={K}", (a.data, a.scale, b.data, b.scale), (offsets,))

    for kernel_name, kernel, reference, shape, operands, grouped in cases():
        want = reference(*operands, *grouped)
        for out_dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            for mma in modes:
                with poisoned(torch):
                    got = kernel(*operands, *grouped, out_dtype=out_dtype, mma=mma)
                name = f"{kernel_name} {str(out_dtype)[6:]} out{f' ({mma})' if mma else ''} vs float64"
                if hardware_mode != "fp8_promote":
                    rep.check(name, shape, rel_error(got, want), tol)
                    continue
                bound = fp8_promote_bound(*operands, *grouped, out_dtype=got.dtype)
                rep.check(f"{name} within the fp8_promote bound", shape, bound_ratio(torch, got, want, bound),
                          1.0, measured_rel_error=rel_error(got, want),
                          note="figure: largest |error| / bound; measured_rel_error: the hardware's")


def section_attention(torch, dev, rep: Report, shapes: dict) -> None:
    """MXFP8 attention (causal) against its emulation and against float64 SDPA (interpreted:
    the emulated and the fp8_promote products)."""
    import torch.nn.functional as F

    from moe_lab.attention import mxfp8_reference_attention
    from moe_lab.kernels.common import INTERPRETED
    from moe_lab.kernels.mx_attention import mx_attention_forward, quantize_qkv

    for label, (B, H, T, D) in shapes.items():
        g = torch.Generator(device=dev).manual_seed(T + D)
        q, k, v = (randn(torch, g, (B, H, T, D)) for _ in range(3))
        ref = mxfp8_reference_attention(q, k, v)
        for mma in (None, "fp8_promote") if INTERPRETED else (None,):
            with poisoned(torch):
                out = mx_attention_forward(*quantize_qkv(q, k, v), mma=mma)
            rep.check(f"mxfp8 attention{f' ({mma})' if mma else ''} vs emulation", label,
                      rel_error(out, ref), 5e-2)
        del ref
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        rep.check("mxfp8 attention vs fp64", label, rel_error(out, exact), 1e-1)


def section_graphs(torch, dev, rep: Report, quick: bool) -> None:
    """The graphed step (`moe_lab.training.graphs.GraphedStep` over the fast implementations
    of this device: on CUDA the Triton kernels) against the *eager reference*: the same
    sync-free step, not captured, over the plain PyTorch implementations (naive dispatch, a
    loop over experts, the reference router), from the same weights on the same batches.
    The first step's loss differs by the kernels alone; the mean over the steps also by
    how the differences grow through training."""
    from moe_lab.config import preset
    from moe_lab.model import ModelImpls
    from moe_lab.training.build import build_model, default_impls, random_batch
    from moe_lab.training.graphs import GraphedStep
    from moe_lab.training.steps import StepConfig, SyncFreeStep

    model_cfg = preset("small")
    batch_size, steps = (2, 3) if quick else (4, 20)
    cfg = StepConfig(read_every=1, warmup_steps=min(5, steps), steps=steps)
    gen = torch.Generator().manual_seed(1)
    batches = [random_batch(model_cfg, batch_size, dev, gen) for _ in range(steps)]
    ref_model, ref_opt = build_model(model_cfg, ModelImpls(), device=dev, seed=0, lr=cfg.lr)
    reference = SyncFreeStep(ref_model, ref_opt, batches[0], cfg)
    fast = default_impls(dev)
    model, optimizer = build_model(model_cfg, fast, device=dev, seed=0, lr=cfg.lr)
    model.load_state_dict(ref_model.state_dict())  # the same weights, whatever the impls
    graphed = GraphedStep(model, optimizer, batches[0], cfg, quiet=True)
    losses = [(reference(b)["loss"], graphed(b)["loss"]) for b in batches]
    want, got = torch.tensor(losses, dtype=torch.float64).T
    impls = {"graphed": f"{graphed.mode}: {fast}", "reference": f"eager: {ModelImpls()}"}
    rep.check("graphed step loss vs eager reference (step 1)", "small", rel_error(got[0], want[0]), 1e-4,
              **impls)
    rep.check(f"graphed step loss vs eager reference (mean of {steps})", "small",
              rel_error(got.mean(), want.mean()), 1e-3, **impls)


# ----------------------------------------------------------------------------- sections: CUDA's own word


def expert_backends_here(torch, dev) -> list[str]:
    """The sync-free expert backends of the core this device runs: ``torch``, ``triton`` and,
    on sm_90 and later, ``triton_tma``."""
    hopper = torch.device(dev).type == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    return ["torch", "triton", *(["triton_tma"] if hopper else [])]


def sync_free_paths(torch, dev, small: bool) -> dict:
    """Each path the workbook certifies sync-free, as ``name -> call``: the dropless layer's
    forward and backward on each expert backend this device runs (bf16 on CUDA), a sync-free
    training step and the same step captured as a CUDA graph (CUDA only)."""
    from moe_lab import MoELayer
    from moe_lab.config import MoEConfig, preset
    from moe_lab.training.build import build_model, default_impls, random_batch
    from moe_lab.training.steps import StepConfig, SyncFreeStep

    cuda = torch.device(dev).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = MoEConfig(d_model=64, n_experts=8, top_k=2, d_expert=32)
    x = torch.randn(4 if small else 64, 16, cfg.d_model, device=dev, dtype=dtype, requires_grad=True)
    paths = {}
    for backend in expert_backends_here(torch, dev):
        layer = MoELayer(cfg, "dropless", backend).to(device=dev, dtype=dtype)

        def layer_step(layer=layer):
            out, _ = layer(x)
            torch.autograd.grad(out.sum(), (x, *layer.parameters()))

        paths[f"dropless layer fwd+bwd ({backend}, {str(dtype)[6:]})"] = layer_step
    model_cfg = preset("tiny")
    batch = random_batch(model_cfg, 2, dev, torch.Generator().manual_seed(0))
    model, optimizer = build_model(model_cfg, default_impls(dev), device=dev, seed=0)
    step = SyncFreeStep(model, optimizer, batch, StepConfig(read_every=10**6))
    paths["sync-free training step (tiny)"] = lambda: step.launch(batch)
    if cuda:
        from moe_lab.training.graphs import GraphedStep

        g_model, g_opt = build_model(model_cfg, default_impls(dev), device=dev, seed=0)
        graphed = GraphedStep(g_model, g_opt, batch, StepConfig(read_every=10**6), quiet=True)
        paths["graphed training step, replay (tiny)"] = lambda: graphed.launch(batch)
    return paths


@contextlib.contextmanager
def one_f_one_b_path(torch, dev):
    """The 1F1B schedule (`moe_lab.parallel.merged_model.MergedModelStep`) of the tiny preset
    on a process group of one rank made here, as ``{name: call}``: one step of two micro-batches. It
    syncs by design (the split sizes of its count exchange go to the host)."""
    import torch.distributed as dist

    from moe_lab import MoELayer
    from moe_lab.config import preset
    from moe_lab.model import MoETransformer
    from moe_lab.parallel.ep import from_layer
    from moe_lab.parallel.merged_model import MergedModelStep
    from moe_lab.training.build import random_batch

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if torch.device(dev).type == "cuda" else "gloo",
                                store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            cfg = preset("tiny")
            dtype = torch.bfloat16 if torch.device(dev).type == "cuda" else torch.float32
            model = MoETransformer(cfg, dispatcher="dropless", expert_backend="torch").to(dev, dtype)
            for block in model.blocks:
                if isinstance(block.ffn, MoELayer):
                    block.ffn = from_layer(block.ffn)
            batch = random_batch(cfg, 2, dev, torch.Generator().manual_seed(0))
            step = MergedModelStep(model, 1, "1f1b")
            yield {"1F1B schedule step (tiny, one rank)": lambda: step.step(batch.x, batch.y, 2) and None}
        finally:
            dist.destroy_process_group()


def section_sync_debug(torch, dev, rep: Report, small: bool) -> None:
    """Ground truth for syncs: each sync-free path (`sync_free_paths`) once to
    warm up, then under CUDA's detector in ``"error"`` mode
    (`moe_lab.workbench.demos.sync_debug.sync_debug_report`), where any device-to-host sync
    fails by name — one inside a C++ operator too — beside what
    `moe_lab.training.sync.count_syncs` (the host-side count the notebooks and the certificate
    rest on) counts for the same call. A path that syncs by design (the 1F1B schedule,
    `one_f_one_b_path`) runs in ``"warn"`` mode instead: CUDA's count of syncs must equal the
    counter's. On a CPU there is no CUDA detector: the section says so and checks nothing."""
    from moe_lab.training.sync import count_syncs
    from moe_lab.workbench.demos.sync_debug import sync_debug_report

    if not torch.cuda.is_available():
        rep.note("no-op: torch.cuda.set_sync_debug_mode watches CUDA syncs; this run has no CUDA device")
        return
    with one_f_one_b_path(torch, dev) as counted:
        for name, call in counted.items():
            call()  # warm-up
            _, by_counter = count_syncs(call)
            by_cuda = sync_debug_report(call, mode="warn").syncs
            rep.exact(f"CUDA's sync count = the counter's: {name}", "CUDA sync debug mode 'warn'",
                      by_cuda == sum(by_counter.values()), cuda_syncs=by_cuda,
                      counted_syncs=sum(by_counter.values()), note=", ".join(sorted(by_counter)))
    for name, call in sync_free_paths(torch, dev, small).items():
        call()  # warm-up: first calls compile, allocate, read device properties
        _, by_counter = count_syncs(call)
        cuda = sync_debug_report(call, mode="error")
        caught = cuda.stopped_at and f"{cuda.error} (at {cuda.stopped_at.where})"
        rep.exact(f"no device-to-host sync: {name}", "CUDA sync debug mode 'error'",
                  not caught and not by_counter, cuda_detector=caught or "no sync",
                  counted_syncs=sum(by_counter.values()), note=caught or "")


def section_notebook_branches(torch, dev, rep: Report, small: bool) -> None:
    """The notebooks' own device branches, through the package functions they call: 03's
    grouped matmul (the learner's kernel as its reference solution, with the solution's
    row lookup, `nb03_triton_from_zero.run_grouped_matmul`) against the textbook loop in
    the dtype the notebook's device multiplies in, and 04's dropless layer on each expert
    backend against the naive layer of the same weights (the layer's speed is notebook 04's
    headline, timed by `bench_dispatch`)."""
    from moe_lab import MoELayer
    from moe_lab.config import MoEConfig
    from moe_lab.kernels.common import INTERPRETED
    from moe_lab.kernels.grouped_gemm import grouped_gemm_reference
    from moe_lab.workbench.exercises import nb03_triton_from_zero as nb03

    # as notebook 03's DOT_DTYPE; the layer's too: interpreted is on the CPU here (`preflight`)
    dtype = torch.float32 if INTERPRETED else torch.bfloat16
    counts = [5, 0, 37, 1] if small else [900, 0, 3000, 196]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    K, N = (32, 48) if small else (1024, 2048)
    g = torch.Generator(device=dev).manual_seed(3)
    x = randn(torch, g, (sum(counts) + 3, K), dtype)  # rows past the last segment, as in 03
    w = randn(torch, g, (len(counts), K, N), dtype, K ** -0.5)
    y = nb03.run_grouped_matmul(nb03.expert_rows, x, w, offsets)
    want = grouped_gemm_reference(x.double(), w.double(), offsets)
    rows = int(offsets[-1])
    rep.check("03 grouped matmul (solution) vs loop", f"E={len(counts)} M={rows} K={K} N={N}",
              rel_error(y[:rows], want[:rows]), 1e-2 if dtype == torch.bfloat16 else 1e-5)
    cfg = MoEConfig(d_model=64 if small else 1024, n_experts=8, top_k=2, d_expert=32 if small else 512)
    tokens = randn(torch, g, (64 if small else 8192, cfg.d_model), dtype)
    naive = MoELayer(cfg, "naive").to(device=dev, dtype=dtype)
    want, _ = naive(tokens)
    for backend in expert_backends_here(torch, dev):
        layer = MoELayer(cfg, "dropless", backend).to(device=dev, dtype=dtype)
        layer.load_state_dict(naive.state_dict())
        got, _ = layer(tokens)
        rep.check(f"04 dropless layer ({backend}) vs naive", f"T={tokens.shape[0]} {str(dtype)[6:]}",
                  rel_error(got, want), 2e-2 if dtype == torch.bfloat16 else 1e-5)


def section_registers(rep: Report) -> None:
    """Registers and spills the driver reports for every kernel launched so far, beside the
    compile report's figures for the same kernel and config (``results/compile/sm_XX.json``
    of this GPU's architecture, matched by kernel, blocks, warps and stages). Interpreted,
    nothing is compiled: the section reads no kernel."""
    arch = f"sm_{rep.env['capability'].replace('.', '')}" if rep.env.get("capability") else "sm_90"
    path = ROOT / "results" / "compile" / f"{arch}.json"
    report_rows = json.loads(path.read_text())["rows"] if path.exists() else []

    def key(row: dict, blocks: dict) -> tuple:  # a launch or a report row: kernel, blocks, warps, stages
        return (row["kernel"], tuple(sorted((k, v) for k, v in blocks.items() if k.startswith("BLOCK"))),
                row["num_warps"], row["num_stages"])

    by_key: dict[tuple, list[dict]] = {}
    for row in report_rows:
        by_key.setdefault(key(row, row["blocks"]), []).append(row)
    launched = compiled_kernels() + rep.launched  # here and in the children
    for k in launched:
        matches = by_key.get(key(k, k["constexprs"]), [])
        regs = sorted({m["registers"] for m in matches})
        spills = sorted({m.get("spill_bytes") for m in matches})
        rep.kernels.append({"kernel": k["kernel"], "config": describe_config(k["constexprs"], k["num_warps"],
                                                                             k["num_stages"]),
                            "registers": k["registers"], "spills": k["spills"],
                            "report_registers": "/".join(map(str, regs)) or "not in the report",
                            "report_spill_bytes": "/".join(map(str, spills)) or "-"})
    print(f"  {len(launched)} compiled kernels read; {len(report_rows)} rows in {path.name}", flush=True)


def section_ceilings(torch, dev, rep: Report, small: bool) -> None:
    from moe_lab.workbench.measure import ceilings

    copy = ceilings.copy_bandwidth(nbytes=2**24 if small else 2**31, device=dev)
    peak = ceilings.matmul_peak(torch.bfloat16, n=512 if small else 8192, device=dev)
    rep.timed("ceilings", copy_gbps=copy.giga, bf16_matmul_tflops=peak.giga / 1e3)


def bench_grouped_gemm(torch, dev, rep: Report, small: bool) -> None:
    """The grouped GEMM forward, bf16, against ``torch._grouped_mm`` (where this torch has one
    for this GPU) and the persistent TMA kernel, at DeepSeek-V3's up/gate projection on one
    GPU of EP8 (``K`` and ``N`` multiples of 8: TMA's 16-byte rows)."""
    from moe_lab.kernels.grouped_gemm import grouped_gemm
    from moe_lab.kernels.grouped_gemm_tma import grouped_gemm_tma

    E, M, K, N = (4, 256, 64, 128) if small else (32, 16384, 7168, 4096)

    counts = torch.full((E,), M // E, device=dev)
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16)
    flops = 2 * M * K * N
    t_tr = seconds(lambda: grouped_gemm(x, w, offsets))
    row = {"shape": f"E={E} M={M} K={K} N={N} bf16", "triton_ms": t_tr * 1e3,
           "triton_tflops": flops / t_tr / 1e12}
    with contextlib.suppress(RuntimeError):  # no _grouped_mm kernel for this GPU or dtype
        t_ref = seconds(lambda: torch._grouped_mm(x, w, offs=offsets[1:]))
        row.update(torch_grouped_mm_ms=t_ref * 1e3, torch_tflops=flops / t_ref / 1e12,
                   ratio_triton_to_torch=t_ref / t_tr)
    t_tma = seconds(lambda: grouped_gemm_tma(x, w, offsets))
    row.update(tma_ms=t_tma * 1e3, tma_tflops=flops / t_tma / 1e12, ratio_tma_to_cp_async=t_tr / t_tma)
    rep.timed("grouped GEMM fwd", **row)


def bench_tuning(torch, dev, rep: Report, shapes: dict, small: bool) -> None:
    """`moe_lab.workbench.measure.autotune` over its `tune_space` for every
    grouped GEMM launch of the layers of ``shapes`` (bf16; ``small``: the first two configs of
    each space, to exercise the tuner), each in the layout the layer launches it (the dX
    launches read the weight through its transposed view): the winner (tile, warps, stages
    and, for the tile-ordered kernels, ``GROUP_M``) and its gain over the rule per launch, all
    timed in this run. The table of winners is rewritten to the run's ``tuned_configs.json`` after
    every launch tuned (a run cut short keeps what it tuned); no launch reads a table: a winner
    is applied explicitly (`moe_lab.kernels.grouped_gemm.FORCED`)."""
    from moe_lab.kernels import grouped_gemm as gg
    from moe_lab.workbench.measure import autotune as tuner

    dtype, table = torch.bfloat16, {}
    # gemm: the op the forward and the dX launch (no copy of the transposed view)
    ops = {"gemm": torch.ops.moe_lab.grouped_gemm, "swiglu": gg.grouped_gemm_swiglu,
           "dw": torch.ops.moe_lab.grouped_gemm_dw}
    for label, s in shapes.items():
        E, m, d, f = s["n_experts"], s["tokens"] * s["top_k"], s["d_model"], s["d_expert"]
        counts = torch.full((E,), m // E, device=dev)
        offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
        for kernel, n, k, transposed in layer_launches(d, f):
            key = tuner.table_key(kernel, m, n, k, E, dtype)
            if key in table:
                continue
            if kernel == "dw":  # x and dY
                x, w = (torch.randn(m, c, device=dev, dtype=dtype) for c in (k, n))
            else:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                n_w = 2 * n if kernel == "swiglu" else n
                w = (torch.randn(E, n_w, k, device=dev, dtype=dtype).transpose(1, 2) if transposed
                     else torch.randn(E, k, n_w, device=dev, dtype=dtype))
            run = partial(ops[kernel], x, w, offsets)
            space = tuner.tune_space(kernel, m, n, k, E, dtype)[:2 if small else None]
            winner, times = tuner.autotune(kernel, space, run, seconds)
            table[key] = tuner.table_entry(winner)
            best = min(times)
            rep.timed(f"tuned {kernel}", shape=f"{label} {key}", configs=len(space),
                      weight="transposed view" if transposed else "contiguous",
                      rule=describe_config(space[0].blocks, space[0].num_warps, space[0].num_stages),
                      rule_group_m=space[0].group_m, rule_ms=times[0] * 1e3,
                      winner=describe_config(winner.blocks, winner.num_warps, winner.num_stages),
                      winner_group_m=winner.group_m, winner_ms=best * 1e3,
                      ratio_rule_to_winner=times[0] / best)
            put(rep.out / tuner.TUNED_FILE, dump({"gpu": rep.env.get("gpu"), "triton": rep.env.get("triton"),
                                                   "dtype": "bfloat16", "configs": table}))


def bench_mx_quantize(torch, dev, rep: Report, M: int, K: int) -> None:
    """The quantizer (both layouts) in GB/s, beside the copy bandwidth of the ceilings section."""
    from moe_lab.kernels.mx_quantize import mx_quantize

    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    t = seconds(lambda: mx_quantize(x))
    nbytes = x.numel() * 2 + 2 * (x.numel() + x.numel() // 32)
    gbps = nbytes / t / 1e9
    copy_gbps = next((b["copy_gbps"] for b in rep.bench if b["bench"] == "ceilings"), None)
    rep.timed("mx_quantize (row+col)", shape=f"{M}x{K}", ms=t * 1e3, gbps=gbps, copy_gbps=copy_gbps,
              fraction_of_copy=gbps / copy_gbps if copy_gbps else None)


def bench_dispatch(rep: Report, small: bool) -> None:
    """04 and 07: the MoE layer's forward + backward at the notebooks' fine-grained shape
    (the smoke run: the coarse one), every dispatcher against the naive one
    (`moe_lab.workbench.benchmarks.moe_layer`)."""
    from moe_lab.workbench.benchmarks.moe_layer import run_shape

    tokens, min_time_s, shape = (64, 0.02, "coarse") if small else (16384, 0.3, "fine")
    result = run_shape(shape, tokens, min_time_s=min_time_s, include_hf=False,
                       only=["dropless torch", "dropless triton", "fused", "fused_atomic"])
    rows = {r["provider"]: r for r in result["rows"]}
    for r in result["rows"]:
        rep.timed(f"MoE layer fwd+bwd ({r['provider']})", shape=f"{shape}, {tokens} tokens",
                  median_ms=r["median_ms"], vs_naive=r["vs_naive"], syncs_per_step=r["syncs_per_step"])
    dropless = "dropless triton" if "dropless triton" in rows else "dropless torch"
    rep.gain("04", f"{dropless} vs naive dispatch", rows[dropless]["vs_naive"], "x",
             f"MoE layer fwd+bwd, {shape} shape, {tokens} tokens, {result['dtype']}")
    if "fused" in rows:  # a Triton kernel: timed where Triton runs compiled
        rep.gain("07", "fused vs unfused dropless", rows[dropless]["median_ms"] / rows["fused"]["median_ms"],
                 "x", f"MoE layer fwd+bwd, {shape} shape, {tokens} tokens, fused vs {dropless}")
    for note in result["notes"]:
        print(f"  note: {note}", flush=True)


def bench_router(torch, dev, rep: Report, T: int, moe: dict) -> None:
    """04: the fused FP32 router against the unfused chain (fp64 and fp32)."""
    from moe_lab.config import MoEConfig
    from moe_lab.moe.router import ROUTER_IMPLS, route

    fused = ROUTER_IMPLS["triton"]
    cfg = MoEConfig(d_expert=64, **moe)
    D, E = cfg.d_model, cfg.n_experts
    x = torch.randn(T, D, device=dev)
    w = torch.randn(E, D, device=dev) / D**0.5
    times = {}
    for dtype in ("fp64", "fp32"):
        c = cfg.replace(router_dtype=dtype)
        times[f"unfused_{dtype}_ms"] = seconds(lambda c=c: route(x, w, c)) * 1e3
    times["fused_fp32_ms"] = seconds(lambda: fused(x, w, cfg, None)) * 1e3
    shape = f"T={T} E={E} top{cfg.top_k} groups {cfg.topk_groups}/{cfg.n_groups}"
    rep.timed("router fwd", shape=shape, **times,
              speedup_vs_unfused_fp64=times["unfused_fp64_ms"] / times["fused_fp32_ms"])
    rep.gain("05", "fused router vs unfused fp64 chain", times["unfused_fp64_ms"] / times["fused_fp32_ms"],
             "x", f"router forward, {shape}")


def bench_mxfp8(torch, dev, rep: Report, at_shapes: dict, mg_shape: tuple) -> None:
    """06: MXFP8 attention vs bf16 SDPA at each head dim, the MXFP8 GEMM vs a bf16 matmul; the
    notes name the MX mode the kernels ran in (`moe_lab.kernels.mx_gemm.mx_mma_mode` says what
    each computes)."""
    import torch.nn.functional as F

    from moe_lab.kernels.common import INTERPRETED
    from moe_lab.kernels.mx_attention import mx_attention_forward, quantize_qkv
    from moe_lab.kernels.mx_gemm import mx_gemm, mx_mma_mode
    from moe_lab.quant.mx import quantize

    mx_mode = mx_mma_mode(INTERPRETED, torch.device(dev) if torch.device(dev).type == "cuda" else None)
    for label, (B, H, T, D) in at_shapes.items():
        q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
        qm, km, vm = quantize_qkv(q, k, v)
        t_mx = seconds(lambda qm=qm, km=km, vm=vm: mx_attention_forward(qm, km, vm))
        t_bf = seconds(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        flops = 4 * B * H * T * T * D / 2
        rep.timed("attention fwd", shape=label, mxfp8_triton_ms=t_mx * 1e3, bf16_sdpa_ms=t_bf * 1e3,
                  mxfp8_tflops=flops / t_mx / 1e12, sdpa_tflops=flops / t_bf / 1e12, speedup=t_bf / t_mx,
                  note=f"QK^T and PV in MX mode {mx_mode}")
        rep.gain("06", f"MXFP8 attention vs bf16 SDPA (head dim {D})", t_bf / t_mx, "x",
                 f"causal forward {label}")
    M, N, K = mg_shape
    x, w = torch.randn(M, K, device=dev), torch.randn(N, K, device=dev)
    a, b = quantize(x), quantize(w)
    xb, wb = x.bfloat16(), w.bfloat16()
    t_mx = seconds(lambda: mx_gemm(a.data, a.scale, b.data, b.scale, out_dtype=torch.bfloat16))
    t_bf = seconds(lambda: xb @ wb.T)
    flops = 2 * M * N * K
    rep.timed("MXFP8 GEMM", shape=f"{M}x{N}x{K}", mx_gemm_ms=t_mx * 1e3, bf16_matmul_ms=t_bf * 1e3,
              mx_tflops=flops / t_mx / 1e12, bf16_tflops=flops / t_bf / 1e12, speedup=t_bf / t_mx,
              note=f"MX mode {mx_mode}")
    rep.gain("06", "MXFP8 GEMM vs bf16 matmul", t_bf / t_mx, "x", f"{M}x{N}x{K}")


def bench_graphs(torch, dev, rep: Report, small: bool) -> None:
    """06: one training step as a CUDA graph against the same step eager."""
    from moe_lab.workbench.demos.graphed_vs_eager import graphed_vs_eager

    batch_size, steps = (2, 3) if small else (4, 20)
    result = graphed_vs_eager("small", batch_size=batch_size, steps=steps,
                              min_time_s=0.05 if small else 0.5, device=dev)
    rep.timed("training step (small), graphed vs eager", **result)
    rep.gain("08", "graphed vs eager training step", result["speedup"], "x",
             f"preset small, batch {batch_size}, mode {result.get('mode')}")


def bench_optimised_step(torch, dev, rep: Report, small: bool) -> None:
    """10: training tokens/s of one step of the optimised stack (and of the naive one, on the
    same batches), as notebook 12's ladder times them."""
    from moe_lab.workbench.benchmarks.ttt.contest import TTTConfig
    from moe_lab.workbench.benchmarks.ttt.racing import ladder_throughput
    from moe_lab.workbench.benchmarks.ttt.stacks import NAIVE, optimised_stack

    cfg = TTTConfig(preset="tiny", batch_size=2) if small else TTTConfig()
    stack = optimised_stack(dev, compile=False if small else None)  # the smoke run: no compile
    rows = ladder_throughput([("naive", NAIVE), ("optimised", stack)], cfg, device=dev,
                             min_time_s=0.05 if small else 2.0)
    for r in rows:
        rep.timed(f"training step tokens/s ({r['label']})", preset=cfg.preset, median_ms=r["median_ms"],
                  tokens_per_s=r["tokens_per_s"], vs_naive=r["vs_first"], stack=r["stack"])
    best = rows[-1]
    rep.gain("12", "tokens/s of the optimised training step", best["tokens_per_s"], "tokens/s",
             f"preset {cfg.preset}, {cfg.tokens_per_step} tokens a step; {best['vs_first']:.3g}x naive")


# ----------------------------------------------------------------------------- preflight


def preflight(cuda: bool, environ) -> dict[str, str]:
    """What the compiled path needs, each ``"ok ..."`` or why it cannot work, before anything
    runs: ``TRITON_INTERPRET`` unset where there is a GPU (set, every kernel would run
    interpreted — on the GPU's memory, slowly, without a word), a C compiler and Python's
    headers (Triton builds each kernel's launcher with them) and a writable Triton cache
    (``$TRITON_CACHE_DIR``, which `main` sets: shared by the child processes, so a kernel
    compiles once). Interpreted, only the cache matters."""
    found = {}
    interpret = environ.get("TRITON_INTERPRET", "")
    if cuda and interpret not in ("", "0"):
        found["TRITON_INTERPRET"] = (f"TRITON_INTERPRET={interpret} is set while a CUDA GPU is present: "
                                     "every kernel would run interpreted; unset it")
    else:
        found["TRITON_INTERPRET"] = "ok: " + ("unset (compiled)" if cuda else "interpreted (no CUDA)")
    if cuda:
        names = [environ["CC"]] if environ.get("CC") else ["cc", "gcc", "clang"]
        cc = next((shutil.which(n) for n in names if shutil.which(n)), None)
        found["C compiler"] = (f"ok: {cc}" if cc else f"no C compiler ({' / '.join(names)}): Triton "
                               "builds each kernel's launcher with one")
        include = Path(sysconfig.get_paths()["include"])
        found["Python.h"] = ("ok" if (include / "Python.h").is_file() else
                             f"no Python.h in {include}: Triton's launcher build needs Python's headers "
                             "(the python3-dev package)")
    cache = Path(environ["TRITON_CACHE_DIR"])
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cache).close()  # a file made and removed there
        found["Triton cache"] = f"ok: {cache}"
    except OSError as exc:
        found["Triton cache"] = f"Triton's cache {cache} is not writable ({exc}); set TRITON_CACHE_DIR"
    return found


# ----------------------------------------------------------------------------- main


def positive_seconds(text: str) -> float:
    with contextlib.suppress(ValueError):
        if math.isfinite(value := float(text)) and value > 0:
            return value
    raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")


def exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """A child ends when the run that started it (pid ``parent``, passed down: it may be gone
    before the child gets here) is gone, killed from outside where nobody could kill the
    child's group: a thread watches, since a hung section blocks the main thread and its
    signals."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def default_out(gpu: str | None) -> Path:
    """Where a run writes without ``--out``: ``results/<gpu slug>/`` on a GPU (committed),
    under ``build/`` for the smoke run (``gpu`` None), which must never leave files in
    ``results/``."""
    if gpu is None:
        return ROOT / "build" / "gpu_check" / "cpu_interpreted_smoke_run"
    return ROOT / "results" / slug(gpu)


def plan(torch, dev: str, rep: Report, cuda: bool, small: bool) -> list[Section]:
    """Every section of the run, in order: the core checks here; then the kernels that have
    never run on hardware before (the persistent TMA grouped GEMM, the MXFP8 kernels in
    their ``fp8_promote`` mode, CUDA-graph capture), CUDA's sync detector and the notebooks'
    device branches, each in a child process; the driver's registers; the figures, each
    headline after the checks of its kernels have passed; the tuner after the headlines
    (what a short budget cuts first)."""
    shapes = SMOKE if small else {"small": SMOKE["small"], **PRODUCTION}
    pm_shapes = {"T=64 k=2 E=8 d=64": (64, 2, 8, 64)}
    mx_shapes = {"128x256": (128, 256), "96x320": (96, 320)}  # 320: a second K tile
    head_dims = (64, 128, 192)
    at_shapes = {f"1x2x64x{d}": (1, 2, 64, d) for d in head_dims}
    mg_shapes = {"M=96 N=80 K=96": (96, 80, 96)}  # ragged against the tiles
    # router: tokens, sequence length (not a multiple of a program's tokens), MoEConfig fields
    rt_shapes = {
        "T=64 E=16 top4 g4/2 sigmoid, seqs of 16": (64, 16, dict(
            d_model=32, n_experts=16, top_k=4, n_groups=4, topk_groups=2, score_func="sigmoid",
            scaling_factor=2.5)),
        "T=48 E=8 top2 softmax, seqs of 6": (48, 6, dict(d_model=32, n_experts=8, top_k=2)),
    }
    if not small:
        pm_shapes["dsv3 T=4096 k=8 E=256 d=7168"] = (4096, 8, 256, 7168)
        mx_shapes["dsv3 8192x7168"] = (8192, 7168)
        at_shapes.update({f"2x16x4096x{d}": (2, 16, 4096, d) for d in head_dims})
        mg_shapes["dsv3 up/gate 8192x4096x7168"] = (8192, 4096, 7168)
        rt_shapes["gpt-oss T=8190 E=32 top4 softmax, seqs of 1365"] = (8190, 1365, dict(
            d_model=2880, n_experts=32, top_k=4))
        rt_shapes["dsv3 T=16380 E=256 top8 g8/4, seqs of 4095"] = (16380, 4095, dict(
            d_model=7168, n_experts=256, top_k=8, n_groups=8, topk_groups=4, score_func="sigmoid",
            scaling_factor=2.5))

    def mxfp8_kernels() -> None:
        section_mx_gemm(torch, dev, rep, mg_shapes, shapes)
        section_attention(torch, dev, rep, at_shapes)
        section_fused_moe(torch, dev, rep, shapes, mxfp8=True)

    router_tokens, _, router_moe = list(rt_shapes.values())[-1]  # the largest router, timed
    return [
        Section("grouped GEMM", lambda: section_grouped_gemm(torch, dev, rep, shapes)),
        Section("fused MoE", lambda: section_fused_moe(torch, dev, rep, shapes, mxfp8=False)),
        Section("permute", lambda: section_permute(torch, dev, rep, pm_shapes)),
        Section("MX quantizer", lambda: section_mx(torch, dev, rep, mx_shapes)),
        Section("fused router", lambda: section_router(torch, dev, rep, rt_shapes)),
        Section("TMA grouped GEMM", lambda: section_grouped_gemm(torch, dev, rep, shapes, tma=True),
                isolated=True),
        Section("MXFP8 kernels", mxfp8_kernels, isolated=True),
        Section("CUDA graph step", lambda: section_graphs(torch, dev, rep, small), isolated=True),
        # a no-op without CUDA, and the notebooks' branches are the core's kernels: in a child on a GPU
        Section("sync debug", lambda: section_sync_debug(torch, dev, rep, small), isolated=cuda),
        Section("notebooks 03 and 04 on the device",
                lambda: section_notebook_branches(torch, dev, rep, small), isolated=cuda),
        Section("registers and spills", lambda: section_registers(rep)),
        Section("ceilings", lambda: section_ceilings(torch, dev, rep, small)),
        Section("grouped GEMM bench", lambda: bench_grouped_gemm(torch, dev, rep, small),
                needs="TMA grouped GEMM"),
        Section("MX quantizer bench", lambda: bench_mx_quantize(torch, dev, rep,
                                                                *list(mx_shapes.values())[-1])),
        Section("04 dispatch vs naive and 07 fused vs unfused", lambda: bench_dispatch(rep, small)),
        Section("04 router", lambda: bench_router(torch, dev, rep, router_tokens, router_moe)),
        Section("06 MXFP8 attention and GEMM vs bf16", lambda: bench_mxfp8(
            torch, dev, rep, {k: v for k, v in at_shapes.items() if small or v[2] > 64},
            list(mg_shapes.values())[-1]), needs="MXFP8 kernels"),
        Section("06 graphed vs eager", lambda: bench_graphs(torch, dev, rep, small), needs="CUDA graph step"),
        Section("12 tokens/s of the optimised step", lambda: bench_optimised_step(torch, dev, rep, small),
                needs="CUDA graph step"),
        Section("tuning", lambda: bench_tuning(torch, dev, rep, shapes if small else PRODUCTION, small)),
    ]


def select(sections: list[Section], only: list[str] | None, skip: list[str] | None,
           finished: set[str]) -> list[Section]:
    """The sections this call runs: ``only`` (``--sections``) or all, less ``skip`` and less
    ``finished`` (with ``--resume``: those an earlier run finished)."""
    known = {slug(s.name): s.name for s in sections}
    for given in (only or []) + (skip or []):
        if slug(given) not in known:
            raise ValueError(f"unknown section {given!r}; the sections are: "
                             + ", ".join(repr(s.name) for s in sections))
    wanted = {known[slug(n)] for n in only} if only else set(known.values())
    wanted -= {known[slug(n)] for n in skip or []} | finished
    return [s for s in sections if s.name in wanted]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None,
                    help="results folder (default results/<gpu-name>; --cpu-smoke: build/gpu_check/...)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes under the interpreter")
    ap.add_argument("--budget-s", type=positive_seconds, default=480.0,
                    help="stop cleanly after this many seconds (default 480), results written")
    ap.add_argument("--section-timeout-s", type=positive_seconds, default=150.0,
                    help="a child process's section is killed after this many seconds (default 150)")
    ap.add_argument("--preflight", action="store_true", help="check what the compiled path needs, then stop")
    ap.add_argument("--sections", nargs="+", metavar="SECTION", help="run only these sections")
    ap.add_argument("--skip", nargs="+", metavar="SECTION", help="run every section but these")
    ap.add_argument("--resume", action="store_true",
                    help="run the sections the last run in --out did not finish; keep its other results")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # the section a child process runs
    ap.add_argument("--child-sink", help=argparse.SUPPRESS)
    ap.add_argument("--child-of", type=int, help=argparse.SUPPRESS)  # the parent's pid
    args = ap.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("no CUDA device: run with --cpu-smoke to exercise the script under the interpreter")
        return 2
    if not cuda:  # this script owns its process: its own test kernels run interpreted too
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # the smoke run tests this script, not the CPU plug-in: no C++ build on its path
        os.environ.setdefault("MOE_LAB_NO_CPU_EXTENSION", "1")
    # one cache for the children (Triton's default where none is set)
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))

    dev = "cuda" if cuda else "cpu"
    small = args.cpu_smoke
    out = Path(args.out) if args.out else default_out(None if small else torch.cuda.get_device_name(0))
    torch.manual_seed(0)

    if args.child:  # one section, in this fresh process; its records go to the sink
        exit_with_parent(args.child_of)
        Path(args.child_sink).with_suffix(".started").touch()  # the parent's clock for it starts now
        rep = Report(out, {}, args.budget_s, sink=Path(args.child_sink))
        rep.run(next(s for s in plan(torch, dev, rep, cuda, small) if s.name == args.child))
        rep.launched += [{**k, "section": args.child} for k in compiled_kernels()]
        rep.write()
        return 0

    found = preflight(cuda, os.environ)
    env = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "triton_mode": "compiled" if cuda and os.environ.get("TRITON_INTERPRET", "") in ("", "0")
           else "interpreted", "preflight": found}
    failed = not all(why.startswith("ok") for why in found.values())
    if failed or args.preflight:
        out.mkdir(parents=True, exist_ok=True)
        put(out / "env.json", dump(env))
        print("\n".join(f"preflight: {what}: {why}" for what, why in found.items()))
        if failed:
            print(f"the compiled path cannot work here; nothing run (env.json in {out})")
            return 2
        return 0
    env.update(gpu_env(torch))
    print(json.dumps(env), flush=True)

    if args.resume and not (out / "sections.json").is_file():
        ap.error(f"--resume: no earlier run in {out} (no sections.json)")
    # a call with --resume, --sections or --skip: one result with the earlier run's
    rep = Report(out, env, args.budget_s, earlier=bool(args.resume or args.sections or args.skip))
    sections = plan(torch, dev, rep, cuda, small)
    finished = {s["section"] for s in rep.sections if args.resume and s["status"].startswith("done")}
    try:
        chosen = select(sections, args.sections, args.skip, finished)
    except ValueError as exc:
        ap.error(str(exc))
    # a child is given this call's arguments (it uses --cpu-smoke) and the folder
    child_args = [*(sys.argv[1:] if argv is None else argv), "--out", str(out)]
    rep.write()
    for section in chosen:
        rep.run(section, child_args, args.section_timeout_s)

    print(f"\nresults in {out}\n{summary_markdown(rep)}")  # the summary says what passed and what did not run
    return 1 if not all(c["ok"] for c in rep.checks) else 3 if rep.unfinished() else 0


if __name__ == "__main__":
    sys.exit(main())
