"""The input flags every evaluation command shares (tools/eval_predictor.py, tools/leaderboard.py): the Teacher,
VAE, sample tables, case source, split and ground truth, or one demo folder for all of them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from predictor_training.data.sample_table import SPLIT_NAMES

DEMO_CONFIG_NAME = "demo_config.json"  # its optional "ground_truth" key names the demo's ground-truth folder


def add_input_args(parser: argparse.ArgumentParser) -> None:
    inputs = parser.add_argument_group("inputs (either --demo D, or the separate flags)")
    inputs.add_argument("--demo", type=Path, help="demo asset folder (tools/make_demo_assets.py): D/teacher, "
                        "D/encoders/vae, D/samples/<split>.jsonl, D/encoded")
    inputs.add_argument("--teacher", type=Path, help="Teacher transformer folder; default: the one recorded in the "
                        "first checkpoint's run config (flags teacher / dataset_root). Either way its config is "
                        "checked against the Teacher config recorded by the checkpoints' training dataset, if any")
    inputs.add_argument("--action_ckpt", type=Path, help="WorldPlay action checkpoint loaded strictly on --teacher")
    inputs.add_argument("--vae", type=Path, help="AutoencoderKLHunyuanVideo15 folder (or a diffusers pipeline folder "
                        "with vae/)")
    inputs.add_argument("--samples_dir", type=Path, help="folder of the sample tables <split>.jsonl")
    inputs.add_argument("--encoded", type=Path, help="encoder outputs {case_id}.pt (the text prefill then runs and "
                        "is timed)")
    inputs.add_argument("--dataset_root", type=Path, help="instead of --encoded: a built dataset whose cases/ hold the "
                        "stored text K/V (no text prefill is run or timed)")
    inputs.add_argument("--split", choices=SPLIT_NAMES, default="holdout25", help="which sample table to evaluate; "
                        "held-out numbers are the ones that count")
    inputs.add_argument("--max_videos", type=int, default=None, help="evaluate only the first N rows of the split")
    inputs.add_argument("--num_latents", type=int, default=32, help="latent frames per video (poses must match)")
    inputs.add_argument("--ground_truth", type=Path, default=None, metavar="DIR", help="folder of ground-truth "
                        "videos, one per evaluated row, named by its video key <case_id>__a<action_id>: a folder of "
                        "PNG frames DIR/<key>/ or a file DIR/<key>.mp4, with the decoded videos' frame count, height "
                        "and width. Every method, the reference included, and the still-image baseline "
                        "repeat_first_frame (the ground truth's first frame held) are then also scored against it. "
                        f"Default with --demo D: D/<the 'ground_truth' entry of D/{DEMO_CONFIG_NAME}> when it has "
                        "one, else none")


def demo_ground_truth(parser: argparse.ArgumentParser, demo: Path) -> Path | None:
    """D/<"ground_truth" of D/demo_config.json>, or None when the demo folder records no ground truth (older demo
    folders, or no demo_config.json)."""
    config_path = demo / DEMO_CONFIG_NAME
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        parser.error(f"--demo {demo}: {config_path} is not valid JSON ({error})")
    return None if config.get("ground_truth") is None else demo / config["ground_truth"]


def sample_table_path(parser: argparse.ArgumentParser, samples_dir: Path, split: str, flag: str = "--split") -> Path:
    table = samples_dir / f"{split}.jsonl"
    if not table.is_file():
        parser.error(f"{flag} {split}: no sample table {table}")
    return table


def resolve_inputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Expand --demo D into the separate inputs, check the combination, set args.sample_table (parser.error on a
    problem)."""
    ground_truth_origin = "--ground_truth"
    if args.demo is not None:
        given = [flag for flag in ("teacher", "action_ckpt", "vae", "samples_dir", "encoded", "dataset_root")
                 if getattr(args, flag) is not None]
        if given:
            parser.error(f"--demo replaces --{', --'.join(given)}")
        args.teacher, args.vae = args.demo / "teacher", args.demo / "encoders" / "vae"
        args.samples_dir, args.encoded = args.demo / "samples", args.demo / "encoded"
        if args.ground_truth is None:
            args.ground_truth = demo_ground_truth(parser, args.demo)
            ground_truth_origin = f"the 'ground_truth' entry of {args.demo / DEMO_CONFIG_NAME}"
    missing = [flag for flag in ("vae", "samples_dir") if getattr(args, flag) is None]
    if missing:
        parser.error(f"missing --{', --'.join(missing)} (or use --demo D)")
    if (args.encoded is None) == (args.dataset_root is None):
        parser.error("give exactly one case source: --encoded DIR or --dataset_root DS")
    if args.ground_truth is not None and not args.ground_truth.is_dir():
        parser.error(f"ground truth {args.ground_truth} (from {ground_truth_origin}): no such folder")
    for flag, minimum in (("max_videos", 1), ("num_latents", 4)):
        value = getattr(args, flag)
        if value is not None and value < minimum:
            parser.error(f"--{flag} must be >= {minimum}, got {value}")
    args.sample_table = sample_table_path(parser, args.samples_dir, args.split)
