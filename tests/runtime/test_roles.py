"""Several trainable roles in the one loop (predictor_training/runtime/roles.py): cadence,
per-role schedules and EMA (its direction and start), the not-due gradient refusal, the multi-role checkpoint (exact
resume on 2 gloo ranks) and loading a single-Predictor checkpoint of format 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from predictor_training.data.batches import ResumableBatches
from predictor_training.runtime.checkpoint import (
    TRAINING_STATE_FORMAT,
    RunState,
    capture_rng_state,
    load_training_state,
    read_training_state,
)
from predictor_training.runtime.distributed import (
    DistEnv,
    cleanup_distributed,
    init_distributed,
    maybe_no_sync,
    wrap_ddp,
)
from predictor_training.runtime.logger import MetricsLogger
from predictor_training.runtime.loop import train_loop
from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer
from predictor_training.runtime.roles import EMA, Role


SINGLE = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
META = {"variant": "toy", "source_blocks": [0, 1], "precision": "fp32"}
ADAMW = {"betas": (0.9, 0.95), "weight_decay": 0.01}


class TwoGroup(nn.Module):
    """A tiny model with the two parameter groups the schedule expects ("fusion", "blocks")."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fusion = nn.Linear(4, 4)
        self.blocks = nn.Linear(4, 2)

    def forward(self, x):
        return self.blocks(torch.tanh(self.fusion(x)))


class Points(Dataset):
    def __init__(self, size: int = 24):
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(size, 4, generator=generator)
        self.y = torch.randn(size, 2, generator=generator)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "y": self.y[index]}


