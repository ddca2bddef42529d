"""Sharded checkpoints of FSDP2 roles (predictor_training/runtime/sharded_checkpoint.py), two gloo ranks.

1. kill -9 inside saves, then resume: the shared train_loop with a checkpoint after every step
   (tests/helpers/fsdp_worker.py `killed`), launched five times in one run directory. Launch 1 is killed while rank
   1 writes its shards of save 2, launch 2 (resumed) after its save's staging folder is complete, launch 3 between
   moving the current folder to training_prev.dcp and renaming the new one into place, launch 4 after the new folder
   is in place but before training_latest.pt is replaced; launch 5 resumes and finishes. Each launch resumes from
   what the kill left; the final weights and AdamW state are bitwise the uninterrupted run's, and so are the logged
   losses.
2. Another world size: the 2-rank folder loaded on 1 rank (and written again), that one loaded on 2 ranks: DCP
   reshards, the model and optimizer states are bitwise the same; the whole training state (loop position, RNG per
   rank) at another world size is refused with a message that names the way to load the weights.
3. The converter: one safetensors file of the full model, loadable into the plain model.

The ranks are launched by tests/helpers/fsdp_worker.py's fork server (`Launcher`: torchrun's environment and
teardown, each launch's ranks forked from one process that imported torch once, so a launch costs its steps, not
three interpreter start-ups). The uninterrupted run (the `reference` fixture, 2 ranks) is launched once and serves
both 1 (the run compared against) and 2-3 (the 2-rank sharded folder)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from predictor_training.runtime.checkpoint import read_training_state, role_state
from predictor_training.runtime.sharded_checkpoint import read_sharded_state, read_token, sharded_folder_for
from tests.helpers.fsdp_worker import LOOP_ROLE, LOOP_STEPS, Launcher, build_model


REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def launcher():
    launcher = Launcher(REPO_ROOT)
    yield launcher
    launcher.close()


@pytest.fixture(scope="module")
def reference(launcher, tmp_path_factory) -> Path:
    """The uninterrupted run of `killed` on 2 ranks, a sharded checkpoint after every step (read only by the tests)."""
    run = tmp_path_factory.mktemp("reference")
    launch(launcher, "killed", run)
    return run


def launch(launcher: Launcher, *args, nproc: int = 2, kill_at: str | None = None) -> dict:
    result = launcher.launch(*args, nproc=nproc, env={"KILL_AT": kill_at} if kill_at else {})
    if kill_at is None:
        assert result["returncode"] == 0, f"{args} {result['codes']}:\n{result['output']}"
    return result


def full_role_state(state_path: Path) -> dict:
    """{"model", "optimizer_state", "param_groups", ...} of the FSDP role, read (full tensors) from its folder."""
    payload = read_training_state(state_path)
    entry = role_state(payload, LOOP_ROLE, state_path)
    folder = sharded_folder_for(state_path, entry["sharded"])
    optimizer_state = read_sharded_state(folder, LOOP_ROLE)["optimizer"]["state"]
    return {"model": entry["model"], "optimizer_state": optimizer_state, "run_state": payload["run_state"],
            "param_groups": entry["optimizer"]["param_groups"], "lr_schedule": entry["lr_schedule"],
            "sharded": entry["sharded"], "world_size": payload["world_size"]}


def assert_bitwise_equal(first: dict, second: dict) -> None:
    assert list(first["model"]) == list(second["model"])
    assert all(torch.equal(first["model"][key], second["model"][key]) for key in first["model"])
    assert sorted(first["optimizer_state"]) == sorted(second["optimizer_state"])
    for name, state in first["optimizer_state"].items():
        assert sorted(state) == sorted(second["optimizer_state"][name])
        assert all(torch.equal(torch.as_tensor(value), torch.as_tensor(second["optimizer_state"][name][key]))
                   for key, value in state.items())


def last_losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the records in train_log.jsonl (a resumed run's records replace the abandoned ones)."""
    losses = {}
    for line in (run_dir / "train_log.jsonl").read_text().splitlines():
        record = json.loads(line)
        losses[record["step"]] = record["loss"]
    return losses


