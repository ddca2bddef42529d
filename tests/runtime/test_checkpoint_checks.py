"""The checks every checkpoint file gets (predictor_training/runtime/checkpoint_checks.py): non-finite tensors,
meta and state-dict mismatches and missing files, each refused in one line naming the file. Their use on saving
and loading: tests/runtime/test_checkpoint.py, tests/runtime/test_inference_weights.py and
tests/recipes/test_bad_input.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from predictor_training.runtime.checkpoint_checks import (
    CheckpointMismatchError,
    NonFiniteError,
    NonFiniteWeightsError,
    check_finite_file_weights,
    check_finite_tensors,
    check_state_matches,
    compare_expect,
    json_plain,
    require_file,
)
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.state_dicts import StateDictMismatchError


def test_non_finite_tensors_are_named():
    tensors = {"ok": torch.ones(2), "steps": torch.tensor([3]), "bad": torch.tensor([1.0, float("nan")])}
    with pytest.raises(NonFiniteError, match=r"save: non-finite values in 1 tensors, e.g. \['bad'\]"):
        check_finite_tensors(tensors, "save")
    with pytest.raises(NonFiniteWeightsError, match=r"w.pt \(role 'critic'\): NaN/Inf in 1 weight tensors"):
        check_finite_file_weights(tensors, "w.pt", "role 'critic'")
    check_finite_tensors({"ok": torch.ones(2), "steps": torch.tensor([3])}, "save")


def test_a_meta_mismatch_shows_the_saved_and_requested_values():
    saved = {"variant": "v4", "source_blocks": [1, 52]}
    compare_expect(saved, {"source_blocks": (1, 52)}, Path("a.pt"))  # a tuple is the list it is saved as
    with pytest.raises(CheckpointMismatchError, match=r"variant: saved 'v4', requested 'disca'; precision: not "
                                                      r"recorded in the checkpoint, requested 'bf16'"):
        compare_expect(saved, {"variant": "disca", "precision": "bf16"}, Path("a.pt"))
    with pytest.raises(TypeError, match="meta must be JSON-serialisable"):
        json_plain({"x": object()}, "meta")


def test_a_state_that_does_not_fit_the_model_is_refused_before_loading(tmp_path):
    model = torch.nn.Linear(2, 3)
    check_state_matches(model, model.state_dict(), "w.pt")
    with pytest.raises(StateDictMismatchError, match="w.pt: its weights do not fit the model: 1 missing keys"):
        check_state_matches(model, {"weight": torch.zeros(3, 2)}, "w.pt")
    with pytest.raises(MissingFileError, match="refusing to start from scratch"):
        require_file(tmp_path / "missing.pt", "training state")
