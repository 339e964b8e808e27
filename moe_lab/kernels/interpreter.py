"""What makes moe_lab's Triton kernels run on a machine without CUDA: the one place.

The kernels are plain ``@triton.jit`` functions, and Triton decides compiled or interpreted as
each one is decorated: interpreted where ``TRITON_INTERPRET`` is set. moe_lab's rule
(`moe_lab.perf.capabilities.interprets_triton`) is ``TRITON_INTERPRET`` when it is set, else
interpreted exactly when there is no CUDA device, so that the kernels run on a CPU with nothing
set. The kernel package runs `install` as it is imported (`moe_lab.kernels`), before any kernel
is defined; a kernel author never calls it. Where the rule says interpreted, it

1. sets Triton's ``knobs.runtime.interpret`` (what ``TRITON_INTERPRET`` sets; the environment
   is left as it was), so every ``@triton.jit`` defined from then on is interpreted — a kernel
   of the caller's own too, which could not run compiled without CUDA;
2. makes Triton's own library (``tl.sum``, ``tl.cumsum``, ..., written with ``@triton.jit``)
   interpretable where Triton was imported before, compiled: each function is replaced by an
   interpreted copy, as the interpreter itself would have made it;
3. under a Triton older than 3.7, lets a scalar argument read as a loop bound with NumPy 2.4
   (``range(0, K, BLOCK_K)``: ``int()`` of a one-element array, which NumPy 2.4 refuses; Triton
   3.7 squeezes the array first, https://github.com/triton-lang/triton/pull/9172);
4. patches Triton's language once per launch instead of at every call of a ``@triton.jit``
   helper: the interpreter patches every builtin of ``triton.language`` at each call and
   restores them at the launch's end, so a second patch within one launch changes nothing and
   costs more than most helpers' own work.
"""

from __future__ import annotations

import functools


@functools.cache
def install() -> bool:
    """Make Triton interpret where moe_lab's rule says so (the four steps above), once per
    process; returns whether it did."""
    from moe_lab.perf.capabilities import interprets_triton

    if not interprets_triton():
        return False
    import triton
    import triton.experimental.gluon  # noqa: F401 - imported by a launch; it wants the library as made
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    # The knob's own setter would also write TRITON_INTERPRET into the environment.
    vars(triton.knobs.runtime)["interpret"] = True
    copies: dict[int, interpreter.InterpretedFunction] = {}
    for module in (tl, tl.standard, tl.random):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                setattr(module, name, copies.setdefault(id(value), interpreter.InterpretedFunction(value.fn)))

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
        patch_tensor = interpreter._patch_lang_tensor

        def patch_tensor_squeezed(tensor: type, scope: object) -> None:
            patch_tensor(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        interpreter._patch_lang_tensor = patch_tensor_squeezed

    launch = interpreter.GridExecutor.__call__

    def launch_patching_once(self: object, *args: object, **kwargs: object) -> object:
        patch, scopes = interpreter._patch_lang, {}

        def patch_once(fn: object) -> object:
            key = tuple(sorted({id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}))
            if key not in scopes:
                scopes[key] = patch(fn)
            return scopes[key]

        interpreter._patch_lang = patch_once
        try:
            return launch(self, *args, **kwargs)
        finally:
            interpreter._patch_lang = patch

    interpreter.GridExecutor.__call__ = launch_patching_once
    return True
