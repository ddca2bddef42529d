"""FSDP2 full-parameter training (predictor_training/runtime/fsdp.py).

1. In-process (no process group): `is_fsdp`, the refusal to shard without one, and the full-state-dict helpers on a
   plain Teacher (name-keyed optimizer state, plain integer-id optimizer state accepted, checks).
2. Two gloo ranks (tests/helpers/fsdp_worker.py): a tiny Teacher trained for 4 AdamW steps (2 micro-batches each,
   the first without gradient reduce-scatter) through `chunk_step`, against 2 steps, save, a new launch that builds
   the model on the meta device, loads (rank 0 broadcasts) and resumes to step 4: losses, grad norms, weights and
   optimizer state are bitwise equal. The 2-rank checkpoint is also loaded at world size 1. Along the way:
   `clip_grad_norm_` on DTensor gradients, activation checkpointing under FSDP, resharding after a no-grad forward.
3. Two gloo ranks, an FSDP role in the shared `train_loop` (tests/helpers/fsdp_worker.py `loop`): 4 steps
   uninterrupted against stopped at step 2 and resumed with `load_training_state` (into a model of another init):
   the same logged losses, grad norms and LRs, bitwise the same final weights and (name-keyed) optimizer state,
   saved sharded (DCP, training_latest.dcp/; more in tests/runtime/test_sharded_checkpoint.py), and inference
   safetensors of full shapes written from the model gathered in BF16. Refused, on every rank alike: grad_sync "ddp"
   / "all_reduce" and an EMA on an FSDP role, a NaN in one rank's shard only (no rank left waiting), inference
   weights from the shards, and the FSDP checkpoint into an unsharded role.

The ranks of 2 and 3 are launched by tests/helpers/fsdp_worker.py's fork server (`Launcher`: torchrun's environment
and teardown; each launch's ranks are forked from one process that imported torch once, so they start as fresh
workers without three interpreter start-ups per launch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from predictor_training.runtime.checkpoint import read_training_state, role_state
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.fsdp import full_state_dicts, gradient_sync, is_fsdp, load_full_state_dicts, shard_model
from predictor_training.runtime.sharded_checkpoint import read_sharded_state, sharded_folder_for
from predictor_training.teacher import StateDictMismatchError
from tests.helpers.fsdp_worker import (
    CUT_AT,
    LOOP_CUT,
    LOOP_ROLE,
    LOOP_STEPS,
    STEPS,
    Launcher,
    build_model,
    make_batch,
    micro_batch_loss,
)


REPO_ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------------------------
# 1. In-process
# ---------------------------------------------------------------------------------------------------------------
def trained_plain_model(seed: int = 0):
    """A plain tiny Teacher and its AdamW after one step through chunk_step (text-stream weights get no grads)."""
    model = build_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro_batch_loss(model, make_batch(model, 1, 0, 0)).backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def test_plain_model_is_not_fsdp_and_sharding_needs_a_process_group(one_thread):
    model = build_model(0)
    assert not is_fsdp(model)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
    with pytest.raises(RuntimeError, match="FSDP needs a process group"):
        shard_model(model, env)
    with gradient_sync(model, enabled=False):  # a plain module: nothing to switch
        pass


def test_full_state_dicts_of_a_plain_model_load_back_in_both_optimizer_formats(one_thread):
    model, optimizer = trained_plain_model(0)
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    assert list(model_state) == list(model.state_dict())
    names = [name for name, _ in model.named_parameters()]
    assert optimizer_state["param_groups"][0]["params"] == names
    with_state = sorted(optimizer_state["state"])
    assert "double_blocks.0.img_attn_q.weight" in with_state and "txt_in.input_embedder.weight" not in with_state

    for saved in (optimizer_state, optimizer.state_dict()):  # name-keyed, and torch's integer ids
        other = build_model(7)
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=5e-4)
        load_full_state_dicts(other, other_optimizer, model_state, saved)
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
        reference = optimizer.state_dict()
        loaded = other_optimizer.state_dict()
        assert loaded["param_groups"] == reference["param_groups"]  # lr back to the saved 1e-3, betas a tuple
        assert sorted(loaded["state"]) == sorted(reference["state"])  # no state made up for unused weights
        assert all(torch.equal(loaded["state"][i][key], value)
                   for i, state in reference["state"].items() for key, value in state.items())

    fresh = build_model(3)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    _, empty = full_state_dicts(fresh, fresh_optimizer)
    assert empty["state"] == {} and empty["param_groups"][0]["params"] == names
    assert not fresh_optimizer.state  # DCP would have taken a zero-gradient step to create state


def test_loading_refuses_mismatched_keys_shapes_and_parameter_groups(one_thread):
    model, optimizer = trained_plain_model(0)
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    target = build_model(1)
    target_optimizer = torch.optim.AdamW(target.parameters(), lr=1e-3)
    broken = dict(model_state)
    broken["final_layer.linear.weight"] = torch.zeros(3, 3)
    broken.pop("img_in.proj.bias")
    with pytest.raises(StateDictMismatchError, match=r"(?s)img_in.proj.bias.*final_layer.linear.weight"):
        load_full_state_dicts(target, target_optimizer, broken, optimizer_state)

    blocks_only = torch.optim.AdamW(target.double_blocks.parameters(), lr=1e-3)
    with pytest.raises(StateDictMismatchError, match=r"0 not saved \[\], \d+ not in this optimizer \['action_in"):
        load_full_state_dicts(target, blocks_only, model_state, optimizer_state)
    with pytest.raises(StateDictMismatchError, match="parameter groups"):
        load_full_state_dicts(target, blocks_only, model_state, optimizer.state_dict())
    foreign = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    with pytest.raises(ValueError, match="build the optimizer after shard_model"):
        full_state_dicts(target, foreign)


# ---------------------------------------------------------------------------------------------------------------
# 2. Two gloo ranks
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launcher():
    launcher = Launcher(REPO_ROOT)
    yield launcher
    launcher.close()


def launch(launcher: Launcher, phase: str, out: Path, nproc: int) -> None:
    result = launcher.launch(phase, out, nproc=nproc)
    assert result["returncode"] == 0, f"{phase} {result['codes']}:\n{result['output']}"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_state(first: dict, second: dict) -> None:
    """Model and optimizer states of two `save_training_state` files are bitwise equal."""
    assert list(first["model"]) == list(second["model"])
    assert all(torch.equal(first["model"][key], second["model"][key]) for key in first["model"])
    first_state, second_state = first["optimizer"]["state"], second["optimizer"]["state"]
    assert sorted(first_state) == sorted(second_state)
    assert all(torch.equal(first_state[name][key], second_state[name][key])
               for name in first_state for key in first_state[name])
    assert first["optimizer"]["param_groups"] == second["optimizer"]["param_groups"]


def test_two_rank_gloo_fsdp_resume_matches_uninterrupted_run(launcher, tmp_path):
    launch(launcher, "fresh", tmp_path, nproc=2)
    launch(launcher, "resume", tmp_path, nproc=2)
    launch(launcher, "reload", tmp_path, nproc=1)
    fresh, resumed, reloaded = load(tmp_path / "fresh.pt"), load(tmp_path / "resume.pt"), load(tmp_path / "reload.pt")

    # 1. 4 steps == 2 steps + save + new launch + resume to 4: every loss and grad norm, then weights and AdamW.
    for rank in range(2):
        full, cut_then_resumed = fresh["full"][rank], fresh["cut"][rank] + resumed["resumed"][rank]
        assert [record["step"] for record in cut_then_resumed] == list(range(1, STEPS + 1))
        assert full == cut_then_resumed
    assert fresh["full"][0][-1]["losses"] != fresh["full"][1][-1]["losses"]  # the ranks saw different data
    assert len({record["grad_norm"] for record in fresh["full"][0]}) == STEPS
    full_final, resumed_final = load(tmp_path / "full_final.pt"), load(tmp_path / "resumed_final.pt")
    assert_same_state(full_final, resumed_final)
    saved = load(tmp_path / "training_latest.pt")
    assert (saved["step"], saved["world_size"]) == (CUT_AT, 2)
    assert not all(torch.equal(saved["model"][key], full_final["model"][key]) for key in saved["model"])
    assert "txt_in.input_embedder.weight" not in saved["optimizer"]["state"]  # never had a gradient

    # 2. The 2-rank checkpoint at world size 1: read back unchanged, and rank 0's next losses are the 2-rank run's.
    assert reloaded["world_size"] == 1
    assert_same_state(saved, load(tmp_path / "reloaded.pt"))
    assert reloaded["records"][0][0]["losses"] == fresh["full"][0][CUT_AT]["losses"]

    # 3. clip_grad_norm_ on DTensor grads is the global norm and scales the full gradients.
    clip = fresh["checks"]["clip"]
    assert clip["norm_type"] == "DTensor"
    assert clip["norm"] == pytest.approx(clip["reference"], rel=1e-6) and clip["norm"] > 0.5  # 0.5: max norm
    assert clip["max_clip_error"] < 1e-7

    # 4. Activation checkpointing under FSDP: bitwise the same loss and gradients. 5. No-grad forwards reshard.
    assert fresh["checks"]["sharded_after_no_grad_forward"] is True
    assert fresh["checks"]["checkpointing"] == {"loss_equal": True, "same_keys": True, "grads_equal": True,
                                                "num_grads": 50}


# ---------------------------------------------------------------------------------------------------------------
# 3. An FSDP role in the shared train_loop, two gloo ranks
# ---------------------------------------------------------------------------------------------------------------
def read_log(run_dir: Path) -> list[dict]:
    """The loop's records without the timing / memory keys."""
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return [{key: value for key, value in record.items() if not key.startswith(("time/", "memory/"))}
            for record in records]


