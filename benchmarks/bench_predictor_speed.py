#!/usr/bin/env python
"""Predictor step time / full Teacher chunk step time, measured side by side, against the FLOP-count ratio.

The eval reports a FLOP-count bound next to the measured speedup of an accelerated schedule
(`predictor_training/teacher/flops.py`). This benchmark checks that the count predicts real time: on CPU configurations with
8 and 12 Teacher blocks it times one Full chunk step (with context K/V, returning the final hidden, as in the
rollout) and one Predictor step on the same chunk (v4: context K/V of its source layers + previous-chunk hidden;
disca: text only), alternating the two calls so that machine load hits both alike, and compares (the fastest of
the rounds is the least disturbed estimate on a shared machine; medians are printed too)

    measured ratio = fastest Predictor step time / fastest Full step time
    FLOP ratio     = predictor_step_flops / teacher_chunk_step_flops

A row passes when the two ratios agree within a factor of 1.5 (exit status 1 otherwise).

    python benchmarks/bench_predictor_speed.py                  # about a minute on 2 cores
    python benchmarks/bench_predictor_speed.py --repeats 30 --threads 2 --configs depth8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from predictor_training.runtime.timing import interleaved
from predictor_training.teacher.flops import TeacherShape, predictor_step_flops, teacher_chunk_step_flops
from predictor_training.predictor.model import build_predictor
from predictor_training.teacher import TextKV, WorldPlayTransformer, randomize_zero_initialised_

TOLERANCE = 1.5


@dataclass(frozen=True)
class BenchConfig:
    name: str
    depth: int
    source_blocks: tuple[int, int]
    hidden_size: int = 256
    heads_num: int = 4
    rope_dim_list: tuple[int, int, int] = (16, 24, 24)
    height: int = 8
    width: int = 12
    context_frames: int = 8
    text_tokens: int = 64
    chunk_frames: int = 4


BENCH_CONFIGS = [
    BenchConfig("depth8", depth=8, source_blocks=(1, 6)),
    BenchConfig("depth12", depth=12, source_blocks=(1, 10)),
]


@dataclass
class Row:
    config: str
    variant: str
    teacher_ms: float  # fastest round
    predictor_ms: float
    flop_ratio: float
    teacher_median_ms: float
    predictor_median_ms: float

    @property
    def measured_ratio(self) -> float:
        return self.predictor_ms / self.teacher_ms

    @property
    def agreement(self) -> float:
        """measured / FLOP ratio (1 = the count predicts the time exactly)."""
        return self.measured_ratio / self.flop_ratio

    @property
    def passed(self) -> bool:
        return 1 / TOLERANCE <= self.agreement <= TOLERANCE

    def line(self) -> str:
        return (f"{self.config:<8} {self.variant:<6} {self.teacher_ms:>12.2f} {self.predictor_ms:>14.2f} "
                f"{self.measured_ratio:>10.3f} {self.flop_ratio:>10.3f} {self.agreement:>10.3f}  "
                f"{'PASS' if self.passed else 'FAIL'}   (medians {self.teacher_median_ms:.2f} / "
                f"{self.predictor_median_ms:.2f} ms)")


# ---------------------------------------------------------------------------------------------------------------
# 1. Models and one chunk's inputs
# ---------------------------------------------------------------------------------------------------------------
def build_teacher(cfg: BenchConfig) -> WorldPlayTransformer:
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset(
        "demo", hidden_size=cfg.hidden_size, heads_num=cfg.heads_num, rope_dim_list=list(cfg.rope_dim_list),
        mm_double_blocks_depth=cfg.depth,
    )
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    return teacher.eval().requires_grad_(False)


def chunk_inputs(teacher: WorldPlayTransformer, cfg: BenchConfig, frames: int, timestep: float,
                 generator: torch.Generator) -> dict:
    """hidden_states [1, 2C+1, T, H, W], timestep [T], action [1, T], viewmats [1, T, 4, 4], Ks [1, T, 3, 3]."""
    viewmats = torch.eye(4).repeat(1, frames, 1, 1)
    viewmats[..., :3, 3] = torch.randn(1, frames, 3, generator=generator)
    Ks = torch.eye(3).repeat(1, frames, 1, 1)
    Ks[..., :2, :2] *= 0.8
    return dict(
        hidden_states=torch.randn(1, 2 * teacher.config.in_channels + 1, frames, cfg.height, cfg.width,
                                  generator=generator),
        timestep=torch.full((frames,), timestep),
        action=torch.randint(0, 81, (1, frames), generator=generator).float(),
        viewmats=viewmats,
        Ks=Ks,
    )


# ---------------------------------------------------------------------------------------------------------------
# 2. Timing (runtime/timing.py: interleaved rounds, warm-up excluded)
# ---------------------------------------------------------------------------------------------------------------
def benchmark(cfg: BenchConfig, repeats: int) -> list[Row]:
    teacher = build_teacher(cfg)
    shape = TeacherShape.from_config(teacher.config)
    generator = torch.Generator().manual_seed(2)
    heads, head_dim = teacher.heads_num, teacher.head_dim
    text_kv = TextKV(
        [torch.randn(1, heads, cfg.text_tokens, head_dim, generator=generator) for _ in range(cfg.depth)],
        [torch.randn(1, heads, cfg.text_tokens, head_dim, generator=generator) for _ in range(cfg.depth)],
    )
    chunk = chunk_inputs(teacher, cfg, cfg.chunk_frames, 833.3, generator)
    tokens_per_frame = cfg.height * cfg.width
    anchor = torch.randn(1, cfg.chunk_frames * tokens_per_frame, cfg.hidden_size, generator=generator)
    rows = []
    with torch.no_grad():
        context_kv, _ = teacher.context_prefill(**chunk_inputs(teacher, cfg, cfg.context_frames, 14.0, generator),
                                                text_kv=text_kv)

        def full_step():
            teacher.chunk_step(**chunk, text_kv=text_kv, context_kv=context_kv, return_final_hidden=True)

        teacher_flops = teacher_chunk_step_flops(shape, tokens_per_frame, cfg.text_tokens, cfg.context_frames,
                                                 cfg.chunk_frames)
        for variant in ("v4", "disca"):
            predictor = build_predictor(teacher, variant, cfg.source_blocks).eval()
            v4 = variant == "v4"
            source_text = text_kv.select(cfg.source_blocks)
            source_context = context_kv.select(cfg.source_blocks) if v4 else None

            def predictor_step():
                predictor(chunk["hidden_states"], anchor, chunk["timestep"][None], chunk["action"], chunk["viewmats"],
                          chunk["Ks"], source_text, context=source_context, prev_chunk_hidden=anchor if v4 else None)

            timings = interleaved({"full": full_step, "predictor": predictor_step}, repeats, warmup=2)
            teacher_times, predictor_times = timings["full"]["times_s"], timings["predictor"]["times_s"]
            flops = predictor_step_flops(shape, predictor.predictor_config(), tokens_per_frame, cfg.text_tokens,
                                         cfg.context_frames, cfg.chunk_frames)
            rows.append(Row(cfg.name, variant, min(teacher_times) * 1e3, min(predictor_times) * 1e3,
                            flops / teacher_flops, statistics.median(teacher_times) * 1e3,
                            statistics.median(predictor_times) * 1e3))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15, help="timed (Full step, Predictor step) rounds per row; "
                        "the fastest of each is compared")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--configs", nargs="+", default=[cfg.name for cfg in BENCH_CONFIGS],
                        choices=[cfg.name for cfg in BENCH_CONFIGS], help="which configurations to run")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    configs = [cfg for cfg in BENCH_CONFIGS if cfg.name in args.configs]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU; fastest of {args.repeats} "
          f"alternating rounds; tolerance {TOLERANCE}x")
    for cfg in configs:
        print(f"  {cfg.name}: hidden {cfg.hidden_size}, {cfg.heads_num} heads, {cfg.depth} blocks, grid "
              f"{cfg.height}x{cfg.width}, chunk {cfg.chunk_frames} frames, context {cfg.context_frames} frames, "
              f"{cfg.text_tokens} text tokens, Predictor source blocks {cfg.source_blocks}")
    rows = []
    for cfg in tqdm(configs, desc="configs", file=sys.stderr):
        rows += benchmark(cfg, args.repeats)
    print(f"{'config':<8} {'variant':<6} {'full_step_ms':>12} {'predictor_ms':>14} {'measured':>10} "
          f"{'flops':>10} {'meas/flops':>10}")
    for row in rows:
        print(row.line())
    failed = [row for row in rows if not row.passed]
    print(f"{'FAIL' if failed else 'PASS'}: {len(rows) - len(failed)}/{len(rows)} rows within {TOLERANCE}x of the "
          "FLOP ratio")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
