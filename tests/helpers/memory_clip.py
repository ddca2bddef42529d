"""The 32-latent clip of the memory-point tests (tests/recipes/test_kd_memory_points.py) and of the KD step's
state tests (tests/recipes/test_kd.py): a demo-config Teacher folder (random weights) and an i2v condition with
encoder outputs, on a camera that looks left (latents 4-7), right (8-11), elsewhere (12-23), then back to the start
(24-31). `ROLLOUT_SEED`'s memory points put memory group 8-11 in the last chunks' context."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from predictor_training.rollout.camera import _rotation_y
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_


NUM_LATENTS = 32
ROLLOUT_SEED = 100  # its points put memory group 8-11 in the last chunks' context


def yaw_path(yaws: list[float]) -> torch.Tensor:
    """World-to-camera [T, 4, 4] (float32) of a camera turning in place."""
    matrices = []
    for yaw in yaws:
        matrix = np.eye(4)
        matrix[:3, :3] = _rotation_y(math.radians(yaw))
        matrices.append(matrix)
    return torch.tensor(np.stack(matrices), dtype=torch.float32)


def write_memory_clip(root: Path) -> dict:
    """A demo-config Teacher folder (random weights) under `root` and a 32-latent i2v condition with encoder outputs.
    Returns {"root", "teacher", "condition"}."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        teacher = WorldPlayTransformer.from_preset("demo")
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(0))
    teacher.save_pretrained(str(root / "teacher"))
    generator = torch.Generator().manual_seed(1)
    yaws = [0.0] * 4 + [-30.0] * 4 + [30.0] * 4 + [90.0] * 12 + [0.0] * 8
    Ks = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.6, 0.5], [0.0, 0.0, 1.0]]).expand(NUM_LATENTS, 3, 3).clone()
    condition = {
        "image_cond": torch.randn(1, 4, 1, 2, 3, generator=generator),
        "viewmats": yaw_path(yaws),
        "Ks": Ks,
        "action": torch.randint(0, 81, (NUM_LATENTS,), generator=generator),
        "prompt_embeds": torch.randn(1, 6, 32, generator=generator),
        "prompt_mask": torch.tensor([[1, 1, 1, 1, 0, 0]]),
        "byt5_text_states": torch.randn(1, 4, 32, generator=generator),
        "byt5_text_mask": torch.tensor([[1, 1, 0, 0]]),
        "vision_states": torch.randn(1, 9, 16, generator=generator),
    }
    return {"root": root, "teacher": root / "teacher", "condition": condition}
