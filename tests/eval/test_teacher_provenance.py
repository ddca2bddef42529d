"""The eval (and the leaderboard, which resolves its Teacher the same way) checks a checkpoint's Teacher by hash
(predictor_training/eval/run.py `check_teacher_by_hash`): a provenance that records the Teacher's weights refuses
any other weights with one line naming both hashes; one that records only the config hash keeps the config check;
a file with nothing recorded keeps the warning. A checkpoint in its run directory still finds its Teacher through
its portable `$RUN_DIR` paths."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from predictor_training.data.provenance import input_provenance
from predictor_training.eval import label_checkpoints, read_predictor_checkpoint, resolve_teacher
from predictor_training.predictor.model import build_predictor
from predictor_training.runtime.inference_weights import read_inference_config, save_inference_weights
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.provenance import make_provenance
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import load_teacher, teacher_config_sha256

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
META = {"variant": "v4", "source_blocks": [0, 1], "precision": "fp32", "step": 2}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Teacher `a` (the one trained on), `b` (same config, other weights), a v4 Predictor built on `a`."""
    root = tmp_path_factory.mktemp("teacher_provenance")
    for name, seed in (("a", 0), ("b", 1)):
        torch.manual_seed(seed)
        WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=2).save_pretrained(str(root / name))
    torch.manual_seed(2)
    teacher = WorldPlayTransformer.from_pretrained(str(root / "a"))
    return {"root": root, "predictor": build_predictor(teacher, "v4", (0, 1)),
            "config_sha": teacher_config_sha256(teacher)}


def checkpoint(world, run: str, provenance: dict | None, **flags):
    """A predictor_step_00002.safetensors in <root>/runs/<run>, its run config recording `provenance` and `flags`."""
    path = world["root"] / "runs" / run / "predictor_step_00002.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    derived = {"predictor": world["predictor"].predictor_config(),
               **({} if provenance is None else {"provenance": provenance})}
    save_inference_weights(path, world["predictor"], metadata=META, config={"flags": flags, "derived": derived})
    return label_checkpoints([read_predictor_checkpoint(path)])[0]


def test_recorded_teacher_weights_are_checked_by_hash(world, capsys):
    root = world["root"]
    provenance = input_provenance(teacher=root / "a", parent=None, data_root=None)
    ckpt = checkpoint(world, "hashed", provenance, teacher=str(root / "a"), dataset_root=None)
    # 1. The Teacher it was trained on passes, by hash and by config; the log says so.
    source = resolve_teacher(root / "a", None, "--teacher", [ckpt])
    assert source.expected_config_sha256 == world["config_sha"]
    load_teacher(source, torch.device("cpu"), torch.float32)
    assert "Teacher checked by hash" in capsys.readouterr().out
    # 2. Same config, other weights: refused in one line naming both hashes and files.
    with pytest.raises(UserInputError) as refused:
        resolve_teacher(root / "b", None, "--demo", [ckpt])
    message = str(refused.value)
    recorded = hashlib.sha256((root / "a" / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()
    actual = hashlib.sha256((root / "b" / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()
    assert recorded in message and actual in message and "\n" not in message
    assert "a/diffusion_pytorch_model.safetensors" in message and str(root / "b") in message
    # 3. An action checkpoint other than the recorded one (none) is refused too.
    overlay = root / "action.pt"
    overlay.write_bytes(b"overlay")
    with pytest.raises(UserInputError, match="action checkpoint"):
        resolve_teacher(root / "a", overlay, "--teacher", [ckpt])


def test_a_checkpoint_in_its_run_directory_finds_its_teacher_through_portable_paths(world, tmp_path):
    root = world["root"]
    ckpt = checkpoint(world, "portable", input_provenance(teacher=root / "a", parent=None, data_root=None),
                      teacher=str(root / "a"), dataset_root=None)
    assert read_inference_config(ckpt.path)["flags"]["teacher"] == "$RUN_DIR/../../a"  # no machine path stored
    source = resolve_teacher(None, None, "--teacher", [ckpt])  # the run's own Teacher, from its config
    assert source.folder.resolve() == (root / "a").resolve()
    moved = tmp_path / "elsewhere" / "deeper" / ckpt.path.name
    moved.parent.mkdir(parents=True)
    shutil.copy(ckpt.path, moved)  # a copied file names a Teacher that is not there: pass one, checked by hash
    copied = label_checkpoints([read_predictor_checkpoint(moved)])[0]
    with pytest.raises(FileNotFoundError, match="no such folder; pass --teacher .*weights sha256"):
        resolve_teacher(None, None, "--teacher", [copied])
    with pytest.raises(UserInputError, match="weights have sha256"):
        resolve_teacher(root / "b", None, "--teacher", [copied])


def test_only_a_config_hash_keeps_the_config_check(world):
    root = world["root"]
    config_only = make_provenance(teacher_sha256=None, teacher_config_sha256="0" * 64,
                                  teacher_action_ckpt_sha256=None, parent_sha256=None, dataset_config_sha256=None,
                                  names={})
    ckpt = checkpoint(world, "config_only", config_only, dataset_root=None)
    source = resolve_teacher(root / "b", None, "--teacher", [ckpt])  # no weights hash: any weights pass here
    assert source.expected_config_sha256 == "0" * 64
    with pytest.raises(UserInputError, match="config sha256"):
        load_teacher(source, torch.device("cpu"), torch.float32)  # ... and the config is checked as before


def test_nothing_recorded_keeps_the_warning(world, capsys):
    root = world["root"]
    ckpt = checkpoint(world, "old", None, dataset_root=str(root / "not_here"))
    source = resolve_teacher(root / "b", None, "--teacher", [ckpt])
    assert source.expected_config_sha256 is None
    out = capsys.readouterr().out
    assert "WARNING" in out and "no provenance recorded" in out and "is not checked against it" in out
