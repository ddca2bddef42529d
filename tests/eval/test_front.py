"""The leaderboard's front (predictor_training/eval/front.py): the paired bootstrap on a known
distribution, and the front on a hand-made table (mixtures in MSE, signed margins)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from predictor_training.eval.front import (
    Estimate,
    FrontRow,
    Units,
    describe_front_point,
    front_at,
    margin_over_front,
    mse_to_psnr,
    paired_difference,
    pareto_rows,
    psnr_to_mse,
    weighted_mean,
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


# ---------------------------------------------------------------------------------------------------------------
# Hand-made weights: row 0 is the sample (both videos), rows 1 and 2 resample video 0 twice, video 1 twice
# ---------------------------------------------------------------------------------------------------------------
HAND_WEIGHTS = np.array([[1.0, 1.0], [2.0, 0.0], [0.0, 2.0]])
A = FrontRow("A", 0.25, np.array([20.0, 30.0]))
B = FrontRow("B", 0.5, np.array([30.0, 20.0]))
C = FrontRow("C", 1.0, np.array([40.0, 40.0]))


def _mix_db(lam: float, psnr_a: float, psnr_b: float) -> float:
    """A fraction lam of the chunks at psnr_a, the rest at psnr_b, mixed in MSE (frames in [0, 1])."""
    return -10 * math.log10(lam * 10 ** (-psnr_a / 10) + (1 - lam) * 10 ** (-psnr_b / 10))


def test_the_front_is_recomputed_under_every_resample():
    """At cost 0.5 the candidates are A, B, and A time-shared with C: lam = (1 - 0.5) / (1 - 0.25) = 2/3 of the
    chunks run A (B with C is lam = 1: B). Per video, A+C = 21.74 / 31.55 dB:
        sample   A 25, B 25, A+C 26.64            -> A+C, the front's members on the sample
        video 0  A 20, B 30, A+C 21.74            -> B
        video 1  A 30, B 20, A+C 31.55            -> A+C
    At cost 1 (the dearest row's own cost, nothing dearer to mix with) the front is C itself."""
    ac = [_mix_db(2 / 3, 20.0, 40.0), _mix_db(2 / 3, 30.0, 40.0)]
    front, names = front_at(0.5, [A, B, C], HAND_WEIGHTS)
    assert front == pytest.approx([(ac[0] + ac[1]) / 2, 30.0, ac[1]], rel=1e-12)
    assert names == ["A", "C", "0.667"] and describe_front_point(names) == "0.67 x A + 0.33 x C"
    front, names = front_at(1.0, [A, B, C], HAND_WEIGHTS)
    assert front == pytest.approx([40.0, 40.0, 40.0]) and names == ["C"]


def test_a_margin_and_its_interval_at_the_stated_level():
    """P at cost 0.5, 28 / 33 dB: margin over the front above = 30.5 - 26.64 on the sample, 28 - 30 = -2 and
    33 - 31.55 = 1.45 under the two resamples; the 95 % interval of those two is their 2.5 and 97.5 percentiles:
    -2 + 0.025 (1.45 + 2) and -2 + 0.975 (1.45 + 2). The row itself is never its own front."""
    ac = [_mix_db(2 / 3, 20.0, 40.0), _mix_db(2 / 3, 30.0, 40.0)]
    row = FrontRow("P", 0.5, np.array([28.0, 33.0]))
    margin, where = margin_over_front(row, [A, B, C], HAND_WEIGHTS)
    spread = 33.0 - ac[1] + 2.0
    assert margin.value == pytest.approx(30.5 - (ac[0] + ac[1]) / 2, rel=1e-12)
    assert (margin.low, margin.high) == pytest.approx((-2 + 0.025 * spread, -2 + 0.975 * spread), rel=1e-12)
    assert where == "0.67 x A + 0.33 x C"
    assert margin_over_front(row, [A, B, C, row], HAND_WEIGHTS)[0] == margin


def test_interval_is_the_95_percent_percentile_interval_of_the_resamples_only():
    """1001 resamples 0, 1, ..., 1000: the 2.5 and 97.5 percentiles are 25 and 975. The sample (row 0, here 5000)
    is the estimate's value, not one of the resamples."""
    estimate = Estimate.from_samples(np.array([5000.0, *range(1001)]))
    assert (estimate.value, estimate.low, estimate.high) == pytest.approx((5000.0, 25.0, 975.0), rel=1e-9)
    assert paired_difference(FrontRow("r", 0, np.array([21.0, 23.0])), FrontRow("b", 0, np.array([20.0, 20.0])),
                             HAND_WEIGHTS).value == 2.0  # (1 + 3) / 2, row minus baseline


def test_an_interval_excludes_zero_only_when_it_lies_on_one_side():
    assert Estimate(1.0, 0.5, 2.0).excludes_zero and Estimate(-1.0, -2.0, -0.5).excludes_zero
    assert not Estimate(0.0, -1.0, 1.0).excludes_zero and not Estimate(0.5, 0.0, 1.0).excludes_zero


def test_every_video_counts_once_whatever_its_number_of_seeds():
    """Video 0 with one seed (10 dB), video 1 with three (20, 26, 32 dB: mean 26): the quality is the mean of the
    videos' means, (10 + 26) / 2 = 18, not the unit mean 22; in a resample a unit weighs its video's draw count
    over the video's number of seeds, so every resample's weights sum to the number of videos."""
    units = Units(np.array([0, 1, 1, 1]))
    weights = units.weights(50, seed=3)
    assert weights[0] == pytest.approx([1, 1 / 3, 1 / 3, 1 / 3])
    assert weights.sum(axis=1) == pytest.approx(np.full(51, 2.0))
    assert np.all(weights[:, 1] == weights[:, 3])  # a video's seeds are drawn together
    assert weighted_mean(weights[:1], np.array([10.0, 20.0, 26.0, 32.0]))[0] == pytest.approx(18.0)


def test_resampling_scenes_widens_the_interval_when_a_scenes_videos_move_together():
    """Scenes of 4 videos whose differences share one scene effect (sd 1) and carry no video noise: the 200 videos
    are 50 independent draws, so the 95 % half-width is 1.96 / sqrt(50) = 0.277; resampling videos treats them as
    200 draws and gives 1.96 / sqrt(200) = 0.139, half of it. With independent videos (no scene effect, sd 1 each)
    both give about 1.96 / sqrt(200). Every video counts once in the point estimate either way."""
    rng = np.random.default_rng(3)
    scenes, paths = 50, 4
    scene_of = np.repeat(np.arange(scenes), paths)
    clustered = np.repeat(rng.normal(0.5, 1.0, scenes), paths)
    independent = rng.normal(0.5, 1.0, scenes * paths)
    by_scene = Units(scene_of, video=np.arange(scenes * paths)).weights(4000, seed=2)
    by_video = Units(np.arange(scenes * paths)).weights(4000, seed=2)
    zero = np.zeros(scenes * paths)

    def width(values, weights):
        estimate = paired_difference(FrontRow("a", 0, values), FrontRow("b", 0, zero), weights)
        assert estimate.value == pytest.approx(values.mean(), abs=1e-12)
        return estimate.high - estimate.low

    assert width(clustered, by_scene) == pytest.approx(2 * 1.96 / math.sqrt(scenes), rel=0.2)
    assert width(clustered, by_video) == pytest.approx(2 * 1.96 / math.sqrt(scenes * paths), rel=0.2)
    assert width(independent, by_scene) == pytest.approx(width(independent, by_video), rel=0.25)


def test_a_video_counts_once_whatever_its_scene_holds():
    """Scene A holds videos a1 (two seeds: 10, 20) and a2 (30); scene B holds b (40): the mean over videos is
    (15 + 30 + 40) / 3 = 28.33, not the mean over scenes ((15 + 30) / 2 + 40) / 2 = 31.25 nor over units 25."""
    units = Units.from_keys(["A", "A", "A", "B"], ["a1", "a1", "a2", "b"])
    assert units.num_clusters == 2
    values = np.array([10.0, 20.0, 30.0, 40.0])
    assert weighted_mean(units.weights(10)[:1], values)[0] == pytest.approx(85.0 / 3.0)
