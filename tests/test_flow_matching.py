"""Flow-matching conventions and the noise-level samplers (bounds without point masses, per-chunk levels)."""

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
from predictor_training.rollout.scheduler import flow_match_sigmas


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
