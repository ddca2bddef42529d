"""The shared training loop (predictor_training/runtime/loop.py): exact resume (1 process and
2-rank DDP), accumulation, NaN refusal, the console, inconsistent wiring, the replica check."""

import copy
import importlib.util
import json
import math
from functools import partial
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from predictor_training.runtime.checkpoint import CHECKPOINTS_KEY, RunState, read_training_state
from predictor_training.runtime.checkpoint_checks import NonFiniteError
from predictor_training.runtime.logger import MetricsLogger
from predictor_training.runtime.loop import replica_mismatches, role_fingerprints, train_loop
from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer, lr_multiplier
from predictor_training.runtime.roles import Role
from tests.helpers.toy_loop import META, SINGLE, TwoLayer, read_log, setup_loop
from tests.helpers.two_ranks import assert_finished, run_two_ranks


TOY_SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "ddp_toy_train.py"


def load_toy():
    spec = importlib.util.spec_from_file_location("ddp_toy_train", TOY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ loop, one process
def test_single_process_resume_matches_uninterrupted_and_drops_stale_records(tmp_path):
    toy = load_toy()
    full, cut = tmp_path / "full", tmp_path / "cut"
    toy.main(["--run_dir", str(full), "--stopped_run_dir", str(cut), "--stopped_at_step", "3"])
    assert read_training_state(cut / "training_latest.pt")["run_state"]["global_step"] == 3
    with open(cut / "train_log.jsonl", "a") as handle:  # records of an abandoned run past the checkpoint
        handle.write(json.dumps({"step": 4, "loss": 999.0}) + "\n")
    toy.main(["--run_dir", str(cut), "--resume", str(cut / "training_latest.pt")])

    full_log, cut_log = read_log(full), read_log(cut)
    assert [r["step"] for r in full_log] == [r["step"] for r in cut_log] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full_log, cut_log):
        for key in ("loss", "velocity_mse", "hidden_mse", "grad_norm", "lr/fusion", "lr/blocks", "epoch"):
            assert a[key] == b[key], (a["step"], key)
    assert json.loads((cut / "train_log.discarded.jsonl").read_text())["loss"] == 999.0
    # the logged LR is the schedule's value for the update (0-based index step - 1); blocks LR 0 during block warmup
    for record in full_log:
        index = record["step"] - 1
        assert record["lr/fusion"] == pytest.approx(1e-2 * lr_multiplier(index, warmup_steps=2, max_steps=6))
        assert record["lr/blocks"] == pytest.approx(1e-3 * lr_multiplier(index, warmup_steps=2, max_steps=6, delay_steps=1))
    assert full_log[0]["lr/blocks"] == 0.0 and len({r["loss"] for r in full_log}) == 6
    expected_keys = {"step", "loss", "velocity_mse", "hidden_mse", "grad_norm", "lr/fusion", "lr/blocks", "epoch",
                     "time/step_s", "time/data_s", "memory/cpu_peak_rss_gib"}
    assert set(full_log[0]) == expected_keys
    names = sorted(p.name for p in full.iterdir())
    assert names == ["predictor_step_00003.safetensors", "predictor_step_00006.safetensors", "train_config.json",
                     "train_log.jsonl", "training_latest.pt", "training_prev.pt"]
    final_full = safetensors.torch.load_file(str(full / "predictor_step_00006.safetensors"))
    final_cut = safetensors.torch.load_file(str(cut / "predictor_step_00006.safetensors"))
    assert all(torch.equal(final_full[k], final_cut[k]) for k in final_full)
    assert all(t.dtype == torch.bfloat16 for t in final_full.values())


def regression_step(batch, *, sync, due=frozenset({"predictor"}), model, scale=1.0):
    x, y = batch
    loss = F.mse_loss(model(x), y)
    (loss * scale).backward()
    return {"loss": loss.item()}


