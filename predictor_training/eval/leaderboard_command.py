"""The command that puts a finished Predictor run on the leaderboard: the closing line the Predictor recipes print
(tools/leaderboard.py runs it; the leaderboard itself is eval/leaderboard.py)."""

from __future__ import annotations

from pathlib import Path

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
from predictor_training.runtime.io import read_json_file


def leaderboard_command(run_dir: Path, *, dataset_root: Path, world_size: int) -> str:
    """The command that puts a finished Predictor run on the leaderboard (the recipes' closing line): its training
    state at its trained plan, against the samplers and caches, on the first held-out split its dataset records
    (holdout25 when it has one). Demo data (sample tables beside a demo_config.json) gets the demo form; a real
    dataset the real one, with $VAE and $ALEXNET left to the user (docs/walkthrough.md § Paths)."""
    config = read_json_file(Path(dataset_root) / DATASET_CONFIG_NAME)
    held_out = [split for split in config.get("splits", []) if split != "train"]
    split = "holdout25" if "holdout25" in held_out or not held_out else held_out[0]
    tables = config.get("sample_tables") or []
    samples = Path(tables[0]).parent if tables else None
    if samples is not None and (samples.parent / "demo_config.json").is_file():
        inputs = f"--demo {samples.parent} --lpips_random_backbone"
    else:
        inputs = (f"--samples_dir {samples or '$SAMPLES'} --dataset_root {dataset_root} --vae $VAE "
                  "--lpips_alexnet $ALEXNET")
    launcher = f"torchrun --nproc_per_node {world_size}" if world_size > 1 else "python"
    return (f"{launcher} tools/leaderboard.py {inputs} --split {split} --ckpt {Path(run_dir) / 'training_latest.pt'} "
            "--predictor_plans trained")
