"""Flow-matching conventions (predictor_training/methods/flow_matching.py) and the
noise-level samplers (bounds without point masses, per-chunk levels); the critic's velocity is the Teacher's Euler
velocity: Euler with it walks exactly along x_sigma = (1 - sigma) x0 + sigma noise."""

from __future__ import annotations

import pytest
import torch

from predictor_training.methods.flow_matching import (
    add_noise,
    chunk_sigmas,
    sample_sigmas,
    shift_sigma,
    unshift_sigma,
    velocity_target,
    x0_from_velocity,
)
from predictor_training.rollout.scheduler import FlowMatchEulerScheduler, differentiable_euler_step, flow_match_sigmas
from predictor_training.teacher.config import DISTILLED_SHIFT, DISTILLED_STEPS


def test_the_shift_matches_the_schedule_and_inverts():
    # The 4-step schedule's sigmas are shift 5 applied to linspace(1, 0, 5).
    u = torch.linspace(1, 0, 5, dtype=torch.float64)
    torch.testing.assert_close(shift_sigma(u, 5.0).float(), flow_match_sigmas(4, 5.0).float())
    torch.testing.assert_close(unshift_sigma(shift_sigma(u, 5.0), 5.0), u)


@pytest.mark.parametrize("kind", ["uniform", "logit_normal", "shifted"])
def test_samplers_stay_inside_the_bounds_without_point_masses(kind):
    generator = torch.Generator().manual_seed(0)
    sigmas = sample_sigmas(kind, 20000, generator, sigma_min=0.2, sigma_max=0.9, shift=5.0)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (20000,)
    assert float(sigmas.min()) >= 0.2 and float(sigmas.max()) <= 0.9
    # clamping would pile draws on the bounds; drawing inside them leaves at most a handful within 1e-4
    assert int(((sigmas - 0.2).abs() < 1e-4).sum()) < 20 and int(((sigmas - 0.9).abs() < 1e-4).sum()) < 20
    again = sample_sigmas(kind, 20000, torch.Generator().manual_seed(0), sigma_min=0.2, sigma_max=0.9, shift=5.0)
    assert torch.equal(sigmas, again)  # a pure function of the generator


def test_sampler_shapes_of_the_distributions():
    generator = torch.Generator().manual_seed(1)
    uniform = sample_sigmas("uniform", 40000, generator)
    assert abs(float(uniform.mean()) - 0.5) < 0.01
    shifted = sample_sigmas("shifted", 40000, generator, shift=5.0)
    # shift 5 puts most of the mass at high noise: P(sigma > 0.625) = P(u > 0.25) = 0.75
    assert abs(float((shifted > 0.625).float().mean()) - 0.75) < 0.01
    logit = sample_sigmas("logit_normal", 40000, generator, logit_mean=1.0, logit_std=0.5)
    assert abs(float(torch.logit(logit).mean()) - 1.0) < 0.01


def test_bad_sampler_settings_are_refused():
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="expected one of"):
        sample_sigmas("beta", 4, generator)
    with pytest.raises(ValueError, match="bounds"):
        sample_sigmas("uniform", 4, generator, sigma_min=0.9, sigma_max=0.5)
    with pytest.raises(ValueError, match="almost never"):
        sample_sigmas("logit_normal", 4, generator, sigma_min=0.999, sigma_max=1.0, logit_mean=-8.0, logit_std=0.1)


def test_noise_target_and_x0_agree():
    generator = torch.Generator().manual_seed(2)
    x0 = torch.randn(2, 3, 8, 2, 2, generator=generator)
    noise = torch.randn(2, 3, 8, 2, 2, generator=generator)
    sigma = chunk_sigmas(torch.tensor([[0.3, 0.9], [1.0, 0.0]]), 4)
    assert sigma.shape == (2, 8) and torch.equal(sigma[0, :4], torch.full((4,), 0.3))
    x_sigma = add_noise(x0, noise, sigma)
    torch.testing.assert_close(x_sigma[1, :, :4], noise[1, :, :4])  # sigma 1: pure noise
    torch.testing.assert_close(x_sigma[1, :, 4:], x0[1, :, 4:])  # sigma 0: the clean latent
    torch.testing.assert_close(x0_from_velocity(x_sigma, velocity_target(x0, noise), sigma), x0)


