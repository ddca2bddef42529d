"""DiffusionNFT, the loss: reinforcement on the forward process of a flow model, with no likelihoods.

Samples x0 of the frozen old policy are scored by a reward; within each group (the K samples of one condition) the
rewards become advantages A = (r - mean) / (std + 1e-4). For a noised sample x_t = (1 - t) x0 + t noise, the trained
policy's velocity v_θ and the old policy's v_old define a positive and a negative policy,

    v+ = β v_θ + (1 - β) sg(v_old),        v- = (1 + β) sg(v_old) - β v_θ,        x0± = x_t - t v±,

and the loss pulls x0+ towards the sample where the advantage is high and x0- where it is low:

    r = clip(A / (2c) + 1/2, 0, 1)       (c: the advantage clip)
    L = mean[ (c / β) * ( r |x0+ - x0|^2 / w+  +  (1 - r) |x0- - x0|^2 / w- ) ],   w± = sg(mean|x0± - x0|)

At v_θ = v_old a zero advantage (r = 1/2) gives no gradient (the two terms cancel) and a non-zero one does
(tests/test_diffusion_nft.py). A KL term to a frozen reference, λ mse(v_θ, v_ref), is added by the caller.

The old policy is refreshed after each policy update, old <- d old + (1 - d) policy, with d from a named schedule
(`old_policy_decay`); `OldPolicy` does this in place on the old policy's own weights and is what a training role
holds in its EMA slot, so the checkpoint carries it (fvtools/train_nft.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-4) -> Tensor:
    """rewards [G, K] (K samples per group) -> advantages [G, K], normalised within each group."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples per group], got {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def nft_loss(v_theta: Tensor, v_old: Tensor, x_t: Tensor, x0: Tensor, t: Tensor, advantage: Tensor, *,
             beta: float, clip: float) -> Tensor:
    """The NFT loss (module docstring), float32. v_theta, v_old, x_t, x0 [B, ...]; t and advantage [B] (or
    broadcastable to x0); per-sample weights w± are means over every non-batch axis."""
    if beta <= 0 or clip <= 0:
        raise ValueError(f"beta and clip must be > 0, got {beta}, {clip}")
    shape = (-1,) + (1,) * (x0.dim() - 1)
    t = t.float().reshape(shape)
    v_old = v_old.detach().float()
    v_theta, x_t, x0 = v_theta.float(), x_t.float(), x0.float()
    x0_positive = x_t - t * (beta * v_theta + (1 - beta) * v_old)
    x0_negative = x_t - t * ((1 + beta) * v_old - beta * v_theta)
    axes = tuple(range(1, x0.dim()))

    def weighted(estimate: Tensor) -> Tensor:
        error = (estimate - x0) ** 2
        scale = (estimate - x0).abs().mean(dim=axes, keepdim=True).detach() if axes else \
            (estimate - x0).abs().detach()
        return error / scale.clamp_min(1e-8)

    r = torch.clamp(advantage.float().reshape(shape) / (2 * clip) + 0.5, 0.0, 1.0)
    return torch.mean((clip / beta) * (r * weighted(x0_positive) + (1 - r) * weighted(x0_negative)))


# ---------------------------------------------------------------------------------------------------------------
# The old policy: an EMA of the trained policy with a scheduled decay
# ---------------------------------------------------------------------------------------------------------------
# The decay d(u) after the policy's u-th update (u = 1, 2, ...); old <- d old + (1 - d) policy. The ramps are the
# three decay types of the DiffusionNFT training code (type 0 = "zero", 1 = "ramp_slow", 2 = "ramp_delayed": a flat
# start, a linear rise, a cap; constants checked against its public copies). "constant" holds `constant`
# (--old_decay) throughout.
OLD_DECAY_SCHEDULES = ("zero", "ramp_slow", "ramp_delayed", "constant")


def old_policy_decay(schedule: str, update: int, constant: float = 0.0) -> float:
    """d for the policy's `update`-th update (1-based) under `schedule`:

        zero           0                                    (old = policy after every update: on-policy)
        ramp_slow      min(0.001 u, 0.5)
        ramp_delayed   0 for u < 75, then min(0.0075 (u - 75), 0.999)
        constant       `constant` (in [0, 1))
    """
    if update < 1:
        raise ValueError(f"update={update}; the decay is defined from the first update (1) on")
    if schedule == "zero":
        return 0.0
    if schedule == "ramp_slow":
        return min(0.001 * update, 0.5)
    if schedule == "ramp_delayed":
        return 0.0 if update < 75 else min(0.0075 * (update - 75), 0.999)
    if schedule == "constant":
        if not 0.0 <= constant < 1.0:
            raise ValueError(f"constant old-policy decay {constant}; expected in [0, 1)")
        return float(constant)
    raise ValueError(f"old-policy decay schedule {schedule!r}; expected one of {OLD_DECAY_SCHEDULES}")


class OldPolicy:
    """The old policy's weights as a frozen module, refreshed after each policy update by
    `old <- d old + (1 - d) policy` with d = `old_policy_decay(schedule, update)` (FP32 arithmetic).

    old_module: the old policy's parameters (the policy's parameter names, e.g. a second LoRA adapter's
    `AdapterWeights` or a frozen copy of the model), initialised equal to the policy. It fills the `ema` slot of
    the policy's `Role` (`Role.step` calls `update(policy_module)` after the optimizer step; the training state saves
    `state_dict()`), so a resume restores it exactly; nothing is copied twice in memory."""

    def __init__(self, old_module: torch.nn.Module, schedule: str, constant: float = 0.0):
        old_policy_decay(schedule, 1, constant)  # validates
        self.old_module = old_module
        self.schedule = schedule
        self.constant = float(constant)
        self.updates = 0
        self.last_decay = 0.0
        if any(param.requires_grad for param in old_module.parameters()):
            raise ValueError("OldPolicy: the old policy's parameters must be frozen (requires_grad=False)")

    @torch.no_grad()
    def update(self, policy_module: torch.nn.Module) -> None:
        """Fold the policy's current weights into the old policy (once per policy update)."""
        self.updates += 1
        decay = old_policy_decay(self.schedule, self.updates, self.constant)
        policy = dict(policy_module.named_parameters())
        for name, old in self.old_module.named_parameters():
            if name not in policy:
                raise KeyError(f"OldPolicy: the policy has no parameter {name!r}")
            mixed = decay * old.float() + (1.0 - decay) * policy[name].detach().float()
            old.copy_(mixed.to(old.dtype))
        self.last_decay = decay

    def state_dict(self) -> dict:
        return {"schedule": self.schedule, "constant": self.constant, "updates": self.updates,
                "last_decay": self.last_decay,
                "weights": {name: param.detach().cpu().clone() for name, param in self.old_module.named_parameters()}}

    def load_state_dict(self, state: dict) -> None:
        if (state["schedule"], float(state["constant"])) != (self.schedule, self.constant):
            raise ValueError(f"OldPolicy.load_state_dict: saved schedule {state['schedule']} (constant "
                             f"{state['constant']}), this run uses {self.schedule} (constant {self.constant})")
        params = dict(self.old_module.named_parameters())
        if sorted(state["weights"]) != sorted(params):
            raise ValueError("OldPolicy.load_state_dict: the saved old policy covers other parameters than this one")
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                params[name].copy_(tensor)
        self.updates = int(state["updates"])
        self.last_decay = float(state["last_decay"])
