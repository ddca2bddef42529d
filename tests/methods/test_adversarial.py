"""DisCa-style adversarial pieces (predictor_training/methods/adversarial.py).

On a toy: the discriminator separates real from fake hidden tokens, neither side's loss reaches the other side's
parameters, R1 trains D, the weight warms up. On tensors of a few numbers with closed-form answers: the generator
and hinge losses' signs, R1 on the real hiddens only, the fake rounded to the reals' grid with a straight-through
gradient (a flipped sign or a swapped role fails them)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from predictor_training.methods.adversarial import (
    Adversary,
    HiddenDiscriminator,
    adversarial_weight,
    discriminator_loss,
    generator_loss,
    on_real_grid,
    r1_penalty,
)
from predictor_training.runtime.random_streams import stream_generator


HIDDEN, TOKENS, BATCH = 16, 12, 32


def real_and_fake(generator: torch.Generator, fake_model: torch.nn.Module):
    real = torch.randn(BATCH, TOKENS, HIDDEN, generator=generator) + 1.0
    fake = fake_model(torch.randn(BATCH, TOKENS, HIDDEN, generator=generator))
    timestep = torch.randint(0, 1000, (BATCH,), generator=generator).float()
    return real, fake, timestep


def test_discriminator_separates_real_from_fake():
    torch.manual_seed(0)
    discriminator = HiddenDiscriminator(HIDDEN, width=32)
    fake_model = torch.nn.Linear(HIDDEN, HIDDEN)  # a generator that is not trained here
    optimizer = torch.optim.Adam(discriminator.parameters(), lr=1e-3)
    generator = stream_generator(0)
    for _ in range(150):
        real, fake, timestep = real_and_fake(generator, fake_model)
        loss, metrics = discriminator_loss(discriminator, real, fake, timestep)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    real, fake, timestep = real_and_fake(generator, fake_model)
    _, metrics = discriminator_loss(discriminator, real, fake, timestep)
    assert metrics["discriminator/accuracy"] > 0.95, metrics


def test_neither_loss_leaks_into_the_other_side():
    torch.manual_seed(1)
    discriminator = HiddenDiscriminator(HIDDEN, width=32)
    fake_model = torch.nn.Linear(HIDDEN, HIDDEN)
    real, fake, timestep = real_and_fake(stream_generator(1), fake_model)
    context = torch.randn(BATCH, HIDDEN)
    discriminator_loss(discriminator, real, fake, timestep, context)[0].backward()
    assert all(parameter.grad is None for parameter in fake_model.parameters())
    assert all(parameter.grad is not None for parameter in discriminator.parameters())
    discriminator.zero_grad(set_to_none=True)
    generator_loss(discriminator, fake, timestep, context).backward()
    assert all(parameter.grad is None for parameter in discriminator.parameters())
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in fake_model.parameters())


def test_r1_trains_the_discriminator_and_the_weight_warms_up():
    torch.manual_seed(2)
    discriminator = HiddenDiscriminator(HIDDEN, width=32)
    real, _, timestep = real_and_fake(stream_generator(2), torch.nn.Identity())
    penalty = r1_penalty(discriminator, real, timestep)
    assert penalty > 0
    penalty.backward()
    assert discriminator.token_in.weight.grad.abs().sum() > 0
    assert [adversarial_weight(step, 0.1, 10) for step in (0, 5, 10, 50)] == [0.0, 0.05, 0.1, 0.1]
    assert adversarial_weight(0, 0.1, 0) == 0.1


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
