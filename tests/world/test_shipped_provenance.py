"""The shipped weights (predictor_training/world/weights) carry no absolute path of a machine, and the shipped
Predictor records by hash the Teacher it was trained on (the shipped one), and says why its parent and dataset
config are unknown (docs/runs.md § Provenance)."""

from __future__ import annotations

import hashlib
import json

from predictor_training.data.provenance import teacher_folder_config_sha256
from predictor_training.eval import read_predictor_checkpoint
from predictor_training.runtime.inference_weights import read_inference_metadata, read_inference_weights
from predictor_training.runtime.io import open_safetensors
from predictor_training.runtime.provenance import absolute_paths_in, recorded_provenance
from predictor_training.world.assets import WORLD_WEIGHTS

SHIPPED_PREDICTOR = WORLD_WEIGHTS / "predictor_frrp" / "predictor_step_00480.safetensors"


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def shipped_records() -> dict[str, object]:
    """{file: its content as plain data}: each JSON file, and each safetensors file's header metadata (JSON values
    decoded)."""
    records = {}
    for path in sorted(WORLD_WEIGHTS.rglob("*")):
        if path.suffix == ".json":
            records[str(path.relative_to(WORLD_WEIGHTS))] = json.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".safetensors":
            with open_safetensors(path) as handle:
                metadata = handle.metadata() or {}
            records[str(path.relative_to(WORLD_WEIGHTS))] = {key: _json_or_text(value)
                                                             for key, value in metadata.items()}
    return records


def test_no_shipped_file_names_an_absolute_path():
    records = shipped_records()
    assert "predictor_frrp/predictor_step_00480.safetensors" in records and "world_config.json" in records
    found = {name: absolute_paths_in(record)[:3] for name, record in records.items() if absolute_paths_in(record)}
    assert found == {}, f"absolute paths of a machine in shipped files: {found}"


def test_the_shipped_predictor_records_the_shipped_teacher_by_hash():
    provenance = recorded_provenance(read_inference_metadata(SHIPPED_PREDICTOR))
    assert provenance is not None, "the shipped Predictor records no provenance"
    teacher_weights = WORLD_WEIGHTS / "teacher" / "diffusion_pytorch_model.safetensors"
    assert provenance["teacher_sha256"] == hashlib.sha256(teacher_weights.read_bytes()).hexdigest()
    assert provenance["teacher_config_sha256"] == teacher_folder_config_sha256(WORLD_WEIGHTS / "teacher")
    assert provenance["names"]["teacher"] == "teacher/diffusion_pytorch_model.safetensors"
    # The parent is git 8bd6098's predictor_step_01920 (hashed from that commit); the dataset config is unknown,
    # and said so, rather than a guessed hash: it is not in the repository.
    assert len(provenance["parent_sha256"]) == 64 and int(provenance["parent_sha256"], 16) >= 0
    assert provenance["names"]["parent"] == "git_8bd6098/predictor_step_01920.safetensors"
    assert provenance["dataset_config_sha256"] is None and set(provenance["unknown"]) == {"dataset_config_sha256"}
    read_inference_weights(SHIPPED_PREDICTOR)  # its tensors still match the tensors_sha256 it was written with
    ckpt = read_predictor_checkpoint(SHIPPED_PREDICTOR)
    assert ckpt.step == 480 and ckpt.run_flags["output_dir"] == str(SHIPPED_PREDICTOR.parent)  # $RUN_DIR expanded
