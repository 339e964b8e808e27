"""Reading a compiled GPU kernel: resources off the cubin, instructions off the PTX, occupancy.

Triton compiles a kernel in stages — Triton IR, then PTX (NVIDIA's virtual assembly), then
``ptxas`` turns the PTX into a cubin, the machine code of one GPU architecture. Three
readings of the result tell a kernel's reviewer most of what matters before it ever runs:

- **Resources** (``cuobjdump -res-usage`` on the cubin): registers per thread, bytes of
  stack and local memory (where registers spill when there are too few), static shared
  memory. ``ptxas -v`` reports the same figures while it compiles (plus the spilled bytes
  on their own); `parse_ptxas_log` reads that log so the two accounts can be compared.
- **Instructions** (the PTX): which tensor-core instruction the matrix multiplies became —
  ``mma.sync`` (Ampere's warp-level MMA, operands in registers), ``wgmma.mma_async``
  (Hopper's warpgroup MMA, operands from shared memory, asynchronous) or ``tcgen05.mma``
  (Blackwell's, accumulating in tensor memory; ``kind::mxf8f6f4`` with ``block_scale`` is
  MX block-scaled FP8 done by the hardware) — and how operands reach shared memory: by
  ``cp.async`` (copies the SM issues and does not wait for) or ``cp.async.bulk.tensor``
  (TMA: one thread hands a whole tile to the copy engine), or through registers
  (``ld.global`` then ``st.shared``), in which case no copy overlaps the math.
- **Occupancy**: how many blocks of the kernel fit on one SM at once, the minimum over
  what its registers, its shared memory, the warp limit and the block limit allow
  (`moe_lab.perf.hardware.GPUArch`). More resident warps hide more latency; a kernel that
  feeds its tensor cores asynchronously needs fewer.

Pure text processing: nothing here imports Triton or torch.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections import Counter

from moe_lab.perf.hardware import GPUArch

# ------------------------------------------------------------------------------ resources

_FP8_CVT = re.compile(r"\s*cvt\.\S*\.e[45]m[23]x2\s")  # the source type is the last
_FUNCTION = re.compile(r"^\s*Function\s+(\S+?):[ \t]*\n(.*)$", re.M)  # its name, the next line
_FIELD = re.compile(r"([A-Z]+(?:\[\d+\])?):(\d+)")


def parse_res_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage`` output → ``{function: {"REG": …, "STACK": …, "SHARED": …,
    "LOCAL": …, …}}`` (every ``NAME:value`` field of the line after ``Function name:``)."""
    return {function: {name: int(value) for name, value in _FIELD.findall(fields)}
            for function, fields in _FUNCTION.findall(text)}


def parse_ptxas_log(text: str) -> dict[str, int]:
    """``ptxas -v`` output for one kernel → ``registers``, ``stack_bytes``,
    ``spill_store_bytes``, ``spill_load_bytes``, ``shared_bytes`` (static; 0 when the log
    names none)."""
    registers = re.search(r"Used (\d+) registers", text)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None or frame is None:
        raise ValueError(f"text must be a `ptxas -v` log with 'Used N registers', got {text[:300]!r}")
    shared = re.search(r"(\d+) bytes smem", text)
    return {"registers": int(registers.group(1)), "stack_bytes": int(frame.group(1)),
            "spill_store_bytes": int(frame.group(2)), "spill_load_bytes": int(frame.group(3)),
            "shared_bytes": int(shared.group(1)) if shared else 0}


# ------------------------------------------------------------------------------ instructions

_PREDICATE = re.compile(r"^@!?%?\w+\s+")
_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)\.(?:row\.col\.)?([\w.]+)")
_WGMMA = re.compile(r"\bwgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.([\w.]+)")
_TCGEN05 = re.compile(r"\btcgen05\.mma(?:\.ws)?\.cta_group::\d\.kind::(\w+)(\.block_scale)?")
# Newest first: a kernel's class is the newest tensor-core generation its PTX uses.
MMA_CLASSES = ("tcgen05.mma", "wgmma", "mma.sync")


def instructions(ptx: str) -> list[str]:
    """The PTX's instruction lines, stripped, without predicates, labels, directives or
    comments (``@%p1 cp.async…`` → ``cp.async…``)."""
    stripped = (raw.split("//", 1)[0].strip() for raw in ptx.splitlines())
    return [_PREDICATE.sub("", line) for line in stripped
            if line and not line.startswith((".", "$", "{", "}")) and not line.endswith(":")]


