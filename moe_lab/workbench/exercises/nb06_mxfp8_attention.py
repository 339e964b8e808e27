"""Exercises of notebook 06 (MXFP8 attention) in PyTorch: reading the bits of the MX format (the
Triton ones, the scale in a kernel and the online softmax, are `nb06_mxfp8_attention_triton`).

- ``decode_e4m3(byte)``: the value of one E4M3 byte (``float8_e4m3fn``): sign bit,
  4 exponent bits with bias 7, 3 mantissa bits; exponent field 0 means subnormal
  (``0.mmm × 2^-6``); ``S.1111.111`` is NaN; there is no infinity.

Each ``check_…`` calls the learner's function on fresh random inputs and raises
`ExerciseError` when an answer differs from the reference (`moe_lab.quant.mx`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from moe_lab.quant.mx import E4M3
from moe_lab.workbench.exercises import ExerciseError, call_answer, exercise


def decode_e4m3(byte: int) -> float:
    """The value of E4M3 byte ``byte`` (0..255): PyTorch's ``float8_e4m3fn`` reading of it,
    what the check compares with."""
    return torch.tensor(byte, dtype=torch.uint8).view(E4M3).item()


@exercise(decode_e4m3)
def check_decode_e4m3(fn: Callable[[int], float]) -> None:
    """Raise `ExerciseError` unless ``fn(byte)`` decodes every one of the 256 E4M3 bytes
    (tried in a random order) to PyTorch's value."""
    truth = torch.arange(256, dtype=torch.uint8).view(E4M3).float().tolist()
    order = list(range(256))
    random.shuffle(order)
    for byte in order:
        got = call_answer(fn, byte)
        want = truth[byte]
        try:
            ok = (math.isnan(got) and math.isnan(want)) or float(got) == want
        except (TypeError, ValueError):
            ok = False
        if not ok:
            fields = f"sign {byte >> 7}, exponent {(byte >> 3) & 0xF:04b}, mantissa {byte & 7:03b}"
            hint = ""
            # The sign first: a sign-blind answer is wrong on negative subnormals too, and
            # there the byte's exponent field is 0 as well.
            if not math.isnan(want) and isinstance(got, (int, float)) and got == -want:
                hint = " (check the sign bit, 0x80)"
            elif (byte >> 3) & 0xF == 0:
                hint = (" (exponent field 0: a subnormal, 0.mmm x 2^-6, no hidden 1 — so 0x00 and "
                        "0x80 are ±0)")
            raise ExerciseError(
                f"decode_e4m3({byte}) = decode_e4m3(0b{byte:08b}) returned {got!r}, expected "
                f"{want!r} ({fields}){hint}"
            )
    print("✓ decode_e4m3 is correct")
