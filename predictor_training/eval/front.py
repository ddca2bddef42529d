"""Quality per cost: the front of what a user can run instead of a Predictor, and intervals that decide (SPEC § 13).

Every row of a leaderboard has a cost (the fraction of the reference's work it does: 1 / speedup, on a FLOP-bound or
a measured axis) and one quality figure per evaluated unit (a video under one noise seed): its PSNR against the
reference F-F-F-F. A row's quality is the mean over videos of the per-video means over seeds.

Time-sharing two rows across chunks (a fraction lam of the chunks runs row a, the rest row b) costs
lam * cost_a + (1 - lam) * cost_b, and its error is interpolated in MSE, not in dB: per unit
mse = lam * mse_a + (1 - lam) * mse_b, PSNR = -10 log10(mse) (PSNR is on frames in [0, 1]). The **front** at cost c
is the best quality of the baselines at cost <= c: a measured row, or a mixture of a cheaper and a dearer row that
costs exactly c. A row's **margin** is its quality minus the front at its own cost.

Intervals: the paired bootstrap over clusters of units: B resamples of the clusters with replacement, every figure
recomputed on each (the front included), the 2.5 / 97.5 percentiles. The cluster is the scene by default (a scene's
camera paths share its first frame and its seeds stay together, so its videos are not independent draws), or the
video (its seeds together). A row beats another only when the interval of the difference excludes 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95


def psnr_to_mse(psnr: np.ndarray) -> np.ndarray:
    """PSNR in dB (frames in [0, 1]) -> MSE; inf -> 0."""
    return np.power(10.0, -np.asarray(psnr, dtype=np.float64) / 10.0)


def mse_to_psnr(mse: np.ndarray) -> np.ndarray:
    """MSE -> PSNR in dB; 0 -> inf."""
    with np.errstate(divide="ignore"):
        return -10.0 * np.log10(np.asarray(mse, dtype=np.float64))


BOOTSTRAP_UNITS = ("scene", "video")  # what a bootstrap resample draws (the cluster of units)


@dataclass(frozen=True)
class Units:
    """The evaluated units (a video under one seed), their videos and the clusters a bootstrap resamples.

    cluster[u]: the cluster of unit u (0..num_clusters-1): what a resample draws, a scene with all its videos and
    seeds, or a video with its seeds. video[u]: the video of unit u (default: its cluster); every video counts once
    in a mean, whatever its number of seeds."""

    cluster: np.ndarray
    video: np.ndarray | None = None

    @classmethod
    def from_keys(cls, cluster_keys: Sequence[str], video_keys: Sequence[str] | None = None) -> "Units":
        """One unit per key; units with equal cluster keys form one cluster, units with equal video keys one video
        (numbered in order of appearance; default: the cluster keys)."""
        def numbered(keys: Sequence[str]) -> np.ndarray:
            order = {key: index for index, key in enumerate(dict.fromkeys(keys))}
            return np.asarray([order[key] for key in keys], dtype=np.int64)

        return cls(numbered(cluster_keys), None if video_keys is None else numbered(video_keys))

    from_video_keys = from_keys

    @property
    def num_clusters(self) -> int:
        return int(self.cluster.max()) + 1

    num_videos = num_clusters

    def weights(self, resamples: int, seed: int = 0) -> np.ndarray:
        """[1 + resamples, units]: row 0 the sample itself, then bootstrap resamples of the clusters; a unit's
        weight is how often its cluster was drawn divided by its video's number of units (so every video counts
        once, and a cluster's videos and seeds are drawn together)."""
        rng = np.random.default_rng(seed)
        clusters = self.num_clusters
        draws = np.zeros((1 + resamples, clusters))
        draws[0] = 1.0
        for row in range(1, 1 + resamples):
            draws[row] = np.bincount(rng.integers(0, clusters, clusters), minlength=clusters)
        video = self.cluster if self.video is None else self.video
        sizes = np.bincount(video).astype(np.float64)
        return draws[:, self.cluster] / sizes[video]


