"""AdamW with named parameter groups and the two-group warmup + cosine LR schedule.

Schedule convention (one place, used by every recipe):

* `step` is the number of optimizer updates already taken, i.e. the 0-based index of the update about to run.
  The update with index `step` uses `peak_lr * lr_multiplier(step, ...)`.
* Warmup: `(step + 1) / warmup_steps` for `step < warmup_steps`, so the first update already moves and update
  `warmup_steps - 1` reaches the peak (no wasted update at LR 0).
* Cosine: for `step >= warmup_steps`, `0.5 * (1 + cos(pi * (step - warmup_steps) / (max_steps - warmup_steps)))`,
  which is 1 at the end of warmup and exactly 0 at `step == max_steps` (the value left after the final update).
* Delay (block warmup): the multiplier is exactly 0 for `step < delay_steps`; from then on the group follows the
  SAME global multiplier. Warmup counts from step 0, not from the end of the delay: with warmup 100 and block
  warmup 100 (the offline recipe), the blocks jump from 0 to the post-warmup value at update 100: the blocks LR is
  0 for the first block_warmup_steps steps, then follows the same schedule.
"""

from __future__ import annotations

import math

import torch
from torch import nn

FUSION_GROUP = "fusion"
BLOCKS_GROUP = "blocks"
FP32_MASTER = "fp32master"


def build_optimizer(
    groups: dict[str, list[nn.Parameter]],
    lrs: dict[str, float],
    *,
    betas: tuple[float, float],
    weight_decay: float,
) -> torch.optim.AdamW:
    """AdamW with one param group per name (`group["name"]`, peak LR in `group["initial_lr"]`).

    Every parameter must be trainable and FP32 ("fp32master": FP32 master weights, so AdamW moments are FP32
    too); frozen BF16 weights stay out of the optimizer.
    """
    # 1. The names must agree between parameters and learning rates.
    if set(groups) != set(lrs):
        raise ValueError(f"build_optimizer: param groups {sorted(groups)} and lrs {sorted(lrs)} name different groups")
    seen: dict[int, str] = {}
    param_groups = []
    for name, params in groups.items():
        params = list(params)
        # 2. Per-group checks: non-empty, trainable, fp32, not shared with another group.
        if not params:
            raise ValueError(f"build_optimizer: param group {name!r} is empty")
        lr = float(lrs[name])
        if not lr > 0:
            raise ValueError(f"build_optimizer: lrs[{name!r}]={lr}; expected a peak learning rate > 0")
        for index, param in enumerate(params):
            if not param.requires_grad:
                raise ValueError(f"build_optimizer: group {name!r} param #{index} has requires_grad=False")
            if param.dtype != torch.float32:
                raise ValueError(
                    f"build_optimizer: group {name!r} param #{index} {tuple(param.shape)} is {param.dtype}; "
                    f"{FP32_MASTER} requires every trainable parameter in torch.float32"
                )
            if id(param) in seen:
                raise ValueError(
                    f"build_optimizer: a parameter {tuple(param.shape)} is in both {seen[id(param)]!r} and {name!r}"
                )
            seen[id(param)] = name
        param_groups.append({"name": name, "params": params, "lr": lr, "initial_lr": lr})
    return torch.optim.AdamW(param_groups, betas=betas, weight_decay=weight_decay)


