"""Exercises of notebook 00 (the lab bench): counting FLOPs and reading a roofline.

- ``moe_layer_training_flops(moe)``: training FLOPs (forward + backward) one token costs in
  one MoE layer of config ``moe`` (`moe_lab.config.MoEConfig`): the router's gate
  (``d_model x n_experts``), its ``top_k`` routed experts and every shared expert (each a
  SwiGLU of three ``d_model x d_expert`` matrices). Checked against `moe_lab.perf.flops`
  on random configurations and the presets.
- ``matmul_attainable_flops(m, n, k, bytes_per_element, peak_flops, bandwidth)``: the
  roofline's bound for ``[m, k] @ [k, n]`` on a machine with that peak and bandwidth.

Each ``check_…`` calls the learner's function on fresh random inputs and raises
`ExerciseError` when an answer differs from the reference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from moe_lab.config import MoEConfig, preset
from moe_lab.perf.flops import FLOPS_PER_MAC, TRAIN_MULTIPLIER, moe_mlp_macs, router_macs
from moe_lab.perf.hardware import matmul_intensity, roofline
from moe_lab.workbench.exercises import ExerciseError, call_answer, close, exercise


def matmul_attainable_flops(
    m: int, n: int, k: int, bytes_per_element: float, peak_flops: float, bandwidth: float
) -> float:
    """Roofline bound of ``[m, k] @ [k, n]``: ``min(peak, bandwidth * intensity)`` with
    intensity ``2mnk / ((mk + kn + mn) * bytes_per_element)`` FLOP/byte."""
    return roofline(peak_flops, bandwidth, matmul_intensity(m, n, k, bytes_per_element))


def moe_layer_training_flops(moe: MoEConfig) -> float:
    """Training FLOPs per token of one MoE layer: the router's gate plus ``top_k`` routed and
    every shared SwiGLU expert, 2 FLOPs per MAC, 3x for forward + backward."""
    macs = moe.d_model * moe.n_experts + (moe.top_k + moe.n_shared_experts) * 3 * moe.d_model * moe.d_expert
    return float(macs * FLOPS_PER_MAC * TRAIN_MULTIPLIER)


@exercise(moe_layer_training_flops)
def check_moe_layer_training_flops(fn: Callable[[MoEConfig], float]) -> None:
    """Raise `ExerciseError` unless ``fn(moe)`` matches `moe_lab.perf.flops`' count of one
    MoE layer (router + routed + shared experts), on the presets and random configurations."""
    rng = random.Random()
    configs = [preset(name).moe for name in ("deepseek_v3", "gpt_oss_20b", "small", "tiny")]
    while len(configs) < 16:
        n_experts = rng.choice([4, 8, 16, 64, 128, 256])
        d_model = rng.choice([64, 256, 1024, 2880, 7168])
        configs.append(MoEConfig(d_model=d_model, n_experts=n_experts,
                                 top_k=rng.randint(1, min(8, n_experts)),
                                 d_expert=rng.choice([64, 512, 2048, 2880]),
                                 n_shared_experts=rng.choice([0, 0, 1, 2])))
    for moe in configs:
        model = preset("tiny", d_model=moe.d_model, moe=moe)  # what moe_lab.perf.flops takes
        want = float((router_macs(model) + moe_mlp_macs(model)) * FLOPS_PER_MAC * TRAIN_MULTIPLIER)
        got = call_answer(fn, moe)
        if close(got, want):
            continue
        routed = 3 * moe.d_model * moe.d_expert * FLOPS_PER_MAC * TRAIN_MULTIPLIER
        router = moe.d_model * moe.n_experts * FLOPS_PER_MAC * TRAIN_MULTIPLIER
        hint = ""
        if close(got, want / TRAIN_MULTIPLIER):
            hint = " (that is the forward pass only: the backward pass costs twice as much)"
        elif close(got, want / FLOPS_PER_MAC):
            hint = " (that counts MACs: one multiply-accumulate is 2 FLOPs)"
        elif close(got, want - router):
            hint = " (the router's gate is a matmul too: d_model x n_experts per token)"
        elif moe.n_shared_experts and close(got, want - moe.n_shared_experts * routed):
            hint = " (every token also goes through the shared experts)"
        elif close(got, router + (moe.n_experts + moe.n_shared_experts) * routed):
            hint = " (a token runs through its top_k experts only, not all of them)"
        raise ExerciseError(
            f"moe_layer_training_flops(MoEConfig(d_model={moe.d_model}, n_experts={moe.n_experts}, "
            f"top_k={moe.top_k}, d_expert={moe.d_expert}, n_shared_experts={moe.n_shared_experts})) "
            f"returned {got!r}, expected {want:.6g}{hint}")
    print("✓ moe_layer_training_flops matches moe_lab.perf.flops")


@exercise(matmul_attainable_flops)
def check_matmul_attainable_flops(fn: Callable[..., float]) -> None:
    """Raise `ExerciseError` unless ``fn`` matches the roofline bound on random shapes,
    covering memory-bound (a skinny matmul) and compute-bound (a square one) cases."""
    rng = random.Random()
    for trial in range(20):
        bpe = (1.0, 2.0, 4.0)[trial % 3]
        bandwidth = rng.uniform(1e12, 8e12)
        if trial % 2 == 0:
            # Skinny: a few tokens through a big weight. At most 16 FLOP/byte, so with a
            # peak above 8 TB/s * 16 FLOP/B = 128 TFLOP/s it is always memory-bound.
            m, n, k = rng.randint(1, 8), rng.randint(1024, 8192), rng.randint(1024, 8192)
            peak = rng.uniform(200e12, 2500e12)
        else:
            m = n = k = rng.randint(2048, 8192)
            peak = rng.uniform(50e12, 2500e12)
        want = matmul_attainable_flops(m, n, k, bpe, peak, bandwidth)
        got = call_answer(fn, m, n, k, bpe, peak, bandwidth)
        if not close(got, want):
            bound = "memory" if want < peak else "compute"
            intensity = matmul_intensity(m, n, k, bpe)
            # Every slip the answer fits: one shape can fit two (a roofline without the
            # element size that lands on the peak is also "the peak").
            hints = []
            if bound == "memory" and close(got, peak):
                hints.append("the peak is out of reach here, the roofline is min(peak, bandwidth × "
                             "intensity)")
            if bound == "compute" and close(got, bandwidth * intensity):
                hints.append("the roofline never exceeds the peak, min(peak, bandwidth × intensity)")
            if close(got, roofline(peak, bandwidth, intensity * bpe)):
                hints.append("the intensity divides the FLOPs by the bytes moved, (mk + kn + mn) · "
                             "bytes_per_element, not by the elements")
            hint = "".join(f": {h}" if i == 0 else f"; or {h}" for i, h in enumerate(hints))
            raise ExerciseError(
                f"matmul_attainable_flops(m={m}, n={n}, k={k}, bytes_per_element={bpe}, "
                f"peak_flops={peak:.3g}, bandwidth={bandwidth:.3g}) returned {got!r}, "
                f"expected {want:.6g} ({bound}-bound{hint})"
            )
    print("✓ matmul_attainable_flops is correct")
