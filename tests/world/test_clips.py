"""World clips (predictor_training/world/clips.py): clip tables the video-latent builder accepts
with the promised splits, lossless mp4 worlds, bad settings refused, revisit paths mixed into the splits and a revisit
world written and read back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from predictor_training.data.video_latent_build import read_clip_plan
from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.video.io import read_video
from predictor_training.world import WorldConfigError, WorldSettings, make_scene, make_world
from predictor_training.world.clips import WorldClip, path_kind, plan_world, render_clip
from predictor_training.world.paths import REVISIT_KINDS
from predictor_training.world.revisits import revisits
from predictor_training.world.shipped import load_shipped_world


REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "render_world.py"
SMALL = dict(num_scenes=3, paths_per_scene=2, holdout_scenes=1, holdout_paths=1, height=16, width=24, num_frames=9)


# =============================================================================================================
# clip tables
# =============================================================================================================
def _files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_world_tables_are_accepted_by_the_video_latent_builder_and_hold_the_promised_splits(tmp_path):
    settings = WorldSettings(**SMALL)
    out = make_world(tmp_path / "W", settings, progress=False)
    assert not out.reused and not (tmp_path / ".W.building").exists()
    plan = read_clip_plan(out.tables, settings.num_frames)
    assert plan.splits() == {"holdout": 4, "train": 4}
    by_split = {split: {job.clip_id for job in plan.clips if job.split == split} for split in ("train", "holdout")}
    assert by_split["train"] == {"s000_p00", "s000_p01", "s001_p00", "s001_p01"}
    # held-out scene 2 (all its paths) + a new path of each train scene
    assert by_split["holdout"] == {"s002_p00", "s002_p01", "s000_p02", "s001_p02"}
    config = json.loads((tmp_path / "W" / "world_config.json").read_text())
    assert config["splits"]["holdout"] == {"held_out_scenes": [2], "held_out_scene_paths": [0, 1],
                                           "new_paths_of_train_scenes": [2]}
    clips = {clip["clip_id"]: clip for clip in config["clips"]}
    train_scene_seeds = {clips[clip_id]["scene_seed"] for clip_id in by_split["train"]}
    assert clips["s002_p00"]["scene_seed"] not in train_scene_seeds
    for scene_index in (0, 1):  # the held-out path of a train scene is a new path of that scene
        new = clips[f"s{scene_index:03d}_p02"]
        for path_index in (0, 1):
            old = clips[f"s{scene_index:03d}_p{path_index:02d}"]
            assert new["path_seed"] != old["path_seed"] and new["pose_string"] != old["pose_string"]
    # every clip: the pose file is the pose string's pose JSON, the frames are the render of the recorded clip
    for job in plan.clips[:2] + plan.clips[-1:]:
        clip = clips[job.clip_id]
        assert json.loads(job.pose.read_text()) == json.loads(json.dumps(pose_string_to_json(clip["pose_string"])))
        assert job.caption == make_scene(clip["scene_seed"]).caption()
        np.testing.assert_array_equal(read_video(job.video), render_clip(out.clips[job.index], settings))
    # same settings: reused, nothing rewritten; other settings: refused with the fields named
    before = {path: path.stat().st_mtime_ns for path in (tmp_path / "W").rglob("*")}
    assert make_world(tmp_path / "W", settings, progress=False).reused
    assert before == {path: path.stat().st_mtime_ns for path in (tmp_path / "W").rglob("*")}
    with pytest.raises(WorldConfigError, match=r"height: 16 there, 32 asked; seed: 0 there, 1 asked"):
        make_world(tmp_path / "W", WorldSettings(**{**SMALL, "height": 32, "seed": 1}), progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(WorldConfigError, match="has no world_config.json"):
        make_world(tmp_path / "other", settings, progress=False)

    # the command line, in another process, writes byte-identical files
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [f"--{name}={value}" for name, value in SMALL.items()]
    result = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "W2"), *args], capture_output=True,
                            text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert _files(tmp_path / "W") == _files(tmp_path / "W2")
    result = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "W2"), *args, "--width", "32"],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 2 and "width: 24 there, 32 asked" in result.stderr


def test_mp4_worlds_are_lossless(tmp_path):
    settings = WorldSettings(**{**SMALL, "num_scenes": 2, "paths_per_scene": 1, "holdout_paths": 0,
                                "video_format": "mp4"})
    out = make_world(tmp_path / "W", settings, progress=False)
    plan = read_clip_plan(out.tables, settings.num_frames)
    assert [job.video.name for job in plan.clips] == ["s000_p00.mp4", "s001_p00.mp4"]
    np.testing.assert_array_equal(read_video(plan.clips[0].video), render_clip(out.clips[0], settings))


def test_bad_settings_are_refused(tmp_path):
    for bad, message in [({"num_frames": 10}, "4k\\+1"), ({"holdout_scenes": 3}, "holdout_scenes"),
                         ({"holdout_scenes": 0, "holdout_paths": 0}, "holdout would be empty"),
                         ({"video_format": "gif"}, "video_format")]:
        with pytest.raises(WorldConfigError, match=message):
            make_world(tmp_path / "W", WorldSettings(**{**SMALL, **bad}), progress=False)
    assert not (tmp_path / "W").exists()


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
