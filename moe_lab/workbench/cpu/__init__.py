"""The CPU plug-in: moe_lab's C++/OpenMP kernels for the laptop race and the CPU benchmarks.

The core of moe_lab (model, MoE layer, Triton kernels, training step) is written for GPUs and
runs on a CPU as it is. This package makes the CPU fast without touching it: C++ kernels that
give each core whole experts or whole attention heads, a counting-sort token permutation, a
one-pass router top-k and a one-call clip + AdamW, each a ``torch.library`` custom op. They
enter the core only through its registries, by name, when `register` is called:

========================  =========================================  ==============================
registry                  name                                       implementation
========================  =========================================  ==============================
``EXPERT_BACKENDS``       ``openmp`` (MLP and token permutation)     `moe_lab.workbench.cpu.grouped`,
                                                                     `moe_lab.workbench.cpu.permute`
``ATTENTION_IMPLS``       ``cpu_fused`` (and its packed RoPE form)   `moe_lab.workbench.cpu.attention`
``ROUTER_IMPLS``          ``cpu_topk`` (the reference chain, C++      `moe_lab.workbench.cpu.permute`
                          top-k)
``CLIP_STEPS``            ``cpu_one_call``                           `moe_lab.workbench.cpu.optim`
``EMBEDDING_IMPLS``       ``opaque_grad`` (no C++ needed)            `moe_lab.workbench.cpu.embedding`
========================  =========================================  ==============================

The kernels are compiled on first use (`moe_lab.workbench.cpu.build`, cached per machine; ``make
install`` builds them ahead) and need a C++ compiler with OpenMP. Without one, `register`
returns False, the names that need the kernels stay absent, and asking for one says why.
"""

from __future__ import annotations

import functools
import threading

from moe_lab.attention import ATTENTION_IMPLS, PACKED_ATTENTION_IMPLS
from moe_lab.model import EMBEDDING_IMPLS
from moe_lab.moe.experts import EXPERT_BACKENDS, ExpertBackend
from moe_lab.moe.router import ROUTER_IMPLS, route
from moe_lab.training.optim import CLIP_STEPS
from moe_lab.workbench.cpu import attention, embedding, grouped, optim, permute
from moe_lab.workbench.cpu.build import unavailable_reason

_lock = threading.Lock()
_registered: bool | None = None


def register() -> bool:
    """Register the plug-in's implementations into the core's registries (once; later calls
    return the first answer). Returns True when the C++ kernels are available here; False
    when they could not be built, in which case only ``opaque_grad`` is registered and the
    other names are marked unavailable with the reason."""
    global _registered
    with _lock:
        if _registered is not None:
            return _registered
        EMBEDDING_IMPLS.register("opaque_grad", embedding.embed)
        entries = [
            (EXPERT_BACKENDS, "openmp", ExpertBackend(grouped.openmp_mlp, permute.permute_tokens,
                                                      permute.unpermute)),
            (ATTENTION_IMPLS, "cpu_fused", attention.grouped_query_attention),
            (PACKED_ATTENTION_IMPLS, "cpu_fused", attention.PackedRope()),
            (ROUTER_IMPLS, "cpu_topk", functools.partial(route, topk=permute.router_topk)),
            (CLIP_STEPS, "cpu_one_call", optim.one_call_step),
        ]
        reason = unavailable_reason()
        for registry, name, impl in entries:
            registry.register(name, impl, missing=reason)
        _registered = reason is None
        return _registered


def status() -> str | None:
    """`register` the plug-in; ``None`` when its kernels are available here, else why not."""
    return None if register() else unavailable_reason()
