"""Video metrics between two folders of videos (the library side of tools/compute_video_metrics.py).

Videos are mp4 (or .mov/.mkv/.avi/.webm) files or folders of PNG frames, paired by their path relative to the root
with the video suffix dropped (ref/case1/act0.mp4 pairs with test/case1/act0.mp4 or the frame folder
test/case1/act0/). Every item needs a partner of the same shape, otherwise the run stops before computing anything.
The metrics are those of `predictor_training.video.metrics`.

Writes to the output folder (each file atomically): metrics.json (settings, aggregate, per video), per_video.csv,
aggregate.csv and, with per_frame, per_frame.csv. Non-finite values are written as inf / nan.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import write_text_atomic
from predictor_training.video.io import VIDEO_SUFFIXES, is_video_file, list_frame_files, read_video
from predictor_training.video.metrics import (
    LPIPS_METRIC_NAME,
    LpipsScorer,
    aggregate_videos,
    compute_video_metrics,
    gaussian_window_1d,
    jsonable,
)

LOG_PREFIX = "[compute_video_metrics]"
OUTPUT_NAMES = ("metrics.json", "per_video.csv", "aggregate.csv", "per_frame.csv")  # what write_outputs writes


# ----------------------------------------------------------------------------------------------------------------
# Pairing
# ----------------------------------------------------------------------------------------------------------------
def discover_videos(root: Path) -> dict[str, Path]:
    """Map 'relative/name' (video suffix dropped) -> video file or PNG-frame folder, for everything under root."""
    items: dict[str, Path] = {}

    def add(key: str, path: Path) -> None:
        if key in items:
            raise UserInputError(f"{root}: both {items[key]} and {path} map to the name {key!r}; keep one of them")
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
        raise UserInputError(f"{root}: no videos ({', '.join(VIDEO_SUFFIXES)}) or PNG-frame folders found")
    return dict(sorted(items.items()))


def pair_videos(ref_dir: Path, test_dir: Path) -> list[tuple[str, Path, Path]]:
    """[(name, ref path, test path)] sorted by name; ValueError listing every item without a partner."""
    ref_items, test_items = discover_videos(ref_dir), discover_videos(test_dir)
    missing_in_test = [key for key in ref_items if key not in test_items]
    missing_in_ref = [key for key in test_items if key not in ref_items]
    if missing_in_test or missing_in_ref:
        lines = [f"  {ref_items[key]} has no partner in {test_dir}" for key in missing_in_test]
        lines += [f"  {test_items[key]} has no partner in {ref_dir}" for key in missing_in_ref]
        header = "unpaired videos (partners are matched by relative name, video suffix dropped):\n"
        raise UserInputError(header + "\n".join(lines))
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
# The comparison
# ----------------------------------------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    """'auto' = cuda if available else cpu; anything else as torch.device (RuntimeError when it is no device); a
    CUDA device this machine does not have is refused here, not at its first tensor."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise RuntimeError(f"this machine has {count} CUDA device(s) visible to torch; expected cpu, auto or one "
                               "of its CUDA devices")
    return device


def compare_video_folders(
    ref_dir: Path,
    test_dir: Path,
    out_dir: Path,
    *,
    device: torch.device,
    lpips_alexnet: Path | None = None,
    lpips_random_backbone: bool = False,
    lpips_random_seed: int = 0,
    frame_batch: int = 16,
    per_frame: bool = False,
    pairs: Sequence[tuple[str, Path, Path]] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Score every video of `test_dir` against its partner in `ref_dir`, write the output files to `out_dir` and
    log the table. Returns the report written to metrics.json: {"settings", "aggregate", "videos"}.

    pairs: `pair_videos(ref_dir, test_dir)` when already made (pairing comes first, so a missing partner fails
    before any weight loading or computing). Raises LpipsWeightsError without LPIPS weights (unless
    lpips_random_backbone), ValueError on unpaired videos or a shape mismatch; nothing is written then.
    """
    # 1. pair first, so a missing partner fails before any weight loading or computing
    pairs = pair_videos(ref_dir, test_dir) if pairs is None else list(pairs)
    scorer = LpipsScorer.from_policy(
        lpips_alexnet,
        random_backbone=lpips_random_backbone,
        random_seed=lpips_random_seed,
        device=device,
    )
    log(f"{LOG_PREFIX} {len(pairs)} video pairs, device {device}, LPIPS column '{scorer.metric_name}' "
        f"(backbone: {scorer.backbone_source})")
    if scorer.metric_name != LPIPS_METRIC_NAME:
        log(f"{LOG_PREFIX} WARNING: random AlexNet backbone; '{scorer.metric_name}' is NOT LPIPS")

    # 2. metrics per pair
    per_video = []
    for name, ref_path, test_path in tqdm(pairs, desc="videos", unit="video"):
        ref, test = read_video(ref_path), read_video(test_path)
        window = gaussian_window_1d().numel()
        if min(ref.shape[1:3]) < window:
            raise UserInputError(f"{ref_path}: frames of {ref.shape[1]}x{ref.shape[2]} pixels; expected at least "
                                 f"{window}x{window} (the SSIM window)")
        if ref.shape != test.shape:
            raise UserInputError(f"shape mismatch for {name!r}: {ref_path} is {ref.shape} [T, H, W, 3] but "
                             f"{test_path} is {test.shape}")
        metrics = compute_video_metrics(
            ref, test, scorer, per_frame=per_frame, device=device, frame_batch=frame_batch
        )
        per_video.append({"name": name, "ref": str(ref_path), "test": str(test_path),
                          "shape": list(ref.shape), "metrics": metrics})

    # 3. aggregate, write, print
    aggregate = aggregate_videos([item["metrics"] for item in per_video])
    report = {
        "settings": {
            "ref_dir": str(ref_dir),
            "test_dir": str(test_dir),
            "device": str(device),
            "frame_batch": frame_batch,
            "lpips": scorer.describe(),
            "pixel_scale": "[0, 1] (uint8 / 255)",
        },
        "aggregate": aggregate,
        "videos": per_video,
    }
    written = write_outputs(out_dir, report, per_video, per_frame)
    log(format_table(per_video, aggregate))
    log(f"{LOG_PREFIX} wrote {', '.join(str(path) for path in written)}")
    return report
