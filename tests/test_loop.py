"""The shared training loop: exact resume (1 process and 2-rank DDP), accumulation, NaN refusal, data, logging."""

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
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from predictor_training.runtime.roles import Role
from tests.two_ranks import assert_finished, run_two_ranks
from predictor_training.runtime.checkpoint import NonFiniteError, RunState, read_training_state, save_training_state
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.logger import MetricsLogger, resolve_swanlab_mode
from predictor_training.data.batches import ResumableBatches
from predictor_training.runtime.loop import replica_mismatches, role_fingerprints, train_loop
from predictor_training.runtime.optim import TwoGroupLRSchedule, WarmupCosineSchedule, build_optimizer, lr_multiplier

REPO_ROOT = Path(__file__).resolve().parents[1]
TOY_SCRIPT = Path(__file__).with_name("ddp_toy_train.py")
SINGLE = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
META = {"variant": "toy", "source_blocks": [0, 1], "precision": "fp32master"}


def load_toy():
    spec = importlib.util.spec_from_file_location("ddp_toy_train", TOY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------ data
class IndexDataset(torch.utils.data.Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index


def collate_indices(items):
    return list(items)


class ToyBucketBatchSampler:
    """Like a bucketing sampler: per epoch, shuffle with (seed, epoch), then batch within 'length' buckets."""

    def __init__(self, size, batch_size, seed):
        self.size, self.batch_size, self.seed, self.epoch = size, batch_size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        buckets = {0: [i for i in order if i % 2 == 0], 1: [i for i in order if i % 2 == 1]}
        for bucket in buckets.values():
            for start in range(0, len(bucket), self.batch_size):
                yield bucket[start : start + self.batch_size]


SAMPLERS = {
    "distributed": lambda: (DistributedSampler(IndexDataset(14), num_replicas=2, rank=1, shuffle=True, seed=3), 2),
    "random": lambda: (RandomSampler(IndexDataset(10), generator=torch.Generator()), 3),
    "sequential": lambda: (SequentialSampler(IndexDataset(7)), 2),
    "bucket_batch_sampler": lambda: (ToyBucketBatchSampler(9, 2, seed=5), None),
    "torch_batch_sampler": lambda: (BatchSampler(RandomSampler(IndexDataset(8), generator=torch.Generator()), 3, False), None),
}


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_resumable_batches_continue_with_the_exact_next_batch(kind):
    def make():
        sampler, batch_size = SAMPLERS[kind]()
        return ResumableBatches(sampler, IndexDataset(20), collate_indices, batch_size=batch_size, seed=11)

    reference = make()
    per_epoch = reference.batches_per_epoch()
    stream = [next(reference) for _ in range(3 * per_epoch + 1)]
    assert reference.epoch == 3 and reference.position == 1
    if kind != "sequential":  # set_epoch / reseeding really changes the order between epochs
        assert stream[:per_epoch] != stream[per_epoch : 2 * per_epoch]
    for cut in (1, per_epoch, per_epoch + 2):
        first = make()
        head = [next(first) for _ in range(cut)]
        resumed = make()
        resumed.load_state_dict(first.state_dict())
        tail = [next(resumed) for _ in range(len(stream) - cut)]
        assert head + tail == stream, (kind, cut)


def test_resumable_batches_refuse_unreplayable_samplers_and_bad_state():
    with pytest.raises(ValueError, match="generator"):
        ResumableBatches(RandomSampler(IndexDataset(4)), IndexDataset(4), collate_indices, batch_size=2).batches_per_epoch()
    with pytest.raises(TypeError, match="cannot replay"):
        ResumableBatches([0, 1, 2], IndexDataset(4), collate_indices, batch_size=2).batches_per_epoch()
    batches = ResumableBatches(SequentialSampler(IndexDataset(4)), IndexDataset(4), collate_indices, batch_size=2, seed=1)
    with pytest.raises(ValueError, match="seed"):
        batches.load_state_dict({"epoch": 0, "position": 1, "seed": 2})
    with pytest.raises(ValueError, match="past"):
        batches.load_state_dict({"epoch": 0, "position": 3, "seed": 1})


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


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fusion = nn.Linear(3, 4)
        self.blocks = nn.Linear(4, 1)

    def forward(self, x):
        return self.blocks(torch.tanh(self.fusion(x)))


class RegressionData(torch.utils.data.Dataset):
    def __init__(self, size=8):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(size, 3, generator=generator), torch.randn(size, 1, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def setup_loop(tmp_path, max_steps, batch_size=2):
    torch.manual_seed(0)
    model = TwoLayer()
    optimizer = build_optimizer({"fusion": list(model.fusion.parameters()), "blocks": list(model.blocks.parameters())},
                                {"fusion": 1e-2, "blocks": 1e-2}, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = TwoGroupLRSchedule(optimizer, warmup_steps=0, max_steps=max_steps, block_warmup_steps=None)
    data = RegressionData()
    batches = ResumableBatches(SequentialSampler(data), data, torch.utils.data.default_collate, batch_size=batch_size)
    return model, optimizer, schedule, data, batches


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


# ------------------------------------------------------------------------------------------------ logging
def test_metrics_logger_is_a_no_op_off_rank_0(tmp_path):
    rank1 = DistEnv(rank=1, local_rank=1, world_size=2, device=torch.device("cpu"), backend="gloo", is_main=False)
    with MetricsLogger(tmp_path / "run", rank1, tracker="swanlab", project="p", experiment="e") as logger:
        logger.log(1, {"loss": 1.0})
        assert logger.discard_after(0) == 0
    assert not (tmp_path / "run").exists()


def test_swanlab_mode_resolution(monkeypatch):
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    assert resolve_swanlab_mode(None) == "online"  # "cloud" is SwanLab's "online"
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    assert resolve_swanlab_mode(None) == "offline"
    assert resolve_swanlab_mode("disabled") == "disabled"  # the flag wins over the environment
    monkeypatch.setenv("SWANLAB_MODE", "cloudy")
    with pytest.raises(ValueError, match="SWANLAB_MODE"):
        resolve_swanlab_mode(None)


def test_swanlab_api_key_never_reaches_a_file(tmp_path, monkeypatch):
    fake_key = "sk-FAKE-test-key-8f3a2b1c"
    monkeypatch.setenv("SWANLAB_API_KEY", fake_key)
    monkeypatch.delenv("SWANLAB_MODE", raising=False)
    run_dir = tmp_path / "run"
    config = {"lr": 1e-4, "swanlab_api_key": fake_key, "nested": {"token": fake_key, "note": f"key={fake_key}"}}
    with MetricsLogger(run_dir, SINGLE, tracker="swanlab", project="predictor-test", experiment="leak",
                       config=config, swanlab_mode="offline") as logger:
        for step in range(1, 4):
            logger.log(step, {"loss": 1.0 / step})
    model, optimizer, schedule, _, _ = setup_loop(tmp_path, max_steps=2)
    save_training_state(run_dir / "training_latest.pt", roles=[Role("predictor", model, optimizer, schedule)],
                        run_state=RunState(), config=config, meta=META)

    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any("swanlab" in path.parts for path in files), "swanlab wrote nothing; the check would be vacuous"
    assert len(read_log(run_dir)) == 3
    leaking = [path for path in files if fake_key.encode() in path.read_bytes()]
    assert leaking == []
    saved_config = read_training_state(run_dir / "training_latest.pt")["config"]
    assert saved_config == {"lr": 1e-4, "nested": {"note": "<redacted>"}}


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
