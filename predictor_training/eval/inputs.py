"""The inputs every evaluation command shares (tools/eval_predictor.py, tools/leaderboard.py): the Teacher, VAE,
sample tables, case source, split and ground truth, or one demo folder for all of them, resolved from their flags
(declared by `recipes/flags.py add_input_args`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from predictor_training.data.sample_table import FINAL_SPLIT

DEMO_CONFIG_NAME = "demo_config.json"  # its optional "ground_truth" key names the demo's ground-truth folder


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


# The flags `recipes/flags.py add_input_args` adds, which `resolve_inputs` takes by name.
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
