"""Camera paths of the demo world, in WorldPlay's pose-string action vocabulary, and their per-video-frame cameras.

``make_pose_string(seed, num_latents)`` draws segments of a few latents each (``SEGMENT_LENGTH_RANGE``), each one
motion from ``MOTION_WEIGHTS`` (w / s / a / d, left / right, and translation + yaw or translation + translation
combinations such as "w+left" or "w+d"), never the same motion twice in a row, until exactly ``num_latents - 1``
steps are used (the last segment is cut to fit): e.g. "w-6, w+left-5, right-8, ...". ``camera.parse_pose_string``
reads it; ``camera.pose_string_to_json`` turns it into the inference-format pose JSON (one key per latent).

``video_frame_cameras(pose_string, num_frames)`` gives the camera of every VIDEO frame (4 per latent step, the VAE's
temporal factor): frame 4i is exactly latent pose i of ``camera.camera_trajectory_from_motions``; frames 4i + k
(k = 1, 2, 3) apply k/4 of step i+1's motion from pose i, in the same order as a whole step (yaw, then pitch, then
the forward and right moves along the partially rotated axes).
"""

from __future__ import annotations

import random
from typing import Mapping

import numpy as np

from predictor_training.camera import FRAMES_PER_LATENT, camera_trajectory_from_motions, parse_pose_string

# motion -> relative weight of being drawn for a segment
MOTION_WEIGHTS: dict[str, float] = {
    "w": 3.0,
    "w+left": 2.0,
    "w+right": 2.0,
    "left": 1.5,
    "right": 1.5,
    "s": 1.0,
    "a": 1.0,
    "d": 1.0,
    "s+left": 0.5,
    "s+right": 0.5,
    "a+left": 0.5,
    "a+right": 0.5,
    "d+left": 0.5,
    "d+right": 0.5,
    "w+a": 0.5,
    "w+d": 0.5,
}
VOCABULARY = ("w", "s", "a", "d", "left", "right")  # the words the motions are made of
SEGMENT_LENGTH_RANGE = (3, 8)  # latents per segment, inclusive


def make_pose_string(seed: int, num_latents: int = 32) -> str:
    """A deterministic random pose string of exactly ``num_latents - 1`` steps (see the module docstring)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not isinstance(num_latents, int) or num_latents < 2:
        raise ValueError(f"num_latents must be an int >= 2 (at least one step), got {num_latents!r}")
    rng = random.Random(seed)
    names = list(MOTION_WEIGHTS)
    weights = [MOTION_WEIGHTS[name] for name in names]
    remaining = num_latents - 1
    segments: list[str] = []
    previous = None
    while remaining > 0:
        motion = previous
        while motion == previous:
            motion = rng.choices(names, weights=weights)[0]
        length = min(remaining, rng.randint(*SEGMENT_LENGTH_RANGE))
        segments.append(f"{motion}-{length}")
        remaining -= length
        previous = motion
    return ", ".join(segments)


def _partial_step(motion: Mapping[str, float], fraction: float) -> np.ndarray:
    """4x4 relative camera motion of ``fraction`` of one step, from the identity."""
    scaled = {key: value * fraction for key, value in motion.items()}
    return camera_trajectory_from_motions([scaled])[1]


def video_frame_cameras(pose_string: str, num_frames: int = 125) -> np.ndarray:
    """Camera-to-world [num_frames, 4, 4] float64 of every video frame of a pose string's path.

    ``num_frames`` must be 4 * steps + 1 (125 frames for 31 steps / 32 latents). Frame 4i equals latent pose i of
    ``camera.pose_string_to_json(pose_string)`` bit for bit.
    """
    motions = parse_pose_string(pose_string)
    expected = FRAMES_PER_LATENT * len(motions) + 1
    if num_frames != expected:
        raise ValueError(
            f"pose string {pose_string!r} has {len(motions)} steps ({len(motions) + 1} latents), which make "
            f"{expected} video frames (4 per step + 1), got num_frames={num_frames}"
        )
    latents = camera_trajectory_from_motions(motions)
    cameras = np.empty((num_frames, 4, 4), dtype=np.float64)
    for step, motion in enumerate(motions):
        start = latents[step]
        cameras[FRAMES_PER_LATENT * step] = start
        for k in range(1, FRAMES_PER_LATENT):
            cameras[FRAMES_PER_LATENT * step + k] = start @ _partial_step(motion, k / FRAMES_PER_LATENT)
    cameras[-1] = latents[-1]
    return cameras


def pose_string_words(pose_string: str) -> list[str]:
    """The motion words of a pose string ("w+left-5, s-3" -> ["w", "left", "s"])."""
    words = []
    for command in (part.strip() for part in pose_string.split(",")):
        if command:
            words.extend(token.strip() for token in command.split("-")[0].split("+"))
    return words
