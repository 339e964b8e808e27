"""Kernel accounting (`moe_lab.workbench.measure.kernel_count`): what counts as a kernel, and its bytes."""

from __future__ import annotations

import pytest
import torch

from moe_lab.config import MoEConfig
from moe_lab.workbench.measure.kernel_count import (
    KernelCount,
    count_compiled_kernels,
    count_kernels,
    kernels_in_inductor_code,
    tensor_bytes,
)

F32 = 4


def test_elementwise_chain_counts_one_kernel_per_op_and_its_bytes():
    x = torch.randn(100, 10)
    kc = count_kernels(lambda x: (x.sigmoid() * 2).sum(), x)
    assert [r.short_name for r in kc.per_op] == ["sigmoid", "mul", "sum"]
    assert kc.ops == 3
    n = 1000 * F32
    assert [(r.bytes_read, r.bytes_written) for r in kc.per_op] == [(n, n), (n, n), (n, F32)]
    assert kc.bytes == sum(r.bytes for r in kc.per_op)
    assert kc.by_name() == {"sigmoid": (1, 2 * n), "mul": (1, 2 * n), "sum": (1, n + F32)}
    assert "3 kernels" in str(kc)


def test_views_and_allocations_are_not_kernels():
    x = torch.randn(8, 6)
    kc = count_kernels(lambda x: (x.view(6, 8).t(), x.reshape(-1)[:5], torch.empty(3),
                                  x.unsqueeze(0).expand(4, 8, 6), x.detach()), x)
    assert kc.ops == 0 and kc.bytes == 0
    copy = count_kernels(lambda x: x.t().reshape(-1), x)  # a transposed reshape must copy
    assert copy.ops == 1 and copy.bytes == 2 * 48 * F32


def test_in_place_out_and_fills():
    x, idx = torch.zeros(10), torch.tensor([1, 1, 3])
    kc = count_kernels(lambda: x.scatter_add_(0, idx, torch.ones(3)))
    names = [r.short_name for r in kc.per_op]
    assert names == ["ones", "scatter_add_"]
    ones, scatter = kc.per_op
    assert (ones.bytes_read, ones.bytes_written) == (0, 3 * F32)
    assert scatter.bytes_read == 10 * F32 + 3 * 8 + 3 * F32  # the target is read too
    assert scatter.bytes_written == 10 * F32
    fill = count_kernels(lambda: x.fill_(1.0)).per_op[0]
    assert (fill.bytes_read, fill.bytes_written) == (0, 10 * F32)
    like = count_kernels(lambda: torch.zeros_like(x)).per_op[0]
    assert (like.bytes_read, like.bytes_written) == (0, 10 * F32)
    values, indices = torch.empty(2), torch.empty(2, dtype=torch.int64)
    topk = count_kernels(lambda: torch.topk(x, 2, out=(values, indices))).per_op[0]
    assert topk.bytes_read == 10 * F32  # the out= buffers are written, not read
    assert topk.bytes_written == 2 * F32 + 2 * 8


def test_expanded_inputs_count_their_memory_not_their_elements():
    b = torch.randn(5)
    assert tensor_bytes(b.expand(1000, 5)) == 5 * F32
    assert tensor_bytes(torch.randn(100)[10:20]) == 10 * F32


def test_backward_is_counted_when_fn_runs_it():
    x = torch.randn(64, requires_grad=True)
    fwd = count_kernels(lambda: x.sigmoid().sum())
    both = count_kernels(lambda: x.sigmoid().sum().backward())
    assert both.ops > fwd.ops
    assert any("sigmoid_backward" in r.name for r in both.per_op)


def test_custom_op_is_one_kernel_plus_its_fills():
    from moe_lab.kernels.fused_router import fused_route_from_logits

    c = MoEConfig(d_model=8, n_experts=16, top_k=4, d_expert=8)
    logits = torch.randn(32, 16)
    kc = count_kernels(fused_route_from_logits, logits, c)
    kernel = kc.per_op[0]
    assert kernel.name == "moe_lab.fused_router.default"
    assert kernel.bytes_read == 32 * 16 * F32
    # outputs: ids int64 + weights fp32 [32, 4], counts int32 + prob sums fp32 [1, 16], z [1]
    assert kernel.bytes_written == 32 * 4 * (8 + 4) + 16 * (4 + 4) + 4
    assert sum(r.short_name == "zeros" for r in kc.per_op) == 3  # zeroed for the atomics
    assert all(r.bytes <= 2 * 16 * 8 for r in kc.per_op[4:])  # the rest work on [E]


