"""Where a run's Teacher comes from, and the one function that loads it (training, eval, dataset builder).

A Teacher is a diffusers-layout folder (config.json + safetensors), optionally with a WorldPlay action checkpoint
loaded strictly on top. A training run that names none uses the Teacher recorded in its dataset's
`dataset_config.json` (`data.dataset_config.resolve_teacher_source`), so the Predictor learns from the Teacher that
made the data; whenever a record exists, the loaded Teacher's config hash must equal the recorded one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.fake_tensors import default_dtype
from predictor_training.runtime.io import read_json_file, sha256_json
from predictor_training.teacher.loading import randomize_zero_initialised_
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


def teacher_config_sha256(teacher: WorldPlayTransformer) -> str:
    """sha256 of the Teacher's constructor arguments as one canonical JSON line (the dataset builder's record)."""
    constructor_args = WorldPlayTransformer.constructor_arguments(teacher.config, source="the loaded Teacher")
    return sha256_json(constructor_args)


def teacher_depth(source: TeacherSource) -> int:
    """The Teacher's number of double blocks, from its config.json alone (no weights)."""
    config_path = Path(source.folder) / "config.json"
    if not config_path.is_file():
        raise MissingFileError(f"{config_path} ({source.origin}): no such file; expected a Teacher folder with "
                               "config.json")
    config = read_json_file(config_path)
    return int(WorldPlayTransformer.constructor_arguments(config, source=str(config_path))["mm_double_blocks_depth"])


def check_source_blocks(source_blocks, source: TeacherSource) -> None:
    """--source_blocks must name double blocks the Teacher has: checked from its config.json before anything is
    created (the launcher's dry run included)."""
    depth = teacher_depth(source)
    if any(not 0 <= int(block) < depth for block in source_blocks):
        raise UserInputError(f"--source_blocks {','.join(map(str, source_blocks))}: the Teacher in {source.folder} "
                             f"({source.origin}) has {depth} double blocks; expected indices in 0..{depth - 1}")


def load_teacher(source: TeacherSource, device: torch.device | str, dtype: torch.dtype) -> WorldPlayTransformer:
    """Load the folder (strict), overlay the action checkpoint (strict), check the config hash against the record,
    move to `device`; returns the Teacher in eval mode with `requires_grad=False` everywhere."""
    teacher = WorldPlayTransformer.from_pretrained(str(source.folder), torch_dtype=dtype)
    if source.action_ckpt is not None:
        WorldPlayTransformer.load_action_checkpoint(source.action_ckpt, teacher)
    if source.expected_config_sha256 is not None:
        actual = teacher_config_sha256(teacher)
        if actual != source.expected_config_sha256:
            raise UserInputError(
                f"Teacher {source.folder} ({source.origin}) has config sha256 {actual[:12]}..., but "
                f"{source.expected_config_sha256[:12]}... was recorded for it; use the same Teacher"
            )
    return teacher.to(device=device).eval().requires_grad_(False)


def preset_teacher_loader(preset: str, on_load=None):
    """A `load_teacher` (the recipes' seam) that builds the Teacher of config `preset` instead of reading a folder -
    no weights, e.g. on a memory rehearsal's fake tensors - as load_teacher leaves it: eval, frozen, in the requested
    dtype. `on_load(teacher)` is called on each (the rehearsal labels its parameters)."""
    def load(source: TeacherSource, device: torch.device | str, dtype: torch.dtype) -> WorldPlayTransformer:
        with default_dtype(dtype):
            teacher = WorldPlayTransformer.from_preset(preset).eval().requires_grad_(False)
        if on_load is not None:
            on_load(teacher)
        return teacher
    return load


def random_teacher(preset: str, device: torch.device | str, dtype: torch.dtype, *, randomize: bool = True
                   ) -> WorldPlayTransformer:
    """The Teacher of config `preset` made directly on `device` in `dtype` with random weights (torch seed 0; with
    `randomize` the upstream zero-initialised layers randomised too, so every path affects the output), eval, frozen:
    a real-size Teacher on a GPU with no weights to read (benchmarks/gpu_acceptance.py)."""
    torch.manual_seed(0)
    with default_dtype(dtype), torch.device(device):
        teacher = WorldPlayTransformer.from_preset(preset)
    if randomize:
        with torch.no_grad():
            randomize_zero_initialised_(teacher, torch.Generator(device=device).manual_seed(1))
    return teacher.eval().requires_grad_(False)


def describe_teacher(source: TeacherSource, teacher: WorldPlayTransformer) -> str:
    """One log line: where the Teacher came from, its depth, width, dtype and device."""
    overlay = "" if source.action_ckpt is None else f" + action checkpoint {source.action_ckpt}"
    return (f"teacher: {source.folder}{overlay} (from {source.origin}); {teacher.num_layers} double blocks, hidden "
            f"{teacher.config.hidden_size}, {str(teacher.dtype).removeprefix('torch.')} on {teacher.device}")
