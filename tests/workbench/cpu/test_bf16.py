"""The float32 -> bfloat16 rounding moe_lab's CPU kernels share (``cpu_bf16.h``'s ``to_bf16``):
the same bits as PyTorch's cast, on the AVX512_BF16 instructions or on ATen's conversion."""

import pytest
import torch

from moe_lab.workbench.cpu import build as cpu_ext

pytestmark = [pytest.mark.skipif(cpu_ext.compiler() is None,
                                reason="no C++ compiler: the CPU kernels cannot be built"),
              pytest.mark.usefixtures("cpu_plugin")]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def edge_values() -> torch.Tensor:
    """Ties to even both ways, the largest finite bfloat16 and the first float32 that rounds
    past it, signed zeros and infinities."""
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x3F808001],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    other = torch.tensor([3.3895313892515355e38, 3.3961e38, -3.3961e38, 0.0, -0.0,
                          float("inf"), -float("inf"), 1.0, -2.5, 1e-30, 2.0**-126])
    return torch.cat([ties, other])


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 33, 47, 64, 100])
def test_round_bf16_has_the_bits_of_torch_cast(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 10)
    edges = edge_values()
    x[: min(n, len(edges))] = edges[: min(n, len(edges))]
    ours = cpu_ext.extension().round_bf16(x)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape
    assert torch.equal(bits(ours), bits(x.bfloat16()))


def test_round_bf16_keeps_nan_and_non_contiguous_input():
    x = torch.randn(40, 3)[:, 1].clone()
    x[[0, 17, 39]] = float("nan")
    ours = cpu_ext.extension().round_bf16(x)
    assert ours.isnan()[[0, 17, 39]].all()
    keep = ~x.isnan()
    assert torch.equal(bits(ours[keep]), bits(x[keep].bfloat16()))
    strided = torch.randn(50, 2)[:, 0]  # a view with stride 2: copied first
    assert torch.equal(bits(cpu_ext.extension().round_bf16(strided)), bits(strided.bfloat16()))


def test_round_bf16_denormals_follow_the_documented_rule():
    # the AVX512_BF16 instruction flushes float32 denormals to a zero of their sign; ATen's
    # conversion keeps them as bfloat16 denormals
    x = torch.tensor([1e-39, -3e-39, 1e-45, -1.1e-38])
    ours = cpu_ext.extension().round_bf16(x)
    if cpu_ext.extension().native_bf16():
        assert torch.equal(bits(ours), bits(torch.tensor([0.0, -0.0, 0.0, -0.0]).bfloat16()))
    else:
        assert torch.equal(bits(ours), bits(x.bfloat16()))


def test_native_bf16_is_built_where_the_cpu_has_it():
    from moe_lab.perf.capabilities import cpuinfo

    has_it = torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_bf16" in cpuinfo()[1]
    assert cpu_ext.extension().native_bf16() == has_it


def test_round_bf16_rejects_other_dtypes():
    with pytest.raises(RuntimeError, match="round_bf16: x must be a float32 CPU tensor"):
        cpu_ext.extension().round_bf16(torch.zeros(3, dtype=torch.float64))
