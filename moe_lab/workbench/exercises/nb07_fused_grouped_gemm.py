"""Exercises of notebook 07_fused_grouped_gemm in PyTorch: the bytes fusion removes (the gather
prologue's row loads, in Triton, are `nb07_fused_grouped_gemm_triton`, which needs Triton).

- ``permute_combine_bytes(tokens, top_k, d, bytes_per_value)``: the bytes the unfused
  forward's two copies move — the permute (token rows in, the row-id map in, ``T·k`` rows
  out) and the weighted unpermute (``T·k`` rows, the map and the float32 weights in, token
  rows out) — which the gather prologue and the scatter epilogue remove. Checked against
  `moe_lab.perf.fusion.launches` on fresh shapes.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from moe_lab.perf import fusion
from moe_lab.workbench.exercises import ExerciseError, call_answer, exercise

# ------------------------------------------------------------- the bytes fusion removes


def permute_combine_bytes(tokens: int, top_k: int, d: int, bytes_per_value: int) -> int:
    """Forward bytes of the permute and of the weighted unpermute (int32 map, float32 weights),
    as `moe_lab.perf.fusion.launches` counts them (the expert count and width do not enter)."""
    shape = fusion.Shape(tokens, top_k, 8, d, 32, bytes_per_value)
    return sum(x.bytes for x in fusion.launches("swiglu_epilogue", shape)
               if x.phase == "fwd" and x.name in ("permute", "unpermute (weighted)"))


@exercise(permute_combine_bytes)
def check_permute_combine_bytes(fn: Callable[[int, int, int, int], int]) -> None:
    """Raise `ExerciseError` unless ``fn`` counts the forward bytes of the two copies as
    `moe_lab.perf.fusion` does, on fresh shapes."""
    rng = random.Random()
    cases = [(8192, 8, 7168, 2), (8192, 4, 2880, 2), (1, 1, 1, 4)]
    cases += [(rng.randrange(1, 5000), rng.randrange(1, 9), rng.randrange(1, 9000), rng.choice((1, 2, 4)))
              for _ in range(5)]
    for tokens, top_k, d, b in cases:
        want = permute_combine_bytes(tokens, top_k, d, b)
        got = call_answer(fn, tokens, top_k, d, b)
        if got != want:
            hint = ""
            if isinstance(got, (int, float)) and got == want - 2 * tokens * top_k * 4 - tokens * top_k * 4:
                hint = " — count the row-id map (int32) read by both copies and the float32 weights"
            raise ExerciseError(f"tokens={tokens}, top_k={top_k}, d={d}, {b} B per value: got {got}, "
                                f"expected {want}{hint}")
    print("✓ permute_combine_bytes counts what the permute and the combine move")
