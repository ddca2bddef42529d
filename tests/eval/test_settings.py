"""The evaluation's settings from the flags (predictor_training/eval/settings.py): the dtype choice, and an explicit
Teacher checked against the training dataset's record."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from predictor_training.eval import label_checkpoints, read_predictor_checkpoint, resolve_dtype, resolve_teacher
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import load_teacher, teacher_config_sha256
from tests.helpers.eval_world import write_eval_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("eval_world"))


def test_dtype_choice_is_explicit():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("bfloat16", [{"precision": "fp32"}], cpu) == (torch.bfloat16, "--dtype bfloat16")
    assert resolve_dtype("auto", [{"precision": "fp32master"}], cpu)[0] == torch.bfloat16
    assert resolve_dtype("auto", [], cpu) == (torch.float32, "--dtype auto without checkpoints: float32 on cpu")
    assert resolve_dtype("auto", [], cuda) == (torch.bfloat16, "--dtype auto without checkpoints: bfloat16 on CUDA")
    with pytest.raises(ValueError, match="choose --dtype"):
        resolve_dtype("auto", [{"precision": "fp32"}, {"precision": "fp32master"}], cpu)


def test_explicit_teacher_is_checked_against_the_training_dataset_record(world, tmp_path):
    """--teacher: the Teacher config recorded by the checkpoint's training dataset is enforced, as in training; a
    run that records no dataset (or whose dataset is not here) leaves the Teacher unchecked."""
    root = world["root"]
    ckpt = label_checkpoints([read_predictor_checkpoint(world["ckpt"])])[0]
    actual = teacher_config_sha256(WorldPlayTransformer.from_pretrained(str(root / "teacher")))

    def trained_on(name: str, sha: str | None):
        dataset = tmp_path / name
        if sha is not None:
            dataset.mkdir()
            (dataset / "dataset_config.json").write_text(json.dumps(
                {"teacher": {"folder": str(root / "teacher"), "config_sha256": sha, "action_ckpt": None}}))
        return dataclasses.replace(ckpt, run_flags={**ckpt.run_flags, "dataset_root": str(dataset)})

    teacher = root / "teacher"
    assert resolve_teacher(teacher, None, "--teacher", [ckpt]).expected_config_sha256 is None  # nothing recorded
    assert resolve_teacher(teacher, None, "--teacher", [trained_on("gone", None)]).expected_config_sha256 is None
    same = resolve_teacher(teacher, None, "--teacher", [trained_on("same", actual)])
    assert same.expected_config_sha256 == actual and same.origin == "--teacher"
    load_teacher(same, torch.device("cpu"), torch.float32)
    other = resolve_teacher(teacher, None, "--demo", [trained_on("other", "0" * 64)])
    with pytest.raises(ValueError, match="config sha256"):
        load_teacher(other, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="different configs"):
        resolve_teacher(teacher, None, "--teacher", [trained_on("a", actual), trained_on("b", "0" * 64)])
