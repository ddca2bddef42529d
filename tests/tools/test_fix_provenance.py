"""tools/fix_provenance.py: an old inference file (absolute paths, no provenance) gets the hashes of its Teacher,
parent and dataset config and a portable run config, its tensor bytes untouched; a Teacher of another config or
architecture is refused before anything is written; --show reads old and new files."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.predictor.model import build_predictor
from predictor_training.runtime.inference_weights import (
    read_inference_config,
    read_inference_metadata,
    save_inference_weights,
)
from predictor_training.runtime.io import open_safetensors
from predictor_training.runtime.provenance import absolute_paths_in, recorded_provenance, \
    rewrite_safetensors_metadata, tensor_bytes_sha256
from predictor_training.teacher import WorldPlayTransformer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import fix_provenance  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def old_file(tmp_path) -> dict:
    """A Predictor file as runs wrote it before provenance: its config names /abs paths of the training machine."""
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=2)
    teacher.save_pretrained(str(tmp_path / "teacher"))
    WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=3).save_pretrained(str(tmp_path / "deeper"))
    predictor = build_predictor(teacher, "v4", (0, 1))
    path = tmp_path / "shipped" / "predictor_step_00480.safetensors"
    path.parent.mkdir()
    flags = {"dataset_root": "/work/world_build/dataset_kd5_train192", "output_dir": "/work/world_build/ckpt_w0.5",
             "init_from": "/work/main/weights/predictor_frrp/predictor_step_01920.safetensors", "teacher": None}
    config = {"flags": flags, "derived": {"predictor": predictor.predictor_config(),
                                          "sample_table": "/work/world_build/a/train.jsonl"}}
    save_inference_weights(path, predictor, metadata={"variant": "v4", "source_blocks": [0, 1], "precision": "fp32",
                                                      "step": 480}, config=config)
    with open_safetensors(path) as handle:  # the header as older code wrote it: the paths as given
        metadata = handle.metadata()
    rewrite_safetensors_metadata(path, {**metadata, "config": json.dumps(config)})
    assert read_inference_config(path) == config
    return {"root": tmp_path, "path": path}


def run(*argv) -> int:
    return fix_provenance.main([str(item) for item in argv])


def test_old_file_gets_provenance_and_keeps_its_tensors(old_file, capsys):
    root, path = old_file["root"], old_file["path"]
    assert run(path, "--show") == 0
    assert capsys.readouterr().out.startswith("no provenance recorded")
    before = tensor_bytes_sha256(path)
    dataset = root / "dataset"
    dataset.mkdir()
    (dataset / "dataset_config.json").write_text("{}")
    assert run(path, "--teacher", root / "teacher", "--parent_unknown", "not on this machine",
               "--dataset_config", dataset) == 0
    out = capsys.readouterr().out
    assert f"tensor bytes sha256: before {before}, after {before}" in out
    assert tensor_bytes_sha256(path) == before
    provenance = recorded_provenance(read_inference_metadata(path))
    teacher_weights = root / "teacher" / "diffusion_pytorch_model.safetensors"
    assert provenance["teacher_sha256"] == hashlib.sha256(teacher_weights.read_bytes()).hexdigest()
    assert provenance["parent_sha256"] is None and provenance["unknown"] == {"parent_sha256": "not on this machine"}
    assert provenance["dataset_config_sha256"] == hashlib.sha256(b"{}").hexdigest()
    config = read_inference_config(path)
    assert config["flags"]["dataset_root"] == "$RUN_DIR/../dataset_kd5_train192"  # relative to --output_dir
    assert config["flags"]["output_dir"] == "$RUN_DIR"
    assert config["derived"]["sample_table"] == "$RUN_DIR/../a/train.jsonl"
    with open_safetensors(path) as handle:
        header = {key: json.loads(value) if key in ("meta", "config") else value
                  for key, value in handle.metadata().items()}
    assert absolute_paths_in(header) == []
    assert run(path, "--show") == 0
    assert "teacher " in capsys.readouterr().out


def test_a_teacher_that_does_not_fit_is_refused_before_writing(old_file, capsys):
    root, path = old_file["root"], old_file["path"]
    before = path.read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        run(path, "--teacher", root / "deeper", "--no_parent", "--dataset_config_unknown", "gone")
    assert exit_info.value.code == 2 and "does not fit the Teacher" in capsys.readouterr().err
    assert path.read_bytes() == before
    with pytest.raises(SystemExit):
        run(path, "--teacher", root / "teacher", "--dataset_config_unknown", "gone")  # the parent is not said
    assert "--parent FILE, --no_parent or --parent_unknown" in capsys.readouterr().err
    assert path.read_bytes() == before
