"""training_latest.pt (predictor_training/runtime/checkpoint.py): round trip, atomicity under SIGKILL, refusals, NaN
guard. Inference weights and pruning: tests/runtime/test_inference_weights.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from predictor_training.runtime.checkpoint import RunState, load_model_weights, load_training_state, read_training_state
from predictor_training.runtime.checkpoint_checks import CheckpointMismatchError, NonFiniteError
from predictor_training.runtime.inference_weights import save_inference_weights
from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer
from predictor_training.runtime.roles import Role
from tests.helpers.tiny_checkpoint import META, TinyPredictor, build, current_lrs, draw_random, save, train_steps


REPO_ROOT = Path(__file__).resolve().parents[2]


def test_round_trip_restores_model_optimizer_schedule_run_state_and_rng(tmp_path):
    model, optimizer, schedule = build()
    train_steps(model, optimizer, schedule)
    path = tmp_path / "training_latest.pt"
    save(path, model, optimizer, schedule, step=2)
    expected_draws = draw_random()

    draw_random()  # move every RNG away from the saved point
    other_model, other_optimizer, other_schedule = build(seed=1)
    run_state = load_training_state(path, roles=[Role("predictor", other_model, other_optimizer, other_schedule)],
                                    expect=META)
    assert draw_random() == expected_draws
    assert run_state == RunState(global_step=2, micro_step=4, epoch=1, data={"epoch": 1, "position": 3, "seed": 0})
    for (name, a), (_, b) in zip(model.state_dict().items(), other_model.state_dict().items()):
        assert torch.equal(a, b), name
    assert other_schedule.step_count == 2 and current_lrs(other_schedule) == current_lrs(schedule)
    # identical optimizer state => identical next update
    torch.manual_seed(5)
    train_steps(other_model, other_optimizer, other_schedule, steps=1)
    torch.manual_seed(5)
    model2, optimizer2, schedule2 = build(seed=2)
    load_training_state(path, roles=[Role("predictor", model2, optimizer2, schedule2)], expect={})
    torch.manual_seed(5)
    train_steps(model2, optimizer2, schedule2, steps=1)
    for a, b in zip(other_model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    payload = read_training_state(path)
    assert payload["meta"] == META and payload["world_size"] == 1
    assert all(t.dtype == torch.float32 for n, t in payload["roles"]["predictor"]["model"].items() if not n.startswith("final"))


@pytest.mark.parametrize(
    "key, requested",
    [("variant", "disca"), ("source_blocks", [0, 53]), ("precision", "bf16")],
)
def test_refuses_mismatched_meta_and_shows_both_values(tmp_path, key, requested):
    model, optimizer, schedule = build()
    path = tmp_path / "training_latest.pt"
    save(path, model, optimizer, schedule, step=1)
    with pytest.raises(CheckpointMismatchError) as error:
        load_training_state(path, roles=[Role("predictor", model, optimizer, schedule)],
                            expect={**META, key: requested})
    message = str(error.value)
    assert key in message and f"saved {META[key]!r}" in message and f"requested {requested!r}" in message
    with pytest.raises(CheckpointMismatchError, match=key):
        load_model_weights(path, model, expect={key: requested})


def test_refuses_other_world_size(tmp_path):
    model, optimizer, schedule = build()
    path = tmp_path / "training_latest.pt"
    save(path, model, optimizer, schedule, step=1)
    payload = read_training_state(path)
    payload["world_size"] = 8
    torch.save(payload, path)
    with pytest.raises(CheckpointMismatchError, match="world_size: saved 8, requested 1"):
        load_training_state(path, roles=[Role("predictor", model, optimizer, schedule)], expect=META)


def test_refuses_other_learning_rates(tmp_path):
    model, optimizer, schedule = build()
    path = tmp_path / "training_latest.pt"
    save(path, model, optimizer, schedule, step=1)
    other_model = TinyPredictor()
    other_optimizer = build_optimizer(
        {"fusion": list(other_model.fusion.parameters()), "blocks": list(other_model.blocks.parameters())},
        {"fusion": 1e-2, "blocks": 5e-3}, betas=(0.9, 0.95), weight_decay=0.01,
    )
    other_schedule = TwoGroupLRSchedule(other_optimizer, warmup_steps=2, max_steps=10, block_warmup_steps=1)
    with pytest.raises(CheckpointMismatchError, match="group 1 initial_lr: saved 0.001, requested 0.005"):
        load_training_state(path, roles=[Role("predictor", other_model, other_optimizer, other_schedule)],
                            expect=META)


def test_missing_resume_file_is_an_error(tmp_path):
    model, optimizer, schedule = build()
    missing = tmp_path / "nope" / "training_latest.pt"
    with pytest.raises(FileNotFoundError, match="nope/training_latest.pt"):
        load_training_state(missing, roles=[Role("predictor", model, optimizer, schedule)], expect=META)
    with pytest.raises(FileNotFoundError):
        load_model_weights(tmp_path / "predictor_step_00100.safetensors", model)


def test_save_requires_meta_and_fp32_master(tmp_path):
    model, optimizer, schedule = build()
    with pytest.raises(ValueError, match="missing \\['precision'\\]"):
        save(tmp_path / "a.pt", model, optimizer, schedule, 1, meta={"variant": "v4", "source_blocks": [1, 2]})
    model.blocks.to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32master"):
        save(tmp_path / "a.pt", model, optimizer, schedule, 1)
    assert not (tmp_path / "a.pt").exists()


def test_non_finite_weights_never_overwrite_the_last_good_checkpoint(tmp_path):
    model, optimizer, schedule = build()
    path = tmp_path / "training_latest.pt"
    weights = tmp_path / "predictor_step_00001.safetensors"
    save(path, model, optimizer, schedule, step=1)
    save_inference_weights(weights, model)
    good_bytes, good_weights = path.read_bytes(), weights.read_bytes()
    with torch.no_grad():
        model.blocks.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="blocks.weight"):
        save(path, model, optimizer, schedule, step=2)
    with pytest.raises(NonFiniteError, match="blocks.weight"):
        save_inference_weights(weights, model)
    assert path.read_bytes() == good_bytes and weights.read_bytes() == good_weights
    assert sorted(p.name for p in tmp_path.iterdir()) == [weights.name, path.name]


def test_training_state_survives_sigkill_during_write(tmp_path):
    """A child saves step 1, then is SIGKILLed while writing step 2: step 1 must still load."""
    path = tmp_path / "training_latest.pt"
    child_code = textwrap.dedent(
        f"""
        import sys, time, torch
        from tests.helpers.tiny_checkpoint import build, train_steps, save  # python -c runs in the repository root
        model, optimizer, schedule = build()
        train_steps(model, optimizer, schedule, steps=1)
        save({str(path)!r}, model, optimizer, schedule, step=1)

        def half_written_save(obj, handle):
            handle.write(b"\\x80" * 4096)  # the start of a pickle, never finished
            handle.flush()
            print("PARTIAL", flush=True)
            time.sleep(120)

        torch.save = half_written_save
        train_steps(model, optimizer, schedule, steps=1)
        save({str(path)!r}, model, optimizer, schedule, step=2)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", child_code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        line = child.stdout.readline()
        assert line.strip() == "PARTIAL", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    tmp_file = path.with_name(path.name + ".tmp")
    assert tmp_file.stat().st_size == 4096  # the kill really interrupted a write
    model, optimizer, schedule = build(seed=3)
    run_state = load_training_state(path, roles=[Role("predictor", model, optimizer, schedule)], expect=META)
    assert run_state.global_step == 1 and schedule.step_count == 1
    # the next save replaces the leftover temp file
    save(path, model, optimizer, schedule, step=1)
    assert not tmp_file.exists()
