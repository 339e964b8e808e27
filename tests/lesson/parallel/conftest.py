"""A process group of one rank (gloo, in this process), for tests that build an `EPMoELayer`
without starting ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
