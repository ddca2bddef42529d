"""train_predictor_v4_rollout.py end to end: the acceptance checks of the
self-rollout recipe (docs/rollout.md § One step = one trajectory per GPU) that need the trainer or 2 ranks.

The DDP checks (distinct keys, all-reduce count, 1-/2-step smoke and resume) share ONE torchrun launch of this very
file on 2 gloo ranks (`__main__` at the bottom), made by the `ddp_report` fixture; the overfit run is one process.
The single-process checks of the trajectory are in tests/predictor/test_self_rollout.py."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.self_rollout import SelfRolloutSettings, SelfRolloutTrajectory, train_trajectory
from predictor_training.recipes.rollout import DuplicateTrajectoryError, RolloutStep
from tests.helpers.rollout_setup import (
    SOURCE_BLOCKS,
    make_inputs,
    make_teacher,
    make_text_kv,
    read_log,
    trainer_args,
    write_rollout_setup,
)


REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1)  # the recipe's loss weights
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def ddp_report(tmp_path_factory):
    """One torchrun launch (2 gloo ranks) of this file's `ddp_checks`; returns its report plus the run dirs."""
    root = tmp_path_factory.mktemp("rollout_ddp")
    paths = write_rollout_setup(root, num_latents=16, case_ids=["c000", "c001"], actions=(0, 3))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}  # the file imports tests.helpers
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).resolve()), str(root)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    report = json.loads((root / "report.json").read_text())
    report["root"] = root
    report["logs"] = {name: read_log(root / name) for name in ("smoke_1step", "full_2step")}
    return report


@pytest.fixture(scope="module")
def overfit_run(tmp_path_factory):
    """20 optimizer steps on ONE trajectory of 8 latents (chunk 0 + one trained chunk), single process."""
    import train_predictor_v4_rollout as trainer

    root = tmp_path_factory.mktemp("rollout_overfit")
    paths = write_rollout_setup(root, num_latents=8, case_ids=["c000"], actions=(2,))
    run_dir = root / "run"
    trainer.main(trainer_args(paths, run_dir, "--init_from", str(paths["init"]), "--max_steps", "20",
                              "--scheduler_warmup_steps", "2", "--block_warmup_steps", "2", "--fusion_lr", "3e-3",
                              "--blocks_lr", "3e-4", "--ckpt_every", "10"))
    return run_dir


# ---------------------------------------------------------------------------------------------------------------
# 1. Distinct (case_id, action_id) keys: the dataset, the sampler, and the per-step check on 2 ranks
# ---------------------------------------------------------------------------------------------------------------
def test_01_ranks_read_distinct_trajectory_keys_every_step(ddp_report):
    sampler = ddp_report["sampler_epoch_keys"]  # rank -> keys of one epoch, in order
    rank0, rank1 = (set(map(tuple, sampler[str(rank)])) for rank in (0, 1))
    assert len(rank0) == len(sampler["0"]) and len(rank1) == len(sampler["1"])  # no repeat within a rank
    assert not rank0 & rank1 and rank0 | rank1 == set(map(tuple, ddp_report["dataset_keys"]))
    assert len(ddp_report["dataset_keys"]) == len(set(map(tuple, ddp_report["dataset_keys"])))
    # the trainer's own per-step check: it passed on every step and refuses duplicates on both ranks alike
    for run in ("smoke_1step", "full_2step"):
        assert [record["trajectory/distinct_keys"] for record in ddp_report["logs"][run]] == [2.0] * len(
            ddp_report["logs"][run])
    assert ddp_report["duplicate_keys_error"] == {"0": True, "1": True}


