"""Latents to frames with the HunyuanVideo-1.5 VAE (eval, rewards, validation)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from predictor_training.runtime.errors import MissingFileError


class VaeDecoder:
    """Latents [1, C, T, H, W] -> uint8 frames [F, H*s, W*s, 3] with an `AutoencoderKLHunyuanVideo15`.

    As the diffusers pipeline: decode(latents / scaling_factor), then (x / 2 + 0.5).clamp(0, 1), * 255, rounded.
    """

    def __init__(self, vae, device: torch.device):
        self.vae = vae
        self.device = device
        self.scaling_factor = float(vae.config.scaling_factor)
        self.temporal_compression = int(vae.config.temporal_compression_ratio)
        self.spatial_compression = int(vae.config.spatial_compression_ratio)

    @classmethod
    def from_folder(cls, folder: str | Path, device: torch.device, dtype: torch.dtype, tiling: bool) -> "VaeDecoder":
        """`folder`: the VAE folder itself (config.json of AutoencoderKLHunyuanVideo15) or a diffusers pipeline
        folder with a `vae/` subfolder."""
        from diffusers import AutoencoderKLHunyuanVideo15

        folder = Path(folder)
        if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
            folder = folder / "vae"
        if not (folder / "config.json").is_file():
            raise MissingFileError(f"--vae {folder}: no config.json (expected an AutoencoderKLHunyuanVideo15 folder)")
        vae = AutoencoderKLHunyuanVideo15.from_pretrained(str(folder), torch_dtype=dtype)
        if tiling:
            vae.enable_tiling()
        return cls(vae.to(device).eval().requires_grad_(False), device)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        video = self.vae.decode(latents.to(self.device, self.vae.dtype) / self.scaling_factor, return_dict=False)[0]
        frames = ((video[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)  # [3, F, H, W]
        return frames.permute(1, 2, 3, 0).contiguous().cpu()
