"""Exercises of notebook 06 (MXFP8 attention) in PyTorch: reading the bits of the MX format (the
Triton ones, the scale in a kernel and the online softmax, are `nb06_mxfp8_attention_triton`).

- ``decode_e4m3(byte)``: the value of one E4M3 byte (``float8_e4m3fn``): sign bit,
  4 exponent bits with bias 7, 3 mantissa bits; exponent field 0 means subnormal
  (``0.mmm × 2^-6``); ``S.1111.111`` is NaN; there is no infinity.
- ``e8m0_scale_byte(block, scale_mode)``: the biased E8M0 byte (0..255) of one block of
  32 float values quantized to MXFP8 (E4M3): ``"floor"`` is the OCP rule
  ``floor(log2(amax)) - 8``, ``"rceil"`` rounds ``amax / 448`` up to a power of two;
  both clamped to ``[-127, 127]`` and biased by 127; a NaN anywhere gives 255.

Each ``check_…`` calls the learner's function on fresh random inputs and raises
`ExerciseError` when an answer differs from the reference (`moe_lab.quant.mx`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from moe_lab.quant.mx import E4M3, block_scale_exponent
from moe_lab.workbench.exercises import ExerciseError, call_answer, exercise, reference_solution


@reference_solution("decode_e4m3")
def decode_e4m3(byte: int) -> float:
    """The value of E4M3 byte ``byte`` (0..255), by hand from its three fields."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent = (byte >> 3) & 0xF
    mantissa = byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:  # subnormal: no hidden 1, exponent fixed at 1 - bias
        return sign * (mantissa / 8) * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


@reference_solution("e8m0_scale_byte")
def e8m0_scale_byte(block: torch.Tensor, scale_mode: str = "floor") -> int:
    """The biased E8M0 scale byte of ``block`` (32 float values) for MXFP8 E4M3."""
    values = block.float().abs()
    if torch.isnan(values).any():
        return 255
    amax = values.max().item()
    if scale_mode == "floor":
        # floor(log2(amax)) read from the float32 exponent field (-127 for zero/subnormal).
        exponent = (int(torch.tensor(amax).view(torch.int32)) >> 23 & 0xFF) - 127
        unbiased = exponent - 8  # E4M3's largest power of two is 2^8 = 256
    else:
        q = torch.tensor(amax / 448.0, dtype=torch.float32).item()  # rounded like hardware
        if math.isinf(q):
            unbiased = 127
        elif q == 0:
            unbiased = -127
        else:
            mantissa, exponent = math.frexp(q)  # q = mantissa * 2^exponent, mantissa in [0.5, 1)
            unbiased = exponent - 1 if mantissa == 0.5 else exponent
    return int(min(max(unbiased, -127), 127) + 127)


@exercise("decode_e4m3")
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


def _blocks(rng: random.Random) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    blocks = []
    for i in range(40):
        x = torch.randn(32, generator=gen) * 2.0 ** rng.uniform(-40, 40)
        if i % 8 == 1:  # a maximum right at / just above 448 * 2^k: where the modes differ
            x[rng.randrange(32)] = 448.0 * 2.0 ** rng.randint(-20, 20) * rng.choice([1, 1.01])
        elif i % 8 == 2:
            x[rng.randrange(32)] = math.nan
        elif i % 8 == 3:
            x.zero_()
        blocks.append(x)
    return blocks


@exercise("e8m0_scale_byte")
def check_e8m0_scale_byte(fn: Callable[..., int]) -> None:
    """Raise `ExerciseError` unless ``fn(block, scale_mode)`` gives the reference's scale
    byte on random blocks, in both ``"floor"`` and ``"rceil"`` modes."""
    rng = random.Random()
    for block in _blocks(rng):
        amax = block.abs().amax().reshape(1)
        for mode in ("floor", "rceil"):
            want = int(block_scale_exponent(amax, E4M3, mode)[0])
            got = call_answer(fn, block.clone(), mode)
            if got != want:
                # Name every slip the answer fits: a NaN block's 255 less the bias is 128,
                # which is also what a NaN-blind answer gives a block whose amax is near 2^9.
                hints = []
                if bool(torch.isnan(block).any()):
                    hints.append("a block holding a NaN gets 255, the E8M0 NaN")
                if isinstance(got, int) and got == want - 127:
                    hints.append("remember the bias: the byte is the exponent + 127")
                if isinstance(got, int) and mode == "rceil" and got == want - 1:
                    hints.append("rceil rounds up: amax / X must not exceed 448")
                hint = f" ({'; or '.join(hints)})" if hints else ""
                raise ExerciseError(
                    f"e8m0_scale_byte(block with amax {amax.item():.6g}, {mode!r}) returned "
                    f"{got!r}, expected {want}{hint}"
                )
