"""Where a run's Teacher comes from (predictor_training/teacher/source.py): the config hash the dataset builder
records, the depth read from config.json alone, the --source_blocks check, and `load_teacher` (strict, the action
checkpoint on top, the recorded hash enforced, frozen in eval mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.io import sha256_json
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import (
    TeacherSource,
    check_source_blocks,
    describe_teacher,
    load_teacher,
    teacher_config_sha256,
    teacher_depth,
)
from tests.helpers.tiny_teacher import make_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """A tiny Teacher (random zero-init layers) saved as a folder, and a second one's weights as an action file."""
    root = tmp_path_factory.mktemp("teacher_source")
    teacher = make_model("tiny", seed=0)
    teacher.save_pretrained(str(root / "teacher"))
    other = make_model("tiny", seed=5)
    save_file({name: tensor.contiguous() for name, tensor in other.state_dict().items()}, root / "action.safetensors")
    return {"folder": root / "teacher", "action": root / "action.safetensors", "teacher": teacher, "other": other}


def source(folder: Path, action=None, sha=None) -> TeacherSource:
    return TeacherSource(folder, action, "--teacher", sha)


def test_the_config_hash_follows_the_constructor_arguments():
    tiny, again, deeper = (WorldPlayTransformer.from_preset("tiny"), WorldPlayTransformer.from_preset("tiny"),
                           WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=3))
    assert teacher_config_sha256(tiny) == teacher_config_sha256(again)  # the weights do not count
    assert teacher_config_sha256(tiny) != teacher_config_sha256(deeper)
    arguments = WorldPlayTransformer.constructor_arguments(tiny.config, source="test")
    assert teacher_config_sha256(tiny) == sha256_json(arguments) and len(teacher_config_sha256(tiny)) == 64


def test_depth_and_source_blocks_from_config_json_alone(tmp_path):
    with torch.device("meta"):
        WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=3).save_config(str(tmp_path / "t"))
    assert not list((tmp_path / "t").glob("*.safetensors"))  # no weights needed
    assert teacher_depth(source(tmp_path / "t")) == 3
    check_source_blocks((0, 2), source(tmp_path / "t"))
    with pytest.raises(UserInputError, match=r"--source_blocks 1,3: .* has 3 double blocks; expected indices in 0..2"):
        check_source_blocks((1, 3), source(tmp_path / "t"))
    with pytest.raises(MissingFileError, match=r"config.json \(--teacher\): no such file"):
        teacher_depth(source(tmp_path / "nowhere"))


def test_load_teacher_is_strict_frozen_and_in_eval_mode(saved):
    teacher = load_teacher(source(saved["folder"]), "cpu", torch.float32)
    assert not teacher.training and not any(param.requires_grad for param in teacher.parameters())
    for name, tensor in saved["teacher"].state_dict().items():
        assert torch.equal(teacher.state_dict()[name], tensor), name
    assert load_teacher(source(saved["folder"]), "cpu", torch.bfloat16).dtype == torch.bfloat16


def test_the_action_checkpoint_is_loaded_on_top(saved):
    teacher = load_teacher(source(saved["folder"], action=saved["action"]), "cpu", torch.float32)
    for name, tensor in saved["other"].state_dict().items():
        assert torch.equal(teacher.state_dict()[name], tensor), name
    line = describe_teacher(source(saved["folder"], action=saved["action"]), teacher)
    assert line.startswith(f"teacher: {saved['folder']} + action checkpoint {saved['action']} (from --teacher); ")
    assert line.endswith(f"{teacher.num_layers} double blocks, hidden {teacher.config.hidden_size}, float32 on cpu")


def test_the_recorded_config_hash_is_enforced(saved):
    recorded = teacher_config_sha256(saved["teacher"])
    load_teacher(source(saved["folder"], sha=recorded), "cpu", torch.float32)
    with pytest.raises(UserInputError, match=f"has config sha256 {recorded[:12]}..., but {'0' * 12}... was recorded"):
        load_teacher(source(saved["folder"], sha="0" * 64), "cpu", torch.float32)
