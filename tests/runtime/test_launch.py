"""The start and end every recipe's `main()` shares (predictor_training/runtime/launch.py), in one process: when a
launch has nothing to train, the run directory made and locked for the run's lifetime (a second writer refused in
one line), the seeds, the resume of the roles and the batch stream, and `run_recipe` running a toy recipe's steps
(a fresh run stopped early, its continuation, a finished run). A whole toy recipe launched through the launchers
runs in tests/recipes/test_run_lock.py."""

from __future__ import annotations

import argparse
import os
import random

import numpy as np
import pytest
import torch

from predictor_training.runtime.checkpoint import RunState, save_training_state
from predictor_training.runtime.errors import CommandParser, UserInputError
from predictor_training.runtime.flags import add_run_args, add_tracker_args
from predictor_training.runtime.launch import (
    Recipe, RunPlan, RunSettings, distributed_run, early_exit, rescaled_position, resume_roles, run_recipe,
)
from predictor_training.runtime.recipe import RecipeData, RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import RunLock, RunLockedError, RunStart, run_config
from tests.helpers.toy_loop import META, SINGLE, read_log, setup_loop

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)


def start(run_dir, kind="fresh", resume_path=None, saved_step=0, stop_step=6) -> RunStart:
    return RunStart(run_dir=run_dir, run_name=run_dir.name, kind=kind, resume_path=resume_path,
                    saved_step=saved_step, stop_step=stop_step)


def flags(**values) -> RunSettings:
    """The run's settings as a recipe's flags give them (`RunSettings.from_flags`), with `values` changed."""
    defaults = dict(backend="auto", seed=0, check_only=False, print_run_dir=False, tracker="none",
                    swanlab_project="toy", swanlab_mode=None, experiment_name=None, max_steps=6, grad_accum=1,
                    ckpt_every=1, keep_last=2, log_every=1, no_progress=True)
    return RunSettings.from_flags(argparse.Namespace(**{**defaults, **values}))


def test_nothing_to_train_for_check_only_print_run_dir_and_a_finished_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert early_exit(flags(), start(run_dir)) is None
    assert early_exit(flags(), start(run_dir, "continue", run_dir / "t.pt", 2)) is None
    assert early_exit(flags(print_run_dir=True), start(run_dir)) == 0
    out, err = capsys.readouterr()
    assert out == f"{run_dir}\n" and err == f"new run in {run_dir}\n"
    finished = start(run_dir, "finished", run_dir / "training_latest.pt", 6)
    assert early_exit(flags(print_run_dir=True), finished) == 3  # a launcher has nothing to start
    assert early_exit(flags(), finished) == 0
    assert "already finished at step 6; nothing to do" in capsys.readouterr().out
    # --check_only: the name, the directory and what a launch would do, exit 0, whatever the launch would do
    for planned, what in ((start(run_dir), "new run in"), (finished, "already finished")):
        assert early_exit(flags(check_only=True), planned) == 0
        out = capsys.readouterr().out
        assert f"check only: run name run\ncheck only: run directory {run_dir}\n" in out and what in out, out
    assert not run_dir.exists()  # nothing is made before the run starts


def test_the_run_directory_is_locked_for_the_run_and_the_seeds_are_set(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "run"
    with distributed_run(flags(backend="gloo", seed=7), start(run_dir)) as env:
        assert env == SINGLE and run_dir.is_dir()
        draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
        holders = RunLock(run_dir).holders()
        assert holders is not None and str(os.getpid()) in holders
        with pytest.raises(RunLockedError):
            RunLock(run_dir).acquire()
        with pytest.raises(UserInputError, match="already running"):  # a second writer, in one line
            with distributed_run(flags(backend="gloo", seed=7), start(run_dir)):
                pass
        assert RunLock(run_dir).holders() == holders  # the refused launch left the run's lock alone
    assert RunLock(run_dir).holders() is None  # released when the block ends
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    assert draws == (random.random(), float(np.random.rand()), float(torch.rand(1)))  # --seed + rank 0
    assert f"new run in {run_dir}" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="inside"):
        with distributed_run(flags(backend="gloo", seed=7), start(run_dir)):
            raise RuntimeError("inside")
    assert RunLock(run_dir).holders() is None  # released however the block ends


