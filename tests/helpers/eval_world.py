"""A tiny evaluation world on disk for the eval and leaderboard tests: a 2-block Teacher, a tiny
random VAE, one case's encoder outputs, sample tables holdout25 (2 rows of 8 latents), holdout50 (1 row of 12) and
train (1 row of 8), and an untrained v4 Predictor checkpoint (exactly hidden reuse); with random ground-truth videos
(`write_ground_truth`) and the library entry point's settings for it (`eval_settings`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from predictor_training.eval import EvalSettings
from predictor_training.predictor.model import build_predictor
from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.rollout.schedule import StepPlan
from predictor_training.runtime.inference_weights import save_inference_weights
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.source import TeacherSource
from predictor_training.video.io import write_video


REPO_ROOT = Path(__file__).resolve().parents[2]
CLI_LATENTS = 8  # holdout25: 2 chunks per video (chunk 0 F-F-F-F, chunk 1 scheduled), decoded by the CLI runs
LONG_LATENTS = 12  # holdout50: 3 chunks, so chunk 2 gets the previous-chunk hidden the Predictor itself made
HEIGHT, WIDTH = 2, 3
RUN_DIR_NAME = "v4tiny_flr1e-4_blr1e-5_schedsteps20_swarmup2_bwarmup2"
STEP = 5
SOURCE_BLOCKS = (0, 1)
CLI_FRAMES = (CLI_LATENTS - 1) * 4 + 1  # decoded frames of a CLI video (temporal compression 4)
FRAME_SIZE = (HEIGHT * 16, WIDTH * 16)  # decoded frame height, width (spatial compression 16): 32 x 48
SIDE_BY_SIDE_SCALE = 6  # auto: the smallest factor making 32-pixel panels >= 192 pixels high
SIDE_BY_SIDE_LABEL = 24  # label strip of panels >= 256 pixels wide


# ---------------------------------------------------------------------------------------------------------------
# A tiny world on disk: Teacher, VAE, encoder outputs, sample table, an untrained v4 checkpoint
# ---------------------------------------------------------------------------------------------------------------
def write_eval_world(root: Path) -> dict:
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=2)
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    teacher.save_pretrained(str(root / "teacher"))

    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(2)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4)
    vae.save_pretrained(str(root / "vae"))

    generator = torch.Generator().manual_seed(3)
    config = teacher.config
    (root / "encoded").mkdir()
    torch.save({
        "prompt_embeds": torch.randn(1, 8, config.text_states_dim, generator=generator),
        "prompt_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]),
        "byt5_text_states": torch.randn(1, 4, config.byt5_states_dim, generator=generator),
        "byt5_text_mask": torch.tensor([[1, 1, 0, 0]]),
        "vision_states": torch.randn(1, 3, config.vision_states_dim, generator=generator),
        "image_cond": torch.randn(1, config.in_channels, 1, HEIGHT, WIDTH, generator=generator),
    }, root / "encoded" / "c000.pt")

    from PIL import Image

    from predictor_training.data.sample_table import SampleRow, write_sample_table

    samples = root / "samples"
    (samples / "poses").mkdir(parents=True)
    Image.new("RGB", (6, 4), (10, 20, 30)).save(samples / "c000.png")
    tables = (("holdout25", CLI_LATENTS, (0, 2)), ("holdout50", LONG_LATENTS, (2,)), ("train", CLI_LATENTS, (1,)))
    for split, num_latents, actions in tables:
        rows = []
        for action_id in actions:
            motion = {0: "w", 1: "d+right"}.get(action_id, "w+left")
            pose = f"poses/a{action_id}_{num_latents}.json"
            (samples / pose).write_text(json.dumps(pose_string_to_json(f"{motion}-{num_latents - 1}")))
            rows.append(SampleRow("c000", "c000.png", "a tiny test case", action_id, pose, 1000 + action_id))
        write_sample_table(samples / f"{split}.jsonl", rows)

    torch.manual_seed(4)
    predictor = build_predictor(teacher, "v4", SOURCE_BLOCKS)
    meta = {"variant": "v4", "source_blocks": list(SOURCE_BLOCKS), "precision": "fp32"}
    ckpt = root / "runs" / RUN_DIR_NAME / f"predictor_step_{STEP:05d}.safetensors"
    ckpt.parent.mkdir(parents=True)
    save_inference_weights(ckpt, predictor, metadata={**meta, "step": STEP},
                           config={"flags": {"teacher": str(root / "teacher")},
                                   "derived": {"predictor": predictor.predictor_config()}})
    return {"root": root, "ckpt": ckpt}


# ---------------------------------------------------------------------------------------------------------------
# Ground-truth videos of the world's rows, and the library entry point's settings
# ---------------------------------------------------------------------------------------------------------------
def write_ground_truth(folder: Path, keys, num_frames: int = CLI_FRAMES, mp4_keys=()) -> Path:
    """Random uint8 ground-truth videos [num_frames, 32, 48, 3]: PNG-frame folders <key>/, lossless <key>.mp4 for
    mp4_keys."""
    generator = np.random.default_rng(5)
    for key in keys:
        frames = generator.integers(0, 256, (num_frames, *FRAME_SIZE, 3), dtype=np.uint8)
        if key in mp4_keys:
            write_video(folder / f"{key}.mp4", frames, fps=24.0, lossless=True)
        else:
            write_video(folder / key, frames, fps=24.0)
    return folder


def eval_settings(world: dict, output_root: Path, **overrides) -> EvalSettings:
    """The library entry point's settings for the tiny world (holdout25, F-P-P-P, no warm-up, no side-by-side)."""
    root = world["root"]
    settings = EvalSettings(
        teacher_source=TeacherSource(root / "teacher", None, "--teacher", None), vae=root / "vae",
        sample_table=root / "samples" / "holdout25.jsonl", split="holdout25", case_source="encoded",
        case_root=root / "encoded", num_latents=CLI_LATENTS, checkpoints=[world["ckpt"]],
        plan=StepPlan.from_steps((1, 2, 3)), dtype=torch.float32, vae_dtype=torch.float32, output_root=output_root,
        num_side_by_side=0, lpips_random_backbone=True, warmup_chunks=0, progress=False,
    )
    return dataclasses.replace(settings, **overrides)
