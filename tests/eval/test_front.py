"""The leaderboard's front (predictor_training/eval/front.py): the paired bootstrap on a known
distribution, and the front on a hand-made table (mixtures in MSE, signed margins)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from predictor_training.eval.front import (
    FrontRow,
    Units,
    front_at,
    margin_over_front,
    mse_to_psnr,
    paired_difference,
    pareto_rows,
    psnr_to_mse,
)


# ---------------------------------------------------------------------------------------------------------------
# Statistics: the bootstrap on a known distribution, the front on a hand-made table
# ---------------------------------------------------------------------------------------------------------------
def test_paired_bootstrap_recovers_a_known_mean_difference():
    rng = np.random.default_rng(0)
    videos, seeds, mu, sigma = 200, 2, 0.4, 1.0
    per_video = rng.normal(mu, sigma, videos)
    base = rng.normal(20, 3, videos * seeds)  # shared per-unit level: pairing removes it
    row = base + np.repeat(per_video, seeds)
    units = Units(np.repeat(np.arange(videos), seeds))
    weights = units.weights(2000, seed=1)
    estimate = paired_difference(FrontRow("a", 0, row), FrontRow("b", 0, base), weights)
    half_width = 1.96 * sigma / math.sqrt(videos)
    assert estimate.value == pytest.approx(per_video.mean(), abs=1e-9)
    assert estimate.low < mu < estimate.high and estimate.excludes_zero
    assert (estimate.high - estimate.low) == pytest.approx(2 * half_width, rel=0.15)
    # the same data with no difference: the interval contains 0
    assert not paired_difference(FrontRow("a", 0, base), FrontRow("b", 0, base + 0.0), weights).excludes_zero


def test_front_mixes_in_mse_and_margins_are_signed():
    units = Units(np.arange(2))
    weights = units.weights(200)
    cheap = FrontRow("cheap", 0.5, np.array([20.0, 20.0]))
    dear = FrontRow("dear", 1.0, np.array([40.0, 40.0]))
    dominated = FrontRow("dominated", 0.9, np.array([19.0, 19.0]))
    front, names = front_at(0.75, [cheap, dear, dominated], weights)
    expected = mse_to_psnr(0.5 * psnr_to_mse(20.0) + 0.5 * psnr_to_mse(40.0))  # 22.97 dB, not the dB mean 30
    assert front[0] == pytest.approx(expected) and names == ["cheap", "dear", "0.500"]
    # at cost 0.6, 80 % of the chunks run the cheap row: 0.8 * 0.5 + 0.2 * 1.0 = 0.6
    mostly_cheap = mse_to_psnr(0.8 * psnr_to_mse(20.0) + 0.2 * psnr_to_mse(40.0))
    assert front_at(0.6, [cheap, dear], weights)[0][0] == pytest.approx(mostly_cheap)
    assert front_at(0.4, [cheap, dear], weights)[0][0] == -np.inf
    above = FrontRow("P", 0.75, np.array([expected + 1.0, expected + 1.0]))
    margin, where = margin_over_front(above, [cheap, dear, dominated], weights)
    assert margin.value == pytest.approx(1.0) and "cheap" in where
    below = FrontRow("P", 0.75, np.array([21.0, 21.0]))
    assert margin_over_front(below, [cheap, dear], weights)[0].value < 0
    faster = margin_over_front(FrontRow("P", 0.4, np.array([21.0, 21.0])), [cheap, dear], weights)
    assert math.isnan(faster[0].value) and faster[1].startswith("none")
    assert pareto_rows([0.5, 1.0, 0.9, 0.75], [20.0, 40.0, 19.0, 30.0]) == [True, True, False, True]
