"""DMD2's losses and sign conventions (predictor_training/methods/dmd2.py).

On 1-D Gaussians: data N(2, 0.5^2), a generator x = b + a z starting at N(-1, 1.5^2). With exact posterior-mean
scores it converges to (2, 0.5); with a learned critic updated every step and the generator every 5th, close to it;
with the two scores swapped it moves away (the sign). As tiny exact tests (no model): the DMD step moves a sample
towards the real score's x0 and away from the fake score's, and the critic's target is noise - x0.

The wiring in the recipe is tested on the tiny world in tests/recipes/test_dmd2.py (the script's runs in
tests/recipes/test_train_dmd2.py)."""

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


def test_a_dmd_step_moves_the_sample_towards_the_real_score_and_away_from_the_fake():
    """x̂ = 0, x0_real = +1, x0_fake = -1 (one element): g = (x0_fake - x0_real) / |x̂ - x0_real| = -2, and one SGD step
    of lr 0.25 on L_G takes x̂ to +0.5, towards the data."""
    sample = torch.zeros(1, 1, requires_grad=True)
    x0_real, x0_fake = torch.ones(1, 1), -torch.ones(1, 1)
    gradient = dmd_gradient(x0_fake, x0_real, sample.detach())
    assert gradient.item() == -2.0
    dmd_generator_loss(sample, gradient).backward()
    assert sample.grad.item() == -2.0  # dL/dx̂ = g / numel
    with torch.no_grad():
        moved = sample - 0.25 * sample.grad
    assert moved.item() == 0.5
    # Scale-free per sample: twice the distance to x0_real, half the gradient.
    far = dmd_gradient(torch.tensor([[0.0, 2.0]]), torch.tensor([[2.0, 2.0]]), torch.tensor([[-2.0, 2.0]]))
    torch.testing.assert_close(far, torch.tensor([[-1.0, 0.0]]))


def test_the_critic_target_is_noise_minus_x0():
    """critic_loss is 0 exactly at v = noise - x̂ and its minimiser over a constant velocity is mean(noise - x̂)."""
    generator = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 3, generator=generator), torch.randn(2, 4, 3, generator=generator)
    assert critic_loss(noise - x0, noise, x0) == 0
    assert critic_loss(x0 - noise, noise, x0) > 0
    velocity = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.SGD([velocity], lr=0.5)
    for _ in range(50):
        optimizer.zero_grad()
        critic_loss(velocity.expand_as(x0), noise, x0).backward()
        optimizer.step()
    torch.testing.assert_close(velocity.detach(), (noise - x0).mean(), rtol=1e-5, atol=1e-6)