@pytest.mark.slow
def test_kill_9_inside_sharded_saves_then_resume_is_bitwise_the_uninterrupted_run(launcher, reference, tmp_path):
    run = tmp_path / "run"
    kills = [("writing:2", 1), ("staged:2", 2), ("rotated:1", 2), ("published:2", 3)]
    for kill_at, step_on_disk in kills:
        result = launch(launcher, "killed", run, kill_at=kill_at)
        # Killed where asked (its rank died of its own SIGKILL there), not failed some other way.
        killed_rank = 1 if kill_at.startswith("writing") else 0
        assert result["returncode"] != 0, f"{kill_at}: the launch was not killed\n{result['output']}"
        assert f"SIGKILL at {kill_at} on rank {killed_rank}\n" in result["output"], result["output"]
        assert result["codes"][killed_rank] == -9, (kill_at, result["codes"])
        # What the kill left: a loadable training_latest.pt of the last completed save, its folder found by token.
        state = full_role_state(run / "training_latest.pt")
        assert state["run_state"]["global_step"] == step_on_disk, kill_at
        if kill_at.startswith("rotated"):  # the pair's folder is now named training_prev.dcp
            assert not (run / "training_latest.dcp").exists()
            assert read_token(run / "training_prev.dcp") == state["sharded"]["token"]
        if kill_at.startswith("published"):  # the new folder is in place, the .pt still the previous save's
            assert read_token(run / "training_latest.dcp") != state["sharded"]["token"]
            assert read_token(run / "training_prev.dcp") == state["sharded"]["token"]
        if kill_at.startswith("writing"):
            assert (run / "training_latest.dcp.writing").is_dir()
    launch(launcher, "killed", run)  # resume to the end

    finished, uninterrupted = full_role_state(run / "training_latest.pt"), full_role_state(
        reference / "training_latest.pt")
    assert finished["run_state"] == uninterrupted["run_state"]
    assert finished["run_state"]["global_step"] == LOOP_STEPS
    assert finished["lr_schedule"] == uninterrupted["lr_schedule"]
    assert finished["param_groups"] == uninterrupted["param_groups"]
    assert_bitwise_equal(finished, uninterrupted)
    assert last_losses(run) == last_losses(reference)
    assert len(set(last_losses(reference).values())) == LOOP_STEPS
    assert "double_blocks.0.img_attn_q.weight" in finished["optimizer_state"]
    assert "txt_in.input_embedder.weight" not in finished["optimizer_state"]  # never had a gradient
    # The previous state is a complete, loadable pair too, one step behind.
    previous = full_role_state(run / "training_prev.pt")
    assert previous["run_state"]["global_step"] == LOOP_STEPS - 1
    assert not (run / "training_latest.dcp.writing").exists()
    # Nothing of the sharded role went into the .pt (no gather): the model and moments are only in the folder.
    raw = torch.load(run / "training_latest.pt", map_location="cpu", weights_only=True)
    assert raw["roles"][LOOP_ROLE]["model"] == {} and raw["roles"][LOOP_ROLE]["optimizer"]["state"] == {}


