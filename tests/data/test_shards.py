"""Shard files (predictor_training/data/shards.py): deterministic, verified safetensors writes and
the JSON-lines manifest (append, rewrite, a torn last line)."""

from __future__ import annotations

import hashlib
import pickle

import pytest
import torch

from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    LazyShard,
    ShardVerificationError,
    append_jsonl,
    file_tensor_crc32,
    read_jsonl,
    tensor_crc32,
    verify_file,
    write_jsonl_atomic,
    write_safetensors_atomic,
)


# =============================================================================================================
# shards.py
# =============================================================================================================
def test_safetensors_writes_are_deterministic_and_verified(tmp_path):
    tensors = {"b": torch.arange(6, dtype=torch.int64), "a": torch.randn(2, 3).bfloat16()}
    facts = write_safetensors_atomic(tmp_path / "x.safetensors", tensors)
    again = write_safetensors_atomic(tmp_path / "y.safetensors", dict(reversed(list(tensors.items()))))
    assert facts == again and (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "y.safetensors").read_bytes()
    assert facts["sha256"] == hashlib.sha256((tmp_path / "x.safetensors").read_bytes()).hexdigest()
    assert facts["tensors"] == {"a": [[2, 3], "bfloat16"], "b": [[6], "int64"]}
    # one CRC-32 per tensor, of its bytes in the file = of the tensor as loaded
    assert facts[TENSOR_CHECKSUM_FIELD] == file_tensor_crc32(tmp_path / "x.safetensors")
    assert facts[TENSOR_CHECKSUM_FIELD] == {name: tensor_crc32(tensor) for name, tensor in tensors.items()}
    assert not list(tmp_path.glob("*.tmp"))
    entry = {"file": "x.safetensors", **facts}
    verify_file(entry, tmp_path)
    shard = pickle.loads(pickle.dumps(LazyShard(tmp_path / "x.safetensors")))
    assert shard.shape("a") == [2, 3] and torch.equal(shard.get("b"), tensors["b"])

    for field, broken, message in [
        ("file", {**entry, "file": "missing.safetensors"}, "field 'file'"),
        ("bytes", {**entry, "bytes": entry["bytes"] + 1}, "field 'bytes'"),
        ("sha256", {**entry, "sha256": "0" * 64}, "field 'sha256'"),
        ("tensors", {**entry, "tensors": {"a": [[3, 2], "bfloat16"], "b": [[6], "int64"]}}, "field 'tensors'"),
        ("tensor_crc32", {**entry, TENSOR_CHECKSUM_FIELD: {"a": "00000000"}}, "field 'tensor_crc32'"),
    ]:
        with pytest.raises(ShardVerificationError, match=message) as error:
            verify_file(broken, tmp_path)
        assert str(tmp_path / broken["file"]) in str(error.value), field


def test_jsonl_append_rewrite_and_torn_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    append_jsonl(path, {"file": "a", "n": 1})
    append_jsonl(path, {"n": 2, "file": "b"})
    assert read_jsonl(path) == [{"file": "a", "n": 1}, {"file": "b", "n": 2}]
    assert path.read_text() == '{"file":"a","n":1}\n{"file":"b","n":2}\n'
    with open(path, "a") as handle:  # what a process killed inside a write leaves
        handle.write('{"file":"c"')
    with pytest.raises(ValueError, match="torn"):
        read_jsonl(path)
    assert read_jsonl(path, allow_torn_tail=True) == [{"file": "a", "n": 1}, {"file": "b", "n": 2}]
    write_jsonl_atomic(path, [{"file": "z"}])
    assert path.read_text() == '{"file":"z"}\n'
    path.write_text('{"file":"a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        read_jsonl(path)
