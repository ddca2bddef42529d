"""Trainable roles: what `train_loop` steps (a Predictor recipe has one role; a method such as DMD has several).

A role is one trainable module with its own optimizer, LR schedule, update cadence, gradient clip, gradient sync and
optional EMA. At loop step s (1-based) a role is *due* when `s % every == 0`: a role with `every=5` is updated at
steps 5, 10, ... and its LR schedule, whose length is the role's own number of updates (`updates_in(max_steps)`),
advances only then. Its EMA, if any, is updated right after its own optimizer step, never on other steps.

Gradient sync (`grad_sync`):
* "ddp": `module` is the DistributedDataParallel wrapper of `raw_module` (or the module itself on one process);
  the step function covers non-final micro-batches with `maybe_no_sync(module, enabled=not sync)`.
* "all_reduce": the loop averages the role's gradients over ranks after the micro-batches (e.g. LoRA adapters on a
  shared frozen base that is not DDP-wrapped).
* "none": the gradients are already synchronised (FSDP reduce-scatters them in backward) or the run is one process.

FSDP2-sharded roles (`predictor_training.runtime.fsdp.shard_model`): raw_module is the sharded model and module is that
same model (no DDP wrapper), grad_sync is "none" (`train_loop` refuses "ddp" and "all_reduce" for it), the optimizer
is built after sharding, and the step function covers non-final micro-batches with
`fsdp.gradient_sync(role.module, enabled=sync)` instead of `maybe_no_sync`. Its checkpoints are sharded with
torch.distributed.checkpoint, each rank writing its own shards (`runtime/sharded_checkpoint.py`); its inference
weights come from the model gathered one tensor at a time in BF16, and a resume reads the shards back
(`sharded_checkpoint.load_sharded_roles`). An FSDP role cannot have an EMA (the shadow would be sharded DTensors
that neither the checkpoint nor `copy_to` handles): `Role` refuses one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

GRAD_SYNCS = ("ddp", "all_reduce", "none")


def module_is_fsdp(module: nn.Module) -> bool:
    """`predictor_training.runtime.fsdp.is_fsdp` without importing that module (it imports the Teacher): a module can only
    have been passed to FSDP2's `fully_shard` once torch's fsdp package is loaded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


