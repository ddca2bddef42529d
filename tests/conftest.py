"""Shared pytest fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tensors on one intra-op thread.

    The test models are tiny, so one thread is as fast as two and does not stall when the machine is busy; it is
    also what every torchrun worker uses (OMP_NUM_THREADS=1), so bytes written in-process and by workers compare.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
