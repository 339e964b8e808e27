"""Host syncs: count them in a real run, and prove a step has none without running it.

A GPU works through a queue. The host (Python) enqueues kernels and moves on at once, so
while the GPU computes step *n* the host is already preparing step *n + 1*; the launch
cost of hundreds of small kernels hides behind the work. A **host sync** is any
operation after which the host must wait until the GPU has drained its queue:

- reading a value on the host: ``.item()``, ``int(t)``, ``if t:``, ``.tolist()``,
  printing a tensor;
- an operator whose output *shape* depends on the data, because the host must know the
  shape to allocate the output: ``nonzero``, ``x[bool_mask]``, ``unique``,
  ``masked_select``, ``bincount``, ``repeat_interleave`` with tensor repeats;
- a blocking copy between host and device (``.cpu()``, ``.to("cuda")`` of host data).

Each sync empties the queue: the GPU idles while the host catches up, and a step that
syncs cannot be captured in a CUDA graph. A naive Mixture-of-Experts layer syncs several
times per layer (count tokens per expert, ``nonzero`` per expert, split by ``.tolist()``);
a dropless, sync-free one keeps every count on the device.

Two tools, one list of sync operators (``SYNC_OPS``): `count_syncs` runs ``fn`` for real
under a ``TorchDispatchMode`` and counts the listed operators it dispatches — on a CPU too:
whether an op syncs is a property of the operator, not of where it ran; `assert_sync_free`
runs ``fn`` (and its backward) on *fake* tensors, nothing computed, and raises `SyncError`
at the first sync, naming the operator and the line that issued it — as fast for a
DeepSeek-sized layer as for a tiny one.

How the count maps to a GPU
---------------------------
``count_syncs`` treats every tensor as if it lived on the accelerator, except tensors
the run itself copied to the host: ``x.cpu().tolist()`` counts 1 on a GPU (the copy)
and 1 on a CPU (the read). Host reads that never reach the dispatcher on a CPU
(``tolist``, ``numpy``, ``repr``) are seen through a ``TorchFunctionMode``; autograd does
not carry that mode into backward, so such a read *inside a custom backward* on a CPU
run is missed (``.item()`` there is still counted). ``F.one_hot`` on a CPU checks its
input's range with two host reads that the CUDA version replaces by device asserts;
those are not counted, so ``one_hot(t, num_classes)`` counts 0 and ``one_hot(t)``
(which must read the maximum to size its output) counts 1, as on a GPU. Explicit
``torch.cuda.synchronize()`` calls are not operators and are not counted.

A ``.tolist()`` of eight values is one sync (one copy), and counts as one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

aten = torch.ops.aten

#: Every operator counted as a host sync, with the reason, keyed by operator name. In
#: ``count_syncs`` counters and ``SyncError.op`` an ATen name carries its overload
#: (``aten.nonzero.default``) and, where the op syncs only in some forms, a note
#: (``aten.index.Tensor (bool mask)``).
SYNC_OPS: dict[str, str] = {
    "aten._local_scalar_dense": "reads one value on the host (.item(), int(t), bool(t), if t:)",
    "aten.is_nonzero": "reads one value on the host (bool(t))",
    "aten.nonzero": "output length = number of non-zeros (also torch.where(c), argwhere)",
    "aten.masked_select": "output length = number of True mask entries",
    "aten.index": "x[bool_mask] runs nonzero on the mask to size its output",
    "aten.index_put_": "x[bool_mask] = v runs nonzero on the mask, unless v is a single "
    "host value (then ATen turns it into masked_fill_, which does not sync)",
    "aten.index_put": "as index_put_",
    "aten._index_put_impl_": "as index_put_",
    "aten.bincount": "output length = max(minlength, max(input) + 1): reads the max on the "
    "host even when minlength is given",
    "aten.repeat_interleave": "with tensor repeats and no output_size=, output length = "
    "sum(repeats)",
    "aten._unique": "output length = number of distinct values",
    "aten._unique2": "output length = number of distinct values (torch.unique)",
    "aten.unique_dim": "output length = number of distinct values",
    "aten.unique_consecutive": "output length = number of runs",
    "aten.unique_dim_consecutive": "output length = number of runs",
    "aten.histc": "with min == max (the default) it reads min and max on the host; pass "
    "min= and max= to avoid it",
    "aten.equal": "returns a Python bool",
    "aten.allclose": "returns a Python bool",
    "aten._to_copy": "a blocking copy between host and device waits for the queue "
    "(.cpu(), .to(device); non_blocking=True does not)",
    "aten.copy_": "a blocking copy between host and device waits for the queue",
    "Tensor.tolist": "copies the values to the host (one sync per call)",
    "Tensor.numpy": "reads the values on the host",
    "Tensor.__array__": "reads the values on the host (np.asarray(t))",
    "Tensor.__repr__": "printing reads the values on the host",
    "Tensor.__str__": "printing reads the values on the host",
    "Tensor.__format__": "formatting reads the values on the host (f'{loss:.3f}')",
    "F.one_hot without num_classes": "reads max(input) on the host to size the output",
}

# Not syncs, though they look related: nonzero_static (fixed size, padded),
# repeat_interleave(..., output_size=n), histc(..., min=a, max=b), _assert_async (a
# device-side assert), masked_fill, where(c, a, b), index_select / gather / scatter_add_ /
# index_add_ with integer indices, one_hot(t, num_classes), topk, sort, argsort, cumsum,
# embedding backward, multinomial (its checks are device asserts in torch 2.x).

_INDEX_PUT = {aten.index_put, aten.index_put_, aten._index_put_impl_}
_COPIES = {aten._to_copy, aten.copy_}
# The ATen operators of SYNC_OPS that sync in some forms only: `_classify` looks at their arguments.
_SOMETIMES = {aten.index, aten.repeat_interleave, aten.histc, *_INDEX_PUT, *_COPIES}
# The ATen operators of SYNC_OPS that sync in every form (a profiler's events name them too).
ALWAYS_SYNCS = {getattr(aten, name[5:]) for name in SYNC_OPS if name.startswith("aten.")} - _SOMETIMES
# Host reads that bypass the dispatcher on a CPU, seen by the function mode.
_HOST_READS = {getattr(torch.Tensor, name[7:]): name for name in SYNC_OPS if name.startswith("Tensor.")}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class SyncError(RuntimeError):
    """A host sync where none was allowed.

    Attributes: ``op`` — the operator, e.g. ``"aten.nonzero.default"``;
    ``where`` — ``"file:line in function: source"`` of the user code that issued it, or
    None when it came from inside PyTorch (e.g. a built-in backward);
    ``phase`` — ``"fn"`` (while running the function) or ``"backward"`` (while running
    the backward pass that ``assert_sync_free`` adds).
    """

    def __init__(self, op: str, where: str | None = None, phase: str = "fn") -> None:
        self.op, self.where, self.phase = op, where, phase
        during = "in the backward pass" if phase == "backward" else "in the function"
        # the SYNC_OPS entry of a recorded name such as ``aten.nonzero.default (bool mask)``
        reason = SYNC_OPS.get(op) or SYNC_OPS.get(op.split(" ")[0].rsplit(".", 1)[0])
        super().__init__(f"host sync {during}: {op}" + (f" ({reason})" if reason else "")
                         + (f"\n  at {where}" if where else ""))


# --------------------------------------------------------------------------------------
# Classifying one operator call
# --------------------------------------------------------------------------------------


def bind_arguments(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name (defaults filled in)."""
    schema = func._schema.arguments
    bound = {arg.name: arg.default_value for arg in schema if arg.has_default_value()}
    bound.update(zip((arg.name for arg in schema if not arg.kwarg_only), args))
    return bound | kwargs


