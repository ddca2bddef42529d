"""Which frames of a camera path come back to a camera seen before (the memory figures of the eval read this).

``revisits(pose)`` reads a pose JSON (a path or the parsed object; the inference format, one camera-to-world
``extrinsic`` per latent, or the upstream training format, both through ``camera.load_pose``) and lists every latent
whose camera equals the camera of an earlier latent: ``Revisit(latent, first_latent, frame, first_frame)``, where
``first_latent`` is the EARLIEST latent with that camera and the frames are the video frames of those latents
(latent i is video frame 4i, the VAE's temporal factor). Cameras are equal when their world-to-camera matrices and
intrinsics agree within ``atol`` (default 1e-6; the demo world's revisit paths return to within ~1e-15, and one
pose-string step moves 0.08 units or 3 degrees, so any tolerance between 1e-12 and 1e-3 gives the same answer).

    >>> [(r.latent, r.first_latent) for r in revisits(pose_string_to_json("left-2, right-2"))]
    [(3, 1), (4, 0)]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from predictor_training.rollout.camera import FRAMES_PER_LATENT, load_pose

DEFAULT_ATOL = 1e-6


@dataclass(frozen=True)
class Revisit:
    """Latent ``latent`` (video frame ``frame``) has the camera of latent ``first_latent`` (frame ``first_frame``),
    its earliest visit."""

    latent: int
    first_latent: int
    frame: int
    first_frame: int


def revisits(pose: str | Path | Mapping, atol: float = DEFAULT_ATOL) -> list[Revisit]:
    """Every latent whose camera equals an earlier latent's, in latent order (see the module docstring)."""
    sequence = load_pose(pose)
    w2c, intrinsics = sequence.w2c, sequence.intrinsics
    found = []
    for latent in range(1, len(w2c)):
        for earlier in range(latent):
            if (np.allclose(w2c[latent], w2c[earlier], rtol=0.0, atol=atol)
                    and np.allclose(intrinsics[latent], intrinsics[earlier], rtol=0.0, atol=atol * 1e3)):
                found.append(Revisit(latent, earlier, FRAMES_PER_LATENT * latent, FRAMES_PER_LATENT * earlier))
                break
    return found


def revisit_frames(pose: str | Path | Mapping, atol: float = DEFAULT_ATOL) -> dict[int, int]:
    """{video frame: video frame of the first visit of its camera} for every revisiting latent of ``pose``."""
    return {item.frame: item.first_frame for item in revisits(pose, atol)}
