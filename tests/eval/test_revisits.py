"""The eval's memory figures (predictor_training/eval/revisits.py) on frames whose answers are
known: a memoryless method is told apart from one that remembers."""

from __future__ import annotations

import torch

from predictor_training.eval.revisits import PSNR_CAP_DB, aggregate_revisits, frame_psnr, revisit_scores, revisit_table


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
