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
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from predictor_training.runtime.errors import UserInputError

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
        raise UserInputError("--backend nccl (or --device cuda): needs a CUDA device, but none is visible to torch; "
                             "expected --backend gloo / auto (or --device cpu / auto) on a machine without a GPU")
    return backend


def _launched_by_torchrun() -> bool:
    present = [name for name in _TORCHRUN_VARS if name in os.environ]
    if present and len(present) != len(_TORCHRUN_VARS):
        missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
        raise UserInputError(
            f"init_distributed: partial torchrun environment (set: {present}, missing: {missing}); "
            "launch with torchrun or unset these variables"
        )
    return bool(present)


def torchrun_number(name: str) -> int:
    """The integer torchrun variable `name` (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_PORT); one line when it is not."""
    text = os.environ[name]
    try:
        return int(text)
    except ValueError:
        raise UserInputError(f"{name}={text!r}: expected an integer (as torchrun sets it)") from None


# How long an unresolvable MASTER_ADDR is looked up again (the name service of a cluster that is still starting)
# before the launch ends with one line; torch's own rendezvous would retry it without end.
MASTER_ADDRESS_WAIT_S = 120.0


def wait_for_master_address(wait_s: float | None = None) -> None:
    """Resolve MASTER_ADDR (and check MASTER_PORT), retrying for up to `wait_s` seconds (`MASTER_ADDRESS_WAIT_S`);
    a name that never resolves raises one `UserInputError` naming it."""
    wait_s = MASTER_ADDRESS_WAIT_S if wait_s is None else wait_s
    address, port = os.environ["MASTER_ADDR"], torchrun_number("MASTER_PORT")
    if not 0 < port < 65536:
        raise UserInputError(f"MASTER_PORT={port}: expected a TCP port in 1..65535")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.getaddrinfo(address, port)
            return
        except (socket.gaierror, UnicodeError) as error:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UserInputError(f"MASTER_ADDR={address!r}: cannot be resolved ({error}) after {wait_s:g} s; "
                                     "expected the host name or address of the rank-0 node") from None
            time.sleep(min(2.0, remaining))


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

    rank, local_rank, world_size = (torchrun_number(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if not 0 <= rank < world_size or not 0 <= local_rank <= rank:
        raise UserInputError(f"RANK={rank} LOCAL_RANK={local_rank} WORLD_SIZE={world_size}: expected 0 <= LOCAL_RANK "
                             "<= RANK < WORLD_SIZE (as torchrun sets them)")
    wait_for_master_address()
    if die_with_launcher:
        exit_with_launcher()
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserInputError(
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
    if seed < 0 or rank < 0 or seed + rank >= 2**32:
        raise ValueError(f"seed_everything: seed={seed}, rank={rank}; expected both >= 0 and seed + rank < 2**32 "
                         "(numpy's seed range)")
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
