"""The offline dataset's manifest (predictor_training/data/manifest.py), read through `PairDataset`: a missing file
and a whole-file checksum mismatch are named, a manifest without per-tensor checksums loads with one warning, and
the last entry of a file wins."""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from predictor_training.data.manifest import UncheckedTensorsWarning
from predictor_training.data.pair_dataset import PairDataset
from predictor_training.data.shards import ShardVerificationError
from predictor_training.data.synthetic import SyntheticSpec, strip_tensor_checksums, write_synthetic_dataset


SPEC = SyntheticSpec()
SOURCE_LAYERS = (2, 0)


def trajectory_tensors(written, case_id, action_id):
    return written[f"trajectories/{case_id}__a{action_id}.safetensors"]


def test_missing_file_is_named(tmp_path):
    write_synthetic_dataset(tmp_path, SPEC)
    victim = tmp_path / "trajectories" / "c001__a2.safetensors"
    victim.unlink()
    with pytest.raises(FileNotFoundError, match="c001__a2.safetensors"):
        PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS)


def test_checksum_mismatch_is_named(tmp_path):
    write_synthetic_dataset(tmp_path, SPEC)
    victim = tmp_path / "cases" / "c000.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, different content: only the checksum can tell
    victim.write_bytes(bytes(data))
    PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS)  # verify=False does not hash
    with pytest.raises(ShardVerificationError, match=r"c000\.safetensors.*sha256"):
        PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS, verify=True)


def test_manifest_without_tensor_checksums_loads_with_one_warning(tmp_path):
    written = write_synthetic_dataset(tmp_path, SPEC)
    strip_tensor_checksums(tmp_path)
    with pytest.warns(UncheckedTensorsWarning) as caught:
        dataset = PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "manifest.jsonl" in message and "no per-tensor checksums" in message and "--verify_dataset" in message
    item = dataset[0]
    stored = trajectory_tensors(written, item["case_id"], item["action_id"])
    assert torch.equal(item["target_hidden"], stored[f"chunk{item['chunk']}.step{item['step']}.final_hidden"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole files were checked up front: nothing to warn about
        PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS, verify=True)


def test_manifest_last_entry_wins(tmp_path):
    small = replace(SPEC, cases={"c000": "train"}, actions=(1,))
    write_synthetic_dataset(tmp_path, small)
    manifest = tmp_path / "manifest.jsonl"
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join(lines + lines[-1:]) + "\n")  # the trajectory was appended twice
    dataset = PairDataset(Path(tmp_path), "train", source_layers=SOURCE_LAYERS)
    assert len(dataset.trajectories) == 1
