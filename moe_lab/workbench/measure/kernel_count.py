"""Kernel accounting: how many kernels a function launches and how many bytes they move.

Elementwise chains are slow for a reason a FLOP count does not show: every operation is a
separate kernel that reads its inputs from memory and writes its output back, and does a
handful of arithmetic per element. Its time is its launch overhead plus its bytes divided
by the memory bandwidth. So to see what fusion buys, count the kernels and the bytes.

`count_kernels(fn, *args)` runs ``fn`` for real under a ``TorchDispatchMode``, which sees
every ATen operator after autograd (so a backward that ``fn`` runs is counted too). Each
operator that does work is one kernel, roughly: views (``view``, ``t``, ``expand``,
``slice``, ``_unsafe_view``, ...) only make new metadata, and ``empty`` only allocates, so
neither is counted. Bytes are estimated per operator from tensor sizes: every tensor it reads (an
expanded or broadcast input counts the memory behind it, not the repeated elements) plus
every tensor it writes; an in-place update reads and writes its target. A custom operator
(a Triton kernel registered with ``torch.library``) is one kernel that reads its inputs
and writes its outputs; the fills inside it (outputs zeroed for atomic adds) are counted
too. This is an estimate of traffic to memory: a kernel that re-reads its input, or a
cache that saves a re-read, is not seen.

``torch.compile``'d functions cannot be watched this way (an active dispatch mode makes
them run uncompiled), so `count_compiled_kernels` reads the code Inductor generated
instead: each generated kernel and each call to a library kernel is one launch, and its
bytes are the sizes of the buffers it is passed.
"""

from __future__ import annotations

import ast
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moe_lab.training.sync import bind_arguments

aten = torch.ops.aten

# Operators that allocate without touching the memory, or only make new metadata for the
# same memory without declaring it a view: no kernel.
_NO_WORK = {
    aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
    aten._unsafe_view, aten.alias, aten.detach, aten.lift_fresh, aten._reshape_alias,
}
# Operators that fill memory with a constant: inside a custom op, the only ATen calls that
# are the op's own work (the rest, under Triton's interpreter, emulate device memory).
_FILLS = {
    aten.zeros, aten.zeros_like, aten.new_zeros, aten.ones, aten.ones_like, aten.new_ones,
    aten.full, aten.full_like, aten.new_full, aten.fill_, aten.zero_,
}
# In-place operators that overwrite their target without reading it.
_OVERWRITES = {aten.fill_, aten.zero_, aten.copy_, aten.normal_, aten.uniform_, aten.random_}


@dataclass(frozen=True)
class OpRecord:
    """One operator call: its name (``"aten.sort.stable"``), the bytes it read and wrote,
    the host time of the call (on a CPU its duration; on CUDA only its launch), and the
    shapes of its outputs."""

    name: str
    bytes_read: int
    bytes_written: int
    seconds: float = math.nan
    shapes: tuple = ()

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def short_name(self) -> str:
        """``"sort"`` for ``"aten.sort.stable"``; custom ops keep their namespace."""
        parts = self.name.split(".")
        if parts[0] == "aten" and len(parts) >= 2:
            return parts[1]
        return ".".join(parts[:2])


