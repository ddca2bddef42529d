"""Demo inputs of the video-latent dataset (predictor_training/world/video_latent_demo.py): procedural clips whose
camera motion shows in the frames, written once per demo folder (deterministic, reused with the same settings,
refused with others or in a folder the demo did not make), with their poses and clip tables. The encoders and a
whole build run in tests/data/test_video_latent_build.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from predictor_training.data.video_latents import VideoDatasetInputError
from predictor_training.video.io import read_video
from predictor_training.world.demo_assets import make_demo_scenes
from predictor_training.world.video_latent_demo import (
    DEMO_CLIPS_DIR,
    DEMO_FRAME_SIZE,
    DEMO_MOTIONS,
    DEMO_NUM_FRAMES,
    DEMO_SETTINGS_NAME,
    demo_tables,
    ensure_demo_encoders,
    make_demo_clips,
    render_demo_frames,
)


@pytest.fixture(scope="module")
def scene():
    return make_demo_scenes(1, 0)[0].spec


def test_the_camera_motion_shows_in_the_frames(scene):
    size = (20, 32)
    clips = {motion: render_demo_frames(scene, motion, 9, size) for motion in ("w", "s", "w+left", "w+right")}
    assert all(frames.shape == (9, 20, 32, 3) and frames.dtype == np.uint8 for frames in clips.values())
    first = clips["w"][0]
    assert all(np.array_equal(frames[0], first) for frames in clips.values())  # latent 0: the same view
    last = {motion: frames[-1].astype(np.int64) for motion, frames in clips.items()}
    assert len({frames.tobytes() for frames in last.values()}) == 4  # every motion ends elsewhere

    def shift(a, b):  # horizontal offset that best aligns b with a
        errors = {dx: np.abs(a[:, 8:-8] - b[:, 8 + dx: b.shape[1] - 8 + dx]).mean() for dx in range(-6, 7)}
        return min(errors, key=errors.get)

    base = first.astype(np.int64)
    assert shift(base, last["w+right"]) < 0 < shift(base, last["w+left"])  # a yaw pans the other way round


def test_clips_tables_and_poses_are_written_once_and_deterministic(tmp_path):
    tables = make_demo_clips(tmp_path / "a" / DEMO_CLIPS_DIR, num_clips=3, num_holdout=1, seed=0)
    folder = tmp_path / "a" / DEMO_CLIPS_DIR
    assert tables == demo_tables(tmp_path / "a") == [folder / "train.jsonl", folder / "holdout.jsonl"]
    rows = {table.stem: [json.loads(line) for line in table.read_text().splitlines()] for table in tables}
    assert [row["clip_id"] for row in rows["train"]] == ["clip000", "clip001"]
    assert [row["clip_id"] for row in rows["holdout"]] == ["clip002"]
    # the last clip of each table is a lossless mp4, the others PNG-frame folders
    assert [row["video"] for row in rows["train"]] == ["frames/clip000", "videos/clip001.mp4"]
    assert rows["holdout"][0]["video"] == "videos/clip002.mp4"
    for index, row in enumerate(rows["train"] + rows["holdout"]):
        video = read_video(folder / row["video"])
        assert video.shape == (DEMO_NUM_FRAMES, *DEMO_FRAME_SIZE, 3)
        pose = json.loads((folder / row["pose"]).read_text())
        assert len(pose) == (DEMO_NUM_FRAMES - 1) // 4 + 1  # one key per latent
        motion = DEMO_MOTIONS[index % len(DEMO_MOTIONS)][1]
        assert np.array_equal(video, render_demo_frames(make_demo_scenes(3, 0)[index].spec, motion,
                                                        DEMO_NUM_FRAMES, DEMO_FRAME_SIZE))
    settings = json.loads((folder / DEMO_SETTINGS_NAME).read_text())
    assert (settings["num_clips"], settings["num_holdout"], settings["seed"]) == (3, 1, 0)
    assert not list(tmp_path.glob("a/.*"))  # the staging folder was renamed into place

    other = make_demo_clips(tmp_path / "b" / DEMO_CLIPS_DIR, num_clips=3, num_holdout=1, seed=0)
    for a, b in zip(tables, other):
        assert a.read_bytes() == b.read_bytes()
    stamp = (folder / "train.jsonl").stat().st_mtime_ns
    assert make_demo_clips(folder, num_clips=3, num_holdout=1, seed=0) == tables  # reused as it is
    assert (folder / "train.jsonl").stat().st_mtime_ns == stamp


def test_other_settings_and_foreign_folders_are_refused(tmp_path):
    folder = tmp_path / DEMO_CLIPS_DIR
    make_demo_clips(folder, num_clips=2, num_holdout=1, seed=0)
    with pytest.raises(VideoDatasetInputError, match="were made with .* this run asks for"):
        make_demo_clips(folder, num_clips=2, num_holdout=1, seed=1)
    (tmp_path / "mine").mkdir()
    with pytest.raises(VideoDatasetInputError, match="exists but has no demo_clips.json"):
        make_demo_clips(tmp_path / "mine", num_clips=2, num_holdout=1)
    for holdout in (0, 2):
        with pytest.raises(ValueError, match="num_holdout"):
            make_demo_clips(tmp_path / "c", num_clips=2, num_holdout=holdout)
    (tmp_path / "encoders").mkdir()
    with pytest.raises(VideoDatasetInputError, match="exists but has no model_index.json"):
        ensure_demo_encoders(tmp_path / "encoders")
    (tmp_path / "encoders" / "model_index.json").write_text("{}")
    assert ensure_demo_encoders(tmp_path / "encoders") == tmp_path / "encoders"  # an encoder folder is kept
