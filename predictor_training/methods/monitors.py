"""Collapse monitors for generator methods (DMD, adversarial, RL): does the generated video still move and vary?

Distribution-matching and RL runs fail in known ways before their losses show it: the video freezes (static), or
turns into one flat colour. Both show first in two statistics of the generated latents, compared per chunk with the
Teacher's latents for the same inputs:

    std ratio            std of the chunk's latents / the Teacher's                (flat video -> 0)
    temporal ratio       mean (x[f+1] - x[f])^2 over the chunk's frames / the Teacher's   (static video -> 0)

A healthy run keeps both near 1. `collapse_monitors` returns them as flat metrics for the loop's log.
"""

from __future__ import annotations

import torch
from torch import Tensor


def temporal_delta_energy(latents: Tensor) -> Tensor:
    """Mean squared difference of consecutive frames of latents [B, C, T, H, W] (0 for a single frame)."""
    if latents.shape[2] < 2:
        return torch.zeros((), dtype=torch.float32, device=latents.device)
    return (latents[:, :, 1:].float() - latents[:, :, :-1].float()).pow(2).mean()


def collapse_monitors(generated: Tensor, teacher: Tensor, chunk_latents: int = 4, eps: float = 1e-12
                      ) -> dict[str, float]:
    """Per-chunk and whole-video std and temporal-delta ratios of `generated` against `teacher` (both
    [B, C, T, H, W], T a multiple of `chunk_latents`). Keys: monitor/std_ratio, monitor/temporal_ratio (whole video),
    monitor/chunk{c}/std_ratio, monitor/chunk{c}/temporal_ratio, monitor/std, monitor/teacher_std."""
    if generated.shape != teacher.shape:
        raise ValueError(f"generated {tuple(generated.shape)} and teacher {tuple(teacher.shape)} latents differ")
    if generated.dim() != 5 or generated.shape[2] % chunk_latents:
        raise ValueError(f"latents must be [B, C, T, H, W] with T a multiple of {chunk_latents}, got "
                         f"{tuple(generated.shape)}")
    with torch.no_grad():
        generated, teacher = generated.float(), teacher.float()
        metrics = {
            "monitor/std": float(generated.std()),
            "monitor/teacher_std": float(teacher.std()),
            "monitor/std_ratio": float(generated.std() / (teacher.std() + eps)),
            "monitor/temporal_ratio": float(temporal_delta_energy(generated) / (temporal_delta_energy(teacher) + eps)),
        }
        for chunk in range(generated.shape[2] // chunk_latents):
            frames = slice(chunk * chunk_latents, (chunk + 1) * chunk_latents)
            ours, theirs = generated[:, :, frames], teacher[:, :, frames]
            metrics[f"monitor/chunk{chunk}/std_ratio"] = float(ours.std() / (theirs.std() + eps))
            metrics[f"monitor/chunk{chunk}/temporal_ratio"] = float(
                temporal_delta_energy(ours) / (temporal_delta_energy(theirs) + eps))
    return metrics