@pytest.mark.slow
def test_sharded_folder_loads_on_another_world_size_and_converts_to_one_file(launcher, reference, tmp_path,
                                                                              capsys):
    state_path = reference / "training_latest.pt"  # 2 ranks, sharded
    source = sharded_folder_for(state_path, read_training_state(state_path)["roles"][LOOP_ROLE]["sharded"])
    two = full_role_state(state_path)
    assert two["world_size"] == 2 and two["sharded"]["world_size"] == 2
    assert two["run_state"]["global_step"] == LOOP_STEPS and two["optimizer_state"]  # trained: moments saved

    # 1. 2 -> 1 -> 2 ranks: the same full model and optimizer state.
    launch(launcher, "reshard", source, tmp_path / "one", nproc=1)
    launch(launcher, "reshard", tmp_path / "one" / "training_latest.dcp", tmp_path / "two", nproc=2)
    for folder in (tmp_path / "one" / "training_latest.dcp", tmp_path / "two" / "training_latest.dcp"):
        state = read_sharded_state(folder, LOOP_ROLE)
        assert_bitwise_equal({"model": state["model"], "optimizer_state": state["optimizer"]["state"]}, two)

    # 2. The whole training state at another world size: refused, naming how to load the weights instead.
    from predictor_training.runtime.checkpoint import load_training_state
    from predictor_training.runtime.checkpoint_checks import CheckpointMismatchError
    from tests.helpers.fsdp_worker import LOOP_META, fsdp_role
    with pytest.raises(CheckpointMismatchError, match=r"world_size: saved 2, requested 1 .*load_sharded_roles"):
        load_training_state(state_path, roles=[fsdp_role(3, None, shard=False)], expect=LOOP_META)

    # 3. The converter (its `main`, in this process: the command line without an interpreter start-up): one
    # safetensors file, the full model, loadable into the plain model.
    from tools.convert_sharded_checkpoint import main as convert

    output = tmp_path / "teacher.safetensors"
    assert convert([str(state_path), "--out", str(output)]) == 0
    assert f"from {source}" in capsys.readouterr().out
    weights = safetensors.torch.load_file(str(output))
    assert all(torch.equal(weights[key], two["model"][key]) for key in two["model"])
    model = build_model(5)
    model.load_state_dict(weights, strict=True)


# ---------------------------------------------------------------------------------------------------------------
# In one process (no process group): the folder's rotation, the token lookup, refusals
# ---------------------------------------------------------------------------------------------------------------
def linear_role(seed: int, steps: int):
    """A role-like object over a plain Linear + AdamW after `steps` steps (DCP works on plain modules too)."""
    from types import SimpleNamespace

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW([{"params": module[0].parameters(), "lr": 1e-2},
                                   {"params": module[1].parameters(), "lr": 1e-3}], betas=(0.8, 0.9))
    for step in range(steps):
        module[0](torch.randn(5, 4)).square().mean().backward()  # module[1] never gets a gradient
        optimizer.step()
        optimizer.zero_grad()
    return SimpleNamespace(name="student", raw_module=module, optimizer=optimizer)


def save_pair(state_path: Path, role) -> dict:
    """What save_training_state does for a sharded role, in one process: shards, publish, the .pt last."""
    from predictor_training.runtime.checkpoint import keep_previous_state
    from predictor_training.runtime.fsdp import named_param_groups
    from predictor_training.runtime.io import atomic_write
    from predictor_training.runtime.sharded_checkpoint import publish_sharded_folder, save_sharded_roles

    entry = save_sharded_roles(state_path, [role])[role.name]
    keep_previous_state(state_path)
    publish_sharded_folder(state_path, {torch.load(state_path, weights_only=True)["roles"]["student"]["sharded"][
        "token"]} if state_path.is_file() else set())
    payload = {"roles": {"student": {"sharded": entry}},
               "param_groups": named_param_groups(role.raw_module, role.optimizer)}
    atomic_write(state_path, lambda tmp: torch.save(payload, tmp))
    return payload


