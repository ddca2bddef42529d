"""Timing of an evaluation rollout: named wall-clock durations (CUDA synchronised) and the rollout that times its
context work."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import numpy as np
import torch

from predictor_training.rollout.ar_rollout import ARRollout, ChunkContext
from predictor_training.runtime.precision import synchronize


class Stopwatch:
    """Wall-clock durations by name (CUDA synchronised before and after each measured block)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.durations: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def measure(self, name: str):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.durations[name].append(time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.durations[name].append(seconds)

    def summary(self) -> dict[str, dict]:
        """{name: {"count", "total_s", "mean_s", "min_s"}}."""
        return {name: {"count": len(values), "total_s": float(sum(values)), "mean_s": float(np.mean(values)),
                       "min_s": float(min(values))} for name, values in self.durations.items()}


class TimedRollout(ARRollout):
    """`ARRollout` that times every context prefill (chunks with context only) and records each chunk's n_ctx.

    In a cached context mode (`RolloutConfig.context_mode` other than exact) the context of a chunk is assembled
    from cached K/V, timed as "context_assembly", and the caching of a finished chunk (`ARRollout.cache_chunk`: the
    incremental mode's Teacher K/V pass, or storing the last Full step's K/V) as "context_cache" (chunks that
    cache something only)."""

    def __init__(self, *args, stopwatch: Stopwatch, **kwargs):
        super().__init__(*args, **kwargs)
        self.stopwatch = stopwatch
        self.context_frames: list[int] = []

    def prefill_context(self, chunk_index: int, with_vec: bool = False) -> ChunkContext:
        synchronize(self.device)
        start = time.perf_counter()
        context = super().prefill_context(chunk_index, with_vec)
        synchronize(self.device)
        if context.num_frames:
            name = "context_prefill" if self.frame_cache is None else "context_assembly"
            self.stopwatch.add(name, time.perf_counter() - start)
        self.context_frames.append(context.num_frames)
        return context

    def cache_chunk(self, chunk_index: int, context: ChunkContext, outputs) -> None:
        cached_before = None if self.frame_cache is None else len(self.frame_cache.frames)
        synchronize(self.device)
        start = time.perf_counter()
        super().cache_chunk(chunk_index, context, outputs)
        synchronize(self.device)
        if cached_before is not None and len(self.frame_cache.frames) > cached_before:
            self.stopwatch.add("context_cache", time.perf_counter() - start)


def method_timings(stopwatch: Stopwatch, text_prefill_s: float | None) -> dict:
    """Per-method timing record: per-call summaries plus rollout / decode / end-to-end seconds."""
    summary = stopwatch.summary()
    rollout_s = summary.pop("rollout")["total_s"]
    decode_s = summary.pop("vae_decode")["total_s"]
    text_s = 0.0 if text_prefill_s is None else text_prefill_s
    return {
        "text_prefill_s": text_prefill_s,
        "rollout_s": rollout_s,
        "vae_decode_s": decode_s,
        "dit_s": text_s + rollout_s,
        "end_to_end_s": text_s + rollout_s + decode_s,
        "calls": summary,
    }