def make_role(name: str, seed: int, every: int, max_steps: int, ema: float | None = None, grad_sync="ddp",
              env: DistEnv = SINGLE) -> Role:
    model = TwoGroup(seed)
    optimizer = build_optimizer({"fusion": list(model.fusion.parameters()), "blocks": list(model.blocks.parameters())},
                                {"fusion": 1e-2, "blocks": 5e-3}, **ADAMW)
    schedule = TwoGroupLRSchedule(optimizer, warmup_steps=1, max_steps=max_steps // every, block_warmup_steps=None)
    module = wrap_ddp(model, env) if grad_sync == "ddp" else model
    return Role(name, model, optimizer, schedule, module=module, every=every, grad_sync=grad_sync,
                ema=None if ema is None else EMA(model, decay=ema))


def two_role_step(batch, *, sync, due, critic: Role, generator: Role, counts: dict, leak: bool = False):
    """The critic trains every step; the generator only when due (or always, with `leak`, to test the refusal)."""
    counts["calls"] = counts.get("calls", 0) + 1
    metrics = {}
    with maybe_no_sync(critic.module, enabled=not sync):
        critic_loss = F.mse_loss(critic.module(batch["x"]), batch["y"])
        critic_loss.backward()
    metrics["loss"] = float(critic_loss.detach())
    if "generator" in due or leak:
        generator_loss = F.mse_loss(generator.module(batch["x"]), -batch["y"])
        generator_loss.backward()
        metrics["generator_loss"] = float(generator_loss.detach())
    else:
        metrics["generator_loss"] = 0.0
    return metrics


def run_two_roles(run_dir: Path, env: DistEnv, *, max_steps: int, stop_at_step: int | None = None,
                  resume: Path | None = None, grad_accum: int = 1, leak: bool = False) -> tuple[RunState, list[Role]]:
    critic = make_role("critic", seed=1, every=1, max_steps=max_steps, env=env)
    generator = make_role("generator", seed=2, every=3, max_steps=max_steps, ema=0.5, grad_sync="all_reduce",
                          env=env)
    data = Points()
    sampler = DistributedSampler(data, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0,
                                 drop_last=True)
    batches = ResumableBatches(sampler, data, torch.utils.data.default_collate, batch_size=2, seed=0)
    run_state = RunState()
    if resume is not None:
        run_state = load_training_state(resume, roles=[critic, generator], expect=META)
        batches.load_state_dict(run_state.data)
    counts: dict = {}
    step_fn = partial(two_role_step, critic=critic, generator=generator, counts=counts, leak=leak)
    with MetricsLogger(run_dir, env) as logger:
        state = train_loop(roles=[critic, generator], batches=batches, step_fn=step_fn, run_dir=run_dir, env=env,
                           run_state=run_state, max_steps=max_steps, stop_at_step=stop_at_step, grad_accum=grad_accum,
                           ckpt_every=-1, keep_last=-1, metrics_logger=logger, config={"toy": True}, meta=META,
                           progress=False)
    return state, [critic, generator]


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# Single process
# ---------------------------------------------------------------------------------------------------------------
def test_roles_step_at_their_cadence_with_their_own_schedule_and_ema(tmp_path):
    state, (critic, generator) = run_two_roles(tmp_path, SINGLE, max_steps=7)
    assert state.global_step == 7
    assert (critic.updates, critic.lr_schedule.step_count) == (7, 7)
    assert (generator.updates, generator.lr_schedule.step_count, generator.ema.updates) == (2, 2, 2)
    records = read_log(tmp_path)
    assert [record["updates/generator"] for record in records] == [0, 0, 1, 1, 1, 2, 2]
    assert [("grad_norm/generator" in record) for record in records] == [False, False, True, False, False, True, False]
    assert all("grad_norm/critic" in record and "lr/critic/fusion" in record for record in records)
    # The generator's schedule counts its own 2 updates (warmup 1): peak LR at both, where a schedule counting loop
    # steps would already have decayed it at step 6.
    assert records[2]["lr/generator/fusion"] == 1e-2 and records[5]["lr/generator/fusion"] == 1e-2
    assert records[5]["lr/critic/fusion"] < 1e-2
    # EMA: decay 0.5 folded in after each generator update only.
    for name, param in generator.raw_module.named_parameters():
        assert not torch.equal(generator.ema.shadow[name], param.detach()), name
    saved = read_training_state(tmp_path / "training_latest.pt")
    assert sorted(saved["roles"]) == ["critic", "generator"]
    assert saved["roles"]["generator"]["updates"] == 2 and saved["roles"]["generator"]["ema"]["updates"] == 2
    assert sorted(path.name for path in tmp_path.glob("*_step_*.safetensors")) == [
        "critic_step_00007.safetensors", "generator_ema_step_00007.safetensors", "generator_step_00007.safetensors"]
    # the EMA's inference weights are its shadow, not the trained weights
    ema_weights = safetensors.torch.load_file(str(tmp_path / "generator_ema_step_00007.safetensors"))
    for name, shadow in generator.ema.shadow.items():
        assert torch.equal(ema_weights[name].float(), shadow.bfloat16().float()), name


def test_a_role_that_is_not_due_must_hold_no_gradient(tmp_path):
    with pytest.raises(RuntimeError, match="step 1: role 'generator' is not due \\(every 3\\) but holds gradients"):
        run_two_roles(tmp_path, SINGLE, max_steps=6, leak=True)
    assert not (tmp_path / "training_latest.pt").exists()


def test_resume_mid_interval_equals_the_uninterrupted_run(tmp_path):
    full_state, full_roles = run_two_roles(tmp_path / "full", SINGLE, max_steps=7, grad_accum=2)
    run_two_roles(tmp_path / "cut", SINGLE, max_steps=7, grad_accum=2, stop_at_step=4)  # between generator steps
    cut_state, cut_roles = run_two_roles(tmp_path / "cut", SINGLE, max_steps=7, grad_accum=2,
                                         resume=tmp_path / "cut" / "training_latest.pt")
    assert cut_state == full_state  # the loop position (the record of written files is not compared: the stopped
    # launch also wrote its step-4 files)
    assert cut_state.checkpoints == [name.replace("00007", "00004") for name in full_state.checkpoints] + (
        full_state.checkpoints)
    drop = ("time/", "memory/")
    for full, cut in zip(read_log(tmp_path / "full"), read_log(tmp_path / "cut"), strict=True):
        assert {k: v for k, v in full.items() if not k.startswith(drop)} == {
            k: v for k, v in cut.items() if not k.startswith(drop)}
    for full, cut in zip(full_roles, cut_roles):
        for (name, a), b in zip(full.raw_module.state_dict().items(), cut.raw_module.state_dict().values()):
            assert torch.equal(a, b), (full.name, name)
    assert all(torch.equal(full_roles[1].ema.shadow[n], cut_roles[1].ema.shadow[n]) for n in full_roles[1].ema.shadow)


def test_a_format_1_single_predictor_state_still_loads(tmp_path):
    """Checkpoints written before roles existed (top-level model / optimizer / lr_schedule) resume into one role."""
    role = make_role("predictor", seed=3, every=1, max_steps=4)
    role.optimizer.zero_grad()
    F.mse_loss(role.module(torch.ones(2, 4)), torch.zeros(2, 2)).backward()
    role.step()
    payload = {
        "format": TRAINING_STATE_FORMAT, "format_version": 1,
        "model": {k: v.clone() for k, v in role.raw_module.state_dict().items()},
        "optimizer": role.optimizer.state_dict(), "lr_schedule": role.lr_schedule.state_dict(),
        "run_state": RunState(global_step=1, micro_step=1).to_dict(), "rng_by_rank": [capture_rng_state()],
        "world_size": 1, "config": {}, "meta": META,
    }
    torch.save(payload, tmp_path / "old.pt")
    fresh = make_role("student", seed=4, every=1, max_steps=4)
    state = load_training_state(tmp_path / "old.pt", roles=[fresh], expect=META)
    assert state.global_step == 1 and fresh.updates == 1 and fresh.lr_schedule.step_count == 1
    for a, b in zip(role.raw_module.state_dict().values(), fresh.raw_module.state_dict().values()):
        assert torch.equal(a, b)
    assert sorted(read_training_state(tmp_path / "old.pt")["roles"]) == ["predictor"]


# ---------------------------------------------------------------------------------------------------------------
# 2 gloo ranks: DDP critic, all-reduced generator, grad accumulation, resume mid generator interval
# ---------------------------------------------------------------------------------------------------------------
def test_two_rank_multi_role_resume_matches_uninterrupted_run(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]
    drop = ("time/", "memory/")
    full, cut = read_log(tmp_path / "full"), read_log(tmp_path / "cut")
    assert [r["step"] for r in full] == [r["step"] for r in cut] == list(range(1, 8))
    for a, b in zip(full, cut):
        assert {k: v for k, v in a.items() if not k.startswith(drop)} == {
            k: v for k, v in b.items() if not k.startswith(drop)}
    full_state = read_training_state(tmp_path / "full" / "training_latest.pt")
    cut_state = read_training_state(tmp_path / "cut" / "training_latest.pt")
    assert full_state["world_size"] == 2 and full_state["run_state"] == cut_state["run_state"]
    for role in ("critic", "generator"):
        for name, tensor in full_state["roles"][role]["model"].items():
            assert torch.equal(tensor, cut_state["roles"][role]["model"][name]), (role, name)


def worker(out: str) -> None:
    out = Path(out)
    env = init_distributed("gloo")
    try:
        run_two_roles(out / "full", env, max_steps=7, grad_accum=2)
        run_two_roles(out / "cut", env, max_steps=7, grad_accum=2, stop_at_step=4)
        run_two_roles(out / "cut", env, max_steps=7, grad_accum=2, resume=out / "cut" / "training_latest.pt")
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    worker(sys.argv[1])


def test_the_generator_ema_direction_and_start():
    """decay 0.9, start after update 1: update 1 copies the weights; update 2 gives 0.9 old + 0.1 new (never the
    reverse); a parameter that does not train has no shadow."""
    module = torch.nn.Linear(2, 1)
    module.bias.requires_grad_(False)
    ema = EMA(module, 0.9, start_update=1)
    assert sorted(ema.shadow) == ["weight"]
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[10.0, -10.0]]))
    ema.update(module)
    torch.testing.assert_close(ema.shadow["weight"], torch.tensor([[10.0, -10.0]]))
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[20.0, 0.0]]))
    ema.update(module)
    torch.testing.assert_close(ema.shadow["weight"], torch.tensor([[11.0, -9.0]]))
    ema.copy_to(module)
    torch.testing.assert_close(module.weight.detach(), torch.tensor([[11.0, -9.0]]))
