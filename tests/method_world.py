"""The tiny world the fvtools method tests train on (df_sft, kd, dmd2, nft): built once per test module."""

from __future__ import annotations

from pathlib import Path

import torch

from predictor_training.data import video_latent_build as vb
from predictor_training.world import video_latent_demo as vd
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_


def write_method_world(root: Path) -> dict[str, Path]:
    """A demo-config Teacher folder (random weights, every path active, the same whichever tests ran before) and a
    3-clip video-latent demo dataset (two train clips, one holdout) under `root`.
    Returns {"root", "teacher", "videos"}."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        teacher = WorldPlayTransformer.from_preset("demo")
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(0))
    teacher.save_pretrained(str(root / "teacher"))
    options = vb.VideoBuildOptions(
        clips=vd.demo_tables(root / "demo"), encoders=root / "demo" / vd.DEMO_ENCODERS_DIR, out=root / "videos",
        height=vd.DEMO_HEIGHT, width=vd.DEMO_WIDTH, num_frames=vd.DEMO_NUM_FRAMES, dtype="float32", device="cpu",
        demo=root / "demo", demo_clips=3, demo_holdout=1,
    )
    assert vb.run(options, prepare_demo=vd.prepare_demo_inputs) == 0
    return {"root": root, "teacher": root / "teacher", "videos": root / "videos"}


def write_trained_looking_predictor(teacher_dir: Path, out: Path, generator: torch.Generator) -> Path:
    """A v4 Predictor on blocks 1, 2 of the Teacher in `teacher_dir`, its zero-initialised output layers made
    non-zero from `generator` (so every parameter gets a gradient through the latent path), saved as inference
    weights at `out`."""
    from predictor_training.predictor.model import build_predictor
    from predictor_training.runtime.checkpoint import checkpoint_meta, save_inference_weights
    predictor = build_predictor(WorldPlayTransformer.from_pretrained(str(teacher_dir)), "v4", (1, 2))
    with torch.no_grad():
        for param in predictor.parameters():
            if param.requires_grad and not param.abs().sum() > 0:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    save_inference_weights(out, predictor, dtype=torch.float32,
                           metadata={**checkpoint_meta("v4", (1, 2), "fp32"), "step": 0})
    return out