# ---------------------------------------------------------------------------------------------------------------
# 9. All-reduce only on the last chunk (2 gloo ranks, counted with a DDP comm hook)
# ---------------------------------------------------------------------------------------------------------------
def test_09_only_the_last_chunk_all_reduces(ddp_report):
    for rank in ("0", "1"):
        counts = ddp_report["allreduce_per_chunk"][rank]  # comm-hook calls during chunks 1, 2, 3
        buckets = counts[-1]
        assert buckets >= 1 and counts[:-1] == [0, 0], counts
        assert ddp_report["allreduce_total"][rank] == buckets  # one round per optimizer step, nothing else
        assert ddp_report["allreduce_total_without_sync"][rank] == 0  # an accumulating trajectory never syncs
    # the single all-reduce gives every rank the mean of the two ranks' full-trajectory gradients
    assert ddp_report["grads_equal_across_ranks"] is True
    assert ddp_report["max_error_vs_mean_of_local_grads"] < 1e-6
    assert ddp_report["local_grads_differ_between_ranks"] is True


# ---------------------------------------------------------------------------------------------------------------
# 11. Smoke: 1-step and 2-step DDP runs, resume = uninterrupted; then a 20-step overfit whose loss falls
# ---------------------------------------------------------------------------------------------------------------
def test_11a_ddp_smoke_one_and_two_steps_and_resume(ddp_report):
    from predictor_training.runtime.checkpoint import read_training_state
    from predictor_training.runtime.inference_weights import read_inference_metadata

    root = ddp_report["root"]
    smoke, full, cut = root / "smoke_1step", root / "full_2step", root / "cut_resumed"
    assert [record["step"] for record in ddp_report["logs"]["smoke_1step"]] == [1]
    assert [record["step"] for record in read_log(full)] == [1, 2] == [record["step"] for record in read_log(cut)]
    states = {name: read_training_state(path / "training_latest.pt") for name, path in
              (("smoke", smoke), ("full", full), ("cut", cut))}
    assert states["smoke"]["run_state"]["global_step"] == 1 and states["full"]["run_state"]["global_step"] == 2
    assert states["full"]["world_size"] == 2
    assert states["full"]["meta"] == {"variant": "v4", "source_blocks": list(SOURCE_BLOCKS), "precision": "fp32",
                                      "recipe": "rollout_fppp"}
    # the 4 trajectories make 2 steps per epoch on 2 ranks: the data position is saved with the step
    assert states["full"]["run_state"]["data"]["position"] == 2
    assert states["full"]["run_state"] == states["cut"]["run_state"]
    for name, tensor in states["full"]["roles"]["predictor"]["model"].items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, states["cut"]["roles"]["predictor"]["model"][name]), name
    smoke_model = states["smoke"]["roles"]["predictor"]["model"]
    full_model = states["full"]["roles"]["predictor"]["model"]
    assert not all(torch.equal(tensor, smoke_model[name]) for name, tensor in full_model.items())
    full_step2, cut_step2 = read_log(full)[1], read_log(cut)[1]
    for key in ("loss", "step1/loss", "step2/loss", "step3/loss", "grad_norm", "latent_grad_l1_min"):
        assert full_step2[key] == cut_step2[key], key
    assert read_inference_metadata(full / "predictor_step_00002.safetensors")["step"] == 2
    assert ddp_report["resume_refusals"] == {"bf16_master": True, "other_source_blocks": True}


