"""DiffusionNFT (predictor_training/methods/nft.py).

On a toy: a linear velocity policy v = w0 + w1 x_t, a 10-step Euler sampler from N(0, 1), reward -(x - 3)^2,
16 groups x 8 samples, beta 0.1, advantage clip 5: the mean reward rises, a zero advantage gives no update.
On tensors of a few numbers with closed-form answers: the advantage's sign and std, which way a positive advantage
and the KL term move the policy, the old policy's EMA and its schedule, the training sigmas on the sampler's grid."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from predictor_training.methods.nft import (
    OldPolicy,
    draw_grid_sigmas,
    group_advantages,
    nft_loss,
    nft_objective,
    old_policy_decay,
    sampler_sigma_grid,
)
from predictor_training.runtime.random_streams import stream_generator


SIGN_BETA, SIGN_CLIP = 1.0, 5.0


# ---------------------------------------------------------------------------------------------------------------
# NFT
# ---------------------------------------------------------------------------------------------------------------
def test_advantage_sign_and_global_std():
    """A = (r - mean of the group) / (std + 1e-4): the better sample of a group gets the positive advantage; std is
    the whole table's (global, the reference's default) or the group's own."""
    rewards = torch.tensor([[0.0, 2.0], [10.0, 10.0]], dtype=torch.float64)
    table_std = (torch.tensor([-5.5, -3.5, 4.5, 4.5], dtype=torch.float64) ** 2).mean().sqrt()  # sqrt(20.75)
    expected_global = torch.tensor([[-1.0, 1.0], [0.0, 0.0]], dtype=torch.float64) / (table_std + 1e-4)
    expected_group = torch.tensor([[-1.0, 1.0], [0.0, 0.0]], dtype=torch.float64) / (1.0 + 1e-4)
    torch.testing.assert_close(group_advantages(rewards, std="global"), expected_global, rtol=0, atol=1e-12)
    torch.testing.assert_close(group_advantages(rewards, std="group"), expected_group, rtol=0, atol=1e-12)
    # global: a group whose rewards differ by a hair keeps a hair-sized advantage; group: it is blown up to +-1
    rewards = torch.tensor([[0.0, 1e-2], [0.0, 4.0]], dtype=torch.float64)
    assert 0 < group_advantages(rewards, std="global")[0, 1] < 1e-2
    assert group_advantages(rewards, std="group")[0, 1] > 0.95
    with pytest.raises(ValueError, match="expected one of"):
        group_advantages(rewards, std="batch")


def _policy_step(advantage: float) -> tuple[float, float, float]:
    """One 1-D sample: x0 = 0, x_t = 1 at t = 0.5 (the velocity that maps x_t to x0 is v* = 2); old policy and
    policy both at v = 1. Returns (dL/dv_theta, e+, e-) with e± = x0± - x0 at v_theta = v_old."""
    x0, x_t, t = torch.zeros(1), torch.ones(1), torch.full((1,), 0.5)
    v_old = torch.ones(1)
    v_theta = torch.ones(1, requires_grad=True)
    loss = nft_loss(v_theta, v_old, x_t, x0, t, torch.tensor([advantage]), beta=SIGN_BETA, clip=SIGN_CLIP)
    loss.backward()
    estimate = float(x_t - t * v_old - x0)  # x0+ = x0- = 0.5 at v_theta = v_old
    return float(v_theta.grad), estimate, estimate


def test_nft_positive_advantage_pulls_the_policy_towards_the_sample():
    """r = 1 (A >= c): L = (c/β) |x0+ - x0|^2 / sg|x0+ - x0|, x0+ = x_t - t v_θ (β = 1), so dL/dv_θ = -2 c t
    sign(e+): a descent step moves v_θ from 1 towards v* = 2 (x0+ towards the sample). r = 0 (A <= -c): the negative
    policy x0- = x_t - t (2 v_old - v_θ) is pulled instead, dL/dv_θ = +2 c t sign(e-): v_θ moves away from v*."""
    gradient, e_positive, _ = _policy_step(SIGN_CLIP)
    assert e_positive > 0
    assert gradient == pytest.approx(-2 * SIGN_CLIP * 0.5)  # -5: v_theta rises towards 2
    gradient, _, e_negative = _policy_step(-SIGN_CLIP)
    assert e_negative > 0
    assert gradient == pytest.approx(2 * SIGN_CLIP * 0.5)  # +5: v_theta falls, away from the sample
    assert _policy_step(0.0)[0] == pytest.approx(0.0, abs=1e-7)  # r = 1/2 at v_theta = v_old: the terms cancel