def run_loop(tmp_path, model, optimizer, schedule, batches, step_fn, max_steps, grad_clip=1.0, **kwargs):
    role = Role("predictor", model, optimizer, schedule, grad_clip=grad_clip)
    with MetricsLogger(tmp_path, SINGLE) as logger:
        return train_loop(roles=[role], batches=batches, step_fn=step_fn, run_dir=tmp_path, env=SINGLE,
                          run_state=kwargs.pop("run_state", RunState()), max_steps=max_steps, metrics_logger=logger,
                          config={"test": True}, meta=META, progress=False, **kwargs)


def test_keep_last_prunes_only_the_files_the_run_wrote_and_a_resume_keeps_the_same_record(tmp_path):
    """--keep_last deletes only the step files the run recorded (RunState.checkpoints), never a look-alike it did not
    write; the record a resumed run saves is the uninterrupted run's (a resume finishes the pruning of its state)."""
    def run(run_dir, max_steps, stop_at_step=None, run_state=None, resume=None):
        model, optimizer, schedule, _, batches = setup_loop(run_dir, max_steps=max_steps)
        role = Role("predictor", model, optimizer, schedule, grad_clip=1.0)
        if resume is not None:
            from predictor_training.runtime.checkpoint import load_training_state
            run_state = load_training_state(resume, roles=[role], expect=META)
            batches.load_state_dict(run_state.data)
        with MetricsLogger(run_dir, SINGLE) as logger:
            return train_loop(roles=[role], batches=batches, step_fn=partial(regression_step, model=model),
                              run_dir=run_dir, env=SINGLE, run_state=run_state or RunState(), max_steps=max_steps,
                              grad_accum=1, ckpt_every=1, keep_last=2, metrics_logger=logger, config={"test": True},
                              meta=META, progress=False, stop_at_step=stop_at_step)

    full, cut = tmp_path / "full", tmp_path / "cut"
    for run_dir in (full, cut):
        run_dir.mkdir()
        (run_dir / "predictor_step_00001.safetensors").write_bytes(b"another run's step 1")  # overwritten: its own
        (run_dir / "predictor_step_00099.safetensors").write_bytes(b"not written by this run")
    final = run(full, 5)
    assert final.checkpoints == ["predictor_step_00004.safetensors", "predictor_step_00005.safetensors"]
    assert sorted(path.name for path in full.glob("predictor_step_*")) == [
        "predictor_step_00004.safetensors", "predictor_step_00005.safetensors", "predictor_step_00099.safetensors"]
    run(cut, 5, stop_at_step=3)
    saved = read_training_state(cut / "training_latest.pt")[CHECKPOINTS_KEY]  # recorded before pruning
    assert saved == [f"predictor_step_0000{step}.safetensors" for step in (1, 2, 3)]
    resumed = run(cut, 5, resume=cut / "training_latest.pt")
    assert resumed.checkpoints == final.checkpoints
    assert (read_training_state(cut / "training_latest.pt")[CHECKPOINTS_KEY]
            == read_training_state(full / "training_latest.pt")[CHECKPOINTS_KEY])
    assert (cut / "predictor_step_00099.safetensors").read_bytes() == b"not written by this run"


