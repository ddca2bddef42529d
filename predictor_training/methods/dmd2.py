"""Distribution matching distillation (DMD2), the losses: what the generator and the fake-score critic optimise.

A generator makes samples x̂ (latents of the clean data). Two score models see them noised at a level σ drawn inside
its bounds (`flow_matching.sample_sigmas`, never clamped), each giving its x0 estimate (`x0 = x_σ - σ v`):

    real score  (frozen) the data distribution's posterior mean            -> x0_real
    fake score  (critic, trained) the generator distribution's posterior mean -> x0_fake

Their difference points from the data towards the generator's samples, so moving x̂ against it moves the generator
distribution towards the data (a KL gradient). DMD2 normalises it per sample by the mean distance of the sample to
the real estimate:

    g   = (x0_fake - x0_real) / mean|x̂ - x0_real|         (per sample, over every non-batch axis; NaN/Inf -> 0)
    L_G = 0.5 * mean((x̂ - sg(x̂ - g))^2)                  (so dL_G/dx̂ = g / numel: the gradient g, scaled)

and the critic learns the generator's distribution by flow matching on the same, detached, sample:

    L_critic = mean((v_fake(x_σ') - (noise' - sg(x̂)))^2)

The sign is the one of DMD2 and FastVideo (FastVideo issue #836): x0_fake - x0_real in x0 space. The toy test on 1-D
Gaussians (tests/methods/test_dmd2.py) pins it: with the scores swapped the generator moves away.
"""

from __future__ import annotations

import torch
from torch import Tensor

from predictor_training.methods.flow_matching import velocity_target


def dmd_gradient(x0_fake: Tensor, x0_real: Tensor, sample: Tensor) -> Tensor:
    """The normalised DMD gradient g (module docstring), shape of `sample` [B, ...], float32, no graph."""
    with torch.no_grad():
        sample, x0_fake, x0_real = sample.float(), x0_fake.float(), x0_real.float()
        axes = tuple(range(1, sample.dim()))
        scale = (sample - x0_real).abs().mean(dim=axes, keepdim=True) if axes else (sample - x0_real).abs().mean()
        return torch.nan_to_num((x0_fake - x0_real) / scale, nan=0.0, posinf=0.0, neginf=0.0)


def dmd_generator_loss(sample: Tensor, gradient: Tensor) -> Tensor:
    """0.5 * mse(x̂, sg(x̂ - g)) in float32: its gradient with respect to x̂ is g / x̂.numel()."""
    sample = sample.float()
    target = (sample - gradient.float()).detach()
    return 0.5 * torch.mean((sample - target) ** 2)


def critic_loss(velocity: Tensor, noise: Tensor, sample: Tensor) -> Tensor:
    """Flow-matching loss of the fake score on the detached generator sample: mean((v - (noise - x̂))^2), float32."""
    return torch.mean((velocity.float() - velocity_target(sample.detach().float(), noise.float())) ** 2)
