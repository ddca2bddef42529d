"""DiffusionNFT: reinforcement on the forward process of a flow model, with no likelihoods; the loss first.

Samples x0 of the frozen old policy are scored by a reward; within each group (the K samples of one condition) the
rewards become advantages A = (r - mean_group) / (std + 1e-4), std over the whole gathered table ("global", the
reference's default) or over the group ("group"). For a noised sample x_t = (1 - t) x0 + t noise at one of the
sampler's own noise levels (`sampler_sigma_grid`), the trained policy's velocity v_θ and the old policy's v_old
define a positive and a negative policy,

    v+ = β v_θ + (1 - β) sg(v_old),        v- = (1 + β) sg(v_old) - β v_θ,        x0± = x_t - t v±,

and the loss pulls x0+ towards the sample where the advantage is high and x0- where it is low:

    r = clip(A / (2c) + 1/2, 0, 1)       (c: the advantage clip)
    L = mean[ (c / β) * ( r |x0+ - x0|^2 / w+  +  (1 - r) |x0- - x0|^2 / w- ) ],   w± = sg(mean|x0± - x0|)

At v_θ = v_old a zero advantage (r = 1/2) gives no gradient (the two terms cancel) and a non-zero one does
(tests/methods/test_nft.py). `nft_objective` adds the KL term to the frozen reference, λ mse(v_θ, sg(v_ref)),
which pulls the policy towards the reference (tests/methods/test_nft.py).

The old policy is refreshed after each policy update, old <- d old + (1 - d) policy, with d from a named schedule
(`old_policy_decay`); `OldPolicy` does this in place on the old policy's own weights and is what a training role
holds in its EMA slot, so the checkpoint carries it (fvtools/train_nft.py).

The recipe's other method pieces: `PolicyModels` (policy, old policy and reference on one method model), `gathered`
(every rank's rewards in one table, so groups are normalised globally), `group_statistics` (what a step logs of its
groups) and `evaluate_against_reference` (the policy and the reference from the same noise on held-out clips).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from predictor_training.methods.method_model import MethodModel
from predictor_training.methods.flow_matching import sample_sigmas
from predictor_training.methods.monitors import collapse_monitors
from predictor_training.methods.rewards import TOTAL
from predictor_training.rollout.scheduler import DISTILLED_SIGMA_FLOOR, flow_match_sigmas
from predictor_training.runtime.distributed import DistEnv, all_gather_objects
from predictor_training.teacher.adapters import AdapterWeights, adapter, copy_lora

OLD_ADAPTER = "old_policy"
# How the advantages are scaled: "global" divides by the std of every reward in the gathered table (DiffusionNFT's
# default, config/base.py sample.global_std = True, applied in flow_grpo/stat_tracking.py), "group" by the std of
# the group's own K rewards.
ADVANTAGE_STDS = ("global", "group")


def group_advantages(rewards: Tensor, *, std: str, eps: float = 1e-4) -> Tensor:
    """rewards [G, K] (K samples per group) -> advantages [G, K] = (r - mean of r's group) / (s + eps), with s the
    population std of all G x K rewards (std="global") or of r's group (std="group").

    With "group", a group whose K rewards differ only by noise (e.g. the quantisation of decoded frames) gets
    advantages of full size; "global" scales every group by the spread of the whole table."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples per group], got {tuple(rewards.shape)}")
    mean = rewards.mean(dim=1, keepdim=True)
    if std == "global":
        scale = rewards.std(unbiased=False)
    elif std == "group":
        scale = rewards.std(dim=1, keepdim=True, unbiased=False)
    else:
        raise ValueError(f"advantage std {std!r}; expected one of {ADVANTAGE_STDS}")
    return (rewards - mean) / (scale + eps)


def sampler_sigma_grid(num_steps: int, shift: float) -> Tensor:
    """The noise levels the sampler visits with `num_steps` Euler steps at `shift`, the final 0 excluded -> [num_steps]
    float32 (4 steps at shift 5: 1, 0.9375, 0.8333, 0.625). NFT trains at these by default, as the reference trains
    at its sampler's own timesteps (DiffusionNFT scripts/train_nft_sd3.py)."""
    return flow_match_sigmas(num_steps, shift)[:-1]


