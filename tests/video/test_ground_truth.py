"""Ground-truth videos (predictor_training/video/ground_truth.py): one key per (case, action) row, found as a PNG-frame
folder or an mp4 (not both), every missing row named before anything runs, checked against the decoded videos'
shape, and the still-image baseline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from predictor_training.runtime.errors import MissingFileError
from predictor_training.video.ground_truth import (
    find_ground_truth_videos,
    load_ground_truth,
    repeat_first_frame,
    video_key,
)
from predictor_training.video.io import write_video


def frames(count: int, height: int = 8, width: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3), dtype=np.uint8)


def test_the_key_of_a_row():
    assert video_key("c007", 3) == "c007__a3"


def test_a_folder_of_frames_or_an_mp4_per_key(tmp_path):
    write_video(tmp_path / "c000__a0", frames(5), fps=24.0)
    write_video(tmp_path / "c000__a1.mp4", frames(5), fps=24.0, lossless=True)
    found = find_ground_truth_videos(tmp_path, ["c000__a0", "c000__a1"])
    assert found == {"c000__a0": tmp_path / "c000__a0", "c000__a1": tmp_path / "c000__a1.mp4"}


def test_every_missing_row_is_named_and_a_row_with_both_is_refused(tmp_path):
    write_video(tmp_path / "c000__a0", frames(5), fps=24.0)
    with pytest.raises(MissingFileError) as error:
        find_ground_truth_videos(tmp_path, ["c000__a0", "c001__a0", "c002__a2"])
    message = str(error.value)
    assert "no ground-truth video for 2 of 3 rows" in message
    assert f"{tmp_path / 'c001__a0'}/ or {tmp_path / 'c001__a0.mp4'}" in message and "c002__a2" in message
    assert f"{tmp_path / 'c000__a0'}/" not in message
    write_video(tmp_path / "c000__a0.mp4", frames(5), fps=24.0, lossless=True)
    with pytest.raises(ValueError, match="both a frame folder and a file for 1 rows"):
        find_ground_truth_videos(tmp_path, ["c000__a0"])


def test_a_loaded_video_is_checked_against_the_decoded_shape(tmp_path):
    video = frames(5, height=8, width=12, seed=3)
    write_video(tmp_path / "truth", video, fps=24.0)
    loaded = load_ground_truth(tmp_path / "truth", (5, 8, 12))
    assert loaded.dtype == torch.uint8 and torch.equal(loaded, torch.from_numpy(video))
    for expected, field in (((6, 8, 12), "frame count is 5, expected 6"), ((5, 16, 12), "height is 8, expected 16"),
                            ((5, 8, 24), "width is 12, expected 24")):
        with pytest.raises(ValueError, match=f"ground-truth {field}"):
            load_ground_truth(tmp_path / "truth", expected)


def test_the_still_image_baseline_repeats_frame_zero():
    truth = torch.from_numpy(frames(4, seed=1))
    still = repeat_first_frame(truth)
    assert still.shape == truth.shape and still.is_contiguous()
    assert all(torch.equal(still[index], truth[0]) for index in range(4))
    assert not torch.equal(still[1], truth[1])
