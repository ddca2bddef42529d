"""Toy recipe for the DDP test: a two-group model trained with `train_loop`, resumable.

    torchrun --standalone --nproc_per_node 2 tests/helpers/ddp_toy_train.py --run_dir /tmp/toy --max_steps 6
    torchrun --standalone --nproc_per_node 2 tests/helpers/ddp_toy_train.py --run_dir /tmp/full --max_steps 6 \
        --stopped_run_dir /tmp/cut --stopped_at_step 3
    torchrun --standalone --nproc_per_node 2 tests/helpers/ddp_toy_train.py --run_dir /tmp/cut --max_steps 6 \
        --resume /tmp/cut/training_latest.pt

Also runs as plain `python` (world size 1). Every random number of a step comes from the global RNG
(noise added to the input), so an exact resume proves the per-rank RNG states are restored.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from predictor_training.runtime.roles import Role
from predictor_training.runtime.checkpoint import RunState, load_training_state
from predictor_training.runtime.distributed import (
    all_gather_objects,
    cleanup_distributed,
    init_distributed,
    maybe_no_sync,
    seed_everything,
    wrap_ddp,
)
from predictor_training.runtime.io import write_json_atomic
from predictor_training.runtime.logger import MetricsLogger
from predictor_training.data.batches import ResumableBatches
from predictor_training.runtime.loop import train_loop
from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer


class ToyPredictor(nn.Module):
    """fusion (trainable) -> blocks (trainable) -> final (frozen); returns (velocity [B, D], hidden [B, H])."""

    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.fusion = nn.Linear(dim, hidden)
        self.blocks = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.final = nn.Linear(hidden, dim)
        self.final.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.blocks(self.fusion(x))
        return self.final(hidden), hidden


class ToyPairs(Dataset):
    """`size` fixed (input, target velocity, target hidden) triples drawn from a seeded generator."""

    def __init__(self, size: int = 32, dim: int = 8, hidden: int = 16, seed: int = 1234):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, dim, generator=generator)
        self.target_velocity = torch.randn(size, dim, generator=generator)
        self.target_hidden = torch.randn(size, hidden, generator=generator)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict:
        return {"index": index, "x": self.inputs[index], "target_v": self.target_velocity[index],
                "target_h": self.target_hidden[index]}


def collate(items: list[dict]) -> dict:
    return {
        "index": torch.tensor([item["index"] for item in items]),
        "x": torch.stack([item["x"] for item in items]),
        "target_v": torch.stack([item["target_v"] for item in items]),
        "target_h": torch.stack([item["target_h"] for item in items]),
    }


def toy_step(batch: dict, *, sync: bool, due: frozenset, ddp_model: nn.Module, seen_indices: list,
             device: torch.device) -> dict[str, float]:
    """Forward + backward of one micro-batch; DDP all-reduces only when `sync`."""
    seen_indices.extend(batch["index"].tolist())
    inputs = batch["x"].to(device)
    with maybe_no_sync(ddp_model, enabled=not sync):
        noise = 0.05 * torch.randn(inputs.shape, device=device)
        velocity, hidden = ddp_model(inputs + noise)
        velocity_mse = F.mse_loss(velocity.float(), batch["target_v"].to(device).float())
        hidden_mse = F.mse_loss(hidden.float(), batch["target_h"].to(device).float())
        loss = velocity_mse + 0.1 * hidden_mse
        loss.backward()
    return {"loss": loss.item(), "velocity_mse": velocity_mse.item(), "hidden_mse": hidden_mse.item()}


def check_disjoint_ranks(step: int, metrics: dict, *, seen_indices: list) -> None:
    """Ranks must never train on the same sample within a step."""
    per_rank = all_gather_objects(sorted(seen_indices))
    seen_indices.clear()
    flat = [index for indices in per_rank for index in indices]
    if len(flat) != len(set(flat)):
        raise RuntimeError(f"step {step}: ranks shared samples: {per_rank}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", required=True, help="output folder (train_log.jsonl, checkpoints)")
    parser.add_argument("--max_steps", type=int, default=6, help="schedule length in optimizer steps")
    parser.add_argument("--stop_at_step", type=int, default=None, help="end this run after this step (default max_steps)")
    parser.add_argument("--resume", default=None, help="training_latest.pt to resume from")
    parser.add_argument("--stopped_run_dir", default=None,
                        help="after the main run, train again from scratch into this folder and stop early")
    parser.add_argument("--stopped_at_step", type=int, default=3, help="where the --stopped_run_dir run stops")
    parser.add_argument("--grad_accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--batch_size", type=int, default=2, help="micro-batch size per rank")
    parser.add_argument("--ckpt_every", type=int, default=3, help="checkpoint interval in optimizer steps")
    parser.add_argument("--warmup_steps", type=int, default=2, help="linear warmup steps of the global schedule")
    parser.add_argument("--block_warmup_steps", type=int, default=1, help="steps with blocks LR 0 (-1: none)")
    parser.add_argument("--seed", type=int, default=0, help="base seed (offset by rank)")
    parser.add_argument("--variant", default="toy", help="recorded in checkpoint meta; resume must match")
    parser.add_argument("--backend", default="gloo", choices=["auto", "gloo", "nccl"], help="process-group backend")
    parser.add_argument("--unsynchronised", action="store_true",
                        help="no DDP wrapper and grad_sync none: every rank trains its own copy on its own data, which "
                             "the loop's replica check must refuse at the first checkpoint")
    return parser.parse_args(argv)


def train_once(args: argparse.Namespace, env, run_dir: str, stop_at_step: int | None, resume: str | None) -> RunState:
    """One run from a fresh seed (or from `resume`) into `run_dir`."""
    seed_everything(args.seed, rank=env.rank)
    meta = {"variant": args.variant, "source_blocks": [0, 1], "precision": "fp32master"}
    config = {**vars(args), "run_dir": run_dir, "stop_at_step": stop_at_step, "resume": resume,
              "world_size": env.world_size}
    # 1. Model, DDP, optimizer, schedule.
    raw_model = ToyPredictor().to(env.device)
    ddp_model = raw_model if args.unsynchronised else wrap_ddp(raw_model, env)
    optimizer = build_optimizer(
        {"fusion": list(raw_model.fusion.parameters()), "blocks": list(raw_model.blocks.parameters())},
        {"fusion": 1e-2, "blocks": 1e-3}, betas=(0.9, 0.95), weight_decay=0.01,
    )
    lr_schedule = TwoGroupLRSchedule(optimizer, warmup_steps=args.warmup_steps, max_steps=args.max_steps,
                                     block_warmup_steps=args.block_warmup_steps)
    # 2. Data.
    dataset = ToyPairs()
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    batches = ResumableBatches(sampler, dataset, collate, batch_size=args.batch_size, seed=args.seed)
    # 3. Resume last, so nothing draws random numbers between the RNG restore and the first step.
    role = Role("predictor", raw_model, optimizer, lr_schedule, module=ddp_model,
                grad_sync="none" if args.unsynchronised else "ddp")
    run_state = RunState()
    if resume:
        run_state = load_training_state(resume, roles=[role], expect=meta)
        batches.load_state_dict(run_state.data)
    if env.is_main:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(run_dir) / "train_config.json", config)
    seen_indices: list[int] = []
    with MetricsLogger(run_dir, env, tracker="none") as metrics_logger:
        return train_loop(
            roles=[role], batches=batches, step_fn=partial(toy_step, ddp_model=ddp_model, seen_indices=seen_indices, device=env.device),
            run_dir=run_dir, env=env, run_state=run_state, max_steps=args.max_steps,
            grad_accum=args.grad_accum, ckpt_every=args.ckpt_every, keep_last=20, metrics_logger=metrics_logger,
            config=config, meta=meta, progress=False,
            extra_step_check=partial(check_disjoint_ranks, seen_indices=seen_indices),
            stop_at_step=stop_at_step,
        )


def main(argv=None) -> None:
    args = parse_args(argv)
    env = init_distributed(args.backend)
    try:
        train_once(args, env, args.run_dir, args.stop_at_step, args.resume)
        if args.stopped_run_dir:
            # saves a second torchrun launch in the test: a fresh run that is interrupted at --stopped_at_step
            train_once(args, env, args.stopped_run_dir, args.stopped_at_step, resume=None)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main()