def count_group_params(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Number of scalar parameters per named group (for the run summary)."""
    return {group["name"]: sum(p.numel() for p in group["params"]) for group in optimizer.param_groups}


def lr_multiplier(step: int, *, warmup_steps: int, max_steps: int, delay_steps: int = 0) -> float:
    """Multiplier of the peak LR for the update with 0-based index `step` (see the module docstring)."""
    if not 0 <= warmup_steps < max_steps:
        raise ValueError(f"lr_multiplier: warmup_steps={warmup_steps}, max_steps={max_steps}; need 0 <= warmup < max")
    if not 0 <= delay_steps < max_steps:
        raise ValueError(f"lr_multiplier: delay_steps={delay_steps}, max_steps={max_steps}; need 0 <= delay < max")
    if not 0 <= step <= max_steps:
        raise ValueError(f"lr_multiplier: step={step} is outside [0, max_steps={max_steps}]")
    if step < delay_steps:
        return 0.0
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def block_delay_steps(block_warmup_steps: int | None) -> int:
    """`--block_warmup_steps` as a delay: None or -1 mean "no block warmup" (delay 0)."""
    if block_warmup_steps is None or block_warmup_steps == -1:
        return 0
    if block_warmup_steps < 0:
        raise ValueError(f"block_warmup_steps={block_warmup_steps}; expected >= 0, or -1/None for none")
    return block_warmup_steps


class WarmupCosineSchedule:
    """Sets `lr = initial_lr * lr_multiplier(step)` on every param group (a group may be held at 0 for its first
    `delays[group name]` updates).

    `self.step_count` counts completed optimizer updates; construction applies the LR for update 0 and each
    `step()` (called right after `optimizer.step()`) applies the LR for the next update.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, warmup_steps: int, max_steps: int,
                 delays: dict[str, int] | None = None):
        self.optimizer = optimizer
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.delays = dict(delays or {})
        self.step_count = 0
        for delay in [0, *self.delays.values()]:
            lr_multiplier(0, warmup_steps=warmup_steps, max_steps=max_steps, delay_steps=delay)
        self._apply()

    def multiplier(self, group_name: str, step: int) -> float:
        return lr_multiplier(step, warmup_steps=self.warmup_steps, max_steps=self.max_steps,
                             delay_steps=self.delays.get(group_name, 0))

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * self.multiplier(group.get("name"), self.step_count)

    def step(self) -> None:
        if self.step_count >= self.max_steps:
            raise RuntimeError(f"{type(self).__name__}: already at max_steps={self.max_steps}; cannot step further")
        self.step_count += 1
        self._apply()

    def settings(self) -> dict:
        """What a resumed run must share with the saved one."""
        return {"warmup_steps": self.warmup_steps, "max_steps": self.max_steps}

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, **self.settings()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step; refuses a checkpoint whose schedule settings differ from this run's."""
        for key, current in self.settings().items():
            saved = state[key]
            if saved != current:
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: saved {key}={saved!r} but this run uses {key}={current!r}"
                )
        self.step_count = int(state["step_count"])
        self._apply()


class TwoGroupLRSchedule(WarmupCosineSchedule):
    """The Predictor recipes' schedule: the "fusion" group from update 0, the "blocks" group held at 0 for
    `block_warmup_steps` updates (module docstring)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        warmup_steps: int,
        max_steps: int,
        block_warmup_steps: int | None,
    ):
        names = [group.get("name") for group in optimizer.param_groups]
        if sorted(map(str, names)) != sorted([FUSION_GROUP, BLOCKS_GROUP]):
            raise ValueError(
                f"TwoGroupLRSchedule: optimizer groups are named {names}; expected exactly "
                f"{[FUSION_GROUP, BLOCKS_GROUP]} (use build_optimizer)"
            )
        self.block_warmup_steps = block_warmup_steps
        super().__init__(optimizer, warmup_steps=warmup_steps, max_steps=max_steps,
                         delays={FUSION_GROUP: 0, BLOCKS_GROUP: block_delay_steps(block_warmup_steps)})

    def settings(self) -> dict:
        return {**super().settings(), "block_delay_steps": self.delays[BLOCKS_GROUP]}


def build_optimizer_and_schedule(predictor, *, fusion_lr: float, blocks_lr: float, betas: tuple[float, float],
                                 weight_decay: float, warmup_steps: int, max_steps: int, block_warmup_steps: int
                                 ) -> tuple[torch.optim.AdamW, TwoGroupLRSchedule]:
    """The Predictor recipes' optimizer and schedule: AdamW over the two groups of
    `predictor.trainable_parameter_groups()` (fusion + head, blocks) and the warmup + cosine schedule with the
    blocks' delay (a recipe passes its --fusion_lr, --blocks_lr, --adam_beta1/2, --weight_decay,
    --scheduler_warmup_steps, --max_steps, --block_warmup_steps)."""
    optimizer = build_optimizer(predictor.trainable_parameter_groups(),
                                {FUSION_GROUP: fusion_lr, BLOCKS_GROUP: blocks_lr},
                                betas=betas, weight_decay=weight_decay)
    lr_schedule = TwoGroupLRSchedule(optimizer, warmup_steps=warmup_steps, max_steps=max_steps,
                                     block_warmup_steps=block_warmup_steps)
    return optimizer, lr_schedule
