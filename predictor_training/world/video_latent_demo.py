"""Demo inputs of the video-latent dataset: procedural moving clips and the demo's tiny random encoders.

``prepare_demo_inputs`` writes them into a demo folder (``--demo D`` of ``tools/build_video_latent_dataset.py``;
``video_latent_build.run(options, prepare_demo=prepare_demo_inputs)`` calls it on rank 0): clips, poses and the clip tables ``train.jsonl`` / ``holdout.jsonl``
in ``D/video_clips``, the encoders in ``D/encoders``. Deterministic from the clip counts and the seed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.data.shards import write_bytes_atomic
from predictor_training.data.video_latents import VideoDatasetInputError, latents_for_frames
from predictor_training.video.io import write_video

# Demo: tiny clips through the demo's tiny random encoders (predictor_training.world.demo_assets).
DEMO_HEIGHT, DEMO_WIDTH = 32, 48  # encoded resolution -> latent grid 2 x 3
DEMO_FRAME_SIZE = (40, 64)  # (height, width) of the written frames: wider than 32 x 48, so resize + crop runs
DEMO_NUM_FRAMES = 29  # 4*7+1 frames -> 8 latents = 2 chunks
DEMO_ENCODER_SEED = 3000  # tools/make_demo_assets.py's encoder sub-seed (_ENCODER_SEED) for --seed 0
DEMO_CLIPS_DIR = "video_clips"
DEMO_ENCODERS_DIR = "encoders"
DEMO_SETTINGS_NAME = "demo_clips.json"
DEMO_MOTIONS = (("forward", "w"), ("forward_left", "w+left"), ("backward", "s"), ("forward_right", "w+right"))


def render_demo_frames(spec, motion: str, num_frames: int, frame_size: tuple[int, int]) -> np.ndarray:
    """uint8 [F, h, w, 3] of a demo scene (``demo.SceneSpec``) seen by a camera that follows ``motion`` ("w", "s",
    "w+left", "w+right"; per latent, as the pose strings): forward zooms in, backward out, a yaw pans. Latent i
    is video frame 4i, so the motion advances by 1/4 latent per frame."""
    from predictor_training.world.demo_assets import render_scene

    height, width = frame_size
    big_h, big_w = 2 * height, 2 * width
    scene = render_scene(spec, big_h, big_w)
    moves = motion.split("+")
    forward = 1.0 if "w" in moves else -1.0 if "s" in moves else 0.0
    yaw = 1.0 if "right" in moves else -1.0 if "left" in moves else 0.0
    frames = []
    for index in range(num_frames):
        latent = index / 4.0
        zoom = 1.0 + 0.05 * forward * latent
        crop_h, crop_w = 0.6 * big_h / zoom, 0.6 * big_w / zoom
        centre_x = big_w / 2 + yaw * 0.03 * big_w * latent
        centre_x = min(max(centre_x, crop_w / 2), big_w - crop_w / 2)
        box = (centre_x - crop_w / 2, big_h / 2 - crop_h / 2, centre_x + crop_w / 2, big_h / 2 + crop_h / 2)
        frames.append(np.asarray(scene.resize((width, height), Image.Resampling.BILINEAR, box=box), dtype=np.uint8))
    return np.stack(frames)


def _demo_settings(num_clips: int, num_holdout: int, seed: int) -> dict:
    return {"version": 1, "num_clips": num_clips, "num_holdout": num_holdout, "seed": seed,
            "num_frames": DEMO_NUM_FRAMES, "frame_size": list(DEMO_FRAME_SIZE),
            "motions": [name for name, _ in DEMO_MOTIONS], "mp4_clip": "the last clip of each table, lossless H.264"}


def make_demo_clips(folder: str | Path, num_clips: int = 6, num_holdout: int = 2, seed: int = 0) -> list[Path]:
    """Write the demo's clips into ``folder`` (the clip tables' folder) and return the two tables.

    ``folder/frames/{clip_id}/`` PNG frames (or ``folder/videos/{clip_id}.mp4``, lossless, for the last clip of
    each table), ``folder/poses/{clip_id}.json`` (inference-format pose from a pose string, one key per latent),
    ``folder/train.jsonl`` and ``folder/holdout.jsonl``, ``folder/demo_clips.json`` (the settings). Deterministic
    from the arguments; an existing folder with the same settings is reused, one with other settings is refused.
    """
    from predictor_training.world.demo_assets import make_demo_scenes

    folder = Path(folder)
    settings = _demo_settings(num_clips, num_holdout, seed)
    tables = [folder / "train.jsonl", folder / "holdout.jsonl"]
    if not 1 <= num_holdout < num_clips:
        raise ValueError(f"demo: num_holdout={num_holdout} must be in [1, num_clips={num_clips})")
    if (folder / DEMO_SETTINGS_NAME).is_file():
        existing = json.loads((folder / DEMO_SETTINGS_NAME).read_text())
        if existing != settings:
            raise VideoDatasetInputError(f"{folder / DEMO_SETTINGS_NAME}: the demo clips there were made with "
                                         f"{existing}, this run asks for {settings}; use another --demo folder")
        return tables
    if folder.exists():
        raise VideoDatasetInputError(f"{folder}: exists but has no {DEMO_SETTINGS_NAME}, so the demo did not make it; "
                                     "use another --demo folder (the demo never replaces files it did not write)")
    staging = folder.parent / f".{folder.name}.building"
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "poses").mkdir(parents=True)
    num_latents = latents_for_frames(DEMO_NUM_FRAMES)
    rows: dict[str, list[dict]] = {"train": [], "holdout": []}
    for index, scene in enumerate(make_demo_scenes(num_clips, seed)):
        clip_id = f"clip{index:03d}"
        split = "train" if index < num_clips - num_holdout else "holdout"
        last_of_split = index == num_clips - num_holdout - 1 or index == num_clips - 1
        motion = DEMO_MOTIONS[index % len(DEMO_MOTIONS)][1]
        frames = render_demo_frames(scene.spec, motion, DEMO_NUM_FRAMES, DEMO_FRAME_SIZE)
        video = f"videos/{clip_id}.mp4" if last_of_split else f"frames/{clip_id}"
        write_video(staging / video, frames, fps=24, lossless=True)
        pose = pose_string_to_json(f"{motion}-{num_latents - 1}")
        write_bytes_atomic(staging / "poses" / f"{clip_id}.json", (json.dumps(pose) + "\n").encode("utf-8"))
        rows[split].append({"clip_id": clip_id, "video": video, "pose": f"poses/{clip_id}.json",
                            "caption": scene.caption})
    for table in tables:
        lines = "".join(json.dumps(row) + "\n" for row in rows[table.stem])
        write_bytes_atomic(staging / table.name, lines.encode("utf-8"))
    write_bytes_atomic(staging / DEMO_SETTINGS_NAME, (json.dumps(settings, indent=2) + "\n").encode("utf-8"))
    staging.rename(folder)
    return tables


def ensure_demo_encoders(folder: str | Path, seed: int = 0) -> Path:
    """``folder`` if it holds encoders already (e.g. the ``encoders/`` of ``tools/make_demo_assets.py``), else the
    demo's tiny random encoders written there (``demo.save_tiny_encoders``, the sizes of the demo Teacher and the
    sub-seed make_demo_assets uses, so they equal the demo assets' encoders for the same seed)."""
    from predictor_training.world.demo_assets import TinyEncoderSizes, save_tiny_encoders

    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return folder
    if folder.exists():
        raise VideoDatasetInputError(f"{folder}: exists but has no model_index.json (not a diffusers encoder folder); "
                                     "use another --demo folder")
    staging = folder.parent / f".{folder.name}.building"
    if staging.exists():
        shutil.rmtree(staging)
    save_tiny_encoders(staging, TinyEncoderSizes(), seed + DEMO_ENCODER_SEED)
    staging.rename(folder)
    return folder


def prepare_demo_inputs(demo: str | Path, num_clips: int = 6, num_holdout: int = 2, seed: int = 0):
    """(encoders folder, clip tables) of the demo folder ``demo``, made when absent (call on one rank only)."""
    demo = Path(demo)
    demo.mkdir(parents=True, exist_ok=True)
    encoders = ensure_demo_encoders(demo / DEMO_ENCODERS_DIR, seed)
    tables = make_demo_clips(demo / DEMO_CLIPS_DIR, num_clips, num_holdout, seed)
    return encoders, tables


def demo_tables(demo: str | Path) -> list[Path]:
    """The clip tables ``prepare_demo_inputs`` writes in the demo folder ``demo``."""
    return [Path(demo) / DEMO_CLIPS_DIR / "train.jsonl", Path(demo) / DEMO_CLIPS_DIR / "holdout.jsonl"]
