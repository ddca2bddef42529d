"""Rendering the demo world (predictor_training/world/render.py): deterministic, and the camera's
motion moves the image as it should (forward grows, yaw shifts, a box in every heading)."""

import math

import numpy as np
import pytest

from predictor_training.rollout.camera import POSE_STRING_K
from predictor_training.world import (
    Box,
    WorldScene,
    make_pose_string,
    make_scene,
    object_ids,
    render_frames,
    video_frame_cameras,
)
from predictor_training.world.scene import BOX_PALETTE, GROUND_Y


H, W = 32, 48


def _yaw(degrees: float) -> np.ndarray:
    angle = math.radians(degrees)
    camera = np.eye(4)
    camera[:3, :3] = [[math.cos(angle), 0, math.sin(angle)], [0, 1, 0], [-math.sin(angle), 0, math.cos(angle)]]
    return camera


def _box(colour: str, x: float, z: float, side: float, height: float | None = None, kind: str = "cube") -> Box:
    height = side if height is None else height
    return Box(kind, colour, BOX_PALETTE[colour], (x - side / 2, GROUND_Y - height, z - side / 2),
               (x + side / 2, GROUND_Y, z + side / 2))


def _hand_scene(*boxes: Box) -> WorldScene:
    return WorldScene(seed=-1, boxes=boxes, ground_names=("grey", "white"),
                      ground_colours=((0.5, 0.5, 0.52), (0.85, 0.85, 0.86)), cell_size=0.7,
                      sky_name="a pale blue sky", horizon=(0.8, 0.87, 0.95), zenith=(0.4, 0.62, 0.9))


# =============================================================================================================
# renders
# =============================================================================================================
def test_render_is_deterministic_and_the_camera_motion_changes_the_frames():
    scene, pose_string = make_scene(3), make_pose_string(3, 8)
    cameras = video_frame_cameras(pose_string, 29)
    first = render_frames(scene, cameras, POSE_STRING_K, H, W)
    again = render_frames(make_scene(3), video_frame_cameras(pose_string, 29), POSE_STRING_K, H, W)
    assert first.dtype == np.uint8 and first.shape == (29, H, W, 3)
    np.testing.assert_array_equal(first, again)
    # chunking (max_rays) does not change the pixels
    np.testing.assert_array_equal(first, render_frames(scene, cameras, POSE_STRING_K, H, W, max_rays=1 << 22))
    difference = np.abs(first[1:].astype(int) - first[0].astype(int)).mean(axis=(1, 2, 3))
    assert (difference > 0).all() and difference[-1] > 5
    # y is down: the top row is sky (between the horizon and zenith colours), the bottom row is ground
    sky_lo = np.minimum(scene.horizon, scene.zenith) * 255 - 1
    sky_hi = np.maximum(scene.horizon, scene.zenith) * 255 + 1
    assert ((first[0, 0] >= sky_lo) & (first[0, 0] <= sky_hi)).all()
    assert not ((first[0, -1] >= sky_lo) & (first[0, -1] <= sky_hi)).all(axis=-1).any()


def test_forward_path_makes_the_object_in_front_grow():
    scene = _hand_scene(_box("red", 0.0, 4.5, 1.0), _box("blue", -3.0, 1.0, 0.8), _box("yellow", 3.0, -2.0, 0.8))
    cameras = video_frame_cameras("w-31", 125)[[0, 40, 80, 124]]
    frames = render_frames(scene, cameras, POSE_STRING_K, H, W).astype(int)
    red = ((frames[..., 0] > 120) & (frames[..., 1] < 90) & (frames[..., 2] < 90)).sum(axis=(1, 2))
    assert (np.diff(red) > 0).all() and red[-1] > 4 * red[0] > 0, red
    ids = (object_ids(scene, cameras, POSE_STRING_K, H, W) == 0).sum(axis=(1, 2))
    assert (np.diff(ids) > 0).all(), ids


def _horizontal_shift(before: np.ndarray, after: np.ndarray, max_shift: int = 10) -> int:
    """s minimising |after[:, x] - before[:, x + s]| (grey levels): content moving left gives s > 0."""
    grey_before, grey_after = before.astype(float).mean(-1), after.astype(float).mean(-1)
    width = before.shape[1]
    errors = {}
    for shift in range(-max_shift, max_shift + 1):
        lo, hi = max(0, -shift), min(width, width - shift)
        errors[shift] = np.abs(grey_after[:, lo:hi] - grey_before[:, lo + shift:hi + shift]).mean()
    return min(errors, key=errors.get)


@pytest.mark.parametrize("word,sign", [("right", 1), ("left", -1)])
def test_pure_yaw_shifts_the_image_content_horizontally(word, sign):
    scene = make_scene(11)
    cameras = video_frame_cameras(f"{word}-31", 125)[[0, 8]]  # 2 latents = 6 degrees, ~3 px at 48 px for 89 deg
    before, after = render_frames(scene, cameras, POSE_STRING_K, H, W)
    shift = _horizontal_shift(before, after)
    assert sign * shift >= 2, shift  # turning right moves the world left in the image


def test_a_box_is_visible_in_every_heading_from_the_start_point():
    headings = np.stack([_yaw(45 * k) for k in range(8)])
    for seed in range(20):
        ids = object_ids(make_scene(seed), headings, POSE_STRING_K, H, W)
        visible = (ids >= 0).sum(axis=(1, 2))
        assert (visible > 0).all(), (seed, visible)