def test_grad_accum_averages_micro_batch_gradients(tmp_path):
    model, optimizer, schedule, data, batches = setup_loop(tmp_path, max_steps=1)
    x, y = data.x[:4], data.y[:4]
    reference = TwoLayer()
    reference.load_state_dict(model.state_dict())
    (0.5 * (F.mse_loss(reference(x[:2]), y[:2]) + F.mse_loss(reference(x[2:]), y[2:]))).backward()
    captured = {}

    def capture(step, metrics):
        captured.update({name: p.grad.clone() for name, p in model.named_parameters()})
        captured["metrics"] = metrics

    state = run_loop(tmp_path, model, optimizer, schedule, batches, partial(regression_step, model=model), 1,
                     grad_accum=2, grad_clip=-1, extra_step_check=capture)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(captured[name], param.grad, rtol=1e-6, atol=1e-7)
    expected_loss = 0.5 * (F.mse_loss(reference(x[:2]), y[:2]).item() + F.mse_loss(reference(x[2:]), y[2:]).item())
    assert captured["metrics"]["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert (state.global_step, state.micro_step, state.data["position"]) == (1, 2, 2)


def test_console_shows_a_short_bar_every_step_and_the_full_row_every_log_every_steps(tmp_path, capsys):
    """train_log.jsonl gets every step whatever --log_every is; the console prints the full row only every
    log_every steps and at the last one, and the bar carries loss, LR and s/step (issue 39)."""
    model, optimizer, schedule, _, batches = setup_loop(tmp_path, max_steps=7)
    role = Role("predictor", model, optimizer, schedule, grad_clip=1.0)
    with MetricsLogger(tmp_path, SINGLE) as logger:
        train_loop(roles=[role], batches=batches, step_fn=partial(regression_step, model=model), run_dir=tmp_path,
                   env=SINGLE, run_state=RunState(), max_steps=7, grad_accum=1, ckpt_every=-1, log_every=3,
                   metrics_logger=logger, config={}, meta=META, progress=True)
    out, err = capsys.readouterr()
    assert [record["step"] for record in read_log(tmp_path)] == [1, 2, 3, 4, 5, 6, 7]
    rows = [line for line in out.splitlines() if line.startswith("step ")]
    assert [row.split(" | ")[0] for row in rows] == ["step 3/7", "step 6/7", "step 7/7"]
    assert all("grad_norm" in row and "lr/fusion" in row and "memory/cpu_peak_rss_gib" in row for row in rows)
    bar = err.replace("\r", "\n").splitlines()[-1]
    assert "7/7" in bar and "loss " in bar and " lr " in bar and "s/step" in bar, bar
    assert "grad_norm" not in err


@pytest.mark.parametrize("failure", ["loss", "grad_norm"])
def test_non_finite_step_is_refused_and_the_last_checkpoint_is_kept(tmp_path, failure):
    model, optimizer, schedule, _, batches = setup_loop(tmp_path, max_steps=4)
    calls = {"n": 0}

    def step_fn(batch, *, sync, due):
        calls["n"] += 1
        if calls["n"] < 3:
            return regression_step(batch, sync=sync, model=model)
        if failure == "loss":
            regression_step(batch, sync=sync, model=model)
            return {"loss": math.nan}
        return regression_step(batch, sync=sync, model=model, scale=math.inf)

    with pytest.raises(NonFiniteError, match=f"step 3: non-finite \\['{failure}'\\]"):
        run_loop(tmp_path, model, optimizer, schedule, batches, step_fn, 4, grad_accum=1, ckpt_every=2)
    saved = read_training_state(tmp_path / "training_latest.pt")
    assert saved["run_state"]["global_step"] == 2
    assert sorted(p.name for p in tmp_path.glob("predictor_step_*")) == ["predictor_step_00002.safetensors"]
    for name, param in model.named_parameters():  # step 3 never reached the optimizer
        assert torch.equal(param, saved["roles"]["predictor"]["model"][name]), name
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2]


def test_loop_refuses_inconsistent_wiring(tmp_path):
    model, optimizer, schedule, _, batches = setup_loop(tmp_path, max_steps=4)
    step_fn = partial(regression_step, model=model)
    with pytest.raises(ValueError, match="module must be raw_module"):
        with MetricsLogger(tmp_path, SINGLE) as logger:
            train_loop(roles=[Role("predictor", model, optimizer, schedule, module=TwoLayer())],
                       batches=batches, step_fn=step_fn, run_dir=tmp_path, env=SINGLE, run_state=RunState(),
                       max_steps=4, grad_accum=1, metrics_logger=logger, config={}, meta=META)
    with pytest.raises(ValueError, match="is at update 0 .* step 2 implies 2"):
        run_loop(tmp_path, model, optimizer, schedule, batches, step_fn, 4, grad_accum=1,
                 run_state=RunState(global_step=2, data=batches.state_dict()))
    for _ in range(2):
        schedule.step()
    with pytest.raises(ValueError, match="batches.load_state_dict"):
        run_loop(tmp_path, model, optimizer, schedule, batches, step_fn, 4, grad_accum=1,
                 run_state=RunState(global_step=2, data={"epoch": 0, "position": 2, "seed": 0}))
    with pytest.raises(ValueError, match="grad_accum=0"):
        run_loop(tmp_path, model, optimizer, schedule, batches, step_fn, 4, grad_accum=0)