def test_11b_overfit_20_steps_on_one_trajectory_lowers_the_loss(overfit_run):
    log = read_log(overfit_run)
    assert [record["step"] for record in log] == list(range(1, 21))
    first, last = log[0]["loss"], sum(record["loss"] for record in log[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    assert all(record["latent_grad_l1_min"] > 0 for record in log)
    assert sorted(path.name for path in overfit_run.glob("predictor_step_*.safetensors")) == [
        "predictor_step_00010.safetensors", "predictor_step_00020.safetensors"]


# ---------------------------------------------------------------------------------------------------------------
# 12. No NaN/Inf, every step's loss falls, peak memory in the log
# ---------------------------------------------------------------------------------------------------------------
def test_12_finite_metrics_falling_step_losses_and_peak_memory_logged(overfit_run, ddp_report):
    logs = [read_log(overfit_run), *ddp_report["logs"].values()]
    for log in logs:
        for record in log:
            memory = [key for key in record if key.startswith("memory/")]
            assert memory and all(record[key] > 0 for key in memory), record
            numbers = {key: value for key, value in record.items() if isinstance(value, (int, float))}
            assert all(math.isfinite(value) for value in numbers.values()), record
            for k in (1, 2, 3):
                assert f"step{k}/hidden_mse" in record and f"step{k}/velocity_mse" in record
    overfit = logs[0]
    for k in (1, 2, 3):
        first, last = overfit[0][f"step{k}/loss"], sum(r[f"step{k}/loss"] for r in overfit[-3:]) / 3
        assert last < first, (k, first, last)


def test_resume_refuses_a_bf16_master_state(tmp_path):
    from predictor_training.runtime.checkpoint import check_fp32_training_state

    def state(dtype):
        return {"roles": {"predictor": {
            "model": {"fusion.proj.weight": torch.zeros(2, 2)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 2, dtype=dtype),
                                        "exp_avg_sq": torch.zeros(2, 2, dtype=dtype)}}, "param_groups": []}}}}

    check_fp32_training_state(state(torch.float32), tmp_path / "fp32.pt")
    with pytest.raises(ValueError, match="exp_avg is torch.bfloat16"):
        check_fp32_training_state(state(torch.bfloat16), tmp_path / "bf16.pt")


