"""Camera paths of the demo world (predictor_training/world/paths.py): pose strings of vocabulary
words, video-frame cameras hitting the latent poses, revisit excursions that mirror each other."""

import json

import numpy as np
import pytest

from predictor_training.rollout.camera import POSE_STRING_K, parse_pose_string, pose_string_to_json, pose_to_input
from predictor_training.world import make_pose_string, video_frame_cameras
from predictor_training.world.paths import (
    OPPOSITE,
    PATH_KINDS,
    REVISIT_KINDS,
    VOCABULARY,
    make_path_pose_string,
    make_revisit_pose_string,
    pose_string_words,
)


# =============================================================================================================
# camera paths
# =============================================================================================================
def test_pose_strings_have_the_asked_steps_and_only_vocabulary_words():
    for num_latents in (2, 8, 32):
        for seed in range(100):
            pose_string = make_pose_string(seed, num_latents)
            assert pose_string == make_pose_string(seed, num_latents)
            assert len(parse_pose_string(pose_string)) == num_latents - 1
            assert set(pose_string_words(pose_string)) <= set(VOCABULARY)
            assert all(int(command.split("-")[1]) > 0 for command in pose_string.split(", "))
    assert len({make_pose_string(seed) for seed in range(50)}) == 50


def test_video_frame_cameras_hit_the_latent_poses_exactly_and_interpolate_between():
    pose_string = make_pose_string(7)
    cameras = video_frame_cameras(pose_string, 125)
    pose = json.loads(json.dumps(pose_string_to_json(pose_string)))  # as written to and read from a file
    assert cameras.shape == (125, 4, 4) and len(pose) == 32
    for latent in range(32):
        np.testing.assert_array_equal(cameras[4 * latent], np.array(pose[str(latent)]["extrinsic"]))
    viewmats, ks, _ = pose_to_input(pose, 32)
    np.testing.assert_allclose(viewmats.numpy(), np.linalg.inv(cameras[::4]), rtol=0, atol=1e-12)
    # the Teacher's normalised K is what the renderer uses: fx / (2 cx) of the pose K
    assert float(ks[0, 0, 0]) == pytest.approx(POSE_STRING_K[0][0] / (2 * POSE_STRING_K[0][2]))
    # a quarter step per video frame: position along w, angle along right
    forward = video_frame_cameras("w-2", 9)
    np.testing.assert_allclose(forward[:, 2, 3], 0.02 * np.arange(9), atol=1e-12)
    turn = video_frame_cameras("w+right-1", 5)
    yaw = np.degrees(np.arctan2(turn[:, 0, 2], turn[:, 2, 2]))
    np.testing.assert_allclose(yaw, [0, 0.75, 1.5, 2.25, 3.0], atol=1e-9)
    for k in range(5):  # the move follows the partially rotated forward axis
        np.testing.assert_allclose(turn[k, :3, 3], 0.02 * k * turn[k, :3, 2], atol=1e-12)
    with pytest.raises(ValueError, match="make 9 video frames"):
        video_frame_cameras("w-2", 125)


def test_turn_back_and_forward_back_mirror_their_excursion():
    for seed in range(20):
        for kind in ("turn_back", "forward_back"):
            commands = [part.split("-") for part in make_revisit_pose_string(seed, 32, kind).split(", ")]
            words = [(name, int(count)) for name, count in commands]
            # somewhere, a pure segment is followed by its opposite with the same count
            assert any(a in OPPOSITE and b == OPPOSITE[a] and n == m for (a, n), (b, m) in zip(words, words[1:]))
    assert make_path_pose_string(3, 32, "generator") == make_pose_string(3, 32)
    assert set(PATH_KINDS) == {"generator", *REVISIT_KINDS}
