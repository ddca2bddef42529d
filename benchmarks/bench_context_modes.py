#!/usr/bin/env python
"""One AR chunk's context cost under each context mode, measured side by side against its FLOP count.

For a chunk with n context frames, the context costs:

    exact         a context prefill of the n frames (every layer, every chunk)
    incremental   placing n cached frames (RoPE + ProPE of their K/V) + one pass over the chunk's 4 frames
    last_step     placing n cached frames only

The script times each (best of --repeats, modes interleaved so machine load hits them alike), and prints the
measured ratio of exact to each mode next to the ratio of their FLOPs (`predictor_training.teacher.flops`), for the cost of
the context alone and for a whole F-F-F-F chunk (context + 4 Full steps). Where measured and FLOP ratios agree, the
calls run at matmul speed; on the demo world's tiny Teacher they do not (each call costs about the same whatever its
token count), which is why the demo eval's measured speedups of the cached modes stay far below their bounds.

    python benchmarks/bench_context_modes.py                     # world (the demo Teacher's size) and medium
    python benchmarks/bench_context_modes.py --configs medium --repeats 5
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from predictor_training.runtime.timing import interleaved
from predictor_training.teacher.flops import (
    TeacherShape,
    context_assembly_flops,
    context_prefill_flops,
    frame_kv_pass_flops,
    teacher_chunk_step_flops,
)
from predictor_training.teacher.frame_kv_cache import FrameKVCache
from predictor_training.teacher import TextKV, WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.config import preset_config


@dataclass(frozen=True)
class BenchConfig:
    name: str
    overrides: dict
    height: int
    width: int
    context_frames: int = 20
    text_tokens: int = 40


CONFIGS = {
    "world": BenchConfig("world", {"mm_double_blocks_depth": 12, "in_channels": 16, "out_channels": 16}, 4, 6),
    "medium": BenchConfig("medium", {"hidden_size": 512, "heads_num": 8, "rope_dim_list": [16, 24, 24],
                                     "mm_double_blocks_depth": 8, "in_channels": 16, "out_channels": 16}, 8, 16),
}
CHUNK_FRAMES = 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=str, default="world,medium",
                        help=f"comma-separated configs among {sorted(CONFIGS)} (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the best is kept (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; expected among {sorted(CONFIGS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def frame_inputs(teacher, frames: int, height: int, width: int, generator: torch.Generator):
    """Model input [1, 2C+1, frames, H, W], timestep [frames], action [1, frames], viewmats, Ks."""
    channels = teacher.config.in_channels
    hidden_states = torch.randn(1, 2 * channels + 1, frames, height, width, generator=generator)
    viewmats = torch.eye(4).repeat(1, frames, 1, 1)
    viewmats[0, :, 2, 3] = -0.1 * torch.arange(frames)
    Ks = torch.tensor([[0.5, 0, 0.5], [0, 0.9, 0.5], [0, 0, 1.0]]).repeat(1, frames, 1, 1)
    action = torch.zeros(1, frames, dtype=torch.long)
    return hidden_states, torch.full((frames,), 14.0), action, viewmats, Ks


@torch.no_grad()
def bench(config: BenchConfig, repeats: int) -> list[str]:
    torch.manual_seed(0)
    teacher = WorldPlayTransformer(**preset_config("demo", **config.overrides)).eval().requires_grad_(False)
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    shape = TeacherShape.from_config(teacher.config)
    heads, head_dim = teacher.heads_num, teacher.head_dim
    text_kv = TextKV([torch.randn(1, heads, config.text_tokens, head_dim, generator=generator)
                      for _ in range(shape.depth)],
                     [torch.randn(1, heads, config.text_tokens, head_dim, generator=generator)
                      for _ in range(shape.depth)])
    n, height, width = config.context_frames, config.height, config.width
    tokens = height * width
    context = frame_inputs(teacher, n, height, width, generator)
    chunk = frame_inputs(teacher, CHUNK_FRAMES, height, width, generator)
    exact_kv, _ = teacher.context_prefill(*context, text_kv)
    cache = FrameKVCache(shape.depth, tokens)
    cache.put(range(n), teacher.frame_kv_pass(*context, text_kv))  # any K/V of the right shape

    def assemble():
        return teacher.assemble_context_kv(cache.gather(range(n)), context[3], context[4], height, width)

    timings = interleaved({
        "exact prefill": lambda: teacher.context_prefill(*context, text_kv),
        "assembly": assemble,
        "cache pass": lambda: teacher.frame_kv_pass(*chunk, text_kv, context_kv=exact_kv),
        "full step": lambda: teacher.chunk_step(*chunk[:1], torch.full((CHUNK_FRAMES,), 500.0), *chunk[2:], text_kv,
                                                context_kv=exact_kv),
    }, repeats)
    times = {name: timing["min_s"] for name, timing in timings.items()}
    flops = {
        "exact prefill": context_prefill_flops(shape, tokens, config.text_tokens, n),
        "assembly": context_assembly_flops(shape, tokens, n),
        "cache pass": frame_kv_pass_flops(shape, tokens, config.text_tokens, n, CHUNK_FRAMES),
        "full step": teacher_chunk_step_flops(shape, tokens, config.text_tokens, n, CHUNK_FRAMES),
    }
    context_cost = {"exact": ["exact prefill"], "incremental": ["assembly", "cache pass"], "last_step": ["assembly"]}
    lines = [f"## {config.name}: {shape.depth} blocks, hidden {shape.hidden_size}, latent frame {height} x {width}, "
             f"{n} context frames, {config.text_tokens} text tokens",
             "", "| call | best s | GFLOPs |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {times[name]:.4f} | {flops[name] / 1e9:.2f} |" for name in times]
    lines += ["", "| mode | context: measured exact/mode | context: FLOP exact/mode | F-F-F-F chunk: measured | "
                  "F-F-F-F chunk: FLOP |", "| --- | ---: | ---: | ---: | ---: |"]

    def total(source, mode, full_steps):
        return sum(source[name] for name in context_cost[mode]) + full_steps * source["full step"]

    for mode in context_cost:
        lines.append(f"| {mode} | {total(times, 'exact', 0) / total(times, mode, 0):.2f}x | "
                     f"{total(flops, 'exact', 0) / total(flops, mode, 0):.2f}x | "
                     f"{total(times, 'exact', 4) / total(times, mode, 4):.2f}x | "
                     f"{total(flops, 'exact', 4) / total(flops, mode, 4):.2f}x |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, best of {args.repeats}")
    for name in args.configs.split(","):
        print("\n".join(["", *bench(CONFIGS[name], args.repeats)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
