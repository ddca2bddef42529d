"""Shared pytest fixtures, and the numerics every test process (and the subprocesses it starts) uses."""

import os

# MKL picks its kernels by the CPU's vector ISA, so an AVX-512 machine rounds float32 matmuls differently from the
# AVX2 machine that made the golden vectors, by up to 1.4x the strict conformance tier (tests/data/conformance/
# README.md section 11). MKL's COMPATIBLE path gives the same results on every x86 CPU. Read when MKL loads: this
# must run before torch is imported, and the environment passes it on to torchrun workers and tool subprocesses.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
# One intra-op thread for the test process and every tool it starts (the tools' automatic choice otherwise depends
# on the machine's load, and torchrun workers use one thread as well).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


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
