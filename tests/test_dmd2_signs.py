"""DMD2's sign and role conventions as tiny exact tests (no model): each one fails when the maths is flipped.

* the DMD step moves a sample towards the real score's x0 and away from the fake score's (methods/dmd2.py);
* the critic's flow-matching target is velocity = noise - x0, the convention of the Teacher's Euler step
  (flow_matching.py, rollout/scheduler.py): Euler with that velocity walks exactly along x_sigma = (1 - sigma) x0 +
  sigma noise;
* the generator's EMA folds the weights in as ema <- decay ema + (1 - decay) param, after its start (roles.EMA, as
  fvtools/train_dmd2.py builds it from --ema_decay / --ema_start_step).

The wiring in the recipe (which score is real, which fake, what the critic regresses, when the generator's loss
applies) is tested on the tiny world in tests/test_fvtools_dmd2.py.
"""

from __future__ import annotations


import pytest
import torch

from predictor_training.methods.dmd2 import critic_loss, dmd_generator_loss, dmd_gradient
from predictor_training.methods.dmd2_models import generator_ema
from predictor_training.methods.flow_matching import add_noise, velocity_target, x0_from_velocity
from predictor_training.rollout.scheduler import FlowMatchEulerScheduler, differentiable_euler_step, flow_match_sigmas
from predictor_training.runtime.roles import EMA
from predictor_training.teacher.config import DISTILLED_SHIFT, DISTILLED_STEPS


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


def test_flow_matching_velocity_is_the_teachers_euler_velocity():
    """On the distilled schedule, the Euler step (pure and the scheduler's) with v = noise - x0 takes x_sigma_i =
    add_noise(x0, noise, sigma_i) to x_sigma_{i+1}, and x0_from_velocity inverts add_noise: the critic and the
    scores use the Teacher's own convention."""
    generator = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(1, 4, 4, 2, 3, generator=generator), torch.randn(1, 4, 4, 2, 3, generator=generator)
    velocity = velocity_target(x0, noise)
    torch.testing.assert_close(velocity, noise - x0)
    sigmas = flow_match_sigmas(DISTILLED_STEPS, DISTILLED_SHIFT)
    scheduler = FlowMatchEulerScheduler(shift=DISTILLED_SHIFT)
    scheduler.set_timesteps(DISTILLED_STEPS)
    torch.testing.assert_close(scheduler.sigmas, sigmas)

    def per_frame(index: int) -> torch.Tensor:  # sigma_index for each frame [B, T]
        return sigmas[index].expand(1, x0.shape[2])

    latent = add_noise(x0, noise, per_frame(0))
    torch.testing.assert_close(latent, noise)  # sigma_0 = 1: pure noise
    for index in range(DISTILLED_STEPS):
        torch.testing.assert_close(x0_from_velocity(latent, velocity, per_frame(index)), x0, rtol=1e-5, atol=1e-5)
        stepped = differentiable_euler_step(latent, velocity, sigmas, index)
        torch.testing.assert_close(scheduler.step(velocity, scheduler.timesteps[index], latent), stepped)
        torch.testing.assert_close(stepped, add_noise(x0, noise, per_frame(index + 1)), rtol=1e-5, atol=1e-5)
        latent = stepped
    torch.testing.assert_close(latent, x0, rtol=1e-5, atol=1e-5)  # sigma_n = 0: the clean sample


def test_the_generator_ema_direction_and_start():
    """decay 0.9, start after update 1: update 1 copies the weights; update 2 gives 0.9 old + 0.1 new (never the
    reverse); a parameter that does not train has no shadow."""
    module = torch.nn.Linear(2, 1)
    module.bias.requires_grad_(False)
    ema = EMA(module, 0.9, start_update=1)
    assert sorted(ema.shadow) == ["weight"]
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[10.0, -10.0]]))
    ema.update(module)
    torch.testing.assert_close(ema.shadow["weight"], torch.tensor([[10.0, -10.0]]))
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[20.0, 0.0]]))
    ema.update(module)
    torch.testing.assert_close(ema.shadow["weight"], torch.tensor([[11.0, -9.0]]))
    ema.copy_to(module)
    torch.testing.assert_close(module.weight.detach(), torch.tensor([[11.0, -9.0]]))


@pytest.mark.parametrize("decay, start_step, every, start_update", [(0.99, 200, 5, 40), (0.5, 3, 2, 1), (0.9, 0, 1, 0)])
def test_the_dmd2_generator_ema_comes_from_its_flags(decay, start_step, every, start_update):
    """--ema_start_step counts loop steps (Self-Forcing's ema_start_step); the EMA counts generator updates."""
    ema = generator_ema(torch.nn.Linear(2, 1), decay=decay, start_step=start_step, every=every)
    assert (ema.decay, ema.start_update) == (decay, start_update)
    assert generator_ema(torch.nn.Linear(2, 1), decay=-1, start_step=200, every=5) is None
