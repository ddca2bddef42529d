"""The input flags every evaluation command shares (tools/eval_predictor.py, tools/leaderboard.py): the Teacher,
VAE, sample tables, case source, split and ground truth, or one demo folder for all of them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from predictor_training.data.sample_table import FINAL_SPLIT, SPLIT_NAMES

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
                        "held-out numbers are the ones that count: choose on holdout25 / holdout50, quote final (new "
                        "scenes nothing is chosen on) in a headline")
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
        hint = (" (a demo folder made before the final split existed has none: make it again with "
                "tools/make_demo_assets.py --overwrite)") if split == FINAL_SPLIT else ""
        parser.error(f"{flag} {split}: no sample table {table}{hint}")
    return table


# The flags `add_input_args` adds, which `resolve_inputs` takes by name.
INPUT_FLAGS = ("demo", "teacher", "action_ckpt", "vae", "samples_dir", "encoded", "dataset_root", "split",
               "max_videos", "num_latents", "ground_truth")


class ResolvedInputs(NamedTuple):
    """The input flags --demo D stands for (teacher, vae, samples_dir, encoded; ground_truth from its config when
    not given), else the given ones, and the sample table of the split."""

    teacher: Path | None
    vae: Path
    samples_dir: Path
    encoded: Path | None
    ground_truth: Path | None
    sample_table: Path


def resolve_inputs(parser: argparse.ArgumentParser, *, demo: Path | None, teacher: Path | None,
                   action_ckpt: Path | None, vae: Path | None, samples_dir: Path | None, encoded: Path | None,
                   dataset_root: Path | None, split: str, max_videos: int | None, num_latents: int,
                   ground_truth: Path | None) -> ResolvedInputs:
    """Expand --demo D into the separate inputs, check the combination and find the split's sample table
    (parser.error on a problem)."""
    ground_truth_origin = "--ground_truth"
    if demo is not None:
        separate = {"teacher": teacher, "action_ckpt": action_ckpt, "vae": vae, "samples_dir": samples_dir,
                    "encoded": encoded, "dataset_root": dataset_root}
        given = [flag for flag, value in separate.items() if value is not None]
        if given:
            parser.error(f"--demo replaces --{', --'.join(given)}")
        teacher, vae = demo / "teacher", demo / "encoders" / "vae"
        samples_dir, encoded = demo / "samples", demo / "encoded"
        if ground_truth is None:
            ground_truth = demo_ground_truth(parser, demo)
            ground_truth_origin = f"the 'ground_truth' entry of {demo / DEMO_CONFIG_NAME}"
    missing = [flag for flag, value in (("vae", vae), ("samples_dir", samples_dir)) if value is None]
    if missing:
        parser.error(f"missing --{', --'.join(missing)} (or use --demo D)")
    if (encoded is None) == (dataset_root is None):
        parser.error("give exactly one case source: --encoded DIR or --dataset_root DS")
    if ground_truth is not None and not ground_truth.is_dir():
        parser.error(f"ground truth {ground_truth} (from {ground_truth_origin}): no such folder")
    for flag, value, minimum in (("max_videos", max_videos, 1), ("num_latents", num_latents, 4)):
        if value is not None and value < minimum:
            parser.error(f"--{flag} must be >= {minimum}, got {value}")
    return ResolvedInputs(teacher, vae, samples_dir, encoded, ground_truth,
                          sample_table_path(parser, samples_dir, split))