def _classify(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """The sync this operator call causes, as a readable name, or None."""
    packet = func.overloadpacket
    if packet in ALWAYS_SYNCS:
        return str(func)
    if packet not in _SOMETIMES:
        return None
    b = bind_arguments(func, args, kwargs)
    if packet is aten.repeat_interleave:
        # Only tensor repeats without output_size= size the output from the data.
        tensor_repeats = func._overloadname in ("Tensor", "self_Tensor")
        return str(func) if tensor_repeats and b["output_size"] is None else None
    if packet is aten.histc:
        return f"{func} (range from data)" if b["min"] == b["max"] else None
    if packet in _COPIES:
        # only a blocking copy between the host and a device waits (meta has no data: never)
        if packet is aten._to_copy:
            src, dst = b["self"].device.type, torch.device(b["device"] or b["self"].device).type
        else:
            src, dst = b["src"].device.type, b["self"].device.type
        if b["non_blocking"] or src == dst or "meta" in (src, dst) or "cpu" not in (src, dst):
            return None
        return f"{func} ({'device->host' if dst == 'cpu' else 'host->device'})"
    # x[bool_mask] and x[bool_mask] = v run nonzero on the mask
    indices = [i for i in b["indices"] if i is not None]
    if not any(i.dtype in (torch.bool, torch.uint8) for i in indices):
        return None
    # ATen's canDispatchToMaskedFill: one mask, one host value, no accumulate.
    masked_fill = (packet is not aten.index and not b["accumulate"] and len(indices) == 1
                   and b["values"].numel() == 1 and b["values"].device.type == "cpu")
    return None if masked_fill else f"{func} (bool mask)"


# --------------------------------------------------------------------------------------
# The two modes: the dispatch mode holds the count, the function mode feeds it
# --------------------------------------------------------------------------------------


class _SyncDispatchMode(TorchDispatchMode):
    """Sees every ATen operator, forward and backward, after autograd and decompositions, and
    holds what both modes share: the counter, or (strict) the wish to raise at once."""

    def __init__(self, strict: bool) -> None:
        super().__init__()
        self.strict = strict
        self.counts: Counter[str] = Counter()
        self.suppress = 0
        self.phase = "fn"
        # Tensors this run copied to the host, by storage address: reading them is not another
        # sync. They are kept alive so that their addresses are not reused by unrelated tensors.
        self.host_copies: dict[int, torch.Tensor] = {}

    def record(self, op: str, read: object = None) -> None:
        """Count (or raise at) ``op``; ``read``: the tensor it reads on the host, if it does (a copy
        this run made to the host is read without another sync)."""
        if self.suppress or _storage_ptr(read) in self.host_copies:
            return
        if self.strict:
            where = _user_line(traceback.extract_stack(sys._getframe(1)))
            raise SyncError(op, where=where, phase=self.phase)
        self.counts[op] += 1

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple[type, ...],
                           args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        op = _classify(func, args, kwargs)
        if op is not None:
            self.record(op, read=args[0] if func.overloadpacket is aten._local_scalar_dense else None)
        out = func(*args, **kwargs)
        if op is not None and op.endswith("(device->host)"):
            host = out if func.overloadpacket is aten._to_copy else args[0]
            if (ptr := _storage_ptr(host)) is not None:
                self.host_copies[ptr] = host
        return out


def _storage_ptr(t: object) -> int | None:
    if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type != "cpu":
        return None  # fake tensors have no data
    return t.untyped_storage().data_ptr() or None


class _SyncFunctionMode(TorchFunctionMode):
    """Sees torch-level calls: host reads that bypass the dispatcher, and ``F.one_hot``."""

    def __init__(self, state: _SyncDispatchMode) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Callable, types: tuple[type, ...], args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.one_hot:
            # F.one_hot(input=..., num_classes=...) by keyword works too
            if (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) < 0:
                self.state.record("F.one_hot without num_classes")
        elif func not in _HOST_READS:
            return func(*args, **kwargs)
        else:
            self.state.record(_HOST_READS[func], read=args[0])
        # One read is one sync, however many scalar reads it makes inside; the CPU one_hot's
        # range checks are device asserts on CUDA: not counted.
        self.state.suppress += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.state.suppress -= 1


# --------------------------------------------------------------------------------------
# Finding the user's line
# --------------------------------------------------------------------------------------


def _backward(result: Any) -> None:
    # The backward of the result's first tensor that requires grad, with gradients w.r.t. every
    # leaf of its graph returned rather than accumulated: the whole backward runs, and no
    # tensor's .grad (fake or real) is touched.
    root = next((t for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t.requires_grad), None)
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = [None if root is None else root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold the leaf
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    if leaves:
        torch.autograd.grad(root, leaves, torch.ones_like(root), allow_unused=True)


def _user_line(frames: traceback.StackSummary) -> str | None:
    """The innermost frame that is neither PyTorch nor this module, stopping at the call
    into user code (`assert_sync_free`, `_backward`). ``frames`` is outermost first."""
    for frame in reversed(frames):
        filename = frame.filename
        if filename == __file__ and frame.name in ("assert_sync_free", "_backward"):
            return None
        if not (filename.startswith((_TORCH_DIR, "<frozen")) or filename in (contextlib.__file__, __file__)):
            return f"{filename}:{frame.lineno} in {frame.name}: {frame.line}"
    return None


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def count_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Counter[str]]:
    """Run ``fn(*args, **kwargs)`` for real and count the host syncs it causes.

    Returns ``(result, counts)`` where ``counts`` maps a readable operator name (e.g.
    ``"aten._local_scalar_dense.default"``, ``"aten.index.Tensor (bool mask)"``,
    ``"Tensor.tolist"``) to how many times it ran; ``sum(counts.values())`` is the
    number of syncs. Backward is included when ``fn`` calls it. See ``SYNC_OPS`` for the
    list and the module docstring for how a CPU count maps to a GPU.
    """
    if not callable(fn):
        raise ValueError(f"count_syncs: fn must be callable, got {type(fn).__name__}")
    state = _SyncDispatchMode(strict=False)
    with _SyncFunctionMode(state), state:
        result = fn(*args, **kwargs)
    return result, state.counts


def _modules_of(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[nn.Module]:
    """Modules whose parameters ``fn`` can reach: ``fn`` itself, the module a bound
    method belongs to, module arguments, and modules ``fn`` names as closure variables or
    globals."""
    candidates: list[object] = [fn, getattr(fn, "__self__", None), *tree_leaves((args, kwargs))]
    code = getattr(fn, "__code__", None)
    if code is not None:
        for cell in fn.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell: a name not assigned yet
                candidates.append(cell.cell_contents)
        candidates += [fn.__globals__[name] for name in code.co_names if name in fn.__globals__]
    return [obj for obj in candidates if isinstance(obj, nn.Module)]


@contextlib.contextmanager
def _fake_parameters(modules: list[nn.Module], mode: FakeTensorMode) -> Iterator[None]:
    """Swap every parameter and buffer of ``modules`` for a fake twin, restore on exit.

    ``mode.from_tensor`` memoises, so a parameter shared by two modules (tied
    embeddings) gets one fake twin, and the real tensors are never touched.
    """
    submodules = {sub for module in modules for sub in module.modules()}  # each once
    saved = [(table, dict(table)) for sub in submodules for table in (sub._parameters, sub._buffers)]
    try:
        for table, real in saved:
            table.update({name: mode.from_tensor(value) for name, value in real.items() if value is not None})
        yield
    finally:
        for table, real in saved:
            table.update(real)


_FAKE_RUN_NOTE = (
    "assert_sync_free ran fn on fake tensors (shapes, no data). An operator without a fake "
    "implementation cannot run there: a raw Triton launch, or a custom op without "
    "torch.library.register_fake. Register kernels as custom ops with a fake implementation."
)


def assert_sync_free(
    fn: Callable[..., Any], *args: Any, backward: bool = True, **kwargs: Any
) -> Any:
    """Check that ``fn(*args, **kwargs)`` (and its backward) never syncs with the host.

    ``fn`` runs under ``FakeTensorMode``: tensor arguments, and the parameters and
    buffers of the modules ``fn`` can reach (``fn`` itself, a bound method's module,
    module arguments, modules it names as closure variables or globals), are replaced by
    fake tensors of the same shape, dtype and device. Nothing is computed and the real
    modules are untouched: their parameters keep their values and get no ``.grad``.

    With ``backward=True``, if the result (or its first tensor that requires grad, for a
    tuple, list or dict) requires grad, the backward pass runs too, with a ones-like
    output gradient; gradients are returned to nowhere rather than accumulated.

    Raises ``SyncError`` at the first sync: an operator from ``SYNC_OPS``, or anything
    ``FakeTensorMode`` itself finds data-dependent. Returns the (fake) result: its
    shapes and dtypes are real, its values are not.

    Every operator must have a fake implementation: a raw Triton launch cannot run on
    fake tensors, so kernels are wrapped as ``torch.library`` custom ops with
    ``register_fake`` (the note added to such an error says so).

    If ``fn`` runs backward itself, pass ``backward=False`` (its backward is checked
    anyway, and a second one would find the graph freed). Real tensors that ``fn`` reads
    from a closure are treated as constants.
    """
    if not callable(fn):
        raise ValueError(f"assert_sync_free: fn must be callable, got {type(fn).__name__}")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = _SyncDispatchMode(strict=True)
    fake_args, fake_kwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
    with _fake_parameters(_modules_of(fn, args, kwargs), mode):
        try:
            with mode, _SyncFunctionMode(state), state:
                result = fn(*fake_args, **fake_kwargs)
                if backward:
                    state.phase = "backward"
                    _backward(result)
        except (DynamicOutputShapeException, DataDependentOutputException) as err:
            where = _user_line(traceback.extract_tb(err.__traceback__))
            raise SyncError(str(err.func), where=where, phase=state.phase) from err
        except Exception as err:
            if not isinstance(err, SyncError) and hasattr(err, "add_note"):  # Python 3.11+
                err.add_note(_FAKE_RUN_NOTE)
            raise
    return result
