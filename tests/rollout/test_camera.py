"""Pose JSON -> (viewmats, Ks, action) and pose strings against conformance set A (memory retrieval:
tests/rollout/test_memory_retrieval.py)."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from predictor_training.conformance import SET_A
from predictor_training.rollout import camera
from predictor_training.rollout.camera import PoseError, load_pose, pose_string_to_json, pose_to_input


NUM_LATENTS = 32


@pytest.fixture(scope="module")
def golden():
    return load_file(str(SET_A / "vectors.safetensors"))


@pytest.fixture(scope="module")
def info():
    return json.loads((SET_A / "vectors.json").read_text())


@pytest.fixture(scope="module")
def pose_json():
    return json.loads((SET_A / "pose.json").read_text())


def assert_pose_inputs_match(inputs, golden, prefix):
    viewmats, ks, action = inputs
    assert viewmats.dtype == ks.dtype == torch.float64 and action.dtype == torch.int64
    torch.testing.assert_close(viewmats, golden[f"{prefix}.viewmats"], atol=1e-12, rtol=0)
    assert torch.equal(ks, golden[f"{prefix}.Ks"])
    assert torch.equal(action, golden[f"{prefix}.action"])


# ---- inference pose JSON --------------------------------------------------------------------------------------
def test_pose_json_matches_golden(golden):
    assert_pose_inputs_match(pose_to_input(SET_A / "pose.json", NUM_LATENTS), golden, "pose")
    pose = load_pose(SET_A / "pose.json")
    assert pose.pose_format == "inference" and pose.num_latents == NUM_LATENTS


def test_pose_string_matches_golden(golden, info):
    pose = pose_string_to_json(info["pose_string"])
    assert pose == json.loads((SET_A / "pose_from_string.json").read_text())
    assert_pose_inputs_match(pose_to_input(pose, NUM_LATENTS), golden, "pose_str")


def test_combined_pose_string_moves_and_turns_in_one_step():
    pose = pose_string_to_json("w+left-2, d+up-1")
    assert list(pose) == ["0", "1", "2", "3"]
    angle = math.radians(3.0)
    yaw_left = np.array([[math.cos(-angle), 0, math.sin(-angle)], [0, 1, 0], [-math.sin(-angle), 0, math.cos(-angle)]])
    step_one = np.array(pose["1"]["extrinsic"])
    np.testing.assert_allclose(step_one[:3, :3], yaw_left, atol=1e-15)
    np.testing.assert_allclose(step_one[:3, 3], yaw_left @ [0, 0, 0.08], atol=1e-15)  # turn first, then move
    _, _, action = pose_to_input(pose, 4)
    # predictor_training/conformance/golden/README.md section 9 codes: forward = 1, right = 3 (translation);
    # yaw left = 2, pitch up = 3 (rotation)
    assert action.tolist() == [0, 1 * 9 + 2, 1 * 9 + 2, 3 * 9 + 3]


@pytest.mark.parametrize(
    "bad, message",
    [("w+w-1", "twice"), ("jump-3", "unknown motion"), ("w-3.5", "non-negative integer"), ("w3", "name-count")],
)
def test_bad_pose_strings_are_rejected(bad, message):
    with pytest.raises(PoseError, match=message):
        pose_string_to_json(bad)


def test_wrong_latent_count_names_file_and_expected_count():
    with pytest.raises(PoseError) as error:
        pose_to_input(SET_A / "pose.json", NUM_LATENTS - 1)
    assert str(SET_A / "pose.json") in str(error.value) and "num_latents=31" in str(error.value)
    pose = load_pose(SET_A / "pose.json")
    with pytest.raises(PoseError, match="num_latents=16"):
        pose_to_input(pose, 16)


def test_missing_keys_and_fields_are_named(pose_json, tmp_path):
    no_frame = {key: value for key, value in pose_json.items() if key != "5"}
    with pytest.raises(PoseError, match="missing key '5'"):
        load_pose(no_frame)
    no_k = copy.deepcopy(pose_json)
    del no_k["3"]["K"]
    path = tmp_path / "no_k.json"
    path.write_text(json.dumps(no_k))
    with pytest.raises(PoseError) as error:
        load_pose(path)
    assert str(path) in str(error.value) and "key '3'" in str(error.value) and "'K'" in str(error.value)
    with pytest.raises(PoseError, match="'extrinsic' \\+ 'K'"):
        load_pose({"0": {"pose": []}})
    with pytest.raises(PoseError, match="4x4"):
        load_pose({"0": {"extrinsic": [[1, 0], [0, 1]], "K": camera.POSE_STRING_K}})
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(PoseError, match="not valid JSON"):
        load_pose(tmp_path / "broken.json")
    with pytest.raises(PoseError, match="does not exist"):
        load_pose(tmp_path / "absent.json")


# ---- training pose JSON ---------------------------------------------------------------------------------------
def training_pose_json(pose_json, world_from_origin, frames_per_latent=4):
    """Per-video-frame w2c of pose.json's cameras moved by a rigid transform; only frames 4i are latent poses, the
    other frames hold a shifted copy so that reading a wrong frame would show."""
    record = {}
    for latent in range(len(pose_json)):
        c2w = world_from_origin @ np.array(pose_json[str(latent)]["extrinsic"])
        for offset in range(frames_per_latent):
            frame_c2w = c2w.copy()
            frame_c2w[:3, 3] += 0.5 * offset
            record[str(latent * frames_per_latent + offset)] = {
                "w2c": np.linalg.inv(frame_c2w).tolist(),
                "intrinsic": pose_json[str(latent)]["K"],
            }
    return record


def rigid_transform(seed):
    generator = torch.Generator().manual_seed(seed)
    rotation, _ = torch.linalg.qr(torch.randn(3, 3, generator=generator, dtype=torch.float64))
    if torch.det(rotation) < 0:
        rotation[:, 0] = -rotation[:, 0]
    transform = np.eye(4)
    transform[:3, :3] = rotation.numpy()
    transform[:3, 3] = torch.randn(3, generator=generator, dtype=torch.float64).numpy() * 5
    return transform


def test_training_format_uses_every_fourth_frame_and_recentres(golden, pose_json, tmp_path):
    path = tmp_path / "train_pose.json"
    path.write_text(json.dumps(training_pose_json(pose_json, rigid_transform(0))))
    pose = load_pose(path)
    assert pose.pose_format == "training" and pose.num_latents == NUM_LATENTS  # 128 frames -> latents 0, 4, .., 124
    viewmats, ks, action = pose_to_input(pose)
    # pose.json starts at the identity, so re-centring undoes the rigid transform
    torch.testing.assert_close(viewmats, golden["pose.viewmats"], atol=1e-10, rtol=0)
    torch.testing.assert_close(ks, golden["pose.Ks"], atol=1e-15, rtol=0)
    assert pose.default_move_threshold == camera.TRAINING_MOVE_THRESHOLD
    assert torch.equal(action, golden["pose.action"])  # every move in pose.json is 0.08 > 0.01

    # a threshold above every move (at most 0.08 * sqrt(2) per latent) keeps only the rotation codes
    _, _, turns_only = pose_to_input(pose, move_threshold=0.2)
    assert torch.equal(turns_only, golden["pose.action"] % 9)

    first = pose_to_input(path, num_latents=16)[0]
    torch.testing.assert_close(first, golden["pose.viewmats"][:16], atol=1e-10, rtol=0)
    with pytest.raises(PoseError) as error:
        load_pose(path, num_latents=NUM_LATENTS + 1)
    assert str(path) in str(error.value) and "num_latents=33" in str(error.value) and "129" in str(error.value)


def test_training_format_missing_field_is_named(pose_json):
    record = training_pose_json(pose_json, np.eye(4))
    del record["8"]["intrinsic"]
    with pytest.raises(PoseError, match="key '8' is missing field 'intrinsic'"):
        load_pose(record)
