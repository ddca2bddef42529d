"""The dataset readers' safetensors handles (predictor_training/data/safetensors_handles.py), read through
`PairDataset`: a damaged tensor is named when read without verify, and damaged text rows on their first read."""

from __future__ import annotations

import re
import warnings

import pytest

from predictor_training.data.pair_dataset import PairDataset
from predictor_training.data.shards import ShardVerificationError, TensorChecksumError
from predictor_training.data.synthetic import SyntheticSpec, damage_tensor, tensor_byte_range, write_synthetic_dataset


SPEC = SyntheticSpec()
SOURCE_LAYERS = (2, 0)


def _index_of(dataset: PairDataset, key: tuple[str, int, int, int], anchor_step: int) -> int:
    return next(i for i in range(len(dataset))
                if dataset.key_of(i) == key and dataset.refs[i].anchor_step == anchor_step)


def test_damaged_tensor_is_named_when_read_without_verify(tmp_path):
    """256 bytes overwritten inside one tensor of a train trajectory: reading a pair that uses it fails by default."""
    write_synthetic_dataset(tmp_path, SPEC)
    victim = tmp_path / "trajectories" / "c000__a0.safetensors"
    name = "chunk2.step1.final_hidden"
    start, end = tensor_byte_range(victim, name)
    assert end - start >= 256  # the damage stays inside this tensor
    damage_tensor(victim, name, 256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a current manifest: no warning
        dataset = PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS)  # no verify: nothing hashed up front
    target = _index_of(dataset, ("c000", 0, 2, 1), anchor_step=0)  # target_hidden = chunk2.step1.final_hidden
    anchor = _index_of(dataset, ("c000", 0, 2, 2), anchor_step=1)  # anchor_hidden = the same tensor
    untouched = _index_of(dataset, ("c000", 0, 1, 3), anchor_step=2)
    pattern = rf"{re.escape(str(victim))}: tensor '{name}': field 'tensor_crc32': expected [0-9a-f]{{8}}, found "
    assert dataset[untouched]["chunk"] == 1
    for index in (target, anchor, target):  # a failed check is not remembered as passed
        with pytest.raises(TensorChecksumError, match=pattern):
            dataset[index]
    with pytest.raises(ShardVerificationError, match=r"c000__a0\.safetensors: field 'sha256'"):
        PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS, verify=True)


def test_damaged_text_rows_are_caught_on_the_first_read(tmp_path):
    """text_k is read row by row; its first read in a process reads it whole and checks it."""
    write_synthetic_dataset(tmp_path, SPEC)
    victim = tmp_path / "cases" / "c001.safetensors"
    damage_tensor(victim, "text_k", 8)
    dataset = PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS)
    index = next(i for i in range(len(dataset)) if dataset.key_of(i)[0] == "c001")
    with pytest.raises(TensorChecksumError, match=rf"{re.escape(str(victim))}: tensor 'text_k'"):
        dataset[index]
    intact = PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS)
    assert intact[0]["case_id"] == "c000"
