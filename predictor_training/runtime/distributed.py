"""Distributed setup in one place: torchrun (nccl/gloo) or plain `python` (world size 1).

Usage:

    env = init_distributed("auto")          # DistEnv(rank, local_rank, world_size, device, backend, is_main)
    seed_everything(args.seed, rank=env.rank)
    ddp_model = wrap_ddp(model, env)        # the plain module when no process group exists
    with maybe_no_sync(ddp_model, enabled=not sync):
        loss.backward()
    cleanup_distributed()

Backend choice: "auto" -> nccl on CUDA, gloo on CPU; "nccl" requires CUDA; "gloo" always runs on the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    rank / local_rank / world_size: torchrun's numbers (0 / 0 / 1 without torchrun).
    device: the device this rank computes on (cuda:<local_rank> or cpu).
    backend: the process-group backend, or None when no process group was created (plain python).
    is_main: rank == 0; the only rank that prints, logs metrics and writes files.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None
    is_main: bool

    @property
    def distributed(self) -> bool:
        """True when a process group exists (collectives must be called on every rank)."""
        return self.backend is not None


def resolve_backend(backend: str) -> str:
    """"auto" -> nccl with CUDA, gloo without; an explicit choice is checked (nccl needs CUDA)."""
    if backend not in _BACKENDS:
        raise ValueError(f"init_distributed: backend={backend!r}; expected one of {_BACKENDS}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("init_distributed: backend='nccl' needs CUDA, but torch.cuda.is_available() is False")
    return backend


def _launched_by_torchrun() -> bool:
    present = [name for name in _TORCHRUN_VARS if name in os.environ]
    if present and len(present) != len(_TORCHRUN_VARS):
        missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
        raise RuntimeError(
            f"init_distributed: partial torchrun environment (set: {present}, missing: {missing}); "
            "launch with torchrun or unset these variables"
        )
    return bool(present)


def exit_with_launcher() -> None:
    """Make this worker die with the process that started it (torchrun's agent).

    torchrun starts each worker in its own session, so killing the launcher (or its process group) would leave the
    ranks training as orphans, writing into the run directory beside a relaunched run. On Linux the kernel sends
    this process SIGKILL when its parent exits (`prctl(PR_SET_PDEATHSIG)`); a parent that is already gone (this
    process was re-parented) ends it at once. A scheduler that kills the whole job kills the workers directly.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os._exit(1)


def init_distributed(backend: str = "auto", *, die_with_launcher: bool = True) -> DistEnv:
    """Create the process group under torchrun, or describe a single process otherwise.

    Under torchrun (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set) this calls
    `dist.init_process_group`, the worker first made to die with its launcher (`exit_with_launcher`; off for a process
    that sets those variables itself, e.g. a test); a group that already exists (a caller that made it, e.g. a test
    running several recipe mains in one group) is joined as it is. As plain python it creates nothing and returns
    world size 1.
    """
    resolved = resolve_backend(backend)
    use_cuda = resolved == "nccl"
    if not _launched_by_torchrun():
        device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        return DistEnv(rank=0, local_rank=0, world_size=1, device=device, backend=None, is_main=True)
    if process_group_active():
        rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
        return DistEnv(rank=rank, local_rank=local_rank, world_size=dist.get_world_size(), device=device,
                       backend=dist.get_backend(), is_main=rank == 0)

    if die_with_launcher:
        exit_with_launcher()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"init_distributed: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are visible"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group(backend=resolved, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend=resolved)
    return DistEnv(
        rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=resolved, is_main=rank == 0
    )


def cleanup_distributed() -> None:
    """Destroy the process group if one exists (safe to call in `finally`)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def process_group_active() -> bool:
    """Whether this process is in a torch.distributed process group now."""
    return dist.is_available() and dist.is_initialized()


def current_rank() -> int:
    """Rank of this process in the default group; before a group exists, torchrun's RANK (0 without torchrun)."""
    return dist.get_rank() if process_group_active() else int(os.environ.get("RANK", "0"))


def print0(*args, **kwargs) -> None:
    """`print` on rank 0 only (flushed, so torchrun logs interleave correctly)."""
    if current_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def log0(message: str) -> None:
    """One timestamped text line on rank 0 only."""
    print0(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}")


def barrier() -> None:
    """`dist.barrier()` when a process group exists; nothing otherwise."""
    if process_group_active():
        dist.barrier()


def all_gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order (`[obj]` without a process group)."""
    if not process_group_active():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def seed_everything(seed: int, rank: int) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device) with `seed + rank`; returns that value.

    Offsetting by rank gives each rank its own noise stream; anything that must agree across ranks
    (model init, control-flow choices) is broadcast from rank 0 instead.
    """
    if seed < 0 or rank < 0:
        raise ValueError(f"seed_everything: seed={seed}, rank={rank}; both must be >= 0")
    effective = seed + rank
    random.seed(effective)
    np.random.seed(effective)
    torch.manual_seed(effective)
    return effective


def wrap_ddp(module: nn.Module, env: DistEnv) -> nn.Module:
    """DistributedDataParallel with the toolkit's settings, or `module` itself when there is no process group.

    forward_sync_buffers=False (no buffer changes during training; buffers are still broadcast once at wrapping, as
    the parameters are, and every rank builds them alike), gradient_as_bucket_view=True (no gradient copy),
    find_unused_parameters=False (every trainable parameter takes part in each forward). The module must already
    be on `env.device`.
    """
    if not env.distributed:
        return module
    if env.device.type == "cuda":
        return DistributedDataParallel(
            module,
            device_ids=[env.device.index],
            output_device=env.device.index,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
            find_unused_parameters=False,
        )
    return DistributedDataParallel(
        module, forward_sync_buffers=False, gradient_as_bucket_view=True, find_unused_parameters=False
    )


def unwrap_model(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (the module itself otherwise)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def maybe_no_sync(module: nn.Module, enabled: bool):
    """`module.no_sync()` when `enabled` and `module` is DDP; a null context otherwise.

    The context must cover both the forward and the backward whose all-reduce is skipped.
    """
    if enabled and isinstance(module, DistributedDataParallel):
        return module.no_sync()
    return contextlib.nullcontext()
