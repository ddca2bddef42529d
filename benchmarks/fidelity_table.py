#!/usr/bin/env python
"""The user's F-P-P-F fidelity protocol on the demo world, beside the user's own real-model row (issue 47; the
user's table: benchmarks/results/2026-07-22-user-real-runs.md): velocity reuse (= the 2-step sampler F-R-R-F), the
v4 recipe and the disca recipe at F-P-P-F, PSNR / SSIM / LPIPS / temporal-delta MSE against F-F-F-F of the same
seed, each with a paired bootstrap interval that resamples scenes (a scene's videos and seeds together), and each
recipe's paired difference from reuse.

It reads the per-video results of a leaderboard run (`<run>/videos/*.json`, the eval's unit of resume), e.g.

    python tools/leaderboard.py --demo demo_data/assets --split train --lpips_random_backbone --samplers "" \\
        --caches "" --counterparts "" --plans F-R-R-F --predictor_plans F-P-P-F \\
        --ckpt V4_RUN/predictor_step_00240.safetensors --ckpt DISCA_RUN/predictor_step_00240.safetensors \\
        --run_name fidelity_train
    python benchmarks/fidelity_table.py eval/fidelity_train --reuse plan_frrf \\
        --row v4=predictor_v4_prefeature_s240_fppf --row disca=disca_s240_fppf --out table.md --json table.json

and writes a Markdown table (and the figures as JSON): one row per method, the user's real-model figures beside
(`--user_rows`: the notes' in-sample F-P-P-F table, 400 videos; printed as given, no interval recorded).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from predictor_training.eval.front import Estimate, Units, weighted_mean
from predictor_training.runtime.errors import CommandParser, UserInputError, command
from predictor_training.runtime.io import write_json_atomic, write_text_atomic

METRICS = {"psnr_full": "PSNR", "ssim": "SSIM", "lpips": "LPIPS", "temporal_delta_mse": "temporal-Δ MSE"}
# The user's in-sample F-P-P-F table of the real model (benchmarks/results/2026-07-22-user-real-runs.md): 100
# training cases x 4 actions, against F-F-F-F; full-resolution PSNR, SSIM, AlexNet LPIPS, temporal-delta MSE.
USER_ROWS = {
    "reuse": {"psnr_full": 18.4639, "ssim": 0.6429, "lpips": 0.2083, "temporal_delta_mse": 0.01212},
    "v4": {"psnr_full": 22.1090, "ssim": 0.7670, "lpips": 0.1168, "temporal_delta_mse": 0.00832},
    "disca": {"psnr_full": 19.4084, "ssim": 0.6748, "lpips": 0.1816, "temporal_delta_mse": 0.01061},
}


def read_results(run_dir: Path) -> list[dict]:
    """The per-video results of an eval or leaderboard run, in file-name order."""
    files = sorted((Path(run_dir) / "videos").glob("*.json"))
    if not files:
        raise UserInputError(f"{run_dir}: no videos/*.json; expected the folder of a finished eval or leaderboard "
                             "run")
    return [json.loads(path.read_text(encoding="utf-8")) for path in files]


def metric_values(results: list[dict], method: str, metric: str) -> np.ndarray:
    """One value per unit (video x seed) of `method`'s metric against F-F-F-F ('lpips': the run's LPIPS column)."""
    values = []
    for result in results:
        if method not in result["methods"]:
            raise UserInputError(f"{result['key']}: no row {method!r}; its rows: {', '.join(result['methods'])}")
        metrics = result["methods"][method]["metrics"]
        key = result["lpips_metric"] if metric == "lpips" else metric
        values.append(float(metrics[key]))
    return np.asarray(values)


def fidelity(results: list[dict], rows: dict[str, str], reuse: str, *, resamples: int = 2000,
             seed: int = 0) -> dict:
    """{label: {metric: Estimate, "psnr_vs_reuse": Estimate}} for `rows` ({label: method key}) and reuse, every
    interval from the same scene resamples (paired)."""
    videos = [result.get("video_key", result["key"]) for result in results]
    weights = Units.from_keys([result["case_id"] for result in results], videos).weights(resamples, seed)
    out = {}
    reuse_psnr = metric_values(results, reuse, "psnr_full")
    for label, method in {"reuse": reuse, **rows}.items():
        out[label] = {metric: Estimate.from_samples(weighted_mean(weights, metric_values(results, method, metric)))
                      for metric in METRICS}
        if method != reuse:
            out[label]["psnr_vs_reuse"] = Estimate.from_samples(
                weighted_mean(weights, metric_values(results, method, "psnr_full") - reuse_psnr))
    return {"rows": out, "num_videos": len(set(videos)), "num_scenes": len({result["case_id"] for result in results}),
            "lpips_metric": results[0]["lpips_metric"]}


def markdown(table: dict, title: str, user: dict | None) -> str:
    def cell(estimate: Estimate, digits: str) -> str:
        return f"{estimate.value:{digits}} [{estimate.low:{digits}}, {estimate.high:{digits}}]"

    # LPIPS and temporal-delta MSE in significant figures: on the demo's distilled Teachers they are ~1e-4..1e-5
    digits = {"psnr_full": ".2f", "ssim": ".3f", "lpips": ".3g", "temporal_delta_mse": ".3g"}
    lines = [f"**{title}** ({table['num_videos']} videos of {table['num_scenes']} scenes; against F-F-F-F; "
             f"bracket: 95 % paired bootstrap over scenes; LPIPS column `{table['lpips_metric']}`)", "",
             "| method | " + " | ".join(METRICS.values()) + " | PSNR − reuse |" + (
                 " real model (user): PSNR / SSIM / LPIPS / temporal-Δ |" if user else ""),
             "| --- | " + " | ".join("---:" for _ in METRICS) + " | ---: |" + (" ---: |" if user else "")]
    for label, figures in table["rows"].items():
        delta = figures.get("psnr_vs_reuse")
        delta_text = "–" if delta is None else delta.format()
        row = f"| {label} | " + " | ".join(cell(figures[metric], digits[metric]) for metric in METRICS)
        row += f" | {delta_text} |"
        if user:
            real = user.get(label)
            row += (" – |" if real is None else
                    f" {real['psnr_full']:.2f} / {real['ssim']:.3f} / {real['lpips']:.3f} / "
                    f"{real['temporal_delta_mse']:.5f} |")
        lines.append(row)
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="a finished eval or leaderboard run (its videos/*.json)")
    parser.add_argument("--reuse", required=True, help="the velocity-reuse row's key (e.g. plan_frrf)")
    parser.add_argument("--row", action="append", default=[], help="LABEL=ROW_KEY of a recipe's row, e.g. "
                        "v4=predictor_v4_prefeature_s240_fppf; repeat; labels v4 / disca get the user's row beside")
    parser.add_argument("--title", default="F-P-P-F against F-F-F-F", help="the table's title")
    parser.add_argument("--user_rows", action=argparse.BooleanOptionalAction, default=True,
                        help="print the user's real-model figures beside (default on)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown table here (default: stdout only)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    rows = {}
    for item in args.row:
        label, sep, key = item.partition("=")
        if not sep or not label or not key:
            parser.error(f"--row {item!r}: expected LABEL=ROW_KEY, e.g. v4=predictor_v4_prefeature_s240_fppf")
        rows[label] = key
    args.rows = rows
    if args.resamples < 100:
        parser.error(f"--resamples must be >= 100, got {args.resamples}")
    return args


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    table = fidelity(read_results(args.run_dir), args.rows, args.reuse, resamples=args.resamples)
    text = markdown(table, args.title, USER_ROWS if args.user_rows else None)
    print(text)
    if args.out is not None:
        write_text_atomic(args.out, text)
    if args.json is not None:
        write_json_atomic(args.json, {"title": args.title, "num_videos": table["num_videos"],
                                      "num_scenes": table["num_scenes"], "lpips_metric": table["lpips_metric"],
                                      "rows": {label: {key: value.to_dict() for key, value in figures.items()}
                                               for label, figures in table["rows"].items()},
                                      "user_rows": USER_ROWS if args.user_rows else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