def draw_grid_sigmas(grid: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """`count` noise levels [count] from `grid` [n]: the grid in a random order (a fresh permutation every n draws),
    so the first min(count, n) are distinct, as the reference trains each sample on a shuffled subset of its
    timesteps."""
    if count < 0 or grid.dim() != 1 or grid.numel() == 0:
        raise ValueError(f"draw_grid_sigmas: count {count}, grid of shape {tuple(grid.shape)}")
    orders = [torch.randperm(grid.numel(), generator=generator) for _ in range(-(-count // grid.numel()))]
    order = torch.cat(orders)[:count] if orders else torch.zeros(0, dtype=torch.long)
    return grid[order]


# Where the training sigmas come from: the sampler's own noise levels, or --sigma_sampler within --sigma_min/max.
TRAIN_SIGMAS = ("sampler_grid", "range")
# The --sigma_* flags (recipes/flags.py add_sigma_args); they apply with --train_sigmas range only.
RANGE_FLAGS = ("sigma_sampler", "sigma_min", "sigma_max", "sigma_shift", "logit_mean", "logit_std")


@dataclass(frozen=True)
class TrainSigmas:
    """Where the training noise levels come from, named as train_nft.py's flags: train_sigmas "sampler_grid" (the
    sampler's own noise levels) or "range" (draws of sigma_sampler within [sigma_min, sigma_max], with sigma_shift,
    logit_mean, logit_std: `flow_matching.sample_sigmas`)."""

    train_sigmas: str
    sigma_sampler: str
    sigma_min: float
    sigma_max: float
    sigma_shift: float
    logit_mean: float
    logit_std: float


def training_sigmas(settings: TrainSigmas, grid: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """`count` training noise levels [count] (`settings.train_sigmas`): the sampler's `grid` in a random order, or
    draws of the sigma sampler within [sigma_min, sigma_max]."""
    if settings.train_sigmas == "sampler_grid":
        return draw_grid_sigmas(grid, count, generator)
    return sample_sigmas(settings.sigma_sampler, count, generator, sigma_min=settings.sigma_min,
                         sigma_max=settings.sigma_max, shift=settings.sigma_shift, logit_mean=settings.logit_mean,
                         logit_std=settings.logit_std)


def describe_train_sigmas(settings: TrainSigmas, grid: Tensor) -> str:
    """The training noise levels in words, for the run summary (`grid`: the sampler's, `sampler_sigma_grid`)."""
    if settings.train_sigmas == "sampler_grid":
        return f"on the sampler's grid {{{', '.join(f'{sigma:.4g}' for sigma in grid.tolist())}}}"
    return f"{settings.sigma_sampler} in [{settings.sigma_min:g}, {settings.sigma_max:g}]"


def check_train_sigmas(parser, settings: TrainSigmas, *, train: str, init_weights: str,
                       allow_sigma_below_teacher: bool) -> None:
    """--train_sigmas: the --sigma_* flags apply with `range` only; a range reaching below the distilled Teacher's
    lowest trained sigma is refused for a policy that starts from the Teacher (`train` "lora", or `init_weights`
    "teacher": old policy and reference are the Teacher too), unless `allow_sigma_below_teacher`."""
    if settings.train_sigmas == "sampler_grid":
        changed = [f"--{name}={getattr(settings, name)}" for name in RANGE_FLAGS
                   if getattr(settings, name) != parser.get_default(name)]
        if changed:
            parser.error(f"{' '.join(changed)} with --train_sigmas sampler_grid: the --sigma_* flags apply with "
                         "--train_sigmas range only")
        return
    if not 0 <= settings.sigma_min < settings.sigma_max <= 1:
        parser.error(f"--sigma_min={settings.sigma_min} --sigma_max={settings.sigma_max}: expected 0 <= min < max "
                     "<= 1")
    distilled = train == "lora" or init_weights == "teacher"
    if distilled and settings.sigma_min < DISTILLED_SIGMA_FLOOR and not allow_sigma_below_teacher:
        parser.error(f"--sigma_min={settings.sigma_min} with --train_sigmas range: the policy starts from the "
                     f"distilled Teacher (--train {train}, --init_weights {init_weights}), trained only at sigma >= "
                     f"{DISTILLED_SIGMA_FLOOR:g}; expected --sigma_min >= {DISTILLED_SIGMA_FLOOR:g}, or add "
                     "--allow_sigma_below_teacher")


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


def nft_objective(v_policy: Tensor, v_old: Tensor, v_reference: Tensor, x_t: Tensor, x0: Tensor, t: Tensor,
                  advantage: Tensor, *, beta: float, clip: float, kl_weight: float) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's training loss: nft_loss + kl_weight * mse(v_policy, sg(v_reference)) -> (loss, nft, kl).

    The KL term's gradient, 2 kl_weight (v_policy - v_reference) / numel, moves the policy towards the frozen
    reference (not the old policy: that one is the NFT term's anchor). Shapes as `nft_loss`."""
    nft = nft_loss(v_policy, v_old, x_t, x0, t, advantage, beta=beta, clip=clip)
    kl = torch.mean((v_policy.float() - v_reference.detach().float()) ** 2)
    return nft + kl_weight * kl, nft, kl


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


# ---------------------------------------------------------------------------------------------------------------
# The three models, the gathered rewards, the evaluation against the reference
# ---------------------------------------------------------------------------------------------------------------
class PolicyModels:
    """The policy, the old policy and the reference on one method model.

    lora: one frozen base with the adapters "policy" (trained) and "old_policy" (frozen, a copy of the policy's
    start); the reference is the base with no adapter. full: the trained model plus two frozen copies of its
    initial weights (old policy, reference). `running(name)` yields the model to call for "policy", "old" or
    "reference" (switching the adapter for its duration in lora mode)."""

    def __init__(self, method_model: MethodModel):
        self.method_model = method_model
        model = method_model.model
        if method_model.mode == "lora":
            copy_lora(model, method_model.adapter, OLD_ADAPTER, trainable=False)
            self.old_module = AdapterWeights(model, OLD_ADAPTER)
            self.modules = {"policy": model, "old": model, "reference": model}
            self.adapters = {"policy": method_model.adapter, "old": OLD_ADAPTER, "reference": None}
        else:
            old, reference = (copy.deepcopy(model).requires_grad_(False) for _ in range(2))
            self.old_module = old
            self.modules = {"policy": model, "old": old, "reference": reference}
            self.adapters = None

    @contextlib.contextmanager
    def running(self, name: str):
        model = self.modules[name]
        if self.adapters is None:
            yield model
        else:
            with adapter(model, self.adapters[name]):
                yield model


def gathered(values: Tensor, env: DistEnv) -> Tensor:
    """values [...] of every rank stacked in rank order -> [world, ...] (all_gather; [1, ...] on one process)."""
    if not env.distributed:
        return values[None]
    local = values.to(env.device)
    parts = [torch.empty_like(local) for _ in range(env.world_size)]
    dist.all_gather(parts, local)
    return torch.stack(parts).cpu()


def group_statistics(table: Tensor, names: list[str], advantages: Tensor) -> dict[str, float]:
    """The logged statistics of one step's groups: table [groups, len(names), K] of every reward (`names`, "total"
    among them) and advantages [groups, K] -> each reward's mean and std, the advantages' |mean|, |max| and std,
    and the fraction of groups whose K totals are all equal (no signal)."""
    metrics = {}
    for index, name in enumerate(names):
        metrics[f"reward/{name}/mean"] = float(table[:, index].mean())
        metrics[f"reward/{name}/std"] = float(table[:, index].std(unbiased=False))
    flat_groups = (table[:, names.index(TOTAL)].std(dim=1, unbiased=False) == 0).float().mean()
    metrics.update({"advantage/abs_mean": float(advantages.abs().mean()),
                    "advantage/abs_max": float(advantages.abs().max()),
                    "advantage/std": float(advantages.std(unbiased=False)),
                    "advantage/flat_groups": float(flat_groups)})
    return metrics


@torch.no_grad()
def evaluate_against_reference(rollout: Callable[[dict, str, int], Tensor],
                               rewards: Callable[[Tensor, dict], dict[str, Tensor]], dataset, count: int,
                               env: DistEnv) -> dict:
    """The policy and the reference each roll out once from the same noise on the first `count` clips of `dataset`,
    split over the ranks (the LoRA/one-process models run no collectives): every reward's mean for both, and the
    collapse monitors of the policy's latents against the reference's.

    rollout(item, role, clip_index) -> latents [1, C, T, H, W] of "policy" or "reference" (its noise a function of
    the clip index); rewards(latents [2, ...], item) -> {reward name: [2], ..., "total": [2]}."""
    mine = range(env.rank, min(count, len(dataset)), env.world_size)
    rows = []
    for index in mine:
        item = dataset[index]
        pair = torch.cat([rollout(item, role, index) for role in ("policy", "reference")])
        scores = rewards(pair, item)
        rows.append({"clip_id": item["clip_id"], "latents": pair,
                     "rewards": {name: [float(value) for value in values] for name, values in scores.items()}})
    rows = [row for part in all_gather_objects(rows) for row in part]
    names = list(rows[0]["rewards"])
    report = {"clips": [row["clip_id"] for row in rows], "reward_policy": {}, "reward_reference": {}}
    for name in names:
        report["reward_policy"][name] = sum(row["rewards"][name][0] for row in rows) / len(rows)
        report["reward_reference"][name] = sum(row["rewards"][name][1] for row in rows) / len(rows)
    policy_latents = torch.cat([row["latents"][:1] for row in rows])
    reference_latents = torch.cat([row["latents"][1:] for row in rows])
    report["monitors"] = collapse_monitors(policy_latents, reference_latents)
    report["policy_wins"] = sum(row["rewards"][TOTAL][0] > row["rewards"][TOTAL][1] for row in rows)
    return report
