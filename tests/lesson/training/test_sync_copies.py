"""The certifier's copies: a blocking copy between host and device is a host sync, in either
direction; a ``non_blocking=True`` one is queued like a kernel and is not. ``assert_sync_free``
runs on fake tensors, where a CUDA tensor needs no GPU (on a CPU-only build, named with its index,
and not the receiver of ``Tensor.copy_``, whose binding guards the device: ``aten.copy_`` is the
same operator)."""

from __future__ import annotations

import pytest
import torch

from moe_lab.training.sync import SyncError, assert_sync_free


def to_device(x: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    return x.to("cuda:0", non_blocking=non_blocking)


def to_host(x: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    return torch.zeros(4, device="cuda:0").to("cpu", non_blocking=non_blocking)


def copy_into_device(x: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    return torch.ops.aten.copy_(torch.empty(4, device="cuda:0"), x, non_blocking)


def copy_into_host(x: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    return x.copy_(torch.zeros(4, device="cuda:0"), non_blocking=non_blocking)


COPIES = [
    (to_device, "aten._to_copy.default (host->device)"),
    (to_host, "aten._to_copy.default (device->host)"),
    (copy_into_device, "aten.copy_.default (host->device)"),
    (copy_into_host, "aten.copy_.default (device->host)"),
]


@pytest.mark.parametrize("copy,op", COPIES, ids=[c.__name__ for c, _ in COPIES])
def test_a_blocking_copy_across_the_host_boundary_syncs_and_a_non_blocking_one_does_not(copy, op):
    x = torch.randn(4)
    with pytest.raises(SyncError) as info:
        assert_sync_free(copy, x, False)
    assert info.value.op == op
    result = assert_sync_free(copy, x, True)
    assert result.device.type == ("cpu" if "device->host" in op else "cuda")


def test_a_copy_that_stays_on_one_side_is_no_sync():
    assert_sync_free(lambda x: x.to("cpu", copy=True).copy_(x), torch.randn(4))
    assert_sync_free(lambda x: torch.zeros(4, device="cuda:0").to("cuda:0", copy=True), torch.randn(4))
