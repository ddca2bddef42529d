"""DisCa-style adversarial training pieces: a conditional discriminator on hidden tokens and its losses.

The discriminator tells the Teacher's final hidden (real) from the Predictor's (fake), conditioned on the step's
timestep and on a summary of the context. Losses are the hinge pair, with a lazy R1 penalty on real inputs and a
warm-up of the adversarial weight:

    L_D = mean(relu(1 - D(real))) + mean(relu(1 + D(sg(fake))))     (+ r1_weight/2 * E|dD(real)/d real|^2, lazily)
    L_G = -mean(D(fake))                                              (D's parameters frozen for this loss)

`discriminator_loss` detaches the fake and `generator_loss` runs D with its parameters out of the graph, so neither
side's loss reaches the other's parameters (tests/methods/test_adversarial.py checks it).

Precision: the real hiddens come in their storage / Teacher dtype (BF16 in a real run), the fake (the Predictor's
FP32 residual sum) does not, so D could tell them apart by the rounding alone. `Adversary` therefore shows D the fake
rounded to the real's dtype, with a straight-through estimator (`on_real_grid`: forward the rounded values, backward
the identity), in both D's loss and the generator term.

A training run (fvtools/train_adversarial.py) has two roles, "predictor" and "discriminator". The discriminator's
side of it lives here: `build_discriminator` (from its own random stream), `build_discriminator_role` (its AdamW,
cosine schedule and cadence), `context_summary` (its context condition), `Adversary` (its update and the
Predictor's warmed-up generator term) and `adversarial_metrics` / `hidden_monitors` (what a step logs of it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.func import functional_call

from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer
from predictor_training.runtime.random_streams import stream_seed
from predictor_training.runtime.roles import Role
from predictor_training.teacher import ContextKV

PREDICTOR, DISCRIMINATOR = "predictor", "discriminator"  # the roles of an adversarial run
DISCRIMINATOR_STREAM = 0xD15C  # the discriminator's initialisation stream: stream_seed(seed, DISCRIMINATOR_STREAM)


def timestep_features(timestep: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal features [B, dim] of timesteps [B] (0..1000)."""
    half = dim // 2
    frequencies = torch.exp(-math.log(max_period) * torch.arange(half, device=timestep.device) / half)
    angles = timestep.float()[:, None] * frequencies[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class HiddenDiscriminator(nn.Module):
    """D(hidden [B, N, D], timestep [B], context [B, D] or None) -> logits [B].

    Tokens are normalised and projected, modulated by the condition (timestep features + context summary; FiLM),
    passed through one more layer, mean-pooled over tokens and mapped to one logit.
    """

    def __init__(self, hidden_size: int, width: int = 256, time_dim: int = 64):
        super().__init__()
        self.time_dim = time_dim
        self.norm = nn.LayerNorm(hidden_size)
        self.token_in = nn.Linear(hidden_size, width)
        self.condition = nn.Sequential(nn.Linear(time_dim + hidden_size, width), nn.SiLU(),
                                       nn.Linear(width, 2 * width))
        self.token_mid = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        self.hidden_size = hidden_size

    def forward(self, hidden: Tensor, timestep: Tensor, context: Tensor | None = None) -> Tensor:
        if context is None:
            context = hidden.new_zeros(hidden.shape[0], self.hidden_size)
        condition = torch.cat([timestep_features(timestep, self.time_dim).to(hidden.dtype), context], dim=-1)
        scale, shift = self.condition(condition).unsqueeze(1).chunk(2, dim=-1)
        x = nn.functional.silu(self.token_in(self.norm(hidden)) * (1 + scale) + shift)
        x = nn.functional.silu(self.token_mid(x))
        return self.head(x.mean(dim=1)).squeeze(-1)


def discriminator_loss(discriminator: nn.Module, real: Tensor, fake: Tensor, timestep: Tensor,
                       context: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Hinge loss of D on real and detached fake hiddens; metrics: loss, accuracy (real > 0, fake < 0) and the mean
    logits D(real), D(fake)."""
    real_logits = discriminator(real.detach(), timestep, context)
    fake_logits = discriminator(fake.detach(), timestep, context)
    loss = torch.relu(1 - real_logits).mean() + torch.relu(1 + fake_logits).mean()
    accuracy = 0.5 * (float((real_logits > 0).float().mean()) + float((fake_logits < 0).float().mean()))
    return loss, {"discriminator/loss": float(loss.detach()), "discriminator/accuracy": accuracy,
                  "discriminator/real_logit_mean": float(real_logits.detach().float().mean()),
                  "discriminator/fake_logit_mean": float(fake_logits.detach().float().mean())}


def r1_penalty(discriminator: nn.Module, real: Tensor, timestep: Tensor, context: Tensor | None = None) -> Tensor:
    """E_batch |dD(real)/d real|^2 (with a graph, so it trains D). Apply it every k-th D step, weighted by k * r1/2
    (lazy regularisation)."""
    real = real.detach().requires_grad_(True)
    logits = discriminator(real, timestep, context)
    (gradient,) = torch.autograd.grad(logits.sum(), real, create_graph=True)
    return gradient.pow(2).flatten(1).sum(dim=1).mean()


def generator_loss(discriminator: nn.Module, fake: Tensor, timestep: Tensor, context: Tensor | None = None) -> Tensor:
    """-mean(D(fake)), with D's parameters as constants: the gradient reaches `fake` (the Predictor), never D."""
    frozen = {name: parameter.detach() for name, parameter in discriminator.named_parameters()}
    return -functional_call(discriminator, frozen, (fake, timestep, context)).mean()


def on_real_grid(fake: Tensor, real_dtype: torch.dtype) -> Tensor:
    """The fake hidden, FP32, with its values rounded to `real_dtype` (e.g. BF16) and a straight-through gradient:
    forward `fake.to(real_dtype)` exactly (as FP32), backward the identity (the gradient reaches `fake` unrounded).
    A real dtype at least as fine as FP32 leaves the values unchanged."""
    fake = fake.float()
    if not real_dtype.is_floating_point:
        raise ValueError(f"on_real_grid: the real hiddens' dtype {real_dtype} is not a floating dtype")
    if torch.finfo(real_dtype).eps <= torch.finfo(torch.float32).eps:
        return fake
    rounded = fake.detach().to(real_dtype).float()
    # (rounded - fake) is exact (Sterbenz: the two are within a factor 2), so the sum is `rounded` exactly.
    return fake + (rounded - fake.detach())


def adversarial_weight(step: int, weight: float, warmup_steps: int) -> float:
    """Linear warm-up of the adversarial loss weight: 0 at step 0, `weight` from `warmup_steps` on."""
    if warmup_steps <= 0:
        return weight
    return weight * min(1.0, step / warmup_steps)


# ---- the discriminator's role in a training run -----------------------------------------------------------------
def build_discriminator(hidden_size: int, *, width: int, seed: int, device: torch.device) -> HiddenDiscriminator:
    """A `HiddenDiscriminator` initialised from its own random stream `stream_seed(seed, DISCRIMINATOR_STREAM)`: the
    global RNG (the Predictor's, the data's) is left exactly as it was, and every rank builds the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, DISCRIMINATOR_STREAM))
        discriminator = HiddenDiscriminator(hidden_size, width=width)
    return discriminator.to(device)


def build_discriminator_role(discriminator: HiddenDiscriminator, *, lr: float, betas: tuple[float, float],
                             weight_decay: float, grad_clip: float, every: int, max_steps: int) -> Role:
    """The "discriminator" role: its own AdamW (one group) with a cosine to 0 over its own updates (no warm-up),
    due every `every` of the loop's `max_steps` steps.

    Its gradients are averaged over ranks by the loop (grad_sync "all_reduce") instead of a DDP wrapper: D runs
    three forwards per update (real, fake, and R1's input-gradient pass with create_graph), which DDP's reducer
    does not support."""
    optimizer = build_optimizer({DISCRIMINATOR: list(discriminator.parameters())}, {DISCRIMINATOR: lr},
                                betas=betas, weight_decay=weight_decay)
    schedule = WarmupCosineSchedule(optimizer, warmup_steps=0, max_steps=max_steps // every)
    return Role(DISCRIMINATOR, discriminator, optimizer, schedule, every=every, grad_clip=grad_clip,
                grad_sync="all_reduce")


def context_summary(context: ContextKV) -> Tensor:
    """The discriminator's context condition [B, D]: the mean over context tokens of the raw V of the last layer of
    `context` (the later source block), heads concatenated; detached, FP32. context: ContextKV whose layers hold
    [B, heads, S, head_dim]."""
    values = context.layers[-1].rope_v.detach().float()
    return values.mean(dim=2).flatten(1)


def hidden_monitors(pred_hidden: Tensor, target_hidden: Tensor) -> dict[str, float]:
    """Std of the Predictor's hidden against the Teacher's (a flat output shows as hidden_std_ratio -> 0)."""
    with torch.no_grad():
        ours, theirs = float(pred_hidden.detach().float().std()), float(target_hidden.detach().float().std())
    return {"monitor/hidden_std": ours, "monitor/teacher_hidden_std": theirs,
            "monitor/hidden_std_ratio": ours / max(theirs, 1e-12)}


def adversarial_metrics(weight: float, generator: float | None, discriminator_metrics: dict[str, float],
                        pred_hidden: Tensor, target_hidden: Tensor) -> dict[str, float]:
    """A step's adversarial/* and monitor/* metrics. generator: the generator term the Predictor was trained with,
    or None where the weight was 0 and no term was built (then -mean D(fake) as the discriminator pass measured it)."""
    if generator is None:
        generator = -discriminator_metrics["discriminator/fake_logit_mean"]
    return {"adversarial/weight": weight, "adversarial/generator_loss": generator,
            **hidden_monitors(pred_hidden, target_hidden)}


class Adversary:
    """The discriminator's side of a step, and the Predictor's adversarial weight.

    predictor_role / discriminator_role: the run's two roles (their update counts drive the weight warm-up and the
    lazy R1 cadence, and are restored on resume); D is `discriminator_role.raw_module` (no DDP wrapper).
    adv_weight, adv_warmup_steps: `adversarial_weight`; r1_weight, r1_every: the lazy R1 penalty's gamma and period.
    """

    def __init__(self, predictor_role: Role, discriminator_role: Role, *, adv_weight: float, adv_warmup_steps: int,
                 r1_weight: float, r1_every: int):
        self.discriminator = discriminator_role.raw_module
        self.predictor_role = predictor_role
        self.discriminator_role = discriminator_role
        self.adv_weight = adv_weight
        self.adv_warmup_steps = adv_warmup_steps
        self.r1_weight = r1_weight
        self.r1_every = r1_every

    def check_due(self, due: frozenset[str]) -> None:
        if PREDICTOR not in due or not due <= {PREDICTOR, DISCRIMINATOR}:
            raise ValueError(f"the adversarial recipe trains {PREDICTOR!r} every step and {DISCRIMINATOR!r} on its "
                             f"cadence; the loop says {sorted(due)} are due")

    def weight(self) -> float:
        """The adversarial weight of this step: warm-up over the Predictor updates done so far."""
        return adversarial_weight(self.predictor_role.updates, self.adv_weight, self.adv_warmup_steps)

    def generator_term(self, pred_hidden: Tensor, timestep: Tensor, condition: Tensor, *,
                       real_dtype: torch.dtype) -> Tensor:
        """-mean D(pred_hidden on the real's grid | timestep, condition) with D's parameters frozen (gradient reaches
        the Predictor only, through the straight-through rounding to `real_dtype`, the real hiddens' dtype).
        pred_hidden [B, N, D], timestep [B], condition [B, D]."""
        return generator_loss(self.discriminator, on_real_grid(pred_hidden, real_dtype), timestep.float(), condition)

    def discriminator_pass(self, real: Tensor, fake: Tensor, timestep: Tensor, condition: Tensor, *,
                           train: bool) -> dict[str, float]:
        """Hinge loss of D on real [B, N, D] (in its own dtype) vs detached fake [B, N, D] rounded to the real's dtype
        (+ lazy R1 on real): backward into D when `train` (D is due), else measured without gradients. Returns the
        discriminator/* metrics."""
        fake = on_real_grid(fake.detach(), real.dtype)
        real, timestep = real.detach().float(), timestep.detach().float()
        if not train:
            with torch.no_grad():
                _, metrics = discriminator_loss(self.discriminator, real, fake, timestep, condition)
            return {**metrics, "discriminator/r1_applied": 0.0}
        loss, metrics = discriminator_loss(self.discriminator, real, fake, timestep, condition)
        # Lazy R1: on every r1_every-th update of D (counted from its first), weighted by r1_every.
        apply_r1 = self.r1_weight > 0 and self.discriminator_role.updates % self.r1_every == 0
        if apply_r1:
            penalty = r1_penalty(self.discriminator, real, timestep, condition)
            loss = loss + 0.5 * self.r1_weight * self.r1_every * penalty
            metrics["discriminator/r1"] = float(penalty.detach())
        loss.backward()
        return {**metrics, "discriminator/r1_applied": float(apply_r1)}