@dataclass(frozen=True)
class KernelCount:
    """``ops``: kernels launched (operators that do work); ``bytes``: estimated bytes read
    plus written by all of them; ``per_op``: the calls in order."""

    ops: int
    bytes: int
    per_op: list[OpRecord] = field(default_factory=list, repr=False)

    @classmethod
    def from_records(cls, records: list[OpRecord]) -> KernelCount:
        return cls(ops=len(records), bytes=sum(r.bytes for r in records), per_op=list(records))

    def by_name(self) -> dict[str, tuple[int, int]]:
        """``short name -> (calls, bytes)``, in order of first call."""
        out: dict[str, tuple[int, int]] = {}
        for r in self.per_op:
            calls, nbytes = out.get(r.short_name, (0, 0))
            out[r.short_name] = (calls + 1, nbytes + r.bytes)
        return out

    @property
    def seconds(self) -> float:
        """Sum of the per-operator host times."""
        return sum(r.seconds for r in self.per_op)

    def __str__(self) -> str:
        return f"{self.ops} kernels, {self.bytes / 1e6:,.3f} MB moved"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of memory behind ``t``: its elements, but no more than its storage holds (an
    expanded tensor repeats elements without repeating memory)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def _unique_tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in ``values`` (nested), each once, in order."""
    return list({id(t): t for t in tree_leaves(values) if isinstance(t, torch.Tensor)}.values())


def _estimate(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    """``(bytes read, bytes written)`` of one operator call."""
    bound = bind_arguments(func, args, kwargs)
    # out= buffers are only written; an in-place target is read too, unless the operator
    # overwrites it (fill_, copy_, ...).
    not_read = {id(bound.get(arg.name)) for arg in func._schema.arguments
                if arg.alias_info is not None and arg.alias_info.is_write
                and (arg.name != "self" or func.overloadpacket in _OVERWRITES)}
    inputs = _unique_tensors((args, kwargs))
    if func.overloadpacket in _FILLS:  # zeros_like(x) reads x's shape, not its memory
        inputs = []
    read = sum(tensor_bytes(t) for t in inputs if id(t) not in not_read)
    written = sum(tensor_bytes(t) for t in _unique_tensors(out))
    return read, written


class _KernelCountMode(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[OpRecord] = []
        self.inside_custom = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func.is_view or func.overloadpacket in _NO_WORK
                or (self.inside_custom and func.overloadpacket not in _FILLS)):
            return func(*args, **kwargs)
        index = len(self.records)
        t0 = time.perf_counter()
        # The Python function behind a ``torch.library.custom_op`` (None for other operators):
        # calling it directly, rather than ``func``, keeps the mode from seeing ``func`` again.
        opdef = _maybe_get_opdef(func) if func.namespace not in ("aten", "prim", "prims") else None
        body = getattr(opdef, "_init_fn", None)
        if body is not None:
            self.inside_custom += 1  # an error inside ends the count: no need to restore it
            with self:  # see the fills inside the custom op (its zeroed outputs) too
                out = body(*args, **kwargs)
            self.inside_custom -= 1
        else:
            out = func(*args, **kwargs)
        seconds = time.perf_counter() - t0
        read, written = _estimate(func, args, kwargs, out)
        shapes = tuple(tuple(t.shape) for t in _unique_tensors(out))
        name = f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"
        # A custom op is listed before the operators it called.
        self.records.insert(index, OpRecord(name, read, written, seconds, shapes))
        return out


def count_kernels(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> KernelCount:
    """Run ``fn(*args, **kwargs)`` for real and count the kernels it launches and the bytes
    they move (estimated, see the module docstring). Includes the backward if ``fn`` runs it."""
    if not callable(fn):
        raise ValueError(f"count_kernels: fn must be callable, got {type(fn).__name__}")
    mode = _KernelCountMode()
    with mode:
        fn(*args, **kwargs)
    return KernelCount.from_records(mode.records)


# --------------------------------------------------------------------------------------
# torch.compile: read the generated code
# --------------------------------------------------------------------------------------

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_SHAPE = r"\(([^()]*)\)"


def _numel(shape_text: str) -> int:
    return math.prod(int(d) for d in shape_text.split(",") if d.strip())  # () -> 1


def kernels_in_inductor_code(code: str) -> list[OpRecord]:
    """The kernel launches in one module of Inductor output code (its ``call`` function).

    ``bytes_read`` of a launch is the size of every buffer it is passed (each read or
    written once: that is what fusion into one loop means); ``bytes_written`` is what a
    library call (``torch.ops.aten.sort``, ...) returns: values in its first input's element
    type, further outputs (indices) 8 bytes per element."""
    buffers: dict[str, tuple[int, int]] = {}  # name -> (bytes, bytes per element)
    # One list a launch: its name, bytes read, bytes written, its first input's bytes per element.
    launches: list[list] = []
    produced_by: dict[str, tuple[int, int]] = {}  # name -> (launch, output position)

    def declare(name: str, shape: str, itemsize: int) -> None:
        buffers[name] = (_numel(shape) * itemsize, itemsize)

    def size_of(arg: str) -> int:
        m = re.match(rf"reinterpret_tensor\(({_NAME}), {_SHAPE}", arg)
        if m:
            return _numel(m.group(2)) * buffers.get(m.group(1), (0, 8))[1]
        return buffers.get(arg, (0, 8))[0]

    # The inputs (``rand_strided`` in ``get_args``) and the buffers ``call`` allocates.
    for m in re.finditer(rf"({_NAME}) = (?:rand_strided|empty_strided\w*)\({_SHAPE}, {_SHAPE}, "
                         rf"(?:device='\w+', dtype=)?torch\.(\w+)\)", code):
        declare(m.group(1), m.group(2), getattr(torch, m.group(4)).itemsize)
    body = code[code.find("def call("):].partition("\nrunner")[0]
    for line in body.splitlines():
        s = line.strip()
        m = re.match(rf"({_NAME}) = ({_NAME}); del {_NAME}", s)
        if m:  # a buffer reused under a new name
            buffers[m.group(1)] = buffers.get(m.group(2), (0, 8))
            continue
        m = re.match(rf"({_NAME}) = ({_NAME})\[(\d+)\]$", s)
        if m and m.group(2) in produced_by:
            produced_by[m.group(1)] = (produced_by[m.group(2)][0], int(m.group(3)))
            continue
        m = re.match(rf"assert_size_stride\(({_NAME}), {_SHAPE}", s)
        if m:
            name = m.group(1)
            if name in produced_by and name not in buffers:
                launch, position = produced_by[name]
                declare(name, m.group(2), launches[launch][3] if position == 0 else 8)
                launches[launch][2] += buffers[name][0]
            continue
        m = re.match(rf"(?:({_NAME}) = )?((?:cpp_fused|triton_|extern_kernels\.|torch\.ops\.|"
                     rf"aten\.)[\w.]*?)(?:\.run)?\(", s)
        if m:
            call = ast.parse(s).body[0].value  # its arguments, keyword arguments by value
            args = [ast.get_source_segment(s, arg) for arg in [*call.args, *(k.value for k in call.keywords)]]
            tensors = [a for a in args if a.startswith("reinterpret_tensor(") or a in buffers]
            first = re.sub(r"^reinterpret_tensor\(|,.*$", "", tensors[0]) if tensors else ""
            launches.append([m.group(2), sum(size_of(a) for a in tensors), 0,
                             buffers.get(first, (0, 8))[1]])
            if m.group(1):
                produced_by[m.group(1)] = (len(launches) - 1, 0)
    return [OpRecord(name, read, written) for name, read, written, _ in launches]


def count_compiled_kernels(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> KernelCount:
    """Kernels and bytes of one call of a ``torch.compile``'d ``fn`` (a plain function is
    compiled here), read from the code Inductor generates for these inputs. The call that
    compiles is the one read; if ``fn`` was compiled for these inputs already, Dynamo's
    caches are reset and it compiles again (Inductor's own caches make that cheap)."""
    # Inductor is slow to import and only this function needs it: the CLI and notebooks
    # that count eager kernels never load it.
    from torch._inductor.utils import run_and_get_code

    target = fn if hasattr(fn, "_torchdynamo_orig_callable") else torch.compile(fn)
    _, codes = run_and_get_code(target, *args, **kwargs)
    if not codes:
        torch._dynamo.reset()
        _, codes = run_and_get_code(target, *args, **kwargs)
    records: list[OpRecord] = []
    for code in codes:
        records += kernels_in_inductor_code(code)
    return KernelCount.from_records(records)
