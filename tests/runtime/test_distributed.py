"""Distributed setup (predictor_training/runtime/distributed.py) in one process: the backend choice, plain python as
world size 1 (no process group), a partial torchrun environment refused, seeds offset by rank, and a one-rank gloo
group for the DDP helpers (wrap, unwrap, no_sync, gather). The 2-rank paths run under torchrun in
tests/runtime/test_loop.py and the recipe tests."""

from __future__ import annotations

import random
import socket

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from predictor_training.runtime.distributed import (
    DistEnv,
    all_gather_objects,
    cleanup_distributed,
    current_rank,
    init_distributed,
    maybe_no_sync,
    print0,
    resolve_backend,
    seed_everything,
    unwrap_model,
    wrap_ddp,
)
from predictor_training.runtime.errors import UserInputError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def test_the_backend_follows_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_backend("auto") == "gloo" and resolve_backend("gloo") == "gloo"
    with pytest.raises(UserInputError, match="--backend nccl .*needs a CUDA device"):
        resolve_backend("nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_backend("auto") == "nccl" and resolve_backend("nccl") == "nccl" and resolve_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="backend='mpi'; expected one of"):
        resolve_backend("mpi")


def test_plain_python_is_one_rank_without_a_process_group(no_torchrun):
    env = init_distributed("gloo")
    assert env == DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
    assert not env.distributed and not torch.distributed.is_initialized()
    module = torch.nn.Linear(2, 2)
    assert wrap_ddp(module, env) is module and unwrap_model(module) is module
    with maybe_no_sync(module, enabled=True):  # a null context for a plain module
        pass
    assert all_gather_objects({"rank": 0}) == [{"rank": 0}]


def test_a_partial_torchrun_environment_is_refused(no_torchrun, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserInputError, match=r"partial torchrun environment .*missing: \['LOCAL_RANK', 'MASTER_ADDR', "
                                           r"'MASTER_PORT'\]"):
        init_distributed("gloo")


def test_an_unresolvable_master_address_ends_after_a_bounded_wait(no_torchrun, monkeypatch):
    """torch's rendezvous retries a name that does not resolve without end; the lookup first, for a bounded wait."""
    import predictor_training.runtime.distributed as distributed

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid",
                        "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(distributed, "MASTER_ADDRESS_WAIT_S", 0.5)
    with pytest.raises(UserInputError, match=r"MASTER_ADDR='no-such-host.invalid': cannot be resolved .* after 0.5 s"):
        init_distributed("gloo")
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(UserInputError, match="MASTER_PORT='http': expected an integer"):
        init_distributed("gloo")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(UserInputError, match="RANK=2 LOCAL_RANK=0 WORLD_SIZE=2: expected"):
        init_distributed("gloo")


def test_only_rank_0_prints(no_torchrun, monkeypatch, capsys):
    print0("from rank 0")
    monkeypatch.setenv("RANK", "1")
    assert current_rank() == 1
    print0("from rank 1")
    assert capsys.readouterr().out == "from rank 0\n"


def test_seeds_are_offset_by_rank():
    assert seed_everything(3, rank=2) == 5
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    assert draws == (random.random(), float(np.random.rand()), float(torch.rand(1)))
    seed_everything(3, rank=1)
    assert float(torch.rand(1)) != draws[2]
    for seed, rank in ((-1, 0), (2**32 - 1, 1)):
        with pytest.raises(ValueError, match=r"expected both >= 0 and seed \+ rank < 2\*\*32"):
            seed_everything(seed, rank=rank)


def test_one_rank_gloo_group_wraps_in_ddp_and_skips_the_all_reduce_under_no_sync(no_torchrun, monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    env = init_distributed("gloo", die_with_launcher=False)  # this test process is no torchrun worker
    try:
        assert env == DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo",
                              is_main=True)
        assert env.distributed and torch.distributed.is_initialized()
        module = torch.nn.Linear(2, 2)
        wrapped = wrap_ddp(module, env)
        assert isinstance(wrapped, DistributedDataParallel) and unwrap_model(wrapped) is module
        assert wrapped.require_backward_grad_sync
        with maybe_no_sync(wrapped, enabled=True):
            assert not wrapped.require_backward_grad_sync
        with maybe_no_sync(wrapped, enabled=False):
            assert wrapped.require_backward_grad_sync
        assert all_gather_objects(("rank", env.rank)) == [("rank", 0)]
    finally:
        cleanup_distributed()
    assert not torch.distributed.is_initialized()
    cleanup_distributed()  # safe to call again
