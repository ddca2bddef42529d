"""DMD2's losses (predictor_training/methods/dmd2.py) on 1-D Gaussians: data N(2, 0.5^2), a generator
x = b + a z starting at N(-1, 1.5^2). With exact posterior-mean scores it converges to (2, 0.5); with a learned critic
updated every step and the generator every 5th, close to it; with the two scores swapped it moves away (the sign)."""

from __future__ import annotations

import pytest
import torch

from predictor_training.methods.dmd2 import critic_loss, dmd_generator_loss, dmd_gradient
from predictor_training.methods.flow_matching import sample_sigmas
from predictor_training.runtime.random_streams import stream_generator

DATA_MEAN, DATA_STD = 2.0, 0.5
BATCH, SIGMA_MIN, SIGMA_MAX = 4096, 0.02, 0.98


def posterior_mean(x_sigma: torch.Tensor, sigma: torch.Tensor, mean, std) -> torch.Tensor:
    """E[x0 | x_sigma] for x0 ~ N(mean, std^2) and x_sigma = (1 - sigma) x0 + sigma noise."""
    keep = 1 - sigma
    return mean + keep * std**2 / (keep**2 * std**2 + sigma**2) * (x_sigma - keep * mean)


def generator_sample(params: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One 'sample' [1, BATCH] of the generator x = b + a z (the DMD normalisation is over its values)."""
    return (params[0] + params[1] * torch.randn(BATCH, generator=generator))[None]


def noised(sample, generator):
    sigma = sample_sigmas("uniform", BATCH, generator, sigma_min=SIGMA_MIN, sigma_max=SIGMA_MAX)[None]
    noise = torch.randn(sample.shape, generator=generator)
    return (1 - sigma) * sample.detach() + sigma * noise, sigma, noise  # flow_matching's convention, on scalars


def generator_step(params, optimizer, generator, fake_x0, swap: bool = False) -> None:
    sample = generator_sample(params, generator)
    x_sigma, sigma, _ = noised(sample, generator)
    x0_real = posterior_mean(x_sigma, sigma, DATA_MEAN, DATA_STD)
    x0_fake = fake_x0(x_sigma, sigma)
    if swap:
        x0_real, x0_fake = x0_fake, x0_real
    optimizer.zero_grad()
    dmd_generator_loss(sample, dmd_gradient(x0_fake, x0_real, sample)).backward()
    optimizer.step()


def exact_fake(params):
    return lambda x_sigma, sigma: posterior_mean(x_sigma, sigma, params[0].detach(), params[1].detach().abs())


def test_generator_loss_gradient_is_the_dmd_gradient():
    sample = torch.randn(2, 3, 4, requires_grad=True)
    gradient = dmd_gradient(torch.randn(2, 3, 4), torch.randn(2, 3, 4), sample)
    dmd_generator_loss(sample, gradient).backward()
    torch.testing.assert_close(sample.grad, gradient / sample.numel())
    # normalised per sample; a zero distance gives 0, not NaN
    assert torch.equal(dmd_gradient(torch.ones(1, 3), torch.zeros(1, 3), torch.zeros(1, 3)), torch.zeros(1, 3))
    assert critic_loss(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3)) == 0


def test_exact_scores_converge_to_the_data_distribution():
    params = torch.tensor([-1.0, 1.5], requires_grad=True)
    optimizer = torch.optim.SGD([params], lr=0.05)
    generator = stream_generator(0)
    first = None
    for step in range(800):
        generator_step(params, optimizer, generator, exact_fake(params))
        if step == 0:
            first = float(params[0].detach())
    assert first > -1.0  # the first step moves b towards 2
    b, a = float(params[0].detach()), abs(float(params[1].detach()))
    assert abs(b - DATA_MEAN) < 0.05 and abs(a - DATA_STD) < 0.05, (b, a)


def test_swapped_scores_move_the_generator_away():
    """The mutation test of the sign: x0_real - x0_fake instead of x0_fake - x0_real."""
    params = torch.tensor([-1.0, 1.5], requires_grad=True)
    optimizer = torch.optim.SGD([params], lr=0.05)
    generator = stream_generator(1)
    for _ in range(50):
        generator_step(params, optimizer, generator, exact_fake(params), swap=True)
    assert abs(float(params[0].detach()) - DATA_MEAN) > 3.0 + 1.0, params


def test_learned_critic_at_its_own_cadence():
    """A linear critic per sigma bin (v = w0 + w1 x_sigma), trained by flow matching on the detached generator sample
    every step (lr 0.2); the generator steps every 5th step (lr 0.05) with the critic's x0 as the fake score."""
    bins = 10
    params = torch.tensor([-1.0, 1.5], requires_grad=True)
    critic = torch.zeros(bins, 2, requires_grad=True)
    generator_optimizer = torch.optim.SGD([params], lr=0.05)
    critic_optimizer = torch.optim.SGD([critic], lr=0.2)
    generator = stream_generator(2)

    def critic_velocity(x_sigma, sigma):
        index = ((sigma - SIGMA_MIN) / (SIGMA_MAX - SIGMA_MIN) * bins).long().clamp(0, bins - 1)
        weights = critic[index]
        return weights[..., 0] + weights[..., 1] * x_sigma

    def fake_x0(x_sigma, sigma):
        with torch.no_grad():
            return x_sigma - sigma * critic_velocity(x_sigma, sigma)

    for step in range(6000):
        sample = generator_sample(params, generator).detach()
        x_sigma, sigma, noise = noised(sample, generator)
        critic_optimizer.zero_grad()
        loss = critic_loss(critic_velocity(x_sigma, sigma), noise, sample) * bins  # each bin sees ~1/bins of it
        loss.backward()
        critic_optimizer.step()
        if step % 5 == 0:
            generator_step(params, generator_optimizer, generator, fake_x0)
    b, a = float(params[0].detach()), abs(float(params[1].detach()))
    print(f"learned critic after 6000 steps: b = {b:.3f}, |a| = {a:.3f}")
    assert abs(b - DATA_MEAN) < 0.15 and abs(a - DATA_STD) < 0.15, (b, a)


@pytest.mark.parametrize("shape", [(4,), (2, 8)])
def test_gradient_shapes(shape):
    sample = torch.randn(*shape)
    assert dmd_gradient(torch.randn(*shape), torch.randn(*shape), sample).shape == sample.shape
