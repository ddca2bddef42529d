"""Latents to frames (predictor_training/video/vae_decoder.py) with a tiny random HunyuanVideo-1.5 VAE: the folder or a
pipeline's vae/ subfolder, the scaling factor undone before decoding, [-1, 1] mapped to uint8 [F, H, W, 3] as the
diffusers pipeline does, frozen, and a clear error without a config.json."""

from __future__ import annotations

import shutil

import pytest
import torch

from predictor_training.runtime.errors import MissingFileError
from predictor_training.video.vae_decoder import VaeDecoder

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def vae_folder(tmp_path_factory):
    """A tiny random VAE (4 latent channels, 16x spatial and 4x temporal compression) with scaling factor 0.5."""
    from diffusers import AutoencoderKLHunyuanVideo15

    folder = tmp_path_factory.mktemp("vae") / "vae"
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                spatial_compression_ratio=16, temporal_compression_ratio=4,
                                scaling_factor=0.5).save_pretrained(str(folder))
    return folder


def test_decoded_frames_are_the_pipelines_uint8_video(vae_folder):
    decoder = VaeDecoder.from_folder(vae_folder, CPU, torch.float32, tiling=False)
    assert (decoder.scaling_factor, decoder.temporal_compression, decoder.spatial_compression) == (0.5, 4, 16)
    assert not decoder.vae.training and not any(param.requires_grad for param in decoder.vae.parameters())
    latents = torch.randn(1, 4, 3, 2, 3, generator=torch.Generator().manual_seed(1))
    frames = decoder.decode(latents)
    assert frames.dtype == torch.uint8 and frames.shape == (9, 32, 48, 3) and frames.is_contiguous()
    with torch.no_grad():
        video = decoder.vae.decode(latents / 0.5, return_dict=False)[0]  # [1, 3, F, H, W] in [-1, 1]
    expected = ((video[0] / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 3, 0)
    assert torch.equal(frames, expected)
    with torch.no_grad():
        unscaled = decoder.vae.decode(latents, return_dict=False)[0]
    assert not torch.equal(frames, ((unscaled[0] / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
                           .permute(1, 2, 3, 0))  # the scaling factor matters here


def test_a_pipeline_folder_is_read_through_its_vae_subfolder(vae_folder, tmp_path):
    shutil.copytree(vae_folder, tmp_path / "pipeline" / "vae")
    decoder = VaeDecoder.from_folder(tmp_path / "pipeline", CPU, torch.float32, tiling=True)
    assert decoder.vae.use_tiling
    direct = VaeDecoder.from_folder(vae_folder, CPU, torch.float32, tiling=False)
    latents = torch.randn(1, 4, 2, 2, 3, generator=torch.Generator().manual_seed(2))
    assert torch.equal(decoder.decode(latents), direct.decode(latents))  # tiling changes nothing at this size
    with pytest.raises(MissingFileError, match=r"--vae .*: no config.json \(expected an AutoencoderKLHunyuanVideo15"):
        VaeDecoder.from_folder(tmp_path / "nothing", CPU, torch.float32, tiling=False)
