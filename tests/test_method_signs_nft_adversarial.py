"""Signs and roles of DiffusionNFT (predictor_training/methods/nft.py) and of the adversarial pieces
(predictor_training/methods/adversarial.py), on tensors of a few numbers with closed-form answers: which way one
update moves, and the exact value it has. Each test names the convention it pins; a flipped sign, a swapped role or
a dropped straight-through path fails it (the mutations are listed in the issue-22 report).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from predictor_training.methods.adversarial import Adversary, discriminator_loss, generator_loss, on_real_grid
from predictor_training.methods.nft import (
    OldPolicy,
    draw_grid_sigmas,
    group_advantages,
    nft_loss,
    nft_objective,
    sampler_sigma_grid,
)
from predictor_training.runtime.random_streams import stream_generator

BETA, CLIP = 1.0, 5.0


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
    loss = nft_loss(v_theta, v_old, x_t, x0, t, torch.tensor([advantage]), beta=BETA, clip=CLIP)
    loss.backward()
    estimate = float(x_t - t * v_old - x0)  # x0+ = x0- = 0.5 at v_theta = v_old
    return float(v_theta.grad), estimate, estimate


def test_nft_positive_advantage_pulls_the_policy_towards_the_sample():
    """r = 1 (A >= c): L = (c/β) |x0+ - x0|^2 / sg|x0+ - x0|, x0+ = x_t - t v_θ (β = 1), so dL/dv_θ = -2 c t
    sign(e+): a descent step moves v_θ from 1 towards v* = 2 (x0+ towards the sample). r = 0 (A <= -c): the negative
    policy x0- = x_t - t (2 v_old - v_θ) is pulled instead, dL/dv_θ = +2 c t sign(e-): v_θ moves away from v*."""
    gradient, e_positive, _ = _policy_step(CLIP)
    assert e_positive > 0
    assert gradient == pytest.approx(-2 * CLIP * 0.5)  # -5: v_theta rises towards 2
    gradient, _, e_negative = _policy_step(-CLIP)
    assert e_negative > 0
    assert gradient == pytest.approx(2 * CLIP * 0.5)  # +5: v_theta falls, away from the sample
    assert _policy_step(0.0)[0] == pytest.approx(0.0, abs=1e-7)  # r = 1/2 at v_theta = v_old: the terms cancel


def test_nft_objective_kl_pulls_the_policy_towards_the_reference():
    """loss = nft + λ mse(v_θ, sg v_ref): its gradient at zero advantage and v_θ = v_old is exactly
    2 λ (v_θ - v_ref) / n, so a descent step moves the policy towards the reference (not the old policy, not away)."""
    v_policy = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    v_old = v_policy.detach().clone()
    v_reference = torch.tensor([0.0, 1.0, 0.5])
    x_t, x0, t = torch.tensor([0.3, 0.1, -0.2]), torch.tensor([0.0, 0.5, 1.0]), torch.full((3,), 0.625)
    kl_weight = 0.25
    loss, nft, kl = nft_objective(v_policy, v_old, v_reference, x_t, x0, t, torch.zeros(3), beta=BETA, clip=CLIP,
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


# ---------------------------------------------------------------------------------------------------------------
# Adversarial
# ---------------------------------------------------------------------------------------------------------------
class LinearCritic(nn.Module):
    """D(h) = a * mean over tokens and features of h [B, N, D] -> [B]; records its inputs."""

    def __init__(self, a: float = 1.0):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a))
        self.inputs: list[torch.Tensor] = []

    def forward(self, hidden, timestep, context=None):
        self.inputs.append(hidden)
        return self.a * hidden.mean(dim=(1, 2))


class SquareCritic(nn.Module):
    """D(h) = a * sum h^2 per sample -> [B]: dD/dh = 2 a h, so R1 = E_b 4 a^2 sum h_b^2."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(1.0))

    def forward(self, hidden, timestep, context=None):
        return self.a * hidden.pow(2).sum(dim=(1, 2))


def _adversary(discriminator: nn.Module, r1_weight: float = 0.0) -> Adversary:
    roles = SimpleNamespace(raw_module=discriminator, updates=0)
    return Adversary(SimpleNamespace(updates=0), roles, adv_weight=1.0, adv_warmup_steps=0, r1_weight=r1_weight,
                     r1_every=1)


