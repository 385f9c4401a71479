"""Fixtures shared by labkit's tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors this small gain nothing from threads and lose a lot on a shared 2-core CPU; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
