"""Flow-matching training conventions shared by the generic methods (diffusion-forcing SFT, KD, DMD, NFT).

The Teacher's convention (the distilled 4-step schedule uses the same one):

    x_sigma = (1 - sigma) * x0 + sigma * noise,    v = noise - x0,    x0 = x_sigma - sigma * v,    timestep = 1000 * sigma

Noise levels are drawn per chunk (one sigma for the 4 latent frames of a chunk, as diffusion forcing does) from one of
three distributions, always *inside* [sigma_min, sigma_max] by construction (inverse CDF or rejection), never by
clamping, so the bounds carry no point mass:

* "uniform": sigma ~ U[sigma_min, sigma_max];
* "logit_normal": sigma = sigmoid(z), z ~ N(logit_mean, logit_std^2), redrawn where outside the bounds;
* "shifted": u ~ U[0, 1] mapped by the schedule's shift, sigma = shift * u / (1 + (shift - 1) * u) (high noise is
  drawn more often for shift > 1, as in the 4-step schedule's sigmas), with u drawn from the bounds' preimage.

All random draws take an explicit `torch.Generator` (never the global RNG).
"""

from __future__ import annotations


import torch
from torch import Tensor

SIGMA_SAMPLERS = ("uniform", "logit_normal", "shifted")


def shift_sigma(u: Tensor, shift: float) -> Tensor:
    """u in [0, 1] -> shift * u / (1 + (shift - 1) * u) (the flow-matching schedule's shift; identity at 1)."""
    return shift * u / (1 + (shift - 1) * u)


def unshift_sigma(sigma: Tensor, shift: float) -> Tensor:
    """Inverse of `shift_sigma`: sigma -> sigma / (shift - (shift - 1) * sigma)."""
    return sigma / (shift - (shift - 1) * sigma)


def sample_sigmas(
    kind: str,
    count: int,
    generator: torch.Generator,
    *,
    sigma_min: float = 0.0,
    sigma_max: float = 1.0,
    shift: float = 1.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> Tensor:
    """`count` noise levels [count] (float32, on the generator's device) from distribution `kind`, inside
    [sigma_min, sigma_max] (module docstring)."""
    if kind not in SIGMA_SAMPLERS:
        raise ValueError(f"sigma sampler {kind!r}; expected one of {SIGMA_SAMPLERS}")
    if not 0.0 <= sigma_min < sigma_max <= 1.0:
        raise ValueError(f"sigma bounds [{sigma_min}, {sigma_max}]; expected 0 <= min < max <= 1")
    device = generator.device
    if kind == "uniform":
        u = torch.rand(count, generator=generator, device=device)
        return sigma_min + (sigma_max - sigma_min) * u
    if kind == "shifted":
        if shift <= 0:
            raise ValueError(f"shift={shift}; expected > 0")
        low, high = (unshift_sigma(torch.tensor(bound, dtype=torch.float64), shift).item()
                     for bound in (sigma_min, sigma_max))
        u = low + (high - low) * torch.rand(count, generator=generator, device=device, dtype=torch.float64)
        return shift_sigma(u, shift).float()
    if logit_std <= 0:
        raise ValueError(f"logit_std={logit_std}; expected > 0")
    sigmas = torch.empty(count, device=device)
    missing = torch.ones(count, dtype=torch.bool, device=device)
    for _ in range(1000):
        draws = torch.sigmoid(logit_mean + logit_std * torch.randn(count, generator=generator, device=device))
        accept = missing & (draws >= sigma_min) & (draws <= sigma_max)
        sigmas[accept] = draws[accept]
        missing &= ~accept
        if not missing.any():
            return sigmas
    raise ValueError(f"logit-normal(mean {logit_mean}, std {logit_std}) almost never falls in [{sigma_min}, "
                     f"{sigma_max}]; widen the bounds or change the distribution")


def chunk_sigmas(chunk_sigma: Tensor, chunk_latents: int) -> Tensor:
    """One noise level per chunk [B, n_chunks] -> per latent frame [B, n_chunks * chunk_latents]."""
    return chunk_sigma.repeat_interleave(chunk_latents, dim=-1)


def add_noise(x0: Tensor, noise: Tensor, sigma: Tensor) -> Tensor:
    """x_sigma = (1 - sigma) x0 + sigma noise. x0, noise [B, C, T, H, W]; sigma per frame [B, T] (float32)."""
    s = sigma.to(torch.float32)[:, None, :, None, None]
    return (1 - s) * x0.float() + s * noise.float()


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The flow-matching target v = noise - x0 (float32)."""
    return noise.float() - x0.float()


def x0_from_velocity(x_sigma: Tensor, velocity: Tensor, sigma: Tensor) -> Tensor:
    """x0 = x_sigma - sigma v. x_sigma, velocity [B, C, T, H, W]; sigma per frame [B, T]."""
    return x_sigma.float() - sigma.to(torch.float32)[:, None, :, None, None] * velocity.float()