# ---------------------------------------------------------------------------------------------------------------
# The torchrun worker (2 gloo ranks): python -m torch.distributed.run --nproc_per_node 2 THIS_FILE ROOT
# ---------------------------------------------------------------------------------------------------------------
def ddp_checks(root: Path) -> None:
    """Runs every DDP check in one process group and writes ROOT/report.json (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import train_predictor_v4_rollout as trainer
    from predictor_training.runtime.checkpoint import load_model_weights
    from predictor_training.runtime.distributed import all_gather_objects, init_distributed, wrap_ddp
    from predictor_training.data.trajectory_dataset import TrajectoryTableDataset

    torch.set_num_threads(1)
    env = init_distributed("gloo")
    paths = {"teacher": root / "teacher", "dataset": root / "dataset", "table": root / "samples" / "train.jsonl",
             "init": root / "init" / "predictor_step_00100.safetensors"}
    report: dict = {}

    # 1. Keys: the table, one epoch of each rank's sampler, and the step check refusing a shared key.
    dataset = TrajectoryTableDataset(paths["table"], dataset_root=paths["dataset"], num_latents=16)
    batches = one_item_per_rank_batches(dataset, env, seed=0, num_workers=0)
    epoch_keys = [list(next(batches)["key"]) for _ in range(batches.batches_per_epoch())]
    report["dataset_keys"] = [list(key) for key in dataset.keys()]
    report["sampler_epoch_keys"] = {str(rank): keys for rank, keys in enumerate(all_gather_objects(epoch_keys))}
    shared_item = dataset[0]  # the same trajectory on both ranks
    step = RolloutStep(model=None, teacher=None, dataset=dataset, rollout_config=None, settings=None,
                              env=env)
    try:
        step(shared_item, sync=True, due=frozenset({"predictor"}))
        refused = False
    except DuplicateTrajectoryError:
        refused = True
    report["duplicate_keys_error"] = {str(rank): flag for rank, flag in enumerate(all_gather_objects(refused))}

    # 2. All-reduce count per chunk, with the DDP-wrapped Predictor on a different trajectory per rank.
    teacher = make_teacher()
    text_kv = make_text_kv(teacher)
    predictor = build_predictor(teacher, "v4", SOURCE_BLOCKS)
    load_model_weights(paths["init"], predictor)
    model = wrap_ddp(predictor, env)
    counter = {"calls": 0}

    def counting_allreduce(state, bucket):
        state["calls"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(counter, counting_allreduce)
    inputs = make_inputs(seed=5 + env.rank)

    def run(sync: bool) -> list[int]:
        """The comm-hook count before each trained chunk's backward (the chunk hook) and at the end."""
        trajectory = SelfRolloutTrajectory(teacher, model, text_kv, inputs, settings=SETTINGS)
        marks = []
        train_trajectory(trajectory, sync=sync, chunk_hook=lambda graph: marks.append(counter["calls"]))
        return marks + [counter["calls"]]

    marks = run(sync=True)
    increments = [after - before for before, after in zip(marks, marks[1:])]  # during chunks 1, 2, 3
    report["allreduce_per_chunk"] = {str(k): v for k, v in enumerate(all_gather_objects(increments))}
    report["allreduce_total"] = {str(k): v for k, v in enumerate(all_gather_objects(counter["calls"]))}
    synced = {name: param.grad.clone() for name, param in predictor.named_parameters() if param.requires_grad}
    model.zero_grad(set_to_none=True)
    counter["calls"] = 0
    run(sync=False)  # accumulating: this trajectory's gradients stay local
    report["allreduce_total_without_sync"] = {str(k): v for k, v in enumerate(all_gather_objects(counter["calls"]))}
    local = {name: param.grad.clone() for name, param in predictor.named_parameters() if param.requires_grad}
    local_all = all_gather_objects(local)
    synced_all = all_gather_objects(synced)
    mean_local = {name: (local_all[0][name] + local_all[1][name]) / 2 for name in local}
    report["grads_equal_across_ranks"] = all(torch.equal(synced_all[0][n], synced_all[1][n]) for n in synced)
    report["max_error_vs_mean_of_local_grads"] = max(float((synced[n] - mean_local[n]).abs().max()) for n in synced)
    report["local_grads_differ_between_ranks"] = any(not torch.equal(local_all[0][n], local_all[1][n]) for n in local)
    del model

    # 3. The trainer itself: a 1-step smoke run, a 2-step run, and a 1-step run resumed to step 2, all under this
    #    process group (each run start joins it and leaves it open: the group is made once).
    common = ["--init_from", str(paths["init"]), "--max_steps", "2", "--scheduler_warmup_steps", "1",
              "--block_warmup_steps", "1", "--fusion_lr", "1e-3", "--blocks_lr", "1e-4", "--ckpt_every", "1"]
    trainer.main(trainer_args(paths, root / "smoke_1step", *common, "--stop_at_step", "1"))
    trainer.main(trainer_args(paths, root / "full_2step", *common))
    trainer.main(trainer_args(paths, root / "cut_resumed", *common, "--stop_at_step", "1"))
    resume = ["--max_steps", "2", "--scheduler_warmup_steps", "1", "--block_warmup_steps", "1", "--fusion_lr", "1e-3",
              "--blocks_lr", "1e-4", "--ckpt_every", "1", "--resume", str(root / "cut_resumed" / "training_latest.pt")]
    trainer.main(trainer_args(paths, root / "cut_resumed", *resume))
    # a resume must refuse other source blocks, and (before loading anything) a BF16-master state
    refusals = {}

    def refusal(argv) -> str | None:
        """The one error line (exit code 2) of a refused launch, or None when it ran."""
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                trainer.main(argv)
        except SystemExit as exited:
            lines = stderr.getvalue().splitlines()
            return lines[-1] if exited.code == 2 and len(lines) == 1 else f"exit {exited.code}: {lines}"
        return None

    line = refusal(trainer_args(paths, root / "other_blocks", *resume, "--source_blocks", "2,0"))
    refusals["other_source_blocks"] = (line is not None and "source_blocks: saved [0, 2], requested [2, 0]" in line
                                       and not (root / "other_blocks").exists())
    if env.is_main:
        payload = torch.load(root / "cut_resumed" / "training_latest.pt", weights_only=True)
        for state in payload["roles"]["predictor"]["optimizer"]["state"].values():
            state["exp_avg"] = state["exp_avg"].bfloat16()
        torch.save(payload, root / "bf16_master.pt")
    dist.barrier()
    line = refusal(trainer_args(paths, root / "bf16_resume", *resume[:-1], str(root / "bf16_master.pt")))
    refusals["bf16_master"] = line is not None and "not an FP32-master training state" in line
    report["resume_refusals"] = refusals
    if env.is_main:
        (root / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ddp_checks(Path(sys.argv[1]))
