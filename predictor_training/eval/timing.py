"""Timing of an evaluation rollout: named wall-clock durations (CUDA synchronised) and the rollout that times its
context work; repeated rollout timings and the spread of per-video speedups (`repeated_timings`, `speedup_spread`:
the leaderboard's measured columns on a shared machine); and one AR chunk's model calls on synthetic inputs with
their FLOP counts (`chunk_calls`, `chunk_call_flops`: benchmarks/gpu_acceptance.py's per-call timings)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Sequence

import numpy as np
import torch

from predictor_training.data.synthetic import teacher_call_inputs
from predictor_training.rollout.ar_rollout import ARRollout
from predictor_training.rollout.policy import ChunkContext
from predictor_training.runtime.precision import autocast, synchronize
from predictor_training.teacher.flops import (
    TeacherShape,
    context_prefill_flops,
    frame_kv_pass_flops,
    predictor_step_flops,
    teacher_chunk_step_flops,
)

CHUNK_FRAMES = 4
CONTEXT_TIMESTEP = 14.0  # the timestep of the context frames' K/V (the dataset's context_timestep)


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


TIMING_STATISTICS = ("median", "min")  # of a method's repeated rollout times on one video


def timing_statistic(samples: Sequence[float], statistic: str) -> float:
    """The median or the minimum of repeated timings (seconds)."""
    if not samples:
        raise ValueError("no timings to summarise")
    if statistic == "median":
        return float(np.median(samples))
    if statistic == "min":
        return float(min(samples))
    raise ValueError(f"timing statistic must be one of {TIMING_STATISTICS}, got {statistic!r}")


def repeated_timings(record: dict, repeats_s: Sequence[float], statistic: str) -> dict:
    """`method_timings`' record of a video's scored rollout, with its rollout time replaced by `statistic` over that
    rollout and `repeats_s` (the same rollout timed again in interleaved rounds): rollout_s, dit_s and end_to_end_s
    follow it; "rollout_repeats_s" keeps every sample (scored pass first) and "timing" says how it was summarised.
    The text prefill and the VAE decode are timed once."""
    samples = [record["rollout_s"], *[float(value) for value in repeats_s]]
    rollout_s = timing_statistic(samples, statistic)
    text_s = record["text_prefill_s"] or 0.0
    return {**record, "rollout_s": rollout_s, "dit_s": text_s + rollout_s,
            "end_to_end_s": text_s + rollout_s + record["vae_decode_s"], "rollout_repeats_s": samples,
            "timing": {"repeats": len(samples), "statistic": statistic}}


def speedup_spread(video_keys: Sequence[str], reference_s: Sequence[float], row_s: Sequence[float]) -> dict:
    """The spread of a row's measured speedup over the videos: per video (its units - seeds - summed) the reference
    time over the row's, then {"median", "q25", "q75", "min", "max", "videos"} of those ratios (the interquartile
    range is what the leaderboard prints beside the pooled speedup)."""
    if not (len(video_keys) == len(reference_s) == len(row_s)) or not video_keys:
        raise ValueError(f"one time per unit: {len(video_keys)} keys, {len(reference_s)} reference and {len(row_s)} "
                         "row times")
    totals: dict[str, list[float]] = {}
    for key, reference, row in zip(video_keys, reference_s, row_s):
        pair = totals.setdefault(key, [0.0, 0.0])
        pair[0] += float(reference)
        pair[1] += float(row)
    ratios = np.asarray([reference / row for reference, row in totals.values()])
    q25, median, q75 = np.percentile(ratios, [25, 50, 75])
    return {"median": float(median), "q25": float(q25), "q75": float(q75), "min": float(ratios.min()),
            "max": float(ratios.max()), "videos": len(ratios)}


def chunk_calls(teacher, predictor, text_kv, context_frames: int, grid: tuple[int, int], device: torch.device
                ) -> dict:
    """{name: call} of one AR chunk's model calls on synthetic inputs made once (`data/synthetic.py`), to run under
    the Teacher's autocast: "full_step" (a Full step with `context_frames` frames of context), "context_prefill" (the
    exact prefill of those frames), "cache_pass" (the incremental mode's K/V pass over a finished chunk) and
    "predictor_step" (a Predictor step with that context). Each call returns its output."""
    n, dtype, config = context_frames, teacher.dtype, teacher.config
    context = teacher_call_inputs(config, n, grid, device=device, dtype=dtype,
                                  generator=torch.Generator(device=device).manual_seed(5))
    chunk = teacher_call_inputs(config, CHUNK_FRAMES, grid, device=device, dtype=dtype,
                                generator=torch.Generator(device=device).manual_seed(6))
    context_timestep = torch.full((n,), CONTEXT_TIMESTEP, device=device)
    blocks = predictor.source_blocks
    with torch.no_grad(), autocast(device, torch.bfloat16):
        context_kv, _ = teacher.context_prefill(context[0], context_timestep, *context[2:], text_kv)
        anchor = torch.randn(1, CHUNK_FRAMES * grid[0] * grid[1], config.hidden_size, device=device,
                             dtype=torch.float32).to(dtype)
        previous_hidden = torch.randn_like(anchor)
    return {
        "full_step": lambda: teacher.chunk_step(*chunk, text_kv, context_kv=context_kv),
        "context_prefill": lambda: teacher.context_prefill(context[0], context_timestep, *context[2:], text_kv)[0],
        "cache_pass": lambda: teacher.frame_kv_pass(chunk[0], torch.full((CHUNK_FRAMES,), CONTEXT_TIMESTEP,
                                                    device=device), *chunk[2:], text_kv, context_kv=context_kv),
        "predictor_step": lambda: predictor(chunk[0], anchor, chunk[1][None], chunk[2], chunk[3], chunk[4],
                                            text_kv.select(blocks), context=context_kv.select(blocks),
                                            prev_chunk_hidden=previous_hidden),
    }


def chunk_call_flops(shape: TeacherShape, predictor_config: dict, tokens_per_frame: int, text_tokens: int,
                     context_frames: int) -> dict[str, int]:
    """The FLOPs of `chunk_calls`' calls (teacher/flops.py)."""
    sizes = (tokens_per_frame, text_tokens, context_frames)
    return {"full_step": teacher_chunk_step_flops(shape, *sizes, CHUNK_FRAMES),
            "context_prefill": context_prefill_flops(shape, *sizes),
            "cache_pass": frame_kv_pass_flops(shape, *sizes, CHUNK_FRAMES),
            "predictor_step": predictor_step_flops(shape, predictor_config, *sizes, CHUNK_FRAMES)}
