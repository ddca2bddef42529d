"""DisCa-style adversarial training pieces: a conditional discriminator on hidden tokens and its losses.

The discriminator tells the Teacher's final hidden (real) from the Predictor's (fake), conditioned on the step's
timestep and on a summary of the context. Losses are the hinge pair, with a lazy R1 penalty on real inputs and a
warm-up of the adversarial weight:

    L_D = mean(relu(1 - D(real))) + mean(relu(1 + D(sg(fake))))     (+ r1_weight/2 * E|dD(real)/d real|^2, lazily)
    L_G = -mean(D(fake))                                              (D's parameters frozen for this loss)

`discriminator_loss` detaches the fake and `generator_loss` runs D with its parameters out of the graph, so neither
side's loss reaches the other's parameters (tests/test_adversarial.py checks it). fvtools/train_adversarial.py trains a
Predictor with them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.func import functional_call


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


def adversarial_weight(step: int, weight: float, warmup_steps: int) -> float:
    """Linear warm-up of the adversarial loss weight: 0 at step 0, `weight` from `warmup_steps` on."""
    if warmup_steps <= 0:
        return weight
    return weight * min(1.0, step / warmup_steps)
