#!/usr/bin/env python
"""Compare every video in TEST_DIR with its partner in REF_DIR: PSNR (full / frame-mean), SSIM, LPIPS-AlexNet,
pixel MSE / RMSE / MAE and temporal-delta MSE (definitions: predictor_training/video/metrics.py and
docs/video_metrics.md).

Videos are mp4 (or .mov/.mkv/.avi/.webm) files or folders of PNG frames, paired by their path relative to the root
with the video suffix dropped (ref/case1/act0.mp4 pairs with test/case1/act0.mp4 or the frame folder
test/case1/act0/). Every item needs a partner of the same shape, otherwise the run stops before computing anything.

Examples:
    python tools/compute_video_metrics.py eval/ref eval/predictor --out eval/metrics --device cuda \\
        --lpips_alexnet ~/weights/alexnet-owt-7be5be79.pth
    # no AlexNet weights at hand (tests, smoke runs): the LPIPS column is renamed, it is NOT LPIPS
    python tools/compute_video_metrics.py ref test --out out --lpips_random_backbone

Writes to --out (each file atomically): metrics.json (settings, aggregate, per video), per_video.csv,
aggregate.csv and, with --per_frame, per_frame.csv. Non-finite values are written as inf / nan.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_check_only_arg, add_threads_arg, report_check_only
from predictor_training.video.folder_metrics import (
    OUTPUT_NAMES,
    compare_video_folders,
    pair_videos,
    resolve_device,
)
from predictor_training.video.metrics import resolve_alexnet_weights


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ref_dir", type=Path, help="folder of reference videos (mp4 files and/or PNG-frame folders)")
    parser.add_argument("test_dir", type=Path, help="folder of test videos, same relative names as REF_DIR")
    parser.add_argument("--out", type=Path, required=True, help="output folder for metrics.json and the CSV files")
    parser.add_argument(
        "--device", default="auto", help="torch device for all metrics, e.g. cpu, cuda, cuda:1; 'auto' = cuda if "
        "available else cpu (the choice is printed)"
    )
    parser.add_argument(
        "--lpips_alexnet", type=Path, default=None, help="torchvision AlexNet state dict for LPIPS; default: "
        "$TORCH_HOME/hub/checkpoints/alexnet-owt-7be5be79.pth. Nothing is ever downloaded"
    )
    parser.add_argument(
        "--lpips_random_backbone", action="store_true", help="run LPIPS on a randomly initialised AlexNet instead "
        "of refusing; the column is then called lpips_random_backbone_NOT_LPIPS (only for tests / smoke runs)"
    )
    parser.add_argument("--lpips_random_seed", type=int, default=0, help="seed of the random AlexNet (with "
                        "--lpips_random_backbone)")
    parser.add_argument("--frame_batch", type=int, default=16, help="frames per batch on the device")
    parser.add_argument("--per_frame", action="store_true", help="also write per-frame series (per_frame.csv and "
                        "a per_frame entry per video in metrics.json)")
    parser.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out "
                        "(default: refuse)")
    add_check_only_arg(parser, what="the video pairs it would compare and the folder it would write (the --device "
                       "is not opened)")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Flags plus the checks argparse cannot make; args.device becomes a torch.device."""
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    for name in ("ref_dir", "test_dir"):
        if not getattr(args, name).is_dir():
            parser.error(f"{name.upper()} {getattr(args, name)}: not a folder")
    if args.lpips_random_backbone and args.lpips_alexnet is not None:
        parser.error("--lpips_alexnet and --lpips_random_backbone exclude each other; pass one")
    if args.frame_batch < 1:
        parser.error(f"--frame_batch must be >= 1, got {args.frame_batch}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")
    earlier = [name for name in OUTPUT_NAMES if (args.out / name).exists()]
    if earlier and not args.overwrite:
        parser.error(f"--out {args.out}: holds {', '.join(earlier)} of an earlier run; pass --overwrite to replace "
                     "them, or another --out")
    for name in ("ref_dir", "test_dir"):
        if args.out.resolve().is_relative_to(getattr(args, name).resolve()):
            parser.error(f"--out {args.out}: inside {name.upper()} {getattr(args, name)}; expected a folder outside "
                         "the inputs")
    if args.check_only:  # the device is the machine's: a GPU command is checked on any machine
        return args
    try:
        args.device = resolve_device(args.device)
    except RuntimeError as error:
        parser.error(f"--device {args.device}: {error}")
    return args


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    set_cpu_threads(args.threads, tool="compute_video_metrics", load_aware=True)
    try:
        pairs = pair_videos(args.ref_dir, args.test_dir)
    except ValueError as error:  # REF_DIR and TEST_DIR do not match: a usage error, before anything is loaded
        parser.error(str(error))
    if args.check_only:
        if not args.lpips_random_backbone:
            resolve_alexnet_weights(args.lpips_alexnet)
        return report_check_only(f"{len(pairs)} video pairs of {args.ref_dir} and {args.test_dir} -> {args.out}")
    compare_video_folders(
        args.ref_dir, args.test_dir, args.out, device=args.device, lpips_alexnet=args.lpips_alexnet,
        lpips_random_backbone=args.lpips_random_backbone, lpips_random_seed=args.lpips_random_seed,
        frame_batch=args.frame_batch, per_frame=args.per_frame, pairs=pairs,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