class EMA:
    """Exponential moving average of a module's trainable parameters, in FP32:
    `shadow <- decay * shadow + (1 - decay) * param` after each update of its role, from `start_update` on (before
    that the shadow copies the weights). `updates` counts the role updates it has seen."""

    def __init__(self, module: nn.Module, decay: float, start_update: int = 0):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA: decay={decay}; expected in [0, 1)")
        if start_update < 0:
            raise ValueError(f"EMA: start_update={start_update}; expected >= 0")
        self.decay = decay
        self.start_update = start_update
        self.updates = 0
        self.shadow = {name: param.detach().float().clone()
                       for name, param in module.named_parameters() if param.requires_grad}

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        """Fold the module's current trainable weights into the shadow (call once per role update)."""
        self.updates += 1
        decay = self.decay if self.updates > self.start_update else 0.0
        for name, param in module.named_parameters():
            if name in self.shadow:
                self.shadow[name].mul_(decay).add_(param.detach().float(), alpha=1.0 - decay)

    def state_dict_of(self, module: nn.Module) -> dict:
        """`module`'s full state dict with the shadow in place of its trained parameters (FP32 shadow; the frozen
        rest as the module holds it): the EMA's inference weights."""
        state = dict(module.state_dict())
        missing = sorted(set(self.shadow) - set(state))
        if missing:
            raise KeyError(f"EMA entries {missing[:3]} are not in the module's state dict")
        state.update(self.shadow)
        return state

    @torch.no_grad()
    def copy_to(self, module: nn.Module) -> None:
        """Write the shadow into the module's trainable parameters (e.g. for an EMA evaluation)."""
        for name, param in module.named_parameters():
            if name in self.shadow:
                param.copy_(self.shadow[name].to(param.dtype))

    def state_dict(self) -> dict:
        return {"decay": self.decay, "start_update": self.start_update, "updates": self.updates,
                "shadow": {name: tensor.cpu() for name, tensor in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        if (state["decay"], state["start_update"]) != (self.decay, self.start_update):
            raise ValueError(f"EMA.load_state_dict: saved decay/start {state['decay']}/{state['start_update']}, this "
                             f"run uses {self.decay}/{self.start_update}")
        if sorted(state["shadow"]) != sorted(self.shadow):
            raise ValueError("EMA.load_state_dict: the saved shadow covers other parameters than this module's")
        self.updates = int(state["updates"])
        for name, tensor in state["shadow"].items():
            self.shadow[name].copy_(tensor)


@dataclass
class Role:
    """One trainable role of a run.

    name: key in checkpoints, logs and the step function's `due` set. raw_module: the module whose `state_dict` is
    saved (unwrapped); module: what the step function calls (the DDP wrapper, or raw_module itself). optimizer /
    lr_schedule: this role's (the schedule's `max_steps` must equal `updates_in(max_steps)` of the loop).
    every: update cadence in loop steps. grad_clip: global-norm clip of this role's gradients, -1 = measure only.
    grad_sync: "ddp" | "all_reduce" | "none" (module docstring). ema: optional EMA of raw_module (not for an
    FSDP-sharded raw_module: refused).
    `updates` (optimizer steps taken) is the schedule's own count, so the two cannot disagree.
    """

    name: str
    raw_module: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: object
    module: nn.Module | None = None
    every: int = 1
    grad_clip: float = 1.0
    grad_sync: str = "ddp"
    ema: EMA | None = None

    def __post_init__(self):
        if self.module is None:
            self.module = self.raw_module
        if self.every < 1:
            raise ValueError(f"role {self.name!r}: every={self.every}; expected >= 1")
        if not (self.grad_clip == -1 or self.grad_clip > 0):
            raise ValueError(f"role {self.name!r}: grad_clip={self.grad_clip}; expected > 0, or -1 to measure only")
        if self.grad_sync not in GRAD_SYNCS:
            raise ValueError(f"role {self.name!r}: grad_sync={self.grad_sync!r}; expected one of {GRAD_SYNCS}")
        if self.ema is not None and self.is_fsdp:
            raise ValueError(f"role {self.name!r}: an EMA of an FSDP-sharded module is not supported (its shadow "
                             "would be sharded DTensors that the checkpoint cannot save); drop ema for this role")

    @property
    def is_fsdp(self) -> bool:
        """Whether raw_module is FSDP2-sharded (its parameters are DTensor shards)."""
        return module_is_fsdp(self.raw_module)

    def is_due(self, step: int) -> bool:
        """Whether loop step `step` (1-based) updates this role."""
        return step % self.every == 0

    @property
    def updates(self) -> int:
        """Optimizer steps this role has taken: its LR schedule advances exactly once per update."""
        return self.lr_schedule.step_count

    def updates_in(self, steps: int) -> int:
        """How many updates this role takes in loop steps 1..steps."""
        return steps // self.every

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters this role's optimizer steps."""
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def parameters_with_grad(self) -> list[str]:
        """Names (within raw_module) of trained parameters that hold a gradient."""
        trained = {id(param) for param in self.parameters}
        return [name for name, param in self.raw_module.named_parameters()
                if id(param) in trained and param.grad is not None]

    def all_reduce_grads(self) -> None:
        """Average this role's gradients over ranks (grad_sync="all_reduce")."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        world = dist.get_world_size()
        for param in self.parameters:
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
                param.grad.div_(world)

    def step(self) -> None:
        """Optimizer step, schedule step (the update count) and EMA - in that order."""
        self.optimizer.step()
        self.lr_schedule.step()
        if self.ema is not None:
            self.ema.update(self.raw_module)
