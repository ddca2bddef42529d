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
