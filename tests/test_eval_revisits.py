"""The eval's memory figures (predictor_training/eval/revisits.py) on frames whose answers are known."""

from __future__ import annotations

import torch

from predictor_training.eval.revisits import (
    PSNR_CAP_DB,
    aggregate_revisits,
    frame_psnr,
    revisit_scores,
    revisit_table,
)
from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.world.revisits import revisit_frames


def test_revisit_frames_of_a_turn_away_and_back():
    pairs = revisit_frames(pose_string_to_json("left-2, right-2"))  # latents 0 1 2 1 0 -> frames 12->4, 16->0
    assert pairs == {12: 4, 16: 0}


def test_a_memoryless_method_is_told_apart_from_one_that_remembers():
    generator = torch.Generator().manual_seed(0)
    truth = torch.randint(0, 256, (17, 8, 8, 3), generator=generator, dtype=torch.uint8)
    truth[12], truth[16] = truth[4], truth[0]  # the true video returns to the views of frames 4 and 0
    remembers = truth.clone()
    forgets = truth.clone()
    forgets[12] = torch.randint(0, 256, (8, 8, 3), generator=generator, dtype=torch.uint8)
    forgets[16] = torch.randint(0, 256, (8, 8, 3), generator=generator, dtype=torch.uint8)
    scores = revisit_scores({"remembers": remembers, "forgets": forgets}, truth, {12: 4, 16: 0})
    assert scores["pairs"] == [[12, 4], [16, 0]]
    assert scores["methods"]["remembers"]["self_psnr"] == PSNR_CAP_DB  # identical frames
    assert scores["methods"]["ground_truth"]["return_minus_first_visit"] == 0.0
    forgot = scores["methods"]["forgets"]
    assert forgot["self_psnr"] < 12 and forgot["return_minus_first_visit"] < -20
    expected = (frame_psnr(forgets[12], truth[12]) + frame_psnr(forgets[16], truth[16])) / 2
    assert abs(forgot["return_psnr_vs_truth"] - expected) < 1e-9

    aggregate = aggregate_revisits([{"revisits": scores}, {"key": "no revisits"}])
    assert aggregate["num_videos"] == 1 and aggregate["num_pairs"] == 2
    assert aggregate["methods"]["forgets"]["self_psnr"] == forgot["self_psnr"]
    assert "| forgets |" in revisit_table(aggregate, {})
    assert aggregate_revisits([{"key": "no revisits"}]) is None


def test_the_revisit_sheet_shows_first_visit_away_and_return(tmp_path):
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from predictor_training.eval.methods import REFERENCE, REUSE_VELOCITY
    from predictor_training.eval.reports import revisit_sheet_frames, write_revisit_sheet
    from predictor_training.eval.runtime import GROUND_TRUTH

    pairs = {12: 4, 16: 0}
    assert revisit_sheet_frames(pairs) == [("first visit (frame 0)", 0), ("away (frame 8)", 8),
                                           ("return (frame 16)", 16)]
    # Each frame a flat grey of its index: the sheet's pixels tell which frame and which method each panel shows.
    ramp = torch.arange(17, dtype=torch.uint8).mul(10).view(17, 1, 1, 1).expand(17, 4, 6, 3).contiguous()
    frames = {GROUND_TRUTH: ramp, REFERENCE: ramp + 1, REUSE_VELOCITY: ramp + 2}
    methods = [SimpleNamespace(name=REFERENCE, panel="reference"), SimpleNamespace(name=REUSE_VELOCITY, panel="v")]
    relative = write_revisit_sheet(tmp_path, "case__a0", frames, methods, pairs, scale=2)
    sheet = np.asarray(Image.open(tmp_path / relative))
    label, gap, height, width = 14, 4, 8, 12  # panels 4 x 6 scaled by 2; the reuse baseline is left out
    assert sheet.shape == (3 * (2 * label + height), 2 * width + gap, 3)
    for row, frame in enumerate((0, 8, 16)):
        top = row * (2 * label + height) + 2 * label
        assert (sheet[top:top + height, :width] == 10 * frame).all()  # ground truth
        assert (sheet[top:top + height, width + gap:] == 10 * frame + 1).all()  # reference


def test_a_result_reads_back_every_metric_record_as_floats(tmp_path):
    """jsonable writes inf as "inf"; read_video_result must turn every metric record back into floats (an "inf"
    left as a string breaks the means)."""
    import json
    import math

    from predictor_training.eval.reports import read_video_result
    from predictor_training.eval.runtime import RESULT_FORMAT, RESULT_VERSION
    from predictor_training.video.metrics import jsonable

    record = {"psnr_full": math.inf, "ssim": 1.0}
    scored = {"metrics": record, "per_chunk": [record], "after_first_chunk": record,
              "per_frame": {"psnr": [math.inf]}}
    result = {"format": RESULT_FORMAT, "version": RESULT_VERSION, "fingerprint": "f", "methods": {"m": scored},
              "against_ground_truth": {"methods": {"m": scored}}}
    path = tmp_path / "video.json"
    path.write_text(json.dumps(jsonable(result)))
    read = read_video_result(path, "f")
    for entry in (read["methods"]["m"], read["against_ground_truth"]["methods"]["m"]):
        assert entry["metrics"]["psnr_full"] == math.inf and entry["per_chunk"][0]["psnr_full"] == math.inf
        assert entry["after_first_chunk"]["psnr_full"] == math.inf and entry["per_frame"]["psnr"] == [math.inf]
