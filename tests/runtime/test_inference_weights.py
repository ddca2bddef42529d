"""Inference weights (predictor_training/runtime/inference_weights.py): BF16, atomic, loadable, secrets never
stored, not private to the user; pruning keeps only the newest files a run wrote."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import safetensors.torch
import torch

from predictor_training.runtime.checkpoint import load_model_weights
from predictor_training.runtime.inference_weights import (
    prune_checkpoints,
    read_inference_config,
    read_inference_metadata,
    save_inference_weights,
)
from tests.helpers.tiny_checkpoint import META, build, save, train_steps


def test_inference_weights_bf16_atomic_and_loadable(tmp_path, monkeypatch):
    model, optimizer, schedule = build()
    train_steps(model, optimizer, schedule)
    path = tmp_path / "predictor_step_00002.safetensors"
    save_inference_weights(path, model, metadata={**META, "step": 2}, config={"hidden": 6, "api_key": "x"})
    tensors = safetensors.torch.load_file(str(path))
    assert set(tensors) == set(model.state_dict()) and all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert read_inference_metadata(path) == {**META, "step": 2}
    assert read_inference_config(path) == {"hidden": 6}  # secrets never stored

    fresh, _, _ = build(seed=4)
    assert load_model_weights(path, fresh, expect={"source_blocks": [1, 52]})["step"] == 2
    for name, param in fresh.state_dict().items():
        assert param.dtype == model.state_dict()[name].dtype  # BF16 file loaded into FP32 master params
        assert torch.equal(param, model.state_dict()[name].to(torch.bfloat16).to(param.dtype)), name

    training_path = tmp_path / "training_latest.pt"
    save(training_path, model, optimizer, schedule, step=2)
    exact, _, _ = build(seed=5)
    load_model_weights(training_path, exact)
    for a, b in zip(exact.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)

    # a failing write leaves the previous file and no temp file
    before = path.read_bytes()

    def failing_save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_inference_weights(path, model)
    assert path.read_bytes() == before and not path.with_name(path.name + ".tmp").exists()


def test_prune_keeps_newest_k_of_the_recorded_files_and_nothing_else(tmp_path):
    steps = [100 * i for i in range(1, 25)] + [100000]
    written = [f"predictor_step_{step:05d}.safetensors" for step in steps]
    for name in written:
        (tmp_path / name).write_bytes(b"x")
    # files this run did not write, some named like its own: never touched
    foreign = ["predictor_step_00050.safetensors", "training_latest.pt", "train_log.jsonl",
               "predictor_step_final.safetensors"]
    for other in foreign:
        (tmp_path / other).write_bytes(b"x")
    deleted = prune_checkpoints(tmp_path, 20, "predictor", [*written, "predictor_step_final.safetensors"])
    assert sorted(p.name for p in deleted) == written[:5]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written[5:] + foreign)
    assert prune_checkpoints(tmp_path, 20, "predictor", written) == deleted  # already gone: named, no error
    assert prune_checkpoints(tmp_path, -1, "predictor", written) == []
    kept = prune_checkpoints(tmp_path, 1, "predictor", written, delete=False)
    assert len(kept) == len(written) - 1 and all(path.exists() for path in kept[5:])
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, 0, "predictor", written)


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_safetensors_checkpoint_is_not_private(tmp_path):
    path = save_inference_weights(tmp_path / "predictor_step_00001.safetensors", {"w": torch.ones(2)},
                                  dtype=torch.float32)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~current_umask()
