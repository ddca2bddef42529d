"""The shared atomic writer (predictor_training/runtime/io.py): replaces the target whole, keeps it
on error, gives new files umask permissions, writes the same safetensors bytes every time."""

from __future__ import annotations

import os
import stat

import pytest

from predictor_training.runtime.io import atomic_write, write_bytes_atomic, write_text_atomic


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_write_replaces_and_error_keeps_the_old_file(tmp_path):
    target = tmp_path / "out.bin"
    write_bytes_atomic(target, b"first")
    write_text_atomic(target, "second\n")
    assert target.read_text() == "second\n"

    def failing(tmp):
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, failing)
    assert target.read_text() == "second\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_new_file_gets_umask_permissions_even_from_a_0600_temp(tmp_path, umask):
    def private_writer(tmp):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)  # like safetensors' save_file
        os.write(fd, b"x")
        os.close(fd)

    previous = os.umask(umask)
    try:
        path = atomic_write(tmp_path / f"f{umask:o}", private_writer)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert current_umask() == previous


def test_safetensors_with_metadata_are_the_same_bytes_every_time(tmp_path):
    """safetensors orders the header's metadata by a randomly seeded hash map (8 saves give 8 orders);
    `save_safetensors` sorts it, so equal weights make equal files (the fault-injection benchmark compares bytes)."""
    import safetensors.torch
    import torch

    from predictor_training.runtime.io import save_safetensors

    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(2, dtype=torch.bfloat16)}
    metadata = {key: f"value of {key} é" for key in "abcdefgh"}
    written = set()
    for index in range(8):
        save_safetensors(tensors, tmp_path / f"{index}.safetensors", metadata)
        written.add((tmp_path / f"{index}.safetensors").read_bytes())
    assert len(written) == 1
    loaded = safetensors.torch.load_file(tmp_path / "0.safetensors")
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
    with safetensors.safe_open(tmp_path / "0.safetensors", framework="pt") as handle:
        assert handle.metadata() == metadata
