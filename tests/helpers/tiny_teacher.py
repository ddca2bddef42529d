"""Tiny random Teachers and their inputs, shared by the teacher, rollout and adapter tests.

* `make_model(preset, seed)`: a preset whose upstream zero-initialised layers are random (every path matters), with
  `text_inputs`, `camera_inputs` and `image_inputs` for its AR calls on a `GRID` latent grid;
* `make_tiny_teacher()`: the frozen tiny preset of the AR-rollout tests, with `tiny_text_kv(teacher)` and
  `tiny_rollout_inputs(teacher, ...)` (a turning, stepping-back camera, seeded noise and memory points)."""

from __future__ import annotations

import torch

from predictor_training.data.synthetic import turning_camera_row
from predictor_training.rollout.ar_rollout import RolloutInputs, make_initial_noise
from predictor_training.rollout.memory_retrieval import make_retrieval_points
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_


# ---- a tiny random Teacher ------------------------------------------------------------------------------------
def make_tiny_teacher() -> WorldPlayTransformer:
    """The tiny preset, its zero-initialised layers random (seed 1), frozen, in eval mode."""
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("tiny")
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    return teacher.eval().requires_grad_(False)


def tiny_text_kv(teacher):
    generator = torch.Generator().manual_seed(2)
    config = teacher.config
    text = torch.randn(1, 6, config.text_states_dim, generator=generator)
    byt5 = torch.randn(1, 3, config.byt5_states_dim, generator=generator)
    vision = torch.randn(1, 2, config.vision_states_dim, generator=generator)
    with torch.no_grad():
        return teacher.text_prefill(text, torch.tensor([[1, 1, 1, 1, 0, 0]]), byt5, torch.tensor([[1, 0, 1]]), vision)


def tiny_rollout_inputs(teacher, num_latents=12, height=2, width=3, seed=5) -> RolloutInputs:
    channels = teacher.config.in_channels
    generator = torch.Generator().manual_seed(seed)
    cameras = turning_camera_row(num_latents, turn=0.5, step_back=0.1)
    return RolloutInputs(
        noise=make_initial_noise(seed, (1, channels, num_latents, height, width)),
        image_cond=torch.randn(1, channels, 1, height, width, generator=generator),
        viewmats=cameras["viewmats"],
        Ks=cameras["Ks"],
        action=torch.randint(0, 81, (num_latents,), generator=generator),
        memory_points=make_retrieval_points(seed, num_points=2000),
    )


GRID = (4, 3)  # H, W


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
def make_model(preset: str = "tiny", seed: int = 0) -> WorldPlayTransformer:
    """A model whose upstream zero-initialised layers are random, so every path affects the output."""
    torch.manual_seed(seed)
    model = WorldPlayTransformer.from_preset(preset)
    randomize_zero_initialised_(model, torch.Generator().manual_seed(seed + 1), scale=0.5)
    return model.eval()


def text_inputs(model: WorldPlayTransformer, generator: torch.Generator, text_len=7, byt5_len=5, vision_len=3):
    config = model.config
    text_mask = torch.ones(1, text_len, dtype=torch.int64)
    text_mask[0, -2:] = 0
    byt5_mask = torch.zeros(1, byt5_len, dtype=torch.int64)
    byt5_mask[0, :2] = 1
    return dict(
        text_states=torch.randn(1, text_len, config.text_states_dim, generator=generator),
        text_mask=text_mask,
        byt5_states=torch.randn(1, byt5_len, config.byt5_states_dim, generator=generator),
        byt5_mask=byt5_mask,
        vision_states=torch.randn(1, vision_len, config.vision_states_dim, generator=generator),
    )


def camera_inputs(frames: int, generator: torch.Generator):
    """Random rotations + translations (w2c) and normalised Ks, float32."""
    rotation, _ = torch.linalg.qr(torch.randn(frames, 3, 3, generator=generator))
    viewmats = torch.eye(4).repeat(frames, 1, 1)
    viewmats[:, :3, :3] = rotation
    viewmats[:, :3, 3] = torch.randn(frames, 3, generator=generator)
    Ks = torch.eye(3).repeat(frames, 1, 1)
    Ks[:, 0, 0] = 0.5 + torch.rand(frames, generator=generator)
    Ks[:, 1, 1] = 0.5 + torch.rand(frames, generator=generator)
    Ks[:, :2, 2] = 0.5
    return viewmats[None], Ks[None]


def image_inputs(model: WorldPlayTransformer, frames: int, generator: torch.Generator, timestep: float):
    channels = 2 * model.config.in_channels + 1
    viewmats, Ks = camera_inputs(frames, generator)
    return dict(
        hidden_states=torch.randn(1, channels, frames, *GRID, generator=generator),
        timestep=torch.full((frames,), timestep),
        action=torch.randint(0, 81, (1, frames), generator=generator).float(),
        viewmats=viewmats,
        Ks=Ks,
    )
