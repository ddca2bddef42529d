"""Print the FLOP-count speed bounds of every schedule under every context mode, and the context cache's memory
(docs/eval.md).

    python tools/print_flop_bounds.py                                   # the real 480p WorldPlay config, 8 chunks
    python tools/print_flop_bounds.py --num_chunks 32
    python tools/print_flop_bounds.py --teacher predictor_training/world/weights/teacher --height 4 --width 6

A bound is the reference's DiT FLOPs (F-F-F-F, exact context) divided by the schedule's under a mode
(`predictor_training.teacher.flops.rollout_flops`; the VAE decode is outside it). Chunk 0 runs F-F-F-F in every schedule, as
in the eval. Chunk c has min(4c, memory_frames) context frames (the memory rule of the AR loop). The cache memory is
what the incremental and last_step modes hold: K and V of every layer for every frame a later chunk can select.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from predictor_training.predictor.model import build_predictor
from predictor_training.rollout.schedule import StepPlan, parse_replace_steps
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_check_only_arg, report_check_only
from predictor_training.runtime.io import read_json_file
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.flops import (
    REAL_LATENT_GRID,
    REAL_TEXT_TOKENS,
    TeacherShape,
    flop_speedup_bound,
    rollout_flops,
)
from predictor_training.teacher.frame_kv_cache import (
    CONTEXT_MODES,
    cache_bytes_per_frame,
)

SCHEDULES = {"F-F-F-F": "", "F-P-P-P": "1,2,3", "F-P-P-F": "1,2", "F-P-F-P": "1,3"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, default=None, help="a Teacher folder (its config.json); default: the "
                        "real WorldPlay-1.5 480p i2v config")
    parser.add_argument("--height", type=int, default=REAL_LATENT_GRID[0],
                        help="latent rows per frame (default %(default)s: 480 px / 16)")
    parser.add_argument("--width", type=int, default=REAL_LATENT_GRID[1],
                        help="latent columns per frame (default %(default)s: 832 px / 16)")
    parser.add_argument("--num_chunks", type=int, default=8, help="chunks of 4 latents (default %(default)s)")
    parser.add_argument("--memory_frames", type=int, default=20, help="most context frames of a chunk (default "
                        "%(default)s)")
    parser.add_argument("--text_tokens", type=int, default=REAL_TEXT_TOKENS, help="text K/V tokens the image queries attend to "
                        "(default %(default)s: SigLIP's 729 plus a prompt)")
    parser.add_argument("--source_blocks", type=str, default="1,52", help="the Predictor's two Teacher blocks "
                        "(default %(default)s; only their existence matters for the count)")
    parser.add_argument("--bytes_per_value", type=int, default=2, help="cache dtype size (default %(default)s: bf16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    add_check_only_arg(parser, what="what it would print (it writes nothing in any case)")
    args = parser.parse_args(argv)
    for flag in ("height", "width", "num_chunks", "memory_frames"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    return args


def teacher_config(folder: Path | None) -> dict:
    if folder is None:
        return preset_config("worldplay_480p_i2v")
    path = folder / "config.json"
    if not path.is_file():
        raise SystemExit(f"error: --teacher {folder}: no config.json there")
    return WorldPlayTransformer.constructor_arguments(read_json_file(path), str(path))


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    config = teacher_config(args.teacher)
    if args.check_only:
        return report_check_only(f"the FLOP bounds of {len(SCHEDULES)} schedules x {len(CONTEXT_MODES)} context modes "
                                 f"of a {config['mm_double_blocks_depth']}-block Teacher, {args.num_chunks} chunks")
    shape = TeacherShape.from_config(config)
    with torch.device("meta"):
        predictor = build_predictor(WorldPlayTransformer(**config), "v4",
                                    [int(block) for block in args.source_blocks.split(",")])
    predictor_config = predictor.predictor_config()
    tokens = args.height * args.width
    contexts = [min(4 * chunk, args.memory_frames) for chunk in range(args.num_chunks)]

    def flops(replace: str, mode: str) -> dict:
        plan = StepPlan.from_steps(parse_replace_steps(replace))
        kind = lambda chunk, step: "predictor" if plan.replaces(chunk, step) else "full"  # noqa: E731
        return rollout_flops(shape, tokens, args.text_tokens, contexts, kind, predictor_config=predictor_config,
                             context_mode=mode)

    reference = flops("", "exact")["total"]
    rows = [{"schedule": name, "context_mode": mode, "tflops": parts["total"] / 1e12,
             "context_share": (parts["context_prefill"] + parts.get("context_cache", 0)) / parts["total"],
             "bound": flop_speedup_bound(reference, parts["total"])}
            for name, replace in SCHEDULES.items() for mode in CONTEXT_MODES for parts in [flops(replace, mode)]]
    per_frame = cache_bytes_per_frame(shape.depth, shape.hidden_size, tokens, args.bytes_per_value)
    cached_frames = 4 * (args.num_chunks - 1)
    memory = {"bytes_per_frame_all_layers": per_frame, "bytes_per_frame_per_layer": per_frame // shape.depth,
              "cached_frames_at_most": cached_frames, "bytes_at_most": per_frame * cached_frames}
    if args.json:
        print(json.dumps({"contexts": contexts, "rows": rows, "cache": memory}, indent=2))
        return 0
    print(f"Teacher: {shape.depth} blocks, hidden {shape.hidden_size}; latent frame {args.height} x {args.width}; "
          f"{args.num_chunks} chunks, context frames {contexts}; {args.text_tokens} text tokens")
    unit, scale = ("TFLOPs", 1.0) if reference >= 1e12 else ("GFLOPs", 1e3)
    print(f"| schedule | context mode | DiT {unit} / video | context share | FLOP bound vs exact F-F-F-F |")
    print("| --- | --- | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['schedule']} | {row['context_mode']} | {row['tflops'] * scale:.1f} | "
              f"{100 * row['context_share']:.0f}% | {row['bound']:.2f}x |")
    print(f"context cache (incremental, last_step): {per_frame / 2**20:.1f} MiB per frame over all layers "
          f"({per_frame // shape.depth / 2**20:.2f} MiB per layer), at most {cached_frames} frames = "
          f"{memory['bytes_at_most'] / 2**30:.2f} GiB ({args.bytes_per_value} bytes per value)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