def test_token_pairs_each_state_with_its_folder_through_rotations(tmp_path, one_thread):
    from predictor_training.runtime.sharded_checkpoint import (
        MissingShardedStateError,
        load_sharded_roles,
        sharded_folder_for,
    )

    state_path = tmp_path / "training_latest.pt"
    first = save_pair(state_path, linear_role(0, steps=1))
    second = save_pair(state_path, linear_role(1, steps=2))
    first, second = first["roles"]["student"], {**second["roles"]["student"], "param_groups": second["param_groups"]}
    assert first["sharded"]["token"] != second["sharded"]["token"]
    assert sharded_folder_for(state_path, second["sharded"]) == tmp_path / "training_latest.dcp"
    previous = torch.load(tmp_path / "training_prev.pt", weights_only=True)["roles"]["student"]
    assert previous["sharded"]["token"] == first["sharded"]["token"]
    assert sharded_folder_for(tmp_path / "training_prev.pt", previous["sharded"]) == tmp_path / "training_prev.dcp"
    assert second["sharded"]["optimizer_state_names"] == ["0.bias", "0.weight"]  # module 1 never had a gradient

    # A folder no state file names (a save killed after publishing it) is deleted by the next save, and the
    # previous state's folder is kept.
    from predictor_training.runtime.sharded_checkpoint import publish_sharded_folder, read_token, save_sharded_roles
    orphan = save_sharded_roles(state_path, [linear_role(2, steps=1)])["student"]["token"]
    publish_sharded_folder(state_path, {second["sharded"]["token"]})  # as rank 0 does, killed before the .pt
    assert read_token(tmp_path / "training_latest.dcp") == orphan
    assert read_token(tmp_path / "training_prev.dcp") == second["sharded"]["token"]
    assert sharded_folder_for(state_path, second["sharded"]) == tmp_path / "training_prev.dcp"
    third = save_pair(state_path, linear_role(3, steps=1))["roles"]["student"]
    assert read_token(tmp_path / "training_latest.dcp") == third["sharded"]["token"]
    assert read_token(tmp_path / "training_prev.dcp") == second["sharded"]["token"]  # not the orphan
    previous = torch.load(tmp_path / "training_prev.pt", weights_only=True)["roles"]["student"]
    assert previous["sharded"]["token"] == second["sharded"]["token"]
    save_pair(state_path, linear_role(1, steps=2))  # back to `second`'s weights for the load below
    second = {**torch.load(state_path, weights_only=True)["roles"]["student"], "param_groups": second["param_groups"]}
    previous = torch.load(tmp_path / "training_prev.pt", weights_only=True)["roles"]["student"]

    # Loading restores weights, moments and the saved hyper-parameters; no state is made up for module 1.
    saved = linear_role(1, steps=2)
    target = linear_role(7, steps=0)
    for group in target.optimizer.param_groups:
        group["lr"] = 0.5
    load_sharded_roles(tmp_path / "training_latest.dcp", [target],
                       {"student": {**second["sharded"], "param_groups": second["param_groups"]}})
    assert all(torch.equal(a, b) for a, b in zip(saved.raw_module.state_dict().values(),
                                                 target.raw_module.state_dict().values()))
    reference, loaded = saved.optimizer.state_dict(), target.optimizer.state_dict()
    assert loaded["param_groups"] == reference["param_groups"]
    assert sorted(loaded["state"]) == sorted(reference["state"]) == [0, 1]
    assert all(torch.equal(torch.as_tensor(loaded["state"][i][key]), torch.as_tensor(value))
               for i, state in reference["state"].items() for key, value in state.items())

    # A folder whose token is not the file's (a stale copy) is never read: refused, naming the fallback.
    (tmp_path / "training_latest.dcp" / "checkpoint_token").write_text("something else\n")
    with pytest.raises(MissingShardedStateError, match=r"token .* is in none of .*training_prev.pt"):
        sharded_folder_for(state_path, second["sharded"])
    # An incomplete folder (no .metadata, as a kill inside DCP's write leaves it) is not complete either.
    (tmp_path / "training_prev.dcp" / ".metadata").unlink()
    with pytest.raises(MissingShardedStateError):
        sharded_folder_for(tmp_path / "training_prev.pt", previous["sharded"])


def test_converter_refuses_bad_arguments(tmp_path, capsys):
    from tools.convert_sharded_checkpoint import main as convert

    with pytest.raises(SystemExit):
        convert([str(tmp_path / "missing.pt"), "--out", str(tmp_path / "x.safetensors")])
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "state.pt").write_bytes(b"")
    with pytest.raises(SystemExit):
        convert([str(tmp_path / "state.pt"), "--out", str(tmp_path / "x.bin")])
    assert "expected a path ending in .safetensors" in capsys.readouterr().err