def sharded_role(payload: dict, path: Path) -> dict:
    """The FSDP role's entry with its model and name-keyed optimizer state read (full tensors) from its folder."""
    entry = role_state(payload, LOOP_ROLE, path)
    saved = read_sharded_state(sharded_folder_for(path, entry["sharded"]), LOOP_ROLE)
    return {**entry, "optimizer": {"state": saved["optimizer"]["state"],
                                   "param_groups": entry["optimizer"]["param_groups"]}}


def test_fsdp_role_in_train_loop_resumes_bit_exact_and_writes_full_inference_weights(launcher, tmp_path):
    launch(launcher, "loop", tmp_path, nproc=2)
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"

    # 1. Stopped at LOOP_CUT + resumed == uninterrupted: every logged value, then weights and AdamW bit for bit.
    full_log, cut_log = read_log(full_dir), read_log(cut_dir)
    assert [record["step"] for record in full_log] == list(range(1, LOOP_STEPS + 1))
    assert full_log == cut_log
    assert len({record["loss"] for record in full_log}) == LOOP_STEPS and all("grad_norm" in r for r in full_log)
    full, resumed = read_training_state(full_dir / "training_latest.pt"), read_training_state(
        cut_dir / "training_latest.pt")
    assert full["world_size"] == 2 and full["run_state"] == resumed["run_state"]
    assert full["run_state"]["global_step"] == LOOP_STEPS
    assert full["roles"][LOOP_ROLE]["model"] == {}  # sharded: the model and AdamW state are in the DCP folder
    full_role, resumed_role = (sharded_role(full, full_dir / "training_latest.pt"),
                               sharded_role(resumed, cut_dir / "training_latest.pt"))
    assert (full_role["updates"], full_role["ema"]) == (LOOP_STEPS, None)
    assert full_role["lr_schedule"] == resumed_role["lr_schedule"]
    assert_same_state(full_role, resumed_role)
    optimizer_state = full_role["optimizer"]
    assert [group["name"] for group in optimizer_state["param_groups"]] == ["fusion", "blocks"]
    assert "double_blocks.0.img_attn_q.weight" in optimizer_state["state"]  # name-keyed
    assert "txt_in.input_embedder.weight" not in optimizer_state["state"]  # never had a gradient

    # 2. The saved model is the full, plain state dict (not this rank's shards), and it trained.
    initial = build_model(0).state_dict()
    model_state = full_role["model"]
    assert list(model_state) == list(initial)
    assert all(model_state[key].shape == initial[key].shape and model_state[key].dtype == torch.float32
               for key in initial)
    assert not torch.equal(model_state["double_blocks.0.img_attn_q.weight"],
                           initial["double_blocks.0.img_attn_q.weight"])

    # 3. Inference weights: full shapes, BF16 of the gathered state; the resumed run's equal the uninterrupted's.
    assert sorted(path.name for path in cut_dir.glob("*.safetensors")) == [
        f"{LOOP_ROLE}_step_{LOOP_CUT:05d}.safetensors", f"{LOOP_ROLE}_step_{LOOP_STEPS:05d}.safetensors"]
    name = f"{LOOP_ROLE}_step_{LOOP_STEPS:05d}.safetensors"
    weights = safetensors.torch.load_file(str(full_dir / name))
    assert sorted(weights) == sorted(initial)
    assert all(weights[key].shape == initial[key].shape for key in initial)
    assert all(torch.equal(weights[key], model_state[key].to(torch.bfloat16)) for key in initial)
    resumed_weights = safetensors.torch.load_file(str(cut_dir / name))
    assert all(torch.equal(weights[key], resumed_weights[key]) for key in initial)

    # 4. Refusals, raised on both ranks (a rank that went on would have hung the launch).
    checks = load(tmp_path / "loop.pt")
    for grad_sync in ("ddp", "all_reduce"):
        assert checks[f"grad_sync_{grad_sync}"] == (
            f"ValueError: train_loop: role '{LOOP_ROLE}': raw_module is FSDP-sharded, which reduce-scatters the "
            f"gradients in backward; grad_sync must be 'none', not '{grad_sync}'")
    assert checks["ema"].startswith(f"ValueError: role '{LOOP_ROLE}': an EMA of an FSDP-sharded module")
    assert checks["inference_from_shards"].startswith("ValueError: save_inference_weights(")
    assert "FSDP-sharded" in checks["inference_from_shards"]
    assert checks["fsdp_state_into_plain_role"].startswith("CheckpointMismatchError: ")
    assert "was saved FSDP-sharded" in checks["fsdp_state_into_plain_role"]
    nan_errors = checks["nan_in_one_shard"]
    assert len(nan_errors) == 2 and nan_errors[0] == nan_errors[1]
    assert nan_errors[0].startswith("NonFiniteError: ")
    assert f"role '{LOOP_ROLE}' rank 1: 1 tensors, e.g. ['{checks['nan_name']}']" in nan_errors[0]
    assert checks["nan_written"] is False
