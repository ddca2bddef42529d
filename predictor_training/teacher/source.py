"""Where a run's Teacher comes from, and the one function that loads it (training, eval, dataset builder).

A Teacher is a diffusers-layout folder (config.json + safetensors), optionally with a WorldPlay action checkpoint
loaded strictly on top. A training run that names none uses the Teacher recorded in its dataset's
`dataset_config.json`, so the Predictor learns from the Teacher that made the data; whenever a record exists, the
loaded Teacher's config hash must equal the recorded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, dataset_teacher_record
from predictor_training.data.shards import sha256_json
from predictor_training.teacher.model import WorldPlayTransformer


@dataclass(frozen=True)
class TeacherSource:
    """folder: transformer folder; action_ckpt: strict overlay or None; origin: human-readable reason (a flag or
    the dataset config); expected_config_sha256: the recorded Teacher config hash to check against (None when
    there is no record to compare with)."""

    folder: Path
    action_ckpt: Path | None
    origin: str
    expected_config_sha256: str | None


def resolve_teacher_source(
    teacher: Path | None, action_ckpt: Path | None, dataset_root: Path | None
) -> TeacherSource:
    """--teacher given: that folder (+ --action_ckpt if given). Else the dataset's recorded folder and action
    checkpoint (an explicit --action_ckpt replaces the recorded one). With a dataset, its config hash is kept so
    `load_teacher` refuses a Teacher of another architecture than the one that made the data."""
    record = None if dataset_root is None else dataset_teacher_record(dataset_root)
    expected_sha = None if record is None else record["config_sha256"]
    if teacher is not None:
        return TeacherSource(Path(teacher), action_ckpt, "--teacher", expected_sha)
    if record is None:
        raise ValueError("no Teacher: pass --teacher DIR (or a --dataset_root whose dataset_config.json records one)")
    where = Path(dataset_root) / DATASET_CONFIG_NAME
    folder = Path(record["folder"])
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{where}: teacher.folder={str(folder)!r} has no config.json; pass --teacher DIR")
    if action_ckpt is None and record["action_ckpt"] is not None:
        action_ckpt = Path(record["action_ckpt"])
        if not action_ckpt.is_file():
            raise FileNotFoundError(f"{where}: teacher.action_ckpt={str(action_ckpt)!r} does not exist; "
                                    "pass --action_ckpt FILE")
    return TeacherSource(folder, action_ckpt, f"teacher.folder of {where}", expected_sha)


def teacher_config_sha256(teacher: WorldPlayTransformer) -> str:
    """sha256 of the Teacher's constructor arguments as one canonical JSON line (the dataset builder's record)."""
    constructor_args = WorldPlayTransformer.constructor_arguments(teacher.config, source="the loaded Teacher")
    return sha256_json(constructor_args)


def load_teacher(source: TeacherSource, device: torch.device | str, dtype: torch.dtype) -> WorldPlayTransformer:
    """Load the folder (strict), overlay the action checkpoint (strict), check the config hash against the record,
    move to `device`; returns the Teacher in eval mode with `requires_grad=False` everywhere."""
    teacher = WorldPlayTransformer.from_pretrained(str(source.folder), torch_dtype=dtype)
    if source.action_ckpt is not None:
        WorldPlayTransformer.load_action_checkpoint(source.action_ckpt, teacher)
    if source.expected_config_sha256 is not None:
        actual = teacher_config_sha256(teacher)
        if actual != source.expected_config_sha256:
            raise ValueError(
                f"Teacher {source.folder} ({source.origin}) has config sha256 {actual[:12]}..., but "
                f"{source.expected_config_sha256[:12]}... was recorded for it; use the same Teacher"
            )
    return teacher.to(device=device).eval().requires_grad_(False)


def describe_teacher(source: TeacherSource, teacher: WorldPlayTransformer) -> str:
    """One log line: where the Teacher came from, its depth, width, dtype and device."""
    overlay = "" if source.action_ckpt is None else f" + action checkpoint {source.action_ckpt}"
    return (f"teacher: {source.folder}{overlay} (from {source.origin}); {teacher.num_layers} double blocks, hidden "
            f"{teacher.config.hidden_size}, {str(teacher.dtype).removeprefix('torch.')} on {teacher.device}")
