"""DiffusionNFT's loss (predictor_training/methods/nft.py) on a toy: a linear velocity policy v = w0 + w1 x_t,
a 10-step Euler sampler from N(0, 1), reward -(x - 3)^2, 16 groups x 8 samples, beta 0.1, advantage clip 5."""

from __future__ import annotations

import torch

from predictor_training.methods.nft import group_advantages, nft_loss
from predictor_training.runtime.random_streams import stream_generator

GROUPS, PER_GROUP, BETA, CLIP = 16, 8, 0.1, 5.0


def velocity(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return w[0] + w[1] * x


def sample(w: torch.Tensor, generator: torch.Generator, steps: int = 10) -> torch.Tensor:
    """Euler from noise at sigma 1 to sigma 0 with the policy `w` (no graph) -> x0 [GROUPS * PER_GROUP]."""
    sigmas = torch.linspace(1, 0, steps + 1)
    x = torch.randn(GROUPS * PER_GROUP, generator=generator)
    with torch.no_grad():
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * velocity(w, x)
    return x


def noised(x0: torch.Tensor, generator: torch.Generator):
    t = 0.01 + 0.98 * torch.rand(x0.shape, generator=generator)
    return (1 - t) * x0 + t * torch.randn(x0.shape, generator=generator), t


def test_mean_reward_rises():
    generator = stream_generator(0)
    w = torch.zeros(2, requires_grad=True)
    old = w.detach().clone()
    optimizer = torch.optim.Adam([w], lr=0.05)
    rewards = []
    for outer in range(31):
        x0 = sample(old, generator)
        reward = -(x0 - 3) ** 2
        rewards.append(float(reward.mean()))
        advantage = group_advantages(reward.view(GROUPS, PER_GROUP), std="group").view(-1)
        for _ in range(4):
            x_t, t = noised(x0, generator)
            loss = nft_loss(velocity(w, x_t), velocity(old, x_t), x_t, x0, t, advantage, beta=BETA, clip=CLIP)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        old = w.detach().clone()  # the old policy refreshed after every outer step (decay 0)
    assert rewards[30] > rewards[0] + 5, rewards  # about -9.0 -> -0.3


def gradient_at_the_old_policy(advantage: torch.Tensor) -> torch.Tensor:
    generator = stream_generator(1)
    w = torch.tensor([0.3, -0.2], requires_grad=True)
    x0 = sample(w.detach(), generator)
    x_t, t = noised(x0, generator)
    nft_loss(velocity(w, x_t), velocity(w.detach(), x_t), x_t, x0, t, advantage, beta=BETA, clip=CLIP).backward()
    return w.grad


def test_zero_advantage_gives_no_update_and_nonzero_gives_one():
    size = GROUPS * PER_GROUP
    assert gradient_at_the_old_policy(torch.zeros(size)).abs().max() < 1e-6
    rewards = torch.randn(GROUPS, PER_GROUP, generator=stream_generator(2))
    advantage = group_advantages(rewards, std="group").view(-1)
    assert gradient_at_the_old_policy(advantage).abs().max() > 1e-3


def test_advantages_are_normalised_within_each_group():
    rewards = torch.randn(4, 8, generator=stream_generator(3)) * torch.tensor([[1.0], [10.0], [0.1], [5.0]])
    rewards = rewards + torch.tensor([[0.0], [100.0], [-3.0], [7.0]])
    advantage = group_advantages(rewards, std="group")
    torch.testing.assert_close(advantage.mean(dim=1), torch.zeros(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(advantage.std(dim=1, unbiased=False), torch.ones(4), atol=1e-3, rtol=0)
    # a group's advantages depend on that group only
    changed = rewards.clone()
    changed[1] += 1000
    torch.testing.assert_close(group_advantages(changed, std="group")[[0, 2, 3]], advantage[[0, 2, 3]])