def test_resume_restores_the_roles_and_puts_the_batches_back(tmp_path):
    model, optimizer, schedule, _, batches = setup_loop(tmp_path, max_steps=4)
    for _ in range(3):
        next(batches)
    saved = RunState(global_step=3, micro_step=3, epoch=0, data=batches.state_dict())
    path = tmp_path / "training_latest.pt"
    save_training_state(path, roles=[Role("predictor", model, optimizer, schedule)], run_state=saved, config={},
                        meta=META)
    expected_next = next(batches)

    other_model, other_optimizer, other_schedule, _, other_batches = setup_loop(tmp_path, max_steps=4)
    with torch.no_grad():
        for param in other_model.parameters():
            param.add_(1.0)
    roles = [Role("predictor", other_model, other_optimizer, other_schedule)]
    assert resume_roles(start(tmp_path, "fresh"), roles, other_batches, META) == RunState()
    held = RunState()
    restored = resume_roles(start(tmp_path, "continue", path, 3), roles, other_batches, META, run_state=held)
    assert restored is held and restored == saved  # filled in place: the recipe's step holds this object
    assert all(torch.equal(a, b) for a, b in zip(other_model.parameters(), model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(next(other_batches), expected_next))
    with pytest.raises(Exception, match="variant"):
        resume_roles(start(tmp_path, "continue", path, 3), roles, None, {**META, "variant": "other"})


def test_a_changed_batch_size_keeps_the_items_seen_in_the_epoch():
    """--allow_changed_settings with another --batch_size: 6 batches of 16 seen -> 12 batches of 8 (rounded down);
    the epoch, the seed and an unchanged batch stay as saved."""
    data = {"epoch": 3, "position": 6, "seed": 0}
    assert rescaled_position(data, [16, 8]) == {"epoch": 3, "position": 12, "seed": 0}
    assert rescaled_position(data, [4, 5])["position"] == 4  # 24 items: 4 whole batches of 5
    assert rescaled_position(data, None) is data


def toy_recipe(calls: list) -> Recipe:
    """A regression model through every step of `run_recipe`, recording what each step saw in `calls`."""
    def data(launch):
        calls.append(("data", launch.start.kind))
        _, _, _, dataset, batches = setup_loop(None, max_steps=launch.args.max_steps)
        return RecipeData(batches, dataset)

    def build(launch):
        model, optimizer, schedule, _, _ = setup_loop(None, max_steps=launch.args.max_steps)
        calls.append(("build", launch.data.dataset is not None))

        def step_fn(batch, *, sync, due):
            x, y = batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return {"loss": loss.item()}
        return RecipeParts(roles=[Role("predictor", model, optimizer, schedule)], step_fn=step_fn, models=[model])

    def summarize(launch):
        calls.append(("summarize", launch.run_state.global_step))
        return run_config(launch.args, run_name=launch.start.run_name)

    def after(launch):
        calls.append(("after", launch.run_state.global_step, launch.config["derived"]["run_name"]))

    return Recipe(plan=lambda args: RunPlan(meta=META, naming=lambda flags, **_: "toy_run"), data=data, build=build,
                  summarize=summarize, after=after)


def toy_args(run_dir, *extra: str) -> argparse.Namespace:
    parser = CommandParser(prog="toy.py")
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--stop_at_step", type=int, default=-1)
    parser.add_argument("--grad_accum", type=int, default=1)
    add_run_args(parser, experiment="toy", precision="fp32", ckpt_every=2, keep_last=2, log_every=1, seed=0)
    add_tracker_args(parser, tracker="none", project="toy")
    return parser.parse_args(["--output_dir", str(run_dir), "--backend", "gloo", "--no_progress", *extra])


def test_run_recipe_runs_the_steps_in_order_and_a_second_launch_continues_from_the_saved_state(tmp_path, capsys):
    run_dir = tmp_path / "run"
    calls = []
    assert run_recipe(toy_args(run_dir, "--check_only"), toy_recipe(calls)) == 0
    assert calls == [] and not run_dir.exists()  # --check_only: nothing built, nothing made
    assert run_recipe(toy_args(run_dir, "--stop_at_step", "2"), toy_recipe(calls)) == 0
    assert calls == [("data", "fresh"), ("build", True), ("summarize", 0), ("after", 2, "toy_run")]
    calls.clear()
    assert run_recipe(toy_args(run_dir), toy_recipe(calls)) == 0  # the directory's own run continues
    assert calls == [("data", "continue"), ("build", True), ("summarize", 2), ("after", 4, "toy_run")]
    assert [row["step"] for row in read_log(run_dir)] == [1, 2, 3, 4]
    calls.clear()
    assert run_recipe(toy_args(run_dir), toy_recipe(calls)) == 0 and calls == []  # finished: nothing to do
    assert "already finished at step 4" in capsys.readouterr().out
