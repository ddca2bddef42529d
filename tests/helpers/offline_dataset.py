"""The tiny offline dataset (the package's `data/synthetic.py write_tiny_teacher_dataset`: the data.md layout,
random tensors and sane cameras for a saved tiny Teacher) and the command lines of train_predictor_v4.py /
train_predictor_disca.py / fvtools/train_adversarial.py on it, shared by the offline recipe, adversarial and
bad-input tests."""

from __future__ import annotations

import json
from pathlib import Path

# write_tiny_dataset(root): the tiny Teacher (2 blocks) saved under root/teacher and a dataset under root/dataset that
# records it; returns the dataset root. ACTIONS, CASES, NUM_CHUNKS: what that dataset holds.
from predictor_training.data.synthetic import TINY_ACTIONS as ACTIONS  # noqa: F401
from predictor_training.data.synthetic import TINY_CASES as CASES  # noqa: F401
from predictor_training.data.synthetic import TINY_NUM_CHUNKS as NUM_CHUNKS  # noqa: F401
from predictor_training.data.synthetic import write_tiny_teacher_dataset as write_tiny_dataset  # noqa: F401


def train_args(dataset: Path, run_dir: Path, *extra: str, steps: int = 3) -> list[str]:
    return ["--dataset_root", str(dataset), "--output_dir", str(run_dir), "--source_blocks", "0,1",
            "--precision", "fp32", "--batch_size", "2", "--max_steps", str(steps), "--scheduler_warmup_steps", "1",
            "--block_warmup_steps", "1", "--fusion_lr", "1e-3", "--blocks_lr", "1e-4", "--ckpt_every", "2",
            "--num_workers", "0", "--tracker", "none", "--no_progress", *extra]


def adversarial_args(dataset: Path, run_dir: Path, *extra: str, steps: int = 3) -> list[str]:
    """The offline tests' flags (train_args) plus a small discriminator."""
    return train_args(dataset, run_dir, "--discriminator_width", "16", "--discriminator_lr", "1e-3", *extra,
                      steps=steps)


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
