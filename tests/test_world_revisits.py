"""Revisit camera paths of the demo world (predictor_training.world.paths) and the helper that finds the frames
sharing a camera with an earlier frame (predictor_training.world.revisits)."""

import json

import numpy as np
import pytest

from predictor_training.rollout.camera import POSE_STRING_K, parse_pose_string, pose_string_to_json
from predictor_training.world import make_scene, render_frames, video_frame_cameras
from predictor_training.world.clips import WorldClip, WorldSettings, make_world, path_kind, plan_world
from predictor_training.world.paths import (
    OPPOSITE,
    PATH_KINDS,
    REVISIT_KINDS,
    make_path_pose_string,
    make_pose_string,
    make_revisit_pose_string,
)
from predictor_training.world.revisits import Revisit, revisit_frames, revisits
from predictor_training.world.shipped import load_shipped_world


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


def test_turn_back_and_forward_back_mirror_their_excursion():
    for seed in range(20):
        for kind in ("turn_back", "forward_back"):
            commands = [part.split("-") for part in make_revisit_pose_string(seed, 32, kind).split(", ")]
            words = [(name, int(count)) for name, count in commands]
            # somewhere, a pure segment is followed by its opposite with the same count
            assert any(a in OPPOSITE and b == OPPOSITE[a] and n == m for (a, n), (b, m) in zip(words, words[1:]))
    assert make_path_pose_string(3, 32, "generator") == make_pose_string(3, 32)
    assert set(PATH_KINDS) == {"generator", *REVISIT_KINDS}


def test_worlds_mix_revisit_paths_into_train_and_held_out_scenes():
    settings = WorldSettings(num_scenes=10, paths_per_scene=4, holdout_scenes=2, holdout_paths=1, revisit_paths=2)
    clips = plan_world(settings)
    kinds = {(clip.scene_index, clip.path_index): clip.path_kind for clip in clips}
    assert all(kinds[(s, p)] == "generator" for s in range(10) for p in (0, 1))
    assert {kinds[(s, p)] for s in range(8) for p in (2, 3)} == set(REVISIT_KINDS)
    assert {kinds[(s, p)] for s in (8, 9) for p in (2, 3)} == set(REVISIT_KINDS)  # the held-out scenes: all four
    assert {kinds[(s, 4)] for s in range(8)} == {"generator", *REVISIT_KINDS}
    for clip in clips:
        assert clip.path_kind == path_kind(settings, clip.scene_index, clip.path_index)
        assert bool(revisits(pose_string_to_json(clip.pose_string))) or clip.path_kind == "generator"
    assert settings.recorded()["revisit_paths"] == 2
    # worlds without revisit paths record neither the setting nor the clips' kinds (older configs read back)
    plain = WorldSettings(num_scenes=3, holdout_scenes=1)
    assert "revisit_paths" not in plain.recorded()
    assert all("path_kind" not in clip.record() for clip in plan_world(plain))
    assert plan_world(plain) == [WorldClip(**clip.record()) for clip in plan_world(plain)]


def test_revisit_world_is_written_and_read_back(tmp_path):
    settings = WorldSettings(num_scenes=2, paths_per_scene=2, holdout_scenes=1, holdout_paths=0, revisit_paths=1,
                             height=16, width=24, num_frames=33)
    out = make_world(tmp_path / "W", settings, progress=False)
    config = json.loads((tmp_path / "W" / "world_config.json").read_text())
    assert config["settings"]["revisit_paths"] == 1 and "path_kinds" in config["splits"]
    assert [clip.get("path_kind", "generator") for clip in config["clips"]] == [
        "generator", "turn_back", "generator", "forward_back"]
    assert make_world(tmp_path / "W", settings, progress=False).clips == out.clips
    for clip in out.clips:
        found = revisits(tmp_path / "W" / clip.pose_path)
        assert bool(found) == (clip.path_kind != "generator")
    # a weights folder whose world has revisit paths loads (path_kind is an optional clip field)
    for name in ("vae", "teacher"):
        (tmp_path / "weights" / name).mkdir(parents=True)
        (tmp_path / "weights" / name / "config.json").write_text("{}")
    (tmp_path / "weights" / "world_config.json").write_text((tmp_path / "W" / "world_config.json").read_text())
    assert load_shipped_world(tmp_path / "weights").clips == out.clips
    with pytest.raises(ValueError, match="revisit_paths"):
        WorldSettings(num_scenes=2, paths_per_scene=2, holdout_scenes=1, revisit_paths=3).validate()
