#!/usr/bin/env python
"""Time the teacher's chunk step and context prefill on CPU and compare with an analytic FLOP model.

For each configuration the script measures the best-of-N wall time of `chunk_step` (with a context cache) and of
`context_prefill`, counts their FLOPs analytically (every matmul, including attention and the ProPE 4x4 maps), and
converts the count into a predicted time with the dense-matmul rate measured in the same run. A predicted/measured
ratio near 1 means the call runs at matmul speed; well below 1 means overheads (small tensors, elementwise work,
Python) dominate.

    python benchmarks/bench_teacher.py                 # tiny + medium, about a minute on 2 cores
    python benchmarks/bench_teacher.py --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from predictor_training.runtime.timing import interleaved
from predictor_training.teacher import TextKV, WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.flops import TeacherShape, teacher_chunk_step_flops
from predictor_training.teacher.flops import context_prefill_flops as teacher_context_prefill_flops


@dataclass(frozen=True)
class BenchConfig:
    name: str
    preset: str
    overrides: dict
    height: int
    width: int
    context_frames: int
    text_tokens: int
    chunk_frames: int = 4


BENCH_CONFIGS = [
    BenchConfig("tiny", "tiny", {}, height=4, width=6, context_frames=8, text_tokens=15),
    BenchConfig(
        "medium",
        "demo",
        {"hidden_size": 512, "heads_num": 8, "rope_dim_list": [16, 24, 24], "mm_double_blocks_depth": 8},
        height=8, width=16, context_frames=8, text_tokens=64,
    ),
]


# ---------------------------------------------------------------------------------------------------------------
# 1. Analytic FLOPs (teacher/flops.py: 2 per multiply-add)
# ---------------------------------------------------------------------------------------------------------------
def chunk_step_flops(model: WorldPlayTransformer, cfg: BenchConfig) -> int:
    return teacher_chunk_step_flops(TeacherShape.from_config(model.config), cfg.height * cfg.width, cfg.text_tokens,
                                    cfg.context_frames, cfg.chunk_frames)


def context_prefill_flops(model: WorldPlayTransformer, cfg: BenchConfig) -> int:
    return teacher_context_prefill_flops(TeacherShape.from_config(model.config), cfg.height * cfg.width,
                                         cfg.text_tokens, cfg.context_frames)


# ---------------------------------------------------------------------------------------------------------------
# 2. Measurements
# ---------------------------------------------------------------------------------------------------------------
def matmul_gflops(size: int, repeats: int) -> float:
    """Dense float32 matmul rate [size, size] @ [size, 4 size] (the shape of an MLP layer)."""
    a, b = torch.randn(size, size), torch.randn(size, 4 * size)
    seconds = interleaved({"matmul": lambda: a @ b}, repeats, warmup=2)["matmul"]["min_s"]
    return 2 * size * size * 4 * size / seconds / 1e9


def build_case(cfg: BenchConfig):
    torch.manual_seed(0)
    model = WorldPlayTransformer.from_preset(cfg.preset, **cfg.overrides).eval()
    randomize_zero_initialised_(model, torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    heads, head_dim = model.heads_num, model.head_dim
    text_kv = TextKV(
        [torch.randn(1, heads, cfg.text_tokens, head_dim, generator=generator) for _ in range(model.num_layers)],
        [torch.randn(1, heads, cfg.text_tokens, head_dim, generator=generator) for _ in range(model.num_layers)],
    )

    def inputs(frames: int, timestep: float) -> dict:
        viewmats = torch.eye(4).repeat(1, frames, 1, 1)
        viewmats[..., :3, 3] = torch.randn(1, frames, 3, generator=generator)
        Ks = torch.eye(3).repeat(1, frames, 1, 1)
        Ks[..., :2, :2] *= 0.8
        return dict(
            hidden_states=torch.randn(
                1, 2 * model.config.in_channels + 1, frames, cfg.height, cfg.width, generator=generator
            ),
            timestep=torch.full((frames,), timestep),
            action=torch.randint(0, 81, (1, frames), generator=generator).float(),
            viewmats=viewmats,
            Ks=Ks,
        )

    return model, text_kv, inputs(cfg.context_frames, 14.0), inputs(cfg.chunk_frames, 833.33)


@dataclass
class Row:
    config: str
    call: str
    queries: int
    keys: int
    gflop: float
    matmul_gflops: float
    measured_ms: float
    predicted_ms: float

    def line(self) -> str:
        ratio = self.predicted_ms / self.measured_ms
        return (
            f"{self.config:<8} {self.call:<16} {self.queries:>7} {self.keys:>7} {self.gflop:>9.3f} "
            f"{self.matmul_gflops:>13.1f} "
            f"{self.measured_ms:>11.2f} {self.predicted_ms:>12.2f} {ratio:>10.3f}"
        )


def benchmark(cfg: BenchConfig, repeats: int, matmul_size: int) -> list[Row]:
    """Time both calls; the matmul rate is re-measured right before each call, so load changes hit both alike."""
    model, text_kv, context_inputs, chunk_inputs = build_case(cfg)
    tokens_per_frame = cfg.height * cfg.width
    with torch.no_grad():
        context_kv, _ = model.context_prefill(**context_inputs, text_kv=text_kv)
        calls = (
            ("chunk_step", lambda: model.chunk_step(**chunk_inputs, text_kv=text_kv, context_kv=context_kv),
             chunk_step_flops(model, cfg), cfg.chunk_frames * tokens_per_frame,
             cfg.text_tokens + (cfg.context_frames + cfg.chunk_frames) * tokens_per_frame),
            ("context_prefill", lambda: model.context_prefill(**context_inputs, text_kv=text_kv),
             context_prefill_flops(model, cfg), cfg.context_frames * tokens_per_frame,
             cfg.text_tokens + cfg.context_frames * tokens_per_frame),
        )
        rows = []
        for call, function, flops, queries, keys in calls:
            rate = matmul_gflops(matmul_size, 3 * repeats)
            seconds = interleaved({call: function}, repeats)[call]["min_s"]  # the fastest: the least disturbed
            predicted_ms = flops / (rate * 1e9) * 1e3
            rows.append(Row(cfg.name, call, queries, keys, flops / 1e9, rate, seconds * 1e3, predicted_ms))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per call (the fastest is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--matmul-size", type=int, default=512, help="side of the calibration matmul [n, n] @ [n, 4n]")
    parser.add_argument("--configs", nargs="+", default=[cfg.name for cfg in BENCH_CONFIGS],
                        choices=[cfg.name for cfg in BENCH_CONFIGS], help="which configurations to run")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.backends.fp32_precision = "ieee"
    size = args.matmul_size
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32; calibration: best of "
          f"{3 * args.repeats} matmuls [{size}x{size}]@[{size}x{4 * size}] right before each call")
    rows = []
    for cfg in tqdm([cfg for cfg in BENCH_CONFIGS if cfg.name in args.configs], desc="configs", file=sys.stderr):
        rows += benchmark(cfg, args.repeats, size)
    print(f"{'config':<8} {'call':<16} {'queries':>7} {'keys':>7} {'GFLOP':>9} {'matmul_GFLOPs':>13} "
          f"{'measured_ms':>11} {'predicted_ms':>12} {'pred/meas':>10}")
    for row in rows:
        print(row.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