def weighted_mean(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[R, units] x [units] -> [R]: mean of `values` under each row of weights (inf values with weight 0 ignored)."""
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        terms = np.where(weights > 0, weights * values[None, :], 0.0)
    return terms.sum(axis=1) / weights.sum(axis=1)


@dataclass(frozen=True)
class FrontRow:
    """One baseline (or any row) for the front: name, cost (fraction of the reference's cost), per-unit PSNR."""

    name: str
    cost: float
    psnr: np.ndarray

    @property
    def mse(self) -> np.ndarray:
        return psnr_to_mse(self.psnr)


def front_at(cost: float, rows: Sequence[FrontRow], weights: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """The front at `cost` under every weight row: ([R] best quality, the names of the row or mixture that gives
    it under the first weight row, i.e. on the sample itself). -inf when no baseline costs <= `cost`."""
    best = np.full(weights.shape[0], -np.inf)
    best_name: list[str] = []
    candidates: list[tuple[list[str], np.ndarray]] = []
    for row in rows:
        if row.cost <= cost:
            candidates.append(([row.name], weighted_mean(weights, row.psnr)))
    cheaper = [row for row in rows if row.cost <= cost]
    dearer = [row for row in rows if row.cost > cost]
    for a in cheaper:
        for b in dearer:
            lam = (b.cost - cost) / (b.cost - a.cost)  # share of chunks that run a
            mixed = mse_to_psnr(lam * a.mse + (1.0 - lam) * b.mse)
            candidates.append(([a.name, b.name, f"{lam:.3f}"], weighted_mean(weights, mixed)))
    for names, quality in candidates:
        if quality[0] > best[0] or not best_name:
            best_name = names
        best = np.maximum(best, quality)
    return best, best_name


def describe_front_point(names: Sequence[str]) -> str:
    """'sampler_1step_frrr' or '0.450 x sampler_1step_frrr + 0.550 x sampler_2step_frrf' (chunk shares); 'none'
    where no baseline is that cheap."""
    if not names:
        return "none (cheaper than every baseline)"
    if len(names) == 1:
        return names[0]
    lam = float(names[2])
    return f"{lam:.2f} x {names[0]} + {1 - lam:.2f} x {names[1]}"


def interval(samples: np.ndarray) -> tuple[float, float]:
    """The percentile interval (CONFIDENCE) of bootstrap samples [R-1]."""
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Estimate:
    """A figure on the sample and its bootstrap interval."""

    value: float
    low: float
    high: float

    @classmethod
    def from_samples(cls, values: np.ndarray) -> "Estimate":
        """values [R]: row 0 the sample, the rest bootstrap resamples (an infinite sample, e.g. the reference
        against itself, is its own interval)."""
        if not np.isfinite(values[0]):
            return cls(float(values[0]), float(values[0]), float(values[0]))
        low, high = interval(values[1:])
        return cls(float(values[0]), low, high)

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high}

    def format(self, digits: int = 2) -> str:
        if math.isnan(self.value):
            return "–"
        return f"{self.value:+.{digits}f} [{self.low:+.{digits}f}, {self.high:+.{digits}f}]"


def margin_over_front(row: FrontRow, baselines: Sequence[FrontRow], weights: np.ndarray) -> tuple[Estimate, str]:
    """The row's quality minus the baselines' front at its own cost (with interval), and what the front is made of
    there. Baselines exclude the row itself."""
    front, names = front_at(row.cost, [base for base in baselines if base.name != row.name], weights)
    if not names:  # no baseline is this cheap: the front is not defined here
        return Estimate(math.nan, math.nan, math.nan), describe_front_point(names)
    return Estimate.from_samples(weighted_mean(weights, row.psnr) - front), describe_front_point(names)


def paired_difference(row: FrontRow, baseline: FrontRow, weights: np.ndarray) -> Estimate:
    """Mean quality of `row` minus that of `baseline` over the same units, with its paired bootstrap interval."""
    return Estimate.from_samples(weighted_mean(weights, row.psnr) - weighted_mean(weights, baseline.psnr))


def pareto_rows(costs: Sequence[float], qualities: Sequence[float]) -> list[bool]:
    """Which rows no other row dominates (cost <= and quality >=, one of them strictly)."""
    points = list(zip(costs, qualities))
    return [not any((c2 <= c and q2 >= q) and (c2 < c or q2 > q) for c2, q2 in points) for c, q in points]


def front_curve(costs: np.ndarray, rows: Sequence[FrontRow], weights: np.ndarray) -> np.ndarray:
    """The front's quality on the sample at each of `costs` (for plots)."""
    return np.asarray([front_at(float(cost), rows, weights[:1])[0][0] for cost in costs])
