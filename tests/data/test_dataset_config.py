"""A dataset root's `dataset_config.json` (predictor_training/data/dataset_config.py): read with errors that name the
file and field, the recorded sample table of a split, and where a run's Teacher comes from (an explicit --teacher
or the recorded one, the recorded config hash kept either way)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from predictor_training.data.dataset_config import (
    DATASET_CONFIG_NAME,
    config_field,
    dataset_teacher_record,
    read_dataset_config,
    recorded_sample_table,
    resolve_teacher_source,
)
from predictor_training.runtime.errors import MissingFieldError, MissingFileError, UserInputError

SHA = "ab" * 32


def write_config(root: Path, config) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / DATASET_CONFIG_NAME).write_text(json.dumps(config))
    return root


def teacher_folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def test_reading_names_the_missing_file_and_refuses_a_non_object(tmp_path):
    with pytest.raises(MissingFileError, match=f"dataset config not found: {tmp_path / DATASET_CONFIG_NAME}"):
        read_dataset_config(tmp_path)
    write_config(tmp_path, [1, 2])
    with pytest.raises(UserInputError, match="holds a list; expected a JSON object"):
        read_dataset_config(tmp_path)
    write_config(tmp_path, {"shift": 5.0})
    assert read_dataset_config(tmp_path) == {"shift": 5.0}


def test_a_missing_field_names_the_file_and_the_field(tmp_path):
    config = {"shift": 5.0, "teacher": {"folder": "/t", "config_sha256": SHA}}
    write_config(tmp_path, config)
    assert config_field(config, "shift", tmp_path) == 5.0
    with pytest.raises(MissingFieldError) as error:
        config_field(config, "num_chunks", tmp_path)
    assert str(error.value) == f"{tmp_path / DATASET_CONFIG_NAME}: missing field 'num_chunks'"
    with pytest.raises(MissingFieldError, match="missing field 'teacher.action_ckpt'"):
        dataset_teacher_record(tmp_path)


def test_the_recorded_sample_table_of_a_split(tmp_path):
    tables = tmp_path / "samples"
    tables.mkdir()
    for split in ("train", "holdout25"):
        (tables / f"{split}.jsonl").write_text("")
    root = write_config(tmp_path / "dataset", {"sample_tables": [str(tables / "train.jsonl"),
                                                                 str(tables / "holdout25.jsonl")]})
    assert recorded_sample_table(root, "holdout25") == tables / "holdout25.jsonl"
    assert recorded_sample_table(root, "train") == tables / "train.jsonl"
    with pytest.raises(UserInputError, match="hold 0 table\\(s\\) named holdout50.jsonl; pass --sample_table"):
        recorded_sample_table(root, "holdout50")
    (tables / "train.jsonl").unlink()
    with pytest.raises(MissingFileError, match="recorded sample table .*train.jsonl does not exist"):
        recorded_sample_table(root, "train")


def test_an_explicit_teacher_wins_and_keeps_the_recorded_hash(tmp_path):
    recorded = teacher_folder(tmp_path / "recorded")
    mine = teacher_folder(tmp_path / "mine")
    root = write_config(tmp_path / "dataset", {"teacher": {"folder": str(recorded), "config_sha256": SHA,
                                                           "action_ckpt": None}})
    source = resolve_teacher_source(mine, None, root)
    assert (source.folder, source.action_ckpt, source.origin, source.expected_config_sha256) == (
        mine, None, "--teacher", SHA)
    alone = resolve_teacher_source(mine, tmp_path / "a.safetensors", None)  # no dataset: nothing to check against
    assert (alone.action_ckpt, alone.expected_config_sha256) == (tmp_path / "a.safetensors", None)
    with pytest.raises(UserInputError, match="no Teacher: pass --teacher DIR"):
        resolve_teacher_source(None, None, None)


def test_the_recorded_teacher_and_action_checkpoint(tmp_path):
    recorded = teacher_folder(tmp_path / "recorded")
    action = tmp_path / "action.safetensors"
    action.write_bytes(b"")
    root = write_config(tmp_path / "dataset", {"teacher": {"folder": str(recorded), "config_sha256": SHA,
                                                           "action_ckpt": str(action)}})
    source = resolve_teacher_source(None, None, root)
    assert (source.folder, source.action_ckpt, source.expected_config_sha256) == (recorded, action, SHA)
    assert source.origin == f"teacher.folder of {root / DATASET_CONFIG_NAME}"
    other = tmp_path / "other.safetensors"
    assert resolve_teacher_source(None, other, root).action_ckpt == other  # an explicit one replaces the record
    action.unlink()
    with pytest.raises(MissingFileError, match="teacher.action_ckpt=.*does not exist; pass --action_ckpt FILE"):
        resolve_teacher_source(None, None, root)
    (recorded / "config.json").unlink()
    with pytest.raises(MissingFileError, match="teacher.folder=.*has no config.json; pass --teacher DIR"):
        resolve_teacher_source(None, other, root)
