"""A tiny Predictor-like model trained a few AdamW steps, for the training-state tests
(tests/runtime/test_checkpoint.py); also imported by the subprocess that test SIGKILLs in the middle of a save."""

import random

import numpy as np
import torch
from torch import nn

from predictor_training.runtime.checkpoint import RunState, save_training_state
from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer
from predictor_training.runtime.roles import Role


META = {"variant": "v4", "source_blocks": [1, 52], "precision": "fp32master"}


class TinyPredictor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fusion = nn.Linear(4, 6)
        self.blocks = nn.Linear(6, 6)
        self.final = nn.Linear(6, 4).to(torch.bfloat16).requires_grad_(False)  # frozen BF16, as in the recipe


def current_lrs(schedule) -> dict[str, float]:
    """LR per group name for the next update."""
    return {group["name"]: group["lr"] for group in schedule.optimizer.param_groups}


def build(seed=0):
    torch.manual_seed(seed)
    model = TinyPredictor()
    optimizer = build_optimizer(
        {"fusion": list(model.fusion.parameters()), "blocks": list(model.blocks.parameters())},
        {"fusion": 1e-2, "blocks": 1e-3}, betas=(0.9, 0.95), weight_decay=0.01,
    )
    schedule = TwoGroupLRSchedule(optimizer, warmup_steps=2, max_steps=10, block_warmup_steps=1)
    return model, optimizer, schedule


def train_steps(model, optimizer, schedule, steps=2):
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(3, 4)
        loss = model.blocks(model.fusion(x)).square().mean()
        loss.backward()
        optimizer.step()
        schedule.step()


def save(path, model, optimizer, schedule, step, meta=META, config=None):
    save_training_state(path, roles=[Role("predictor", model, optimizer, schedule)],
                        run_state=RunState(global_step=step, micro_step=2 * step, epoch=1, data={"epoch": 1, "position": 3, "seed": 0}),
                        config=config or {"lr": 1e-4}, meta=meta)


def draw_random():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()
