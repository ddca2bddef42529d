"""The demo world (SPEC §10): procedural 3D scenes rendered from exact camera paths of WorldPlay's action vocabulary.

* ``scene``: ``WorldScene`` / ``make_scene(seed)`` (checkered ground, sky gradient, coloured boxes all around the
  start point, ``caption()``).
* ``render``: ``render_frames(scene, c2w, K, height, width)`` -> uint8 [F, H, W, 3] (vectorised torch ray casting),
  ``object_ids``, ``render_intrinsics``, ``contact_sheet``.
* ``paths``: ``make_pose_string(seed, num_latents)``, ``video_frame_cameras(pose_string, num_frames)``.
  ``make_revisit_pose_string(seed, num_latents, kind)``: paths that come back exactly to earlier cameras.
* ``revisits``: ``revisits(pose)`` -> the latents / video frames of a pose JSON whose camera equals an earlier one's.
* ``clips``: ``WorldSettings``, ``make_world(out, settings)`` -> clip tables for the video-latent builder
  (``tools/render_world.py`` is the command line; docs/demo_world.md).
* ``vae``: the world VAE (a small ``AutoencoderKLHunyuanVideo15``), its training windows and PSNR
  (``tools/train_world_vae.py``).
* ``assets``: the world Teacher's config and the encoder folder (tiny text/vision encoders + the world VAE).

``tools/build_demo_world.py`` rebuilds everything: render, VAE, encoders, encode, df_sft, ODE cache, kd.

Axes: OpenCV camera axes of the start camera (x right, y down, z forward), the ground at y = +1.
"""

from predictor_training.world.clips import WorldConfigError, WorldSettings, make_world, plan_world
from predictor_training.world.paths import make_pose_string, video_frame_cameras
from predictor_training.world.render import contact_sheet, object_ids, render_frames, render_intrinsics
from predictor_training.world.scene import Box, WorldScene, make_scene

__all__ = [
    "Box",
    "WorldConfigError",
    "WorldScene",
    "WorldSettings",
    "contact_sheet",
    "make_pose_string",
    "make_scene",
    "make_world",
    "object_ids",
    "plan_world",
    "render_frames",
    "render_intrinsics",
    "video_frame_cameras",
]
