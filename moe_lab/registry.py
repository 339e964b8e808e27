"""Named implementations: the one mechanism by which a variant is chosen.

Every concept with more than one implementation (dispatchers, expert backends, token
permutations, routers, attention cores, embeddings, the optimizer's clip-and-step) keeps a
`Registry` beside its reference: a dict from a name to the implementation, with a line saying
what it holds. A model or a training stack is configured with names, never with ``if``
branches on the platform, and a plug-in (the C++ CPU kernels in ``moe_lab.workbench.cpu``)
adds names from outside with `Registry.register` — the core never imports it.

A name that is not registered is refused with the names that are, what the registry holds, and
how a plug-in adds names (``plugin=True``) or why this one is unavailable here (no C++ compiler
for the plug-in, no Triton for the kernels: `Registry.unavailable`)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: Why Triton kernels cannot run in this Python (Triton ships Linux wheels only), or ``None``; the
#: registries mark their Triton names unavailable with it (`Registry.register`). Found without
#: importing Triton.
TRITON_MISSING: str | None = None if importlib.util.find_spec("triton") else (
    "it needs Triton, which installs on Linux only: run it on Linux, in the container or on a "
    "hosted GPU notebook (README, Where to run it)")

#: What the error of an unknown name adds in a registry the CPU plug-in registers into.
PLUGIN_HINT = "moe_lab.workbench.cpu.register() adds the CPU plug-in's names"


class Registry(dict, Generic[T]):
    """``name -> implementation`` for one concept: ``kind`` names it in messages,
    ``description`` says in a line what an entry is, ``plugin`` whether the CPU plug-in adds
    names to it."""

    def __init__(self, kind: str, description: str, *, plugin: bool = False) -> None:
        super().__init__()
        self.kind, self.description, self.plugin = kind, description, plugin
        # name -> why it could not be registered here (shown when it is asked for)
        self.unavailable: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"<{self.kind} registry: {self.description}; names {sorted(self)}>"

    def register(self, name: str, impl: T | None = None, *, missing: str | None = None
                 ) -> Callable[[T], T] | T:
        """``registry.register(name, impl)``, or ``@registry.register(name)`` as a decorator;
        given ``missing`` (why ``impl`` cannot run here), records it in ``unavailable`` instead."""

        def add(obj: T) -> T:
            if missing:
                self.unavailable[name] = missing
                return obj
            self[name] = obj
            self.unavailable.pop(name, None)
            return obj

        return add if impl is None else add(impl)

    def lookup(self, name: str, arg: str) -> T:
        """The implementation registered as ``name``; ``arg`` names the argument in the error."""
        if isinstance(name, str) and name in self:
            return self[name]
        message = f"{arg} must be one of {sorted(self)}, got {name!r}"
        note = f"; {self.kind} registry: {self.description}"
        if isinstance(name, str) and name in self.unavailable:
            raise ValueError(f"{message} ({name!r} is not available here: {self.unavailable[name]}){note}")
        raise ValueError(message + note + (f"; {PLUGIN_HINT}" if self.plugin else ""))

    def check(self, name: str, arg: str) -> str:
        """``name`` if it is registered, else the error of `lookup`."""
        self.lookup(name, arg)
        return name