# ---------------------------------------------------------------------------------------------------------------
# The convention is the Teacher scheduler's: the exact velocity carries x_sigma along the schedule onto the data
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, shift", [(4, 5.0), (8, 3.0)])
def test_an_euler_step_of_the_exact_velocity_lands_on_the_next_noise_level(steps, shift):
    """From x at sigmas[i] = add_noise(x0, noise, sigmas[i]), one Euler step of the scheduler with the target
    velocity lands on add_noise(x0, noise, sigmas[i + 1]); the last step on x0 itself. A flipped velocity sign, or
    add_noise with x0 and noise swapped, walks away from the data instead."""
    from predictor_training.rollout.scheduler import FlowMatchEulerScheduler, differentiable_euler_step

    generator = torch.Generator().manual_seed(3)
    x0 = torch.randn(1, 4, 4, 2, 3, generator=generator)
    noise = torch.randn(1, 4, 4, 2, 3, generator=generator)
    velocity = velocity_target(x0, noise)
    scheduler = FlowMatchEulerScheduler(shift=shift)
    scheduler.set_timesteps(steps)
    sigmas = scheduler.sigmas
    torch.testing.assert_close(sigmas, flow_match_sigmas(steps, shift))
    x = add_noise(x0, noise, torch.full((1, 4), float(sigmas[0])))
    torch.testing.assert_close(x, noise)  # sampling starts from pure noise
    for index in range(steps):
        level = torch.full((1, 4), float(sigmas[index]))
        expected = add_noise(x0, noise, torch.full((1, 4), float(sigmas[index + 1])))
        pure = differentiable_euler_step(x, velocity, sigmas, index)
        x = scheduler.step(velocity, scheduler.timesteps[index], x)
        torch.testing.assert_close(x, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(pure, x, rtol=0, atol=0)
        # the one-step clean estimate from this level is the data (x0_from_velocity = an Euler step to sigma 0)
        torch.testing.assert_close(x0_from_velocity(add_noise(x0, noise, level), velocity, level), x0,
                                   rtol=0, atol=1e-5)
    torch.testing.assert_close(x, x0, rtol=0, atol=1e-5)


def test_the_teachers_ar_loop_fed_the_exact_velocity_reproduces_the_data():
    """The AR loop itself (its scheduler, its write-back): a step hook that returns velocity_target(x0, noise) for
    the rollout's own noise makes every chunk enter step k at add_noise(x0, noise, sigma_k) and end on x0."""
    from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
    from predictor_training.rollout.policy import StepOutput
    from predictor_training.rollout.teacher_forcing import clip_text_kv
    from predictor_training.teacher import WorldPlayTransformer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        teacher = WorldPlayTransformer.from_preset("demo").eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(4)
    num_latents = 8
    condition = {
        "prompt_embeds": torch.randn(1, 3, 32, generator=generator), "prompt_mask": torch.ones(1, 3, dtype=torch.long),
        "byt5_text_states": torch.randn(1, 2, 32, generator=generator),
        "byt5_text_mask": torch.ones(1, 2, dtype=torch.long),
        "vision_states": torch.randn(1, 9, 16, generator=generator),
    }
    text_kv = clip_text_kv(teacher, condition, torch.device("cpu"), None, grad=False)
    Ks = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.6, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
    inputs = RolloutInputs.from_seed(7, torch.randn(1, 4, 1, 2, 3, generator=generator),
                                     torch.eye(4, dtype=torch.float64).expand(num_latents, 4, 4).clone(),
                                     Ks.expand(num_latents, 3, 3).clone(), torch.zeros(num_latents, dtype=torch.long))
    x0 = torch.randn(1, 4, num_latents, 2, 3, generator=generator)
    noise = inputs.noise.clone()
    rollout = ARRollout(teacher, text_kv, inputs, RolloutConfig(state_dtype=torch.float32))
    entered = []

    def exact(call):
        frames = rollout.chunk_frames(call.chunk_index)
        sigma = float(rollout.sigmas[call.step_index])
        expected = add_noise(x0[:, :, frames], noise[:, :, frames], torch.full((1, 4), sigma))
        entered.append(float((call.latent.float() - expected).abs().max()))
        return StepOutput(velocity=velocity_target(x0[:, :, frames], noise[:, :, frames]))

    final = rollout.run(step_fn=exact)
    assert len(entered) == 2 * 4 and max(entered) < 1e-5, entered
    torch.testing.assert_close(final.float(), x0, rtol=0, atol=1e-5)


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
