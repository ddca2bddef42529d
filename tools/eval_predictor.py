#!/usr/bin/env python
"""Evaluate Predictor checkpoints against the full Teacher: quality, speed and side-by-side videos (docs/eval.md).

For each (case, action) of a split, the same seed is rolled out as the reference F-F-F-F, as velocity reuse and
hidden reuse at the replaced steps, and with each --ckpt's Predictor at the replaced steps; the videos are decoded
with the VAE and every method is scored against the reference (PSNR full / frame-mean, SSIM, LPIPS, pixel MSE /
RMSE / MAE, temporal-delta MSE; per video, per chunk and aggregated). With --ground_truth (or a demo folder that has
one) every method, and the still first frame (repeat_first_frame), is also scored against the ground-truth videos.
With --context_modes exact,incremental (or last_step) the reference and each Predictor also run with that context
mode (reference@incremental, predictor_<ckpt>@incremental), still scored and timed against the exact reference.
The logic lives in the package predictor_training/eval/.

Demo (CPU, after `bash tools/launch_predictor_v4_rollout_training.sh`; no AlexNet weights here, so the LPIPS column is
the clearly labelled random-backbone figure):

    python tools/eval_predictor.py --demo demo_data/assets --split holdout25 \\
        --ckpt checkpoints/<run>/predictor_step_00020.safetensors --replace_steps 1,2,3 --lpips_random_backbone

Choose checkpoints, presets and hyperparameters on holdout25 / holdout50; --split final (the demo's new scenes,
which nothing is chosen on) gives the figure a headline quotes (docs/eval.md).

Real model, 8 GPUs, two checkpoints sharing the reference rollouts:

    torchrun --nproc_per_node 8 tools/eval_predictor.py --split holdout25 \\
        --samples_dir /data/samples --encoded /data/encoded --vae /models/HunyuanVideo-1.5-i2v/vae \\
        --ckpt RUN/predictor_step_00300.safetensors --ckpt RUN/predictor_step_02000.safetensors \\
        --replace_steps 1,2,3 --lpips_alexnet ~/weights/alexnet-owt-7be5be79.pth

Outputs go to <output_root>/<train_run>_ckptstep<N>_<schedule>_<split>/ (default output_root: eval/ in the
repository; a name that would pass 255 characters keeps the first run's part and ends in __and<K>more_<sha8>_...;
--check_only prints it and checks the inputs without running): eval_config.json, videos/*.json (one per finished video; a rerun skips them), per_video.csv,
per_chunk.csv, aggregate.csv, timings.csv, aggregate.json, drift.png, table.md, side_by_side/*.mp4 (with ground
truth also drift_ground_truth.png).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from predictor_training.eval import (
    DTYPES,
    parse_context_modes,
    resolve_eval_settings,
    run_evaluation,
)
from predictor_training.eval.run import check_evaluation
from predictor_training.eval.inputs import INPUT_FLAGS, resolve_inputs
from predictor_training.recipes.flags import add_input_args
from predictor_training.eval.reports import SIDE_BY_SIDE_MIN_HEIGHT
from predictor_training.eval.settings import EVAL_FLAGS
from predictor_training.recipes.flags import add_plan_args, check_plan
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.distributed import (
    cleanup_distributed,
    init_distributed,
    print0,
)
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_check_only_arg, add_threads_arg, report_check_only
from predictor_training.teacher.frame_kv_cache import CONTEXT_MODES

REPO_ROOT = Path(__file__).resolve().parents[1]  # default --output_root: eval/ in the repository


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_args(parser)
    method = parser.add_argument_group("methods")
    method.add_argument("--ckpt", type=Path, action="append", default=[], help="Predictor checkpoint "
                        "(predictor_step_XXXXX.safetensors or training_latest.pt); repeat to compare several in one "
                        "run (they share the reference and reuse rollouts)")
    add_plan_args(parser, group=method, reuse=True,
                  note="; '' = none. Every --ckpt runs the plan (with --reuse_steps its R steps "
                  "by velocity reuse: an F-R-R-P checkpoint at its own plan, the rollout recipe's --reuse_steps); the "
                  "reuse baselines fill every step that is not Full (F-R-R-R, the 1-step sampler, and F-H-H-H). The "
                  "automatic run name carries the plan (fppp, frrp)")
    method.add_argument("--chunk0", choices=("full", "schedule"), default="full", help="full: chunk 0 stays F-F-F-F "
                        "and the schedule applies to chunks 1.. (docs/eval.md § What is compared); schedule: chunk 0 "
                        "follows it too (not possible for v4, which needs a previous chunk)")
    method.add_argument("--context_modes", type=str, default="exact", metavar="MODES", help="comma list of the "
                        f"context modes to compare, from {', '.join(CONTEXT_MODES)} (predictor_training/"
                        "frame_kv_cache.py; default: exact). exact re-prefills each chunk's context and is always "
                        "run: its F-F-F-F reference is the baseline of every metric, speedup and FLOP bound. For "
                        "every other mode M the reference and each --ckpt run once more under M, as reference@M and "
                        "predictor_<ckpt>@M (the reuse baselines are not repeated); incremental caches each finished "
                        "chunk's K/V with one extra Teacher pass, last_step keeps the K/V of the chunk's last Full "
                        "step. Other than exact alone, the modes join the resume fingerprint and the automatic run "
                        "name ends in _ctx-<mode>[+<mode>]")
    method.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="Teacher weights, "
                        "autocast and running latents (default: auto). auto = the checkpoints' training precision "
                        "(fp32master -> bfloat16, fp32 -> float32); without checkpoints it depends on the device: "
                        "bfloat16 on CUDA, float32 on CPU. The chosen dtype is logged first")
    method.add_argument("--vae_dtype", choices=("auto", *DTYPES), default="auto", help="VAE weights; auto = --dtype")
    method.add_argument("--vae_tiling", action="store_true", help="decode in spatial tiles (less GPU memory)")
    output = parser.add_argument_group("outputs")
    output.add_argument("--output_root", type=Path, default=REPO_ROOT / "eval", help="parent of the eval run directory")
    output.add_argument("--run_name", type=str, default=None, help="eval run directory name; default "
                        "<train_run>_ckptstep<N>_<schedule>_<split>")
    output.add_argument("--num_side_by_side", type=int, default=2, help="side-by-side mp4 for the first N videos")
    output.add_argument("--side_by_side_scale", type=int, default=0, metavar="N", help="integer nearest-neighbour "
                        "upscaling of every side-by-side panel; 0 = auto: the smallest factor that makes a panel at "
                        f"least {SIDE_BY_SIDE_MIN_HEIGHT} pixels high (1 for videos that are already)")
    output.add_argument("--fps", type=float, default=24.0, help="frame rate of the side-by-side mp4")
    output.add_argument("--lpips_alexnet", type=Path, default=None, help="torchvision AlexNet state dict for LPIPS; "
                        "default $TORCH_HOME/hub/checkpoints/alexnet-owt-7be5be79.pth; nothing is downloaded")
    output.add_argument("--lpips_random_backbone", action="store_true", help="no real AlexNet: use a random one and "
                        "report the column as lpips_random_backbone_NOT_LPIPS (demo / tests only)")
    run = parser.add_argument_group("run")
    run.add_argument("--warmup_chunks", type=int, default=2, help="chunks of every method run untimed before the "
                     "first video (0 = no warm-up)")
    run.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto", help="process-group backend "
                     "under torchrun")
    run.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_check_only_arg(run, what="the eval run name and directory and the videos it would evaluate")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Flags plus the cross-flag rules that need no file beyond the sample table."""
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    inputs = resolve_inputs(parser, **{flag: getattr(args, flag) for flag in INPUT_FLAGS})
    vars(args).update(inputs._asdict())  # the inputs --demo stands for, and the split's sample table
    if args.lpips_alexnet is not None and args.lpips_random_backbone:
        parser.error("--lpips_alexnet and --lpips_random_backbone exclude each other")
    for flag, minimum in (("num_side_by_side", 0), ("side_by_side_scale", 0), ("warmup_chunks", 0)):
        value = getattr(args, flag)
        if value < minimum:
            parser.error(f"--{flag} must be >= {minimum}, got {value}")
    args.plan = dataclasses.replace(args.plan, chunk0_full=args.chunk0 == "full")  # what every --ckpt runs
    check_plan(parser, args.plan, predictor_step=False)  # '' = none: every method then equals the reference
    try:
        args.context_modes = parse_context_modes(args.context_modes)
    except ValueError as error:
        parser.error(str(error))
    return args


@command
def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(parser, argv)
    if args.check_only:  # the same refusals as a run: a user's mistake is one line, a bug keeps its traceback
        settings = resolve_eval_settings(**{flag: getattr(args, flag) for flag in EVAL_FLAGS}, argv=argv,
                                         device=torch.device("cpu"))
        return report_check_only(*check_evaluation(settings))
    set_cpu_threads(args.threads, tool="eval", load_aware=True)
    env = init_distributed(args.backend)
    try:
        # --ckpt, --teacher, --dtype, --chunk0 problems are UserInputErrors (one line, exit 2); a bug keeps its
        # traceback
        settings = resolve_eval_settings(**{flag: getattr(args, flag) for flag in EVAL_FLAGS}, argv=argv,
                                         device=env.device)
        report = run_evaluation(settings, env)
        if env.is_main:
            print0(report["table"])
            print0(f"[eval_predictor] {len(report['computed'])} videos computed, {report['skipped']} already "
                   f"finished; outputs in {report['out_dir']}")
    finally:
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
