#!/usr/bin/env python
"""Compare every video in TEST_DIR with its partner in REF_DIR: PSNR (full / frame-mean), SSIM, LPIPS-AlexNet,
pixel MSE / RMSE / MAE and temporal-delta MSE (definitions: predictor_training/metrics.py and train.md).

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
import csv
import io
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from tqdm import tqdm

from predictor_training.atomic_io import write_text_atomic
from predictor_training.metrics import (
    LpipsScorer,
    LpipsWeightsError,
    aggregate_videos,
    compute_video_metrics,
    jsonable,
)
from predictor_training.video_io import VIDEO_SUFFIXES, is_video_file, list_frame_files, read_video


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return args


# ----------------------------------------------------------------------------------------------------------------
# Pairing
# ----------------------------------------------------------------------------------------------------------------
def discover_videos(root: Path) -> dict[str, Path]:
    """Map 'relative/name' (video suffix dropped) -> video file or PNG-frame folder, for everything under root."""
    items: dict[str, Path] = {}

    def add(key: str, path: Path) -> None:
        if key in items:
            raise ValueError(f"{root}: both {items[key]} and {path} map to the name {key!r}; keep one of them")
        items[key] = path

    for folder, _, file_names in os.walk(root):
        folder = Path(folder)
        if list_frame_files(folder):
            add(folder.relative_to(root).as_posix(), folder)
        for file_name in sorted(file_names):
            path = folder / file_name
            if is_video_file(path):
                add(path.relative_to(root).with_suffix("").as_posix(), path)
    if not items:
        raise ValueError(f"{root}: no videos ({', '.join(VIDEO_SUFFIXES)}) or PNG-frame folders found")
    return dict(sorted(items.items()))


def pair_videos(ref_dir: Path, test_dir: Path) -> list[tuple[str, Path, Path]]:
    ref_items, test_items = discover_videos(ref_dir), discover_videos(test_dir)
    missing_in_test = [key for key in ref_items if key not in test_items]
    missing_in_ref = [key for key in test_items if key not in ref_items]
    if missing_in_test or missing_in_ref:
        lines = [f"  {ref_items[key]} has no partner in {test_dir}" for key in missing_in_test]
        lines += [f"  {test_items[key]} has no partner in {ref_dir}" for key in missing_in_ref]
        header = "unpaired videos (partners are matched by relative name, video suffix dropped):\n"
        raise ValueError(header + "\n".join(lines))
    return [(key, ref_items[key], test_items[key]) for key in ref_items]


# ----------------------------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------------------------
def _csv_text(header: list[str], rows: list[list]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buffer.getvalue()


def _metric_columns(metrics: dict) -> list[str]:
    return [key for key in metrics if key != "per_frame"]


def write_outputs(out_dir: Path, report: dict, per_video: list[dict], with_per_frame: bool) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    # 1. JSON with everything
    path = out_dir / "metrics.json"
    write_text_atomic(path, json.dumps(jsonable(report), indent=2, allow_nan=False) + "\n", newline="")
    written.append(path)
    # 2. per-video and aggregate CSV
    columns = _metric_columns(per_video[0]["metrics"])
    rows = [[item["name"], str(item["ref"]), str(item["test"])] + [item["metrics"][key] for key in columns]
            for item in per_video]
    path = out_dir / "per_video.csv"
    write_text_atomic(path, _csv_text(["name", "ref", "test"] + columns, rows), newline="")
    written.append(path)
    aggregate = report["aggregate"]
    path = out_dir / "aggregate.csv"
    write_text_atomic(path, _csv_text(list(aggregate), [list(aggregate.values())]), newline="")
    written.append(path)
    # 3. optional per-frame CSV
    if with_per_frame:
        series_keys = list(per_video[0]["metrics"]["per_frame"])
        rows = []
        for item in per_video:
            series = item["metrics"]["per_frame"]
            rows += [[item["name"], frame] + [series[key][frame] for key in series_keys]
                     for frame in range(len(series["mse"]))]
        path = out_dir / "per_frame.csv"
        write_text_atomic(path, _csv_text(["name", "frame"] + series_keys, rows), newline="")
        written.append(path)
    return written


def format_table(per_video: list[dict], aggregate: dict) -> str:
    columns = _metric_columns(per_video[0]["metrics"])
    names = [item["name"] for item in per_video] + ["MEAN"]
    name_width = max(len(name) for name in names)
    widths = [max(10, len(column)) for column in columns]

    def cell(value, width: int) -> str:
        return f"{value:>{width}d}" if isinstance(value, int) else f"{value:>{width}.6g}"

    lines = ["  ".join([f"{'video':<{name_width}}"] + [f"{column:>{width}}" for column, width in zip(columns, widths)])]
    for name, metrics in [(item["name"], item["metrics"]) for item in per_video] + [("MEAN", aggregate)]:
        lines.append("  ".join([f"{name:<{name_width}}"] + [cell(metrics[c], w) for c, w in zip(columns, widths)]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    # 1. pair first, so a missing partner fails before any weight loading or computing
    pairs = pair_videos(args.ref_dir, args.test_dir)
    scorer = LpipsScorer.from_policy(
        args.lpips_alexnet,
        random_backbone=args.lpips_random_backbone,
        random_seed=args.lpips_random_seed,
        device=device,
    )
    print(f"[compute_video_metrics] {len(pairs)} video pairs, device {device}, LPIPS column '{scorer.metric_name}' "
          f"(backbone: {scorer.backbone_source})")
    if scorer.metric_name != "lpips_alex":
        print(f"[compute_video_metrics] WARNING: random AlexNet backbone; '{scorer.metric_name}' is NOT LPIPS")

    # 2. metrics per pair
    per_video = []
    for name, ref_path, test_path in tqdm(pairs, desc="videos", unit="video"):
        ref, test = read_video(ref_path), read_video(test_path)
        if ref.shape != test.shape:
            raise ValueError(f"shape mismatch for {name!r}: {ref_path} is {ref.shape} [T, H, W, 3] but "
                             f"{test_path} is {test.shape}")
        metrics = compute_video_metrics(
            ref, test, scorer, per_frame=args.per_frame, device=device, frame_batch=args.frame_batch
        )
        per_video.append({"name": name, "ref": str(ref_path), "test": str(test_path),
                          "shape": list(ref.shape), "metrics": metrics})

    # 3. aggregate, write, print
    aggregate = aggregate_videos([item["metrics"] for item in per_video])
    report = {
        "settings": {
            "ref_dir": str(args.ref_dir),
            "test_dir": str(args.test_dir),
            "device": str(device),
            "frame_batch": args.frame_batch,
            "lpips": scorer.describe(),
            "pixel_scale": "[0, 1] (uint8 / 255)",
        },
        "aggregate": aggregate,
        "videos": per_video,
    }
    written = write_outputs(args.out, report, per_video, args.per_frame)
    print(format_table(per_video, aggregate))
    print(f"[compute_video_metrics] wrote {', '.join(str(path) for path in written)}")
    return report


if __name__ == "__main__":
    try:
        main()
    except (LpipsWeightsError, ValueError, FileNotFoundError) as error:  # input problems: message, no traceback
        sys.exit(f"compute_video_metrics: error: {error}")
