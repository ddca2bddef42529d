"""The shared atomic writer (predictor_training/runtime/io.py): replaces the target whole, keeps it
on error, gives new files umask permissions, writes the same safetensors bytes every time; the output-folder kind
check of the builders; taking back what a refused command created."""

from __future__ import annotations

import os
import re
import stat

import pytest

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import (
    FOLDER_KINDS,
    CreatedPaths,
    atomic_write,
    check_output_folder_kind,
    write_bytes_atomic,
    write_text_atomic,
)


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


def test_folder_kinds_name_the_files_the_toolkit_writes():
    from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
    from predictor_training.data.ode_cache import CACHE_CONFIG_NAME
    from predictor_training.data.video_latents import CONFIG_NAME
    from predictor_training.eval.run import EVAL_CONFIG_NAME
    from predictor_training.runtime.run_directory import TRAIN_CONFIG_NAME
    from predictor_training.world.shipped import WORLD_CONFIG_NAME

    for name in (DATASET_CONFIG_NAME, CACHE_CONFIG_NAME, CONFIG_NAME, EVAL_CONFIG_NAME, TRAIN_CONFIG_NAME,
                 WORLD_CONFIG_NAME, "demo_config.json"):
        assert name in FOLDER_KINDS, name


@pytest.mark.parametrize("contents, marker, layout, refusal", [
    ({}, "dataset_config.json", None, None),                                            # empty: a new build
    ({"dataset_config.json": "{}", "cases": None}, "dataset_config.json", {"dataset_config.json", "cases"}, None),
    ({"dataset_config.json": "{}", "manifest.jsonl.tmp": ""}, "dataset_config.json",
     {"dataset_config.json", "manifest.jsonl"}, None),                                   # a killed write
    ({"video_dataset_config.json": "{}"}, "dataset_config.json", None, "holds a video-latent dataset"),
    ({"train_config.json": "{}", "predictor_step_00002.safetensors": ""}, "ode_cache_config.json", None,
     "holds a run directory"),
    ({"notes.txt": "mine"}, "dataset_config.json", None, "holds 1 entry (e.g. 'notes.txt') but no dataset_config.json"),
    ({"dataset_config.json": "{}", "video_dataset_config.json": "{}"}, "dataset_config.json", None,
     "holds a video-latent dataset"),
    ({"dataset_config.json": "{}", "notes.txt": ""}, "dataset_config.json", {"dataset_config.json"},
     "also holds ['notes.txt']"),
    ({"poses": None, "train.jsonl": ""}, None, None, None),                              # a kind without a marker
    ({"train.jsonl": "", "config.json": "{}"}, None, None, "holds a model folder"),
])
def test_an_output_folder_of_another_kind_is_refused(tmp_path, contents, marker, layout, refusal):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in contents.items():
        (out / name).mkdir() if text is None else (out / name).write_text(text)
    check = lambda: check_output_folder_kind(out, flag="--out", marker=marker,  # noqa: E731
                                             layout=None if layout is None else frozenset(layout))
    if refusal is None:
        check()
    else:
        with pytest.raises(UserInputError, match=r"^--out .*" + re.escape(refusal)):
            check()
    check_output_folder_kind(tmp_path / "new", flag="--out", marker=marker)  # a new folder is always fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserInputError, match="is a file"):
        check_output_folder_kind(tmp_path / "file", flag="--out", marker=marker)


def test_created_paths_removes_only_what_was_made_after_the_snapshot(tmp_path):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "kept.txt").write_text("before")
    created = CreatedPaths(existing).snapshot()
    (existing / "kept.txt").write_text("changed")  # existed: never removed (the command must not change it)
    (existing / "new.txt").write_text("new")
    (existing / "sub").mkdir()
    (existing / "sub" / "file").write_text("x")
    created.remove()
    assert sorted(path.name for path in existing.iterdir()) == ["kept.txt"]

    new = tmp_path / "a" / "b" / "run"
    created = CreatedPaths(new).snapshot()
    new.mkdir(parents=True)
    (new / "run.lock").write_text("")
    created.remove()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["existing"]  # a/b/run and the parents it made
