"""The eval's reports (predictor_training/eval/reports.py): the revisit sheet, and a video
result read back with every metric record as floats."""

from __future__ import annotations

import torch


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
