"""The benchmarks' one timing helper: calls timed in interleaved rounds, so a load change on a shared machine hits
every call alike, with the warm-up rounds left out."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from predictor_training.runtime.precision import synchronize


def interleaved(calls: dict[str, Callable[[], object]], repeats: int, *, warmup: int = 1,
                device: torch.device | str = "cpu") -> dict[str, dict]:
    """`warmup` untimed rounds of every call, then `repeats` timed rounds, the calls interleaved in each round (CUDA
    synchronised around each call on a GPU `device`): {name: {"times_s", "min_s", "median_s"}}."""
    times = {name: [] for name in calls}
    for round_index in range(warmup + repeats):
        for name, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: {"times_s": values, "min_s": min(values), "median_s": statistics.median(values)}
            for name, values in times.items()}
