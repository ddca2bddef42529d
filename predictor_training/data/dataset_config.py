"""`dataset_config.json`: what a dataset root records about how it was built (read here, written by the builder).

Fields the readers use: `num_latents`, `num_chunks`, `num_steps`, `chunk_latents`, `shift`, `context_timestep`,
`memory`, `prefeature_layers`, `sample_tables` and `teacher` (folder, config_sha256, action_ckpt); data.md lists them
all. Every missing field is an error naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path

from predictor_training.runtime.errors import MissingFieldError, MissingFileError, UserInputError
from predictor_training.runtime.io import read_json_file
from predictor_training.teacher.source import TeacherSource

DATASET_CONFIG_NAME = "dataset_config.json"


def read_dataset_config(root: str | Path) -> dict:
    """``root/dataset_config.json`` as a dict (FileNotFoundError naming the path when absent)."""
    path = Path(root) / DATASET_CONFIG_NAME
    if not path.is_file():
        raise MissingFileError(f"dataset config not found: {path} (build the dataset with "
                                "tools/build_predictor_dataset.py)")
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise UserInputError(f"{path}: holds a {type(config).__name__}; expected a JSON object")
    return config


def config_field(config: dict, name: str, root: str | Path):
    """One required field of the dataset config; KeyError naming the file and field when absent."""
    if name not in config:
        raise MissingFieldError(f"{Path(root) / DATASET_CONFIG_NAME}: missing field {name!r}")
    return config[name]


def dataset_teacher_record(root: str | Path) -> dict:
    """The `teacher` record of the dataset config: folder, config_sha256, action_ckpt (each required)."""
    teacher = config_field(read_dataset_config(root), "teacher", root)
    for field in ("folder", "config_sha256", "action_ckpt"):
        if field not in teacher:
            raise MissingFieldError(f"{Path(root) / DATASET_CONFIG_NAME}: missing field 'teacher.{field}'")
    return teacher


def recorded_sample_table(root: str | Path, split: str) -> Path:
    """The sample table of `split` the dataset was built from (the one named `<split>.jsonl` in `sample_tables`)."""
    where = Path(root) / DATASET_CONFIG_NAME
    recorded = [Path(path) for path in config_field(read_dataset_config(root), "sample_tables", root)]
    matching = [path for path in recorded if path.stem == split]
    if len(matching) != 1:
        raise UserInputError(f"{where}: sample_tables {[str(p) for p in recorded]} hold {len(matching)} table(s) named "
                         f"{split}.jsonl; pass --sample_table")
    if not matching[0].is_file():
        raise MissingFileError(f"{where}: recorded sample table {matching[0]} does not exist; pass --sample_table")
    return matching[0]


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
        raise UserInputError("no Teacher: pass --teacher DIR (or a --dataset_root whose dataset_config.json records one)")
    where = Path(dataset_root) / DATASET_CONFIG_NAME
    folder = Path(record["folder"])
    if not (folder / "config.json").is_file():
        raise MissingFileError(f"{where}: teacher.folder={str(folder)!r} has no config.json; pass --teacher DIR")
    if action_ckpt is None and record["action_ckpt"] is not None:
        action_ckpt = Path(record["action_ckpt"])
        if not action_ckpt.is_file():
            raise MissingFileError(f"{where}: teacher.action_ckpt={str(action_ckpt)!r} does not exist; "
                                    "pass --action_ckpt FILE")
    return TeacherSource(folder, action_ckpt, f"teacher.folder of {where}", expected_sha)
