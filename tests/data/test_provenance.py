"""What a training run records of its inputs (predictor_training/data/provenance.py): the Teacher's weights hash
and its config hash as the toolkit computes it, the parent and the data config; a resumed run keeps what its
training state recorded."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import predictor_training.data.provenance as provenance_module
from predictor_training.data.provenance import data_config_file, input_provenance, run_provenance
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.run_directory import RunStart
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import teacher_config_sha256

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("provenance") / "teacher"
    torch.manual_seed(0)
    WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=2).save_pretrained(str(folder))
    return folder


def test_inputs_are_recorded_by_hash(teacher_folder, tmp_path):
    parent = tmp_path / "predictor_step_00960.safetensors"
    parent.write_bytes(b"parent weights")
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    (dataset / "dataset_config.json").write_text('{"num_latents": 8}')
    record = input_provenance(teacher=teacher_folder, action_ckpt=None, parent=parent, data_root=dataset)
    weights = teacher_folder / "diffusion_pytorch_model.safetensors"
    assert record["teacher_sha256"] == sha256(weights)
    assert record["teacher_config_sha256"] == teacher_config_sha256(
        WorldPlayTransformer.from_pretrained(str(teacher_folder)))  # what datasets record and load_teacher checks
    assert record["parent_sha256"] == sha256(parent)
    assert record["dataset_config_sha256"] == sha256(dataset / "dataset_config.json")
    assert record["teacher_action_ckpt_sha256"] is None and "unknown" not in record
    assert record["names"] == {"teacher": "teacher/diffusion_pytorch_model.safetensors",
                               "parent": f"{tmp_path.name}/predictor_step_00960.safetensors",
                               "dataset_config": "dataset/dataset_config.json"}
    started_fresh = input_provenance(teacher=teacher_folder, parent=None, data_root=None)
    assert started_fresh["parent_sha256"] is None and started_fresh["names"]["parent"] is None


def test_data_config_of_each_kind_of_data_folder(tmp_path):
    for name in ("dataset_config.json", "ode_cache_config.json", "video_dataset_config.json"):
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).write_text("{}")
        assert data_config_file(folder) == folder / name
    table = tmp_path / "train.jsonl"
    table.write_text("")
    assert data_config_file(table) == table
    (tmp_path / "bare").mkdir()
    with pytest.raises(MissingFileError, match="dataset_config.json"):
        data_config_file(tmp_path / "bare")


def test_a_resumed_run_keeps_the_provenance_its_state_recorded(teacher_folder, tmp_path, monkeypatch):
    fresh = RunStart(tmp_path / "run", "run", "fresh", None, 0, 4)
    computed = run_provenance(fresh, ENV, teacher=teacher_folder, action_ckpt=None, parent=None, data_root=None)
    assert computed["teacher_sha256"] == sha256(teacher_folder / "diffusion_pytorch_model.safetensors")
    resumed = RunStart(tmp_path / "run", "run", "continue", tmp_path / "run" / "training_latest.pt", 2, 4)
    saved = {**computed, "parent_sha256": "c" * 64}
    monkeypatch.setattr(provenance_module, "read_training_summary",
                        lambda path: {"config": {"flags": {}, "derived": {"provenance": saved}}})
    assert run_provenance(resumed, ENV, teacher=teacher_folder, action_ckpt=None, parent=None,
                          data_root=None) == saved  # not hashed again: the start's parent is what counts
    monkeypatch.setattr(provenance_module, "read_training_summary",
                        lambda path: {"config": {"flags": {}, "derived": {}}})  # a state from before provenance
    older = run_provenance(resumed, ENV, teacher=teacher_folder, action_ckpt=None, parent=None, data_root=None)
    assert older["parent_sha256"] is None and "whose run recorded no provenance" in older["unknown"]["parent_sha256"]
