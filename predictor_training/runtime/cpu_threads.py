"""How many CPU threads a tool's tensors use, chosen so that jobs sharing a machine do not oversubscribe it.

torch's default is one thread per core, whatever else runs: two such jobs on 2 cores ran one eval video in 309 s
instead of 11 s. The tools call `set_cpu_threads` at start: `--threads N` when given, else `OMP_NUM_THREADS` when
set (torchrun sets 1 per worker), else the cores this process may run on (its CPU affinity) split over the ranks
on this host, at least 1 - and for the tools that only measure (the eval, the video metrics), less the cores other
jobs keep busy (the 1-minute load average). The tools that make data (demo assets, dataset builders, encoders,
the ODE cache) do not look at the load: the thread count changes float rounding, and their outputs must not
depend on what else runs on the machine. The choice is printed.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

THREADS_ENV = "OMP_NUM_THREADS"
# CPU features that change which float kernels MKL / oneDNN / torch pick, hence the rounding of float32 results.
KERNEL_ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                    "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_kind() -> dict:
    """What decides the bits of this machine's CPU float results: torch's kernel level, the ISA flags above (from
    /proc/cpuinfo, where there is one), MKL's conditional-numerical-reproducibility setting (MKL_CBWR) and the
    torch version. Two runs on the same kind give the same bits; `cpu_model` is for people only."""
    flags, model = [], "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags" and not flags:
                present = set(value.split())
                flags = [flag for flag in KERNEL_ISA_FLAGS if flag in present]
            elif key.strip() == "model name" and model == "unknown":
                model = value.strip()
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "isa_flags": flags,
            "mkl_cbwr": os.environ.get("MKL_CBWR", "unset"), "torch": torch.__version__, "cpu_model": model}


def same_cpu_kind(first: dict, second: dict) -> bool:
    """Whether two `cpu_kind` records describe the same kind (everything but the model name)."""
    return {k: v for k, v in first.items() if k != "cpu_model"} == {k: v for k, v in second.items()
                                                                     if k != "cpu_model"}


def available_cores() -> int:
    """Cores in this process's CPU affinity (all cores where the platform has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose_cpu_threads(requested: int | None, *, ranks_on_host: int = 1, cores: int | None = None,
                       busy: float | None = None, load_aware: bool = True) -> tuple[int, str]:
    """(threads, why). `requested`: --threads (None = choose). `cores` / `busy` default to this machine's affinity
    and 1-minute load average (given explicitly in tests); `load_aware=False` ignores the load."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads={requested}: expected >= 1")
        return requested, "--threads"
    if os.environ.get(THREADS_ENV, "").strip():
        value = int(os.environ[THREADS_ENV])
        return max(1, value), f"{THREADS_ENV}={value}"
    cores = available_cores() if cores is None else cores
    if not load_aware:
        return max(1, cores // max(1, ranks_on_host)), (f"{cores} cores in this process's affinity, "
                                                         f"{ranks_on_host} rank(s) on this host")
    busy = os.getloadavg()[0] if busy is None else busy
    free = max(1, math.floor(cores - busy + 0.5))
    threads = max(1, free // max(1, ranks_on_host))
    return threads, (f"{cores} cores in this process's affinity, load {busy:.1f} from other jobs, "
                     f"{ranks_on_host} rank(s) on this host")


def set_cpu_threads(requested: int | None, *, tool: str, load_aware: bool, ranks_on_host: int | None = None) -> int:
    """Choose (see `choose_cpu_threads`; the ranks on this host default to torchrun's LOCAL_WORLD_SIZE, else 1),
    apply to torch's intra-op pool, print one line on stderr (stdout stays the tool's own); returns the count. `load_aware`: True for tools that only
    measure, False for tools that make data."""
    if ranks_on_host is None:
        ranks_on_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads, why = choose_cpu_threads(requested, ranks_on_host=ranks_on_host, load_aware=load_aware)
    torch.set_num_threads(threads)
    prefix = f"[{tool}] " if tool else ""
    print(f"{prefix}cpu threads: {threads} ({why}; --threads N to change)", file=sys.stderr, flush=True)
    return threads
