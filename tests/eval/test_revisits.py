"""The eval's memory figures (predictor_training/eval/revisits.py) on frames whose answers are
known: a memoryless method is told apart from one that remembers."""

from __future__ import annotations

import math

import pytest
import torch

from predictor_training.eval.revisits import (
    FIGURES,
    PSNR_CAP_DB,
    aggregate_revisits,
    frame_psnr,
    revisit_scores,
    revisit_table,
)


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


def _db(levels: float) -> float:
    """PSNR of two uint8 frames that differ by `levels` grey levels everywhere: 10 log10(1 / (levels / 255)^2)."""
    return 20 * math.log10(255 / levels)


def _video(levels: list[int]) -> torch.Tensor:
    """uint8 [F, 4, 4, 3], frame f uniformly `levels[f]`."""
    return torch.tensor(levels, dtype=torch.uint8)[:, None, None, None].expand(-1, 4, 4, 3).contiguous()


def test_revisit_figures_of_hand_made_frames():
    """Frames 6 and 8 come back to the cameras of frames 2 and 0 (the truth renders them again within 2 and 1 grey
    levels); a pair past the video's end (frame 9 of 9) is dropped. The method's frames, in grey levels:
        first visits  v[2] = 125 (truth 120: 5 off),  v[0] = 103 (truth 100: 3 off)
        returns       v[6] = 140 (its own v[2]: 15 off; truth 122: 18 off),  v[8] = 154 (v[0]: 51; truth 101: 53)
    Each figure is the mean over the two pairs."""
    truth = _video([100, 110, 120, 130, 140, 150, 122, 170, 101])
    method = _video([103, 110, 125, 130, 140, 150, 140, 170, 154])
    scores = revisit_scores({"m": method}, truth, {6: 2, 8: 0, 9: 4})
    assert scores["pairs"] == [[6, 2], [8, 0]]
    first, back = (_db(5) + _db(3)) / 2, (_db(18) + _db(53)) / 2
    assert scores["methods"]["m"] == pytest.approx({"self_psnr": (_db(15) + _db(51)) / 2,
                                                    "first_visit_psnr_vs_truth": first,
                                                    "return_psnr_vs_truth": back,
                                                    "return_minus_first_visit": back - first}, rel=1e-12)
    assert scores["methods"]["ground_truth"] == pytest.approx({"self_psnr": (_db(2) + _db(1)) / 2,
                                                               "first_visit_psnr_vs_truth": PSNR_CAP_DB,
                                                               "return_psnr_vs_truth": PSNR_CAP_DB,
                                                               "return_minus_first_visit": 0.0}, rel=1e-12)
    assert frame_psnr(method[0], truth[0]) == pytest.approx(20 * math.log10(85), rel=1e-12)  # 255 / 3 = 85


def test_revisit_aggregate_is_the_mean_over_the_videos_with_revisits():
    def video(pairs: int, value: float) -> dict:
        return {"revisits": {"pairs": [[4 * (j + 1), 0] for j in range(pairs)],
                             "methods": {"m": {figure: value + index for index, figure in enumerate(FIGURES)}}}}

    aggregate = aggregate_revisits([video(2, 10.0), {"key": "no revisits"}, video(1, 20.0)])
    assert aggregate["num_videos"] == 2 and aggregate["num_pairs"] == 3
    assert aggregate["methods"]["m"] == {figure: 15.0 + index for index, figure in enumerate(FIGURES)}
