"""Ground-truth videos next to generated ones: one key per (case, action) row, found in a folder of PNG-frame folders
or mp4 files, checked against the generated videos' shape."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from predictor_training.runtime.errors import MissingFileError
from predictor_training.video.io import read_video

GROUND_TRUTH_FILE_SUFFIX = ".mp4"  # <folder>/<key>.mp4; the other layout is the PNG-frame folder <folder>/<key>


def video_key(case_id: str, action_id: int) -> str:
    return f"{case_id}__a{action_id}"


def ground_truth_candidates(folder: Path, key: str) -> tuple[Path, Path]:
    """The two accepted places of one row's ground truth: (PNG-frame folder <folder>/<key>, file <folder>/<key>.mp4)."""
    folder = Path(folder)
    return folder / key, folder / f"{key}{GROUND_TRUTH_FILE_SUFFIX}"


def find_ground_truth_videos(folder: Path, keys: Sequence[str]) -> dict[str, Path]:
    """{key: ground-truth video path} for every key, checked before anything runs: a row with neither a frame folder
    nor an mp4, or with both, is an error naming the paths (missing rows are all listed)."""
    found, missing, ambiguous = {}, [], []
    for key in keys:
        frame_folder, video_file = ground_truth_candidates(folder, key)
        present = [path for path, exists in ((frame_folder, frame_folder.is_dir()), (video_file, video_file.is_file()))
                   if exists]
        if not present:
            missing.append(f"{frame_folder}/ or {video_file}")
        elif len(present) == 2:
            ambiguous.append(f"{frame_folder}/ and {video_file}")
        else:
            found[key] = present[0]
    if missing:
        raise MissingFileError(
            f"--ground_truth {folder}: no ground-truth video for {len(missing)} of {len(keys)} rows; expected a "
            f"folder of PNG frames <key>/ or a file <key>{GROUND_TRUTH_FILE_SUFFIX} for each: {'; '.join(missing)}")
    if ambiguous:
        raise ValueError(f"--ground_truth {folder}: both a frame folder and a file for {len(ambiguous)} rows (keep "
                         f"one): {'; '.join(ambiguous)}")
    return found


def load_ground_truth(path: Path, expected_shape: tuple[int, int, int]) -> Tensor:
    """One ground-truth video (`video_io.read_video`) -> uint8 [F, H, W, 3], checked against the decoded videos'
    (F, H, W) = `expected_shape`; a difference is an error naming the path, the field and both values."""
    video = read_video(path)  # uint8 [F, H, W, 3]
    for field, index in (("frame count", 0), ("height", 1), ("width", 2)):
        if video.shape[index] != expected_shape[index]:
            frames, height, width = expected_shape
            raise ValueError(f"{path}: ground-truth {field} is {video.shape[index]}, expected {expected_shape[index]} "
                             f"(the decoded videos have {frames} frames of {height} x {width} pixels)")
    return torch.from_numpy(np.ascontiguousarray(video))


def repeat_first_frame(truth: Tensor) -> Tensor:
    """The still-image baseline: frame 0 of `truth` [F, H, W, 3] repeated F times -> [F, H, W, 3]."""
    return truth[:1].expand_as(truth).contiguous()