def test_generator_loss_is_minus_mean_critic_and_raises_the_fakes_score():
    critic = LinearCritic(2.0)
    fake = torch.full((2, 3, 5), 0.5, requires_grad=True)
    loss = generator_loss(critic, fake, torch.zeros(2))
    assert float(loss.detach()) == pytest.approx(-1.0)  # -mean(2 * 0.5)
    loss.backward()
    torch.testing.assert_close(fake.grad, torch.full((2, 3, 5), -2.0 / 30))  # d(-mean a h)/dh
    assert critic.a.grad is None  # D's parameters are constants here
    with torch.no_grad():  # a descent step on the generator loss raises D(fake)
        assert float(critic(fake - 0.1 * fake.grad, torch.zeros(2)).mean()) > 1.0


def test_hinge_discriminator_loss_raises_real_and_lowers_fake():
    """L_D = mean relu(1 - D(real)) + mean relu(1 + D(fake)): D(real) = 0.5, D(fake) = -0.25 gives 0.5 + 0.75, and
    dL/da = -mean h_real + mean h_fake = -0.75 (a rises: D(real) up, D(fake) down)."""
    critic = LinearCritic(1.0)
    real, fake = torch.full((2, 3, 5), 0.5), torch.full((2, 3, 5), -0.25)
    loss, metrics = discriminator_loss(critic, real, fake, torch.zeros(2))
    assert float(loss.detach()) == pytest.approx(1.25)
    assert metrics["discriminator/accuracy"] == 1.0  # real > 0, fake < 0 counts as right
    loss.backward()
    assert float(critic.a.grad) == pytest.approx(-0.75)


def test_r1_is_taken_on_the_real_hiddens_only():
    """D = a sum h^2, a = 1: real = 1 (12 entries per sample) gives R1 = 4 * 12 = 48, fake = 0.5 would give 12. With
    gamma = 1 and r1_every = 1 the loss is relu(1 - 12) + relu(1 + 3) + 0.5 * 48 a^2: dL/da = 3 + 48 = 51."""
    critic = SquareCritic()
    real, fake = torch.ones(2, 3, 4), torch.full((2, 3, 4), 0.5)
    metrics = _adversary(critic, r1_weight=1.0).discriminator_pass(real, fake, torch.zeros(2), None, train=True)
    assert metrics["discriminator/r1_applied"] == 1.0
    assert metrics["discriminator/r1"] == pytest.approx(48.0)
    assert float(critic.a.grad) == pytest.approx(51.0)


def test_fake_is_rounded_to_the_reals_grid_with_a_straight_through_gradient():
    """The real hiddens are BF16, the fake FP32: D sees the fake rounded to BF16 (in its own loss and in the
    generator term), while the generator's gradient reaches the fake unrounded: exactly the FP32 gradient of D at the
    rounded input (-a / n everywhere; 1/30 is not a BF16 number, so a plain cast's BF16 backward would differ)."""
    generator = stream_generator(5)
    fake = (1 + torch.rand(2, 3, 5, generator=generator) * 1e-2).requires_grad_(True)  # off the BF16 grid
    rounded = fake.detach().bfloat16().float()
    assert not torch.equal(rounded, fake.detach())
    real = torch.randn(2, 3, 5, generator=generator).bfloat16()
    critic = LinearCritic(1.0)
    adversary = _adversary(critic)
    adversary.discriminator_pass(real, fake, torch.zeros(2), None, train=True)
    real_input, fake_input = critic.inputs
    assert torch.equal(real_input, real.float()) and torch.equal(fake_input, rounded)
    critic.inputs.clear()
    term = adversary.generator_term(fake, torch.zeros(2), None, real_dtype=real.dtype)
    assert torch.equal(critic.inputs[0], rounded)
    assert float(term.detach()) == pytest.approx(-float(rounded.mean()), rel=1e-6)
    term.backward()
    assert fake.grad is not None and torch.equal(fake.grad, torch.full((2, 3, 5), -1.0 / 30))
    # An FP32 real leaves the fake exactly as it is.
    assert torch.equal(on_real_grid(fake.detach(), torch.float32), fake.detach())
