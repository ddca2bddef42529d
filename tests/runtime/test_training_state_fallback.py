"""A damaged training_latest.pt is named, not a traceback, and the run keeps training_prev.pt to continue from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from predictor_training.runtime.checkpoint import (
    PREVIOUS_TRAINING_STATE_NAME,
    TRAINING_STATE_NAME,
    DamagedTrainingStateError,
    read_training_state,
    read_training_summary,
)


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

import toy_launch_recipe  # noqa: E402


def run_toy(output_root: Path, *extra: str) -> int:
    return toy_launch_recipe.main(["--output_root", str(output_root), "--max_steps", "4", "--no_progress",
                                   "--backend", "gloo", *extra])


def test_the_previous_state_is_kept_and_a_truncated_latest_is_named(tmp_path, capsys):
    assert run_toy(tmp_path / "whole") == 0
    assert run_toy(tmp_path / "cut", "--stop_at_step", "3") == 0
    run_dir = tmp_path / "cut" / "toy_run"
    assert read_training_summary(run_dir / PREVIOUS_TRAINING_STATE_NAME)["step"] == 2
    assert read_training_summary(run_dir / TRAINING_STATE_NAME)["step"] == 3

    latest = run_dir / TRAINING_STATE_NAME
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])  # a truncated copy
    with pytest.raises(DamagedTrainingStateError, match="damaged") as error:
        read_training_state(latest)
    assert str(run_dir / PREVIOUS_TRAINING_STATE_NAME) in str(error.value)

    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:  # the run's own relaunch: one line and exit 2, no traceback
        run_toy(tmp_path / "cut")
    assert stopped.value.code == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and message.startswith("toy_launch_recipe.py: error: ")
    assert str(latest) in message and "--resume" in message

    previous = run_dir / PREVIOUS_TRAINING_STATE_NAME
    assert run_toy(tmp_path / "cut", "--resume", str(previous)) == 0
    final = "predictor_step_00004.safetensors"
    resumed, whole = load_file(run_dir / final), load_file(tmp_path / "whole" / "toy_run" / final)
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)