def opcode(line: str) -> str:
    """The instruction's name with its qualifiers: ``cp.async.wait_group 1;`` → ``cp.async.wait_group``."""
    return line.split(None, 1)[0].rstrip(";")


def mma_instructions(ptx: str) -> dict[str, object]:
    """The tensor-core MMAs in ``ptx``: ``class`` (``"tcgen05.mma"``, ``"wgmma"``,
    ``"mma.sync"`` — the newest present — or ``"none"``: CUDA cores only), ``kinds``
    (each distinct shape/type, e.g. ``"wgmma m64n64k16 f32.bf16.bf16"``, ``"tcgen05.mma
    kind::mxf8f6f4 block_scale"``), ``count`` (MMA instructions in the PTX, not executions)
    ``block_scaled`` (the hardware applies MX block scales) and ``fp8_upcasts`` (``cvt``
    instructions from an FP8 type, e.g. ``cvt.rn.f16x2.e4m3x2``: FP8 operands widened for a
    16-bit MMA, as ``tl.dot_scaled`` does on sm_90)."""
    kinds: Counter[str] = Counter()
    upcasts = 0
    block_scaled = False
    for line in instructions(ptx):
        upcasts += bool(_FP8_CVT.match(line))
        if match := _TCGEN05.search(line):
            scaled = bool(match.group(2)) or match.group(1).startswith("mx")
            block_scaled |= scaled
            kinds[f"tcgen05.mma kind::{match.group(1)}{' block_scale' if scaled else ''}"] += 1
        elif match := _WGMMA.search(line):
            kinds[f"wgmma {match.group(1)} {match.group(2)}"] += 1
        elif match := _MMA_SYNC.search(line):
            kinds[f"mma.sync {match.group(1)} {match.group(2)}"] += 1
    newest = next((name for name in MMA_CLASSES if any(k.startswith(name) for k in kinds)), "none")
    return {"class": newest, "kinds": sorted(kinds), "count": sum(kinds.values()),
            "block_scaled": block_scaled, "fp8_upcasts": upcasts}


def async_copies(ptx: str) -> dict[str, object]:
    """How operands reach shared memory, as counted in the PTX (instructions, not executions).

    ``kind``: ``"TMA"`` (``cp.async.bulk.tensor`` present), else ``"cp.async"`` (per-thread
    async copies), else ``"none"``. ``tma``, ``cp_async``: their counts; ``commit_groups``:
    ``cp.async.commit_group`` count; ``max_pending_groups``: the largest N of
    ``cp.async.wait_group N`` — a wait that leaves N groups in flight lets the copies of the
    next N tiles overlap this tile's math, so N ≥ 1 is the PTX's evidence of a multi-buffered
    loop; ``mbarrier_inits``, ``mbarrier_waits``: ``mbarrier.init`` and ``mbarrier.try_wait``
    counts (TMA copies and ``tcgen05`` MMAs both signal completion through mbarriers, so these
    count both); ``global_loads``: ``ld.global`` count (operands through registers).
    """
    ops = [opcode(line) for line in instructions(ptx)]
    tma = sum(op.startswith("cp.async.bulk.tensor") for op in ops)
    per_thread = sum(op.startswith(("cp.async.ca.", "cp.async.cg.")) for op in ops)
    pending = [int(m) for m in re.findall(r"\bcp\.async\.wait_group\s+(\d+)", ptx)]
    return {"kind": "TMA" if tma else ("cp.async" if per_thread else "none"), "tma": tma,
            "cp_async": per_thread,
            "commit_groups": sum(op == "cp.async.commit_group" for op in ops),
            "max_pending_groups": max(pending, default=0),
            "mbarrier_inits": sum(op.startswith("mbarrier.init") for op in ops),
            "mbarrier_waits": sum(op.startswith("mbarrier.try_wait") for op in ops),
            "global_loads": sum(op.startswith("ld.global") for op in ops)}


# The instructions a loop sketch keeps: data movement into and out of shared memory,
# synchronisation, and the MMAs themselves. Address arithmetic and the like are left out.
_SKETCH_PREFIXES = ("mma.", "wgmma.", "tcgen05.", "cp.async", "mbarrier.", "ld.global", "ld.shared",
                    "st.shared", "ldmatrix", "bar.sync", "barrier.", "fence.")
_LABEL = re.compile(r"^(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+);")