def test_nft_objective_kl_pulls_the_policy_towards_the_reference():
    """loss = nft + λ mse(v_θ, sg v_ref): its gradient at zero advantage and v_θ = v_old is exactly
    2 λ (v_θ - v_ref) / n, so a descent step moves the policy towards the reference (not the old policy, not away)."""
    v_policy = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    v_old = v_policy.detach().clone()
    v_reference = torch.tensor([0.0, 1.0, 0.5])
    x_t, x0, t = torch.tensor([0.3, 0.1, -0.2]), torch.tensor([0.0, 0.5, 1.0]), torch.full((3,), 0.625)
    kl_weight = 0.25
    loss, nft, kl = nft_objective(v_policy, v_old, v_reference, x_t, x0, t, torch.zeros(3), beta=SIGN_BETA, clip=SIGN_CLIP,
                                  kl_weight=kl_weight)
    loss.backward()
    expected_kl = float(((v_policy.detach() - v_reference) ** 2).mean())  # (1 + 9 + 0) / 3
    assert float(kl.detach()) == pytest.approx(expected_kl)
    assert float(loss.detach()) == pytest.approx(float(nft.detach()) + kl_weight * expected_kl)
    torch.testing.assert_close(v_policy.grad, 2 * kl_weight * (v_policy.detach() - v_reference) / 3, rtol=1e-6,
                               atol=1e-7)
    moved = v_policy.detach() - 0.1 * v_policy.grad
    assert ((moved - v_reference).abs() <= (v_policy.detach() - v_reference).abs()).all()
    assert ((moved - v_reference).abs() < (v_policy.detach() - v_reference).abs()).any()


def test_old_policy_ema_moves_the_old_policy_by_one_minus_decay():
    """old <- d old + (1 - d) policy: with d = 0.9 the old policy moves a tenth of the way (0 -> 0.1), not nine."""
    policy, old_module = nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False).requires_grad_(False)
    with torch.no_grad():
        policy.weight.fill_(1.0)
        old_module.weight.fill_(0.0)
    old = OldPolicy(old_module, "constant", 0.9)
    old.update(policy)
    assert float(old_module.weight) == pytest.approx(0.1)
    old.update(policy)
    assert float(old_module.weight) == pytest.approx(0.19)  # 0.9 * 0.1 + 0.1 * 1
    assert float(policy.weight.detach()) == 1.0  # the policy is never touched


def test_training_sigmas_are_the_samplers_grid():
    """The default training sigmas are the sampler's own non-zero sigmas (4 steps at shift 5: 1, .9375, .8333,
    .625), drawn as a permutation per sample (distinct while the grid lasts)."""
    grid = sampler_sigma_grid(4, 5.0)
    torch.testing.assert_close(grid, torch.tensor([1.0, 0.9375, 5 / 6, 0.625]), rtol=0, atol=1e-7)
    assert float(grid.min()) > 0
    generator = stream_generator(0)
    drawn = draw_grid_sigmas(grid, 3, generator)
    assert len(set(drawn.tolist())) == 3 and set(drawn.tolist()) <= set(grid.tolist())
    drawn = draw_grid_sigmas(grid, 9, generator)
    assert sorted(drawn[:4].tolist()) == sorted(grid.tolist())  # every grid sigma once, then again
    assert sorted(drawn[4:8].tolist()) == sorted(grid.tolist())
    assert draw_grid_sigmas(grid, 0, generator).numel() == 0


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


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


# ---------------------------------------------------------------------------------------------------------------
# old policy
# ---------------------------------------------------------------------------------------------------------------
def test_old_policy_follows_its_schedule():
    assert [old_policy_decay("ramp_slow", u) for u in (1, 250, 500, 900)] == [0.001, 0.25, 0.5, 0.5]
    assert old_policy_decay("ramp_delayed", 74) == 0.0 and old_policy_decay("ramp_delayed", 75) == 0.0
    assert old_policy_decay("ramp_delayed", 175) == pytest.approx(0.75)
    assert old_policy_decay("ramp_delayed", 10_000) == 0.999
    assert old_policy_decay("zero", 7) == 0.0 and old_policy_decay("constant", 3, 0.9) == 0.9
    with pytest.raises(ValueError, match="expected one of"):
        old_policy_decay("cosine", 1)
    policy = nn.Linear(3, 2)
    old_module = nn.Linear(3, 2).requires_grad_(False)
    old_module.load_state_dict(policy.state_dict())
    old = OldPolicy(old_module, "constant", 0.75)
    expected = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    for update in range(3):
        with torch.no_grad():
            for param in policy.parameters():
                param.add_(1.0 + update)
        old.update(policy)
        expected = {name: 0.75 * expected[name] + 0.25 * param for name, param in policy.state_dict().items()}
        for name, tensor in old_module.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    assert old.updates == 3
    restored = OldPolicy(nn.Linear(3, 2).requires_grad_(False), "constant", 0.75)
    restored.load_state_dict(old.state_dict())
    assert restored.updates == 3 and torch.equal(restored.old_module.weight, old_module.weight)
    with pytest.raises(ValueError, match="saved schedule constant"):
        OldPolicy(nn.Linear(3, 2).requires_grad_(False), "zero").load_state_dict(old.state_dict())
    zero = OldPolicy(old_module, "zero")
    zero.update(policy)  # decay 0: the old policy becomes the policy
    assert torch.equal(old_module.weight, policy.weight)
