"""The interop tests run tiny Hugging Face models: one intra-op thread runs them several
times faster than a thread pool contending for a shared CPU."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