def test_unfused_reference_moves_many_times_the_logits():
    from moe_lab.moe.router import route_from_logits

    c = MoEConfig(d_model=8, n_experts=64, top_k=4, d_expert=8, score_func="sigmoid",
                  n_groups=8, topk_groups=2)
    logits = torch.randn(128, 64, dtype=torch.float64)
    # the chain as frameworks run it (torch.topk), in FP64 and FP32
    kc = count_kernels(route_from_logits, logits, c, torch.zeros(64), lowest_index_ties=False)
    assert kc.ops > 25
    assert kc.bytes > 10 * logits.numel() * logits.element_size()
    fp32 = count_kernels(route_from_logits, logits.float(), c, torch.zeros(64),
                         lowest_index_ties=False)
    assert fp32.ops == kc.ops - 1  # no cast of the float32 bias
    assert fp32.bytes < 0.6 * kc.bytes  # half the bytes per element, plus the int64 indices


INDUCTOR_CODE = '''
def call(self, args):
    arg0_1, arg1_1 = args
    args.clear()
    assert_size_stride(arg0_1, (512, 256), (256, 1), 'input')
    buf0 = empty_strided_cpu((512, 256), (256, 1), torch.float32)
    buf1 = empty_strided_cpu((512, 1), (1, 512), torch.float32)
    cpp_fused_add_sigmoid_0(arg0_1, arg1_1, buf0, buf1)
    del arg0_1
    # a comment that names cpp_fused_nothing(buf0)
    buf2 = torch.ops.aten.topk.default(reinterpret_tensor(buf0, (512, 8, 32), (256, 32, 1), 0), 2)
    buf3 = buf2[0]
    assert_size_stride(buf3, (512, 8, 2), (16, 2, 1), 'torch.ops.aten.topk.default')
    buf4 = buf2[1]
    assert_size_stride(buf4, (512, 8, 2), (16, 2, 1), 'torch.ops.aten.topk.default')
    del buf2
    buf5 = buf1; del buf1  # reuse
    aten.scatter_reduce_.two(buf5,0,buf4,buf3, reduce='sum', include_self=True)
    return (buf0, buf5, )

runner = Runner(partitions=[])


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = rand_strided((512, 256), (256, 1), device='cpu', dtype=torch.float32)
    arg1_1 = rand_strided((256, ), (1, ), device='cpu', dtype=torch.float32)
    return [arg0_1, arg1_1]
'''


def test_inductor_code_is_read_launch_by_launch():
    records = kernels_in_inductor_code(INDUCTOR_CODE)
    assert [r.name for r in records] == ["cpp_fused_add_sigmoid_0", "torch.ops.aten.topk.default",
                                         "aten.scatter_reduce_.two"]
    fused, topk, scatter = records
    big = 512 * 256 * F32
    assert fused.bytes_read == big + 256 * F32 + big + 512 * F32 and fused.bytes_written == 0
    assert topk.bytes_read == big
    assert topk.bytes_written == 512 * 16 * F32 + 512 * 16 * 8  # values fp32, indices int64
    assert scatter.bytes_read == 512 * F32 + 512 * 16 * 8 + 512 * 16 * F32
    kc = KernelCount.from_records(records)
    assert kc.ops == 3


@pytest.mark.slow  # one torch.compile
def test_compiled_function_is_counted_from_its_generated_code():
    x = torch.randn(256, 64)
    kc = count_compiled_kernels(lambda x: (x.sigmoid() * 2 + 1).sum(-1), x)
    eager = count_kernels(lambda x: (x.sigmoid() * 2 + 1).sum(-1), x)
    assert 1 <= kc.ops < eager.ops
    assert kc.bytes < eager.bytes