# ------------------------------------------------------------------------------------------------ DDP
def torchrun(*args, timeout=120):
    result = run_two_ranks(TOY_SCRIPT, *args, timeout=timeout)
    assert_finished(result)
    return result


def test_replica_check_finds_the_rank_whose_weights_differ():
    """The checkpoint's cross-rank check compares per-parameter float64 sums and sums of squares: equal weights give
    equal fingerprints, one changed weight shows on its rank only; FSDP roles are not fingerprinted."""
    def role_of(module):
        optimizer = build_optimizer({"all": list(module.parameters())}, {"all": 0.1}, betas=(0.9, 0.99),
                                    weight_decay=0.0)
        return Role("predictor", module, optimizer, WarmupCosineSchedule(optimizer, warmup_steps=0, max_steps=4))

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    same = copy.deepcopy(model)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.weight[1, 2] += 1e-6
    per_rank = [role_fingerprints([role_of(m)]) for m in (model, same, changed)]
    assert per_rank[0] == per_rank[1]
    assert replica_mismatches(per_rank) == {"predictor": [2]}
    assert replica_mismatches(per_rank[:2]) == {}


def test_ddp_two_ranks_unsynchronised_role_is_refused_at_the_checkpoint(tmp_path):
    """A role whose gradients are never synchronised (no DDP, grad_sync none) trains a different copy on each rank:
    the first checkpoint stops the run on every rank, naming the role, and writes nothing."""
    run_dir = tmp_path / "run"
    result = run_two_ranks(TOY_SCRIPT, "--run_dir", run_dir, "--max_steps", "6", "--unsynchronised", timeout=120)
    assert result.returncode != 0
    assert "the replicas of a role differ from rank 0's: 'predictor' on rank(s) [1]" in result.stdout + result.stderr
    assert not (run_dir / "training_latest.pt").exists()


def test_ddp_two_ranks_resume_matches_uninterrupted(tmp_path):
    """torchrun x2 (gloo): 6 steps with grad_accum 2, vs. stopped at step 3 and resumed in a new launch."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    torchrun("--run_dir", str(full), "--max_steps", "6", "--grad_accum", "2",
             "--stopped_run_dir", str(cut), "--stopped_at_step", "3")
    assert read_training_state(cut / "training_latest.pt")["world_size"] == 2
    assert [r["step"] for r in read_log(cut)] == [1, 2, 3]
    torchrun("--run_dir", str(cut), "--max_steps", "6", "--grad_accum", "2",
             "--resume", str(cut / "training_latest.pt"))

    full_log, cut_log = read_log(full), read_log(cut)
    assert [r["step"] for r in full_log] == [r["step"] for r in cut_log] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full_log[3:], cut_log[3:]):
        for key in ("loss", "velocity_mse", "hidden_mse", "grad_norm", "lr/fusion", "lr/blocks", "epoch"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    assert full_log[-1]["epoch"] == 1  # 8 micro-batches per rank per epoch: steps 5-6 run in epoch 1
    full_state = read_training_state(full / "training_latest.pt")
    cut_state = read_training_state(cut / "training_latest.pt")
    assert full_state["run_state"] == cut_state["run_state"]
    assert all(torch.equal(full_state["roles"]["predictor"]["model"][k], cut_state["roles"]["predictor"]["model"][k]) for k in full_state["roles"]["predictor"]["model"])
