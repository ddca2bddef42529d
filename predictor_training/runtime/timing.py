"""The benchmarks' one timing helper: calls timed in interleaved rounds, so a load change on a shared machine hits
every call alike, with the warm-up rounds left out (`interleaved`). Beside it what a benchmark's report says about
the time it had and the machine it ran on: a wall-clock `Budget` of sections, the measured BF16 matmul peak, the
SDPA kernels a call dispatched to and the device's description (`device_environment`)."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from predictor_training.runtime.precision import synchronize


def interleaved(calls: dict[str, Callable[[], object]], repeats: int, *, warmup: int = 1,
                device: torch.device | str = "cpu", clock: Callable[[], float] = time.perf_counter,
                rotate: bool = False) -> dict[str, dict]:
    """`warmup` untimed rounds of every call, then `repeats` timed rounds, the calls interleaved in each round (CUDA
    synchronised around each call on a GPU `device`; seconds read from `clock`): {name: {"times_s", "min_s",
    "median_s"}}. rotate: round r starts at the call r mod #calls of `calls`' order (then wraps), so no call always
    runs first (right after a pause or another kind of work); times_s stay in round order."""
    times = {name: [] for name in calls}
    names = list(calls)
    for round_index in range(warmup + repeats):
        shift = round_index % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            call = calls[name]
            synchronize(device)
            start = clock()
            call()
            synchronize(device)
            if round_index >= warmup:
                times[name].append(clock() - start)
    return {name: {"times_s": values, "min_s": min(values), "median_s": statistics.median(values)}
            for name, values in times.items()}


class Budget:
    """Wall time left for a benchmark's sections; `fits(section, estimate_s)` says whether to run one and, when it
    does not fit, prints and records the skip (`skipped`: section, planned_s, left_s, line)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()
        self.skipped: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def skip(self, section: str, line: str, planned_s: float = 0.0) -> None:
        print(line, flush=True)
        self.skipped.append({"section": section, "planned_s": planned_s, "left_s": max(self.left(), 0.0),
                             "line": line})

    def fits(self, section: str, estimate_s: float) -> bool:
        if estimate_s <= self.left():
            return True
        self.skip(section, f"skipped {section}: planned {estimate_s:.0f} s, {max(self.left(), 0):.0f} s of "
                           f"--budget_s {self.seconds:.0f} left", estimate_s)
        return False


def matmul_peak(n: int, device: torch.device, repeats: int) -> dict:
    """BF16 TFLOP/s of an n x n x n matmul (`interleaved`, best of `repeats`; 10 matmuls per call on a GPU): the
    device's achievable peak."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    loops = 10 if torch.device(device).type == "cuda" else 1
    seconds = interleaved({"matmul": lambda: [a @ b for _ in range(loops)]}, repeats, device=device)["matmul"]["min_s"]
    return {"n": n, "seconds": seconds / loops, "tflops": 2 * n ** 3 / (seconds / loops) / 1e12}


SDPA_KERNELS = {  # profiler op name fragment -> kernel
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_attention_math": "math",
}


def sdpa_kernels(call: Callable[[], object]) -> list[str]:
    """The SDPA kernels `call()` dispatched to, read from the profiler's op names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        call()
    names = {event.name for event in profile.events()}
    found = []
    for fragment, kernel in SDPA_KERNELS.items():
        if any(name.endswith(fragment) or name == f"aten::{fragment}" for name in names) and kernel not in found:
            found.append(kernel)
    if "flash (CPU)" in found and "flash" in found:
        found.remove("flash")
    return found


def device_environment(device: torch.device) -> dict:
    """The device (name, memory, capability; or the CPU and its threads), torch / CUDA / cuDNN / Python versions and
    which SDPA kernels are enabled."""
    record = {"device_type": device.type, "torch": torch.__version__, "python": platform.python_version(),
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
              else None}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record.update({"device": properties.name, "memory_gib": properties.total_memory / 2 ** 30,
                       "capability": f"{properties.major}.{properties.minor}",
                       "multiprocessors": properties.multi_processor_count,
                       "driver_visible_devices": torch.cuda.device_count()})
        record["sdpa_enabled"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                  "memory_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                  "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                  "math": torch.backends.cuda.math_sdp_enabled()}
    else:
        record.update({"device": platform.processor() or platform.machine(), "memory_gib": None,
                       "threads": torch.get_num_threads()})
    return record
