"""Provenance (predictor_training/runtime/provenance.py): the portable form of a run config's paths and back, the
detector of absolute paths, the weights hash, the record's unknown values, an inference file written from a run
config that carries provenance, and a safetensors header rewritten without touching the tensor bytes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from predictor_training.runtime.inference_weights import (
    read_inference_config,
    read_inference_metadata,
    read_inference_weights,
    save_inference_weights,
    tensors_sha256,
)
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import open_safetensors
from predictor_training.runtime.provenance import (
    NOT_RECORDED,
    absolute_paths_in,
    describe_provenance,
    expand_run_dir,
    make_provenance,
    portable_path,
    portable_paths,
    recorded_provenance,
    rewrite_safetensors_metadata,
    tensor_bytes_sha256,
    weights_sha256,
    with_provenance,
)

SHA_A, SHA_B = "a" * 64, "b" * 64


def record(**changes) -> dict:
    values = dict(teacher_sha256=SHA_A, teacher_config_sha256=SHA_B, teacher_action_ckpt_sha256=None,
                  parent_sha256=None, dataset_config_sha256=None,
                  names={"teacher": "teacher/diffusion_pytorch_model.safetensors"})
    values.update(changes)
    return make_provenance(**values)


@pytest.mark.parametrize("text, expected", [
    ("/data/runs/r1", "$RUN_DIR"),
    ("/data/runs/r1/training_latest.pt", "$RUN_DIR/training_latest.pt"),
    ("/data/runs/other/predictor_step_00960.safetensors", "$RUN_DIR/../other/predictor_step_00960.safetensors"),
    ("/data/datasets/d1", "$RUN_DIR/../../datasets/d1"),
    ("/data/teacher", "$RUN_DIR/../../teacher"),
    ("C:\\data\\teachers\\kd2", "$ELSEWHERE/teachers/kd2"),
    ("D:/weights/teacher", "$ELSEWHERE/weights/teacher"),
    ("checkpoints", "checkpoints"),  # a relative path names nothing of the machine: kept
    ("demo_data/dataset", "demo_data/dataset"),
])
def test_portable_path_table(text, expected):
    assert portable_path(text, "/data/runs/r1") == expected


def test_portable_config_has_no_absolute_path_and_expands_back(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    config = {"flags": {"dataset_root": str(tmp_path / "ds"), "teacher": None, "output_root": "checkpoints",
                        "init_from": str(run_dir / "predictor_step_00002.safetensors"), "max_steps": 4},
              "derived": {"tables": [str(tmp_path / "ds" / "train.jsonl")], "run_name": "r1"}}
    assert len(absolute_paths_in(config)) == 3
    portable = portable_paths(config, run_dir)
    assert absolute_paths_in(portable) == []
    assert portable["flags"]["dataset_root"] == "$RUN_DIR/../../ds"
    assert portable["flags"]["init_from"] == "$RUN_DIR/predictor_step_00002.safetensors"
    back = expand_run_dir(portable, run_dir)
    assert Path(back["flags"]["dataset_root"]).resolve() == (tmp_path / "ds").resolve()
    assert Path(back["derived"]["tables"][0]).resolve() == (tmp_path / "ds" / "train.jsonl").resolve()
    assert back["flags"]["output_root"] == "checkpoints" and back["flags"]["max_steps"] == 4
    assert expand_run_dir(config, run_dir) == config  # an older file's absolute paths are kept


@pytest.mark.parametrize("value, found", [
    ("/work/world_build/dataset_kd5_train192", ["/work/world_build/dataset_kd5_train192"]),
    ("data: /home/alice/ds/train.jsonl, 12 clips", ["/home/alice/ds/train.jsonl"]),
    ("--ckpt=/srv/runs/x.safetensors", ["/srv/runs/x.safetensors"]),
    ("C:\\Users\\bob\\teacher", ["C:\\Users\\bob\\teacher"]),
    ("fy/(2cy) times width", []),  # the world config's intrinsics text: no path
    ("a / b", []),
    ("$RUN_DIR/../../main/predictor_frrp/predictor_step_01920.safetensors", []),
    ("predictor_frrp/predictor_step_00480.safetensors", []),
])
def test_absolute_paths_in_table(value, found):
    assert absolute_paths_in({"nested": [value]}) == found


def test_weights_sha256_is_sha256sum_of_the_file_or_of_the_listing(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "config.json").write_text("{}")
    (one / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")
    assert weights_sha256(one) == hashlib.sha256(b"weights").hexdigest()
    assert weights_sha256(one / "diffusion_pytorch_model.safetensors") == hashlib.sha256(b"weights").hexdigest()
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "m-00002-of-00002.safetensors").write_bytes(b"second")
    (sharded / "m-00001-of-00002.safetensors").write_bytes(b"first")
    listing = (f"{hashlib.sha256(b'first').hexdigest()}  m-00001-of-00002.safetensors\n"
               f"{hashlib.sha256(b'second').hexdigest()}  m-00002-of-00002.safetensors\n")
    assert weights_sha256(sharded) == hashlib.sha256(listing.encode()).hexdigest()
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserInputError, match="no weight files"):
        weights_sha256(tmp_path / "empty")


def test_the_record_says_what_is_unknown_and_old_files_have_none():
    assert describe_provenance(None) == NOT_RECORDED == "no provenance recorded"
    assert recorded_provenance({"step": 3}) is None
    unknown = record(unknown={"parent_sha256": "not on this machine"})
    assert describe_provenance(unknown) == ("teacher aaaaaaaaaaaa (teacher/diffusion_pytorch_model.safetensors); "
                                            "parent unknown; dataset config none")
    with pytest.raises(ValueError, match="have values"):
        record(unknown={"teacher_sha256": "why"})
    with pytest.raises(ValueError, match="unknown keys"):
        record(unknown={"parent": "why"})
    with pytest.raises(UserInputError, match="format"):
        recorded_provenance({"provenance": {**record(), "format": 99}})
    config = {"flags": {}, "derived": {"provenance": record()}}
    assert with_provenance({"step": 1}, config) == {"step": 1, "provenance": record()}
    assert with_provenance({"step": 1}, {"flags": {}, "derived": {}}) == {"step": 1}


def test_inference_file_records_the_run_provenance_and_no_machine_path(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    config = {"flags": {"dataset_root": str(tmp_path / "ds"), "output_dir": str(run_dir)},
              "derived": {"provenance": record(parent_sha256=SHA_B)}}
    path = save_inference_weights(run_dir / "predictor_step_00002.safetensors", {"w": torch.ones(2, 3)},
                                  metadata={"precision": "fp32", "step": 2}, config=config)
    meta = read_inference_metadata(path)
    assert recorded_provenance(meta)["parent_sha256"] == SHA_B and meta["step"] == 2
    stored = read_inference_config(path)
    assert stored["flags"] == {"dataset_root": "$RUN_DIR/../../ds", "output_dir": "$RUN_DIR"}
    with open_safetensors(path) as handle:
        assert absolute_paths_in({key: json.loads(value) if key in ("meta", "config") else value
                                  for key, value in handle.metadata().items()}) == []
    bare = save_inference_weights(run_dir / "bare.safetensors", {"w": torch.ones(2)}, metadata={"precision": "fp32"},
                                  config={"flags": {}, "derived": {}})
    assert recorded_provenance(read_inference_metadata(bare)) is None  # a config without provenance: none recorded


def test_header_rewrite_keeps_the_tensor_bytes(tmp_path):
    tensors = {"b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "a": torch.ones(5)}
    path = save_inference_weights(tmp_path / "w.safetensors", tensors, metadata={"precision": "fp32"},
                                  config={"flags": {"x": "/abs/path/y"}})
    before_bytes, before_tensors = tensor_bytes_sha256(path), tensors_sha256(read_inference_weights(path))
    with open_safetensors(path) as handle:
        metadata = handle.metadata()
    rewrite_safetensors_metadata(path, {**metadata, "meta": json.dumps({"precision": "fp32", "note": "x" * 37})})
    assert tensor_bytes_sha256(path) == before_bytes
    assert tensors_sha256(read_inference_weights(path)) == before_tensors  # the recorded checksum still holds
    assert read_inference_metadata(path)["note"] == "x" * 37
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0  # the header padded as safetensors pads it
    with pytest.raises(TypeError, match="strings"):
        rewrite_safetensors_metadata(path, {"meta": {"not": "a string"}})