def _loops(ptx: str) -> list[tuple[int, int]]:
    """(first, last) line numbers of every backward branch's range, innermost first."""
    lines = ptx.splitlines()
    labels = {match.group(1): number for number, line in enumerate(lines)
              if (match := _LABEL.match(line.strip()))}
    loops = [(labels[match.group(1)], number) for number, line in enumerate(lines)
             if (match := _BRANCH.search(line)) and labels.get(match.group(1), number + 1) < number]
    return sorted(loops, key=lambda span: span[1] - span[0])


# Which sketch lines to keep first: the MMAs, then the async copies and their waits, then the rest.
_PRIORITY = (("mma.", "wgmma.mma_async", "tcgen05.mma"),
             ("cp.async", "mbarrier.try_wait", "wgmma.wait_group"))


def loop_sketch(ptx: str, max_lines: int = 14, width: int = 96) -> list[str]:
    """The innermost loop that holds a tensor-core MMA (else one with an async copy), as the
    instructions that move operands and multiply them, in program order, runs of the same
    instruction collapsed to one line with ``×N``. A longer loop keeps its MMA lines first,
    then its async copies and waits, then the rest, up to ``max_lines``; ``…`` marks a gap.
    Empty when no loop has an MMA or an async copy."""
    lines = ptx.splitlines()
    wanted = next((span for keys in (("mma.sync", "wgmma.mma_async", "tcgen05.mma"), ("cp.async",))
                   for span in _loops(ptx)
                   if any(k in line for line in lines[span[0]:span[1] + 1] for k in keys)), None)
    if wanted is None:
        return []
    kept = [(opcode(line), line) for line in instructions("\n".join(lines[wanted[0]:wanted[1] + 1]))
            if opcode(line).startswith(_SKETCH_PREFIXES)]
    runs = [list(run) for _, run in itertools.groupby(kept, key=operator.itemgetter(0))]
    sketch = [(run[0][0], run[0][1], len(run)) for run in runs]  # (opcode, first line, run length)

    def priority(i: int) -> tuple[int, int]:
        return next((rank for rank, ops in enumerate(_PRIORITY) if sketch[i][0].startswith(ops)), 2), i

    ranked = sorted(range(len(sketch)), key=priority)
    keep = sorted(ranked[:max_lines])
    out: list[str] = []
    for position, index in enumerate(keep):
        if index > (keep[position - 1] + 1 if position else 0):
            out.append("…")
        op, first, count = sketch[index]
        first = re.sub(r"\s+", " ", first.rstrip(";"))
        first = first if len(first) <= width else first[: width - 1] + "…"
        out.append(first + (f"   ×{count}" if count > 1 else ""))
    return out + (["…"] if keep and keep[-1] < len(sketch) - 1 else [])


# ------------------------------------------------------------------------------ occupancy


def occupancy(registers: int, shared_bytes: int, num_warps: int, limits: GPUArch) -> dict[str, object]:
    """Theoretical occupancy of a kernel using ``registers`` per thread and ``shared_bytes``
    of shared memory per block (its own static + dynamic; the system's reserved kilobyte per
    block, ``limits.reserved_shared_per_block``, is added here), launched with ``num_warps``
    warps per block, on an SM with ``limits``.

    Returns ``blocks_per_sm``, ``warps_per_sm``, ``occupancy`` (resident warps / the SM's
    maximum), ``limiter`` (which limit binds: ``"registers"``, ``"shared"``, ``"warps"``,
    ``"blocks"``; the first in that order on a tie) and each limit's block count
    (``by_registers``, ``by_shared``, ``by_warps``, ``by_blocks``). A block asking for more
    shared memory than ``limits.max_shared_per_block`` cannot launch: 0 blocks.
    """
    unit = limits.register_alloc_unit
    registers_per_warp = math.ceil(max(registers, 1) * 32 / unit) * unit
    by_registers = (limits.registers_per_sm // registers_per_warp) // num_warps
    per_block = shared_bytes + limits.reserved_shared_per_block
    per_block = math.ceil(per_block / limits.shared_alloc_unit) * limits.shared_alloc_unit
    by_shared = 0 if shared_bytes > limits.max_shared_per_block else limits.shared_per_sm // per_block
    by = {"registers": by_registers, "shared": by_shared,
          "warps": limits.max_warps_per_sm // num_warps, "blocks": limits.max_blocks_per_sm}
    limiter = min(by, key=lambda name: by[name])  # min keeps the first of equal values
    blocks = by[limiter]
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps,
            "occupancy": blocks * num_warps / limits.max_warps_per_sm, "limiter": limiter,
            **{f"by_{name}": count for name, count in by.items()}}
