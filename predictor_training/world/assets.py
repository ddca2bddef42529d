"""The demo world's model assets besides the VAE: the world Teacher's config and the encoder folder.

* `world_teacher_config(latent_channels)`: the demo Teacher preset (width 64, 2 heads, the tiny encoders' text
  widths) made `WORLD_TEACHER_DEPTH` blocks deep with the VAE's latent channels in and out. At depth 12 a 2-block
  Predictor step costs about 18-19% of a full step by FLOPs on a 4 x 6 latent grid (`predictor_training/teacher/flops.py`).
* `write_world_encoders(out, vae_folder, captions, seed)`: the tiny random text / glyph / vision encoders of the demo
  (their tokenizer also knows every word of the world's captions) with the trained world VAE in place of the
  demo's random one: a diffusers `HunyuanVideo15ImageToVideoPipeline` folder that `tools/build_video_latent_dataset.py
  --encoders` and the eval read.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from predictor_training.world.demo_assets import TinyEncoderSizes, save_tiny_encoders
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.model import WorldPlayTransformer

WORLD_TEACHER_DEPTH = 12
WORLD_WEIGHTS = Path(__file__).resolve().parent / "weights"  # what tools/build_demo_world.py --stages ship writes


def world_teacher_config(latent_channels: int, depth: int = WORLD_TEACHER_DEPTH) -> dict:
    """Constructor arguments of the world Teacher."""
    return preset_config("demo", in_channels=int(latent_channels), out_channels=int(latent_channels),
                         mm_double_blocks_depth=int(depth))


def write_world_teacher_config(folder: str | Path, latent_channels: int, depth: int = WORLD_TEACHER_DEPTH) -> Path:
    """`folder/config.json` of the world Teacher (what `fvtools/train_df_sft.py --init_weights scratch` reads)."""
    folder = Path(folder)
    with torch.device("meta"):
        model = WorldPlayTransformer(**world_teacher_config(latent_channels, depth))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(str(folder))
    return folder / "config.json"


def write_world_encoders(out: str | Path, vae_folder: str | Path, captions: Sequence[str], seed: int = 0) -> Path:
    """The encoder folder of the world (written to a staging folder, renamed into place; an existing one is kept)."""
    out, vae_folder = Path(out), Path(vae_folder)
    if (out / "model_index.json").is_file():
        return out
    from diffusers import AutoencoderKLHunyuanVideo15

    latent_channels = int(AutoencoderKLHunyuanVideo15.load_config(str(vae_folder))["latent_channels"])
    sizes = TinyEncoderSizes.for_teacher_config(world_teacher_config(latent_channels))
    staging = out.parent / f".{out.name}.writing"
    if staging.exists():
        shutil.rmtree(staging)
    save_tiny_encoders(staging, sizes, seed, extra_texts=list(captions))
    shutil.rmtree(staging / "vae")
    shutil.copytree(vae_folder, staging / "vae")
    staging.rename(out)
    return out
