"""Revisits (predictor_training/world/revisits.py): the frames of a path that share a camera
with an earlier frame, from hand-written paths, pose files and the world's revisit paths."""

from __future__ import annotations

import json

import numpy as np
import pytest

from predictor_training.rollout.camera import POSE_STRING_K, parse_pose_string, pose_string_to_json
from predictor_training.world import make_scene, render_frames, video_frame_cameras
from predictor_training.world.paths import REVISIT_KINDS, make_revisit_pose_string
from predictor_training.world.revisits import Revisit, revisit_frames, revisits


def test_revisits_of_hand_written_paths():
    assert revisits(pose_string_to_json("w-8")) == []
    assert revisits(pose_string_to_json("left-2, right-2")) == [Revisit(3, 1, 12, 4), Revisit(4, 0, 16, 0)]
    # a rectangle walked without turning comes back to the start once; look-around passes the start twice
    assert [(r.latent, r.first_latent) for r in revisits(pose_string_to_json("w-2, a-3, s-2, d-3"))] == [(10, 0)]
    found = {r.latent: r.first_latent for r in revisits(pose_string_to_json("left-3, right-6, left-3"))}
    assert found[6] == 0 and found[12] == 0 and found[10] == 8 and found[4] == 2 and 9 not in found
    # combined words do not undo each other (yaw first within a step): no exact return
    assert revisits(pose_string_to_json("w+left-4, s+right-4")) == []
    assert revisit_frames(pose_string_to_json("w-3, s-3")) == {16: 8, 20: 4, 24: 0}


def test_revisits_reads_pose_files_and_the_training_format(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(pose_string_to_json("right-5, left-5")))
    assert [(r.latent, r.first_latent) for r in revisits(path)][-1] == (10, 0)
    # upstream training format: one key per video frame with w2c; latent i = frame 4i
    cameras = video_frame_cameras("right-5, left-5", 41)
    training = {str(i): {"w2c": np.linalg.inv(c2w).tolist(), "intrinsic": POSE_STRING_K} for i, c2w in enumerate(cameras)}
    assert revisits(training) == revisits(path)


@pytest.mark.parametrize("kind", REVISIT_KINDS)
def test_revisit_paths_come_back_exactly_and_their_frames_repeat(kind):
    scene = make_scene(5)
    for seed in range(6):
        pose_string = make_revisit_pose_string(seed, 32, kind)
        assert pose_string == make_revisit_pose_string(seed, 32, kind)  # deterministic
        assert len(parse_pose_string(pose_string)) == 31
        found = revisits(pose_string_to_json(pose_string))
        assert found, f"{kind} seed {seed}: {pose_string} revisits nothing"
        cameras = video_frame_cameras(pose_string, 125)
        for item in found:
            np.testing.assert_allclose(cameras[item.frame], cameras[item.first_frame], atol=1e-9)
        last = found[-1]
        frames = render_frames(scene, cameras[[last.first_frame, last.frame]], POSE_STRING_K, 16, 24)
        assert np.abs(frames[0].astype(int) - frames[1].astype(int)).max() <= 1
    with pytest.raises(ValueError, match="unknown revisit kind"):
        make_revisit_pose_string(0, 32, "spiral")


def test_revisit_frames_of_a_turn_away_and_back():
    pairs = revisit_frames(pose_string_to_json("left-2, right-2"))  # latents 0 1 2 1 0 -> frames 12->4, 16->0
    assert pairs == {12: 4, 16: 0}
