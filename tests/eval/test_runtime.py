"""Running one video (predictor_training/eval/runtime.py), the parts that need no model: the letters of a finished
rollout's step kinds, one per chunk, and a video scored against a target as a whole, per chunk and after the first
chunk. The rollouts themselves run on the tiny eval world in tests/eval/test_methods.py and
tests/tools/test_eval_predictor.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from predictor_training.eval.runtime import KIND_LETTERS, LETTER_KINDS, score_video, step_kind_letters
from predictor_training.video.metrics import chunk_frame_ranges, compute_video_metrics, summarize_frame_range


def test_step_kinds_read_as_one_string_of_letters_per_chunk():
    kinds = {(0, step): "full" for step in range(4)}
    kinds.update({(1, 0): "full", (1, 1): "reuse_velocity", (1, 2): "reuse_velocity", (1, 3): "predictor"})
    kinds.update({(2, 0): "full", (2, 1): "forecast", (2, 2): "cache_residual", (2, 3): "reuse_hidden"})
    assert step_kind_letters(kinds, num_chunks=3, num_steps=4) == ["FFFF", "FRRP", "FTAH"]
    assert step_kind_letters(kinds, num_chunks=2, num_steps=2) == ["FF", "FR"]
    assert {LETTER_KINDS[letter] for letter in "FPRHTAB"} == set(KIND_LETTERS)  # one letter per kind, both ways
    with pytest.raises(KeyError):
        step_kind_letters({(0, 0): "full"}, num_chunks=1, num_steps=2)


def test_a_video_is_scored_whole_per_chunk_and_after_the_first_chunk():
    """8 latents = 2 chunks = 29 frames: chunk 0 frames [0, 13) identical to the target, chunk 1 [13, 29) not."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, 256, (29, 16, 16, 3), generator=generator, dtype=torch.uint8)
    test = target.clone()
    test[13:] = torch.randint(0, 256, (16, 16, 16, 3), generator=generator, dtype=torch.uint8)
    ranges = chunk_frame_ranges(8)
    assert ranges == [(0, 13), (13, 29)]
    scored = score_video(target, test, None, ranges, torch.device("cpu"))
    assert set(scored) == {"metrics", "per_chunk", "after_first_chunk", "per_frame"}
    expected = compute_video_metrics(target, test, None, per_frame=True, device=torch.device("cpu"))
    per_frame = expected.pop("per_frame")
    assert json.dumps(scored["metrics"]) == json.dumps(expected)  # NaN (frame 0's temporal delta) compares as text
    assert json.dumps(scored["per_frame"]) == json.dumps(per_frame)
    first, second = scored["per_chunk"]
    assert first["identical_frames"] == first["num_frames"] == 13 and math.isinf(first["psnr_full"])
    assert second["num_frames"] == 16 and second["identical_frames"] == 0 and math.isfinite(second["psnr_full"])
    assert json.dumps(scored["after_first_chunk"]) == json.dumps(summarize_frame_range(per_frame, 13, 29))
    assert json.dumps(second) == json.dumps(scored["after_first_chunk"])
    assert scored["metrics"]["identical_frames"] == 13


def test_after_the_first_chunk_spans_every_later_chunk():
    target = torch.zeros(45, 16, 16, 3, dtype=torch.uint8)  # 12 latents: chunks [0, 13), [13, 29), [29, 45)
    test = target.clone()
    test[29:] = 255
    ranges = chunk_frame_ranges(12)
    scored = score_video(target, test, None, ranges, torch.device("cpu"))
    later = scored["after_first_chunk"]
    assert later["num_frames"] == 32 and later["identical_frames"] == 16  # chunk 1 identical, chunk 2 not
    assert json.dumps(later) == json.dumps(summarize_frame_range(scored["per_frame"], 13, 45))
