"""Named implementations: the one mechanism by which a variant is chosen.

Every concept with more than one implementation (dispatchers, expert backends, token
permutations, routers, attention cores, embeddings, the optimizer's clip-and-step) keeps a
`Registry` beside its reference: a dict from a name to the implementation. A model or a
training stack is configured with names, never with ``if`` branches on the platform, and a
plug-in (such as the C++ CPU kernels in ``moe_lab.workbench.cpu``) adds names from outside with
`Registry.register` — the core never imports it.

A name that is not registered is refused with the names that are, and, where a plug-in
tried to register it and could not (no C++ compiler, say), with the reason it gave
(`Registry.mark_unavailable`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

# The plug-ins that add names from outside the core, for the message of an unknown name.
_PLUGIN_HINT = "moe_lab.workbench.cpu.register() adds the CPU plug-in's names"


class Registry(dict, Generic[T]):
    """``name -> implementation`` for one concept (``kind``, used in messages)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.unavailable: dict[str, str] = {}

    def register(self, name: str, impl: T | None = None) -> Callable[[T], T] | T:
        """``registry.register(name, impl)``, or ``@registry.register(name)`` as a decorator."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def add(obj: T) -> T:
            self[name] = obj
            self.unavailable.pop(name, None)
            return obj

        return add if impl is None else add(impl)

    def mark_unavailable(self, name: str, reason: str) -> None:
        """Record why ``name`` could not be registered here (shown when it is asked for)."""
        self.unavailable[name] = reason

    def lookup(self, name: str, arg: str) -> T:
        """The implementation registered as ``name``; ``arg`` names the argument in the error."""
        if isinstance(name, str) and name in self:
            return self[name]
        message = f"{arg} must be one of {sorted(self)}, got {name!r}"
        if isinstance(name, str) and name in self.unavailable:
            message += f" ({name!r} is not available here: {self.unavailable[name]})"
        else:
            message += f" ({_PLUGIN_HINT})"
        raise ValueError(message)

    def check(self, name: str, arg: str) -> str:
        """``name`` if it is registered, else the error of `lookup`."""
        self.lookup(name, arg)
        return name
