"""The demo world's model assets besides the VAE (predictor_training/world/assets.py): the world Teacher's config (the
demo preset, WORLD_TEACHER_DEPTH blocks, the VAE's latent channels in and out) and the encoder folder (the tiny
encoders with the world's VAE in place of the demo's random one, written once)."""

from __future__ import annotations

import json

import pytest
import torch

from predictor_training.teacher.config import preset_config
from predictor_training.teacher.model import WorldPlayTransformer
from predictor_training.world.assets import (
    WORLD_TEACHER_DEPTH,
    world_teacher_config,
    write_world_encoders,
    write_world_teacher_config,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_world_teacher_is_the_demo_preset_made_deep_with_the_vaes_channels():
    config = world_teacher_config(16)
    demo = preset_config("demo")
    assert (config["in_channels"], config["out_channels"]) == (16, 16)
    assert config["mm_double_blocks_depth"] == WORLD_TEACHER_DEPTH == 12
    changed = {key for key in demo if config[key] != demo[key]}
    assert changed <= {"in_channels", "out_channels", "mm_double_blocks_depth"}
    assert world_teacher_config(8, depth=2)["mm_double_blocks_depth"] == 2


def test_the_written_config_builds_that_teacher(tmp_path):
    path = write_world_teacher_config(tmp_path / "teacher", 16, depth=2)
    assert path == tmp_path / "teacher" / "config.json" and not list((tmp_path / "teacher").glob("*.safetensors"))
    loaded = WorldPlayTransformer.load_config(str(tmp_path / "teacher"))
    with torch.device("meta"):
        model = WorldPlayTransformer.from_config(loaded)
    assert model.num_layers == 2 and model.config.in_channels == model.config.out_channels == 16
    assert WorldPlayTransformer.constructor_arguments(loaded, source="test") == world_teacher_config(16, depth=2)


@pytest.fixture(scope="module")
def world_vae(tmp_path_factory):
    """A tiny random VAE folder with 16 latent channels, standing in for the trained world VAE."""
    from diffusers import AutoencoderKLHunyuanVideo15

    folder = tmp_path_factory.mktemp("world_vae") / "vae"
    torch.manual_seed(0)
    AutoencoderKLHunyuanVideo15(latent_channels=16, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                spatial_compression_ratio=16, temporal_compression_ratio=4).save_pretrained(str(folder))
    return folder


def test_the_encoder_folder_carries_the_world_vae_and_is_written_once(world_vae, tmp_path):
    out = write_world_encoders(tmp_path / "encoders", world_vae, ["a glowing teal pyramid"], seed=0)
    assert out == tmp_path / "encoders" and (out / "model_index.json").is_file()
    assert not (tmp_path / ".encoders.writing").exists()  # the staging folder was renamed into place
    for path in world_vae.iterdir():
        assert (out / "vae" / path.name).read_bytes() == path.read_bytes(), path.name
    assert json.loads((out / "vae" / "config.json").read_text())["latent_channels"] == 16
    tokenizer_files = "".join(path.read_text(errors="ignore") for path in (out / "tokenizer").iterdir())
    assert "pyramid" in tokenizer_files  # the tokenizer knows the world's own caption words (not a demo word)
    stamp = (out / "model_index.json").stat().st_mtime_ns
    assert write_world_encoders(out, world_vae, ["something else"], seed=1) == out
    assert (out / "model_index.json").stat().st_mtime_ns == stamp  # an existing folder is kept
