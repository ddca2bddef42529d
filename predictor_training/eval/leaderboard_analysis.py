"""The leaderboard's analysis of the evaluated rows: costs on every axis as a fraction of the reference's (the
FLOP bound on the config that ran and at the real 8.6B config, the measured DiT and end-to-end times), quality
against F-F-F-F with paired bootstrap intervals, the difference from the baseline row, each Predictor's margin over
the baselines' front, and the front of all rows (the front arithmetic itself is eval/front.py's)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from predictor_training.eval.front import (
    BOOTSTRAP_UNITS,
    Estimate,
    FrontRow,
    Units,
    margin_over_front,
    paired_difference,
    pareto_rows,
    weighted_mean,
)
from predictor_training.eval.leaderboard import DEFAULT_BASELINE, RowSpec
from predictor_training.eval.methods import EXACT_CONTEXT, REFERENCE
from predictor_training.eval.runtime import LETTER_KINDS
from predictor_training.eval.timing import speedup_spread
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.flops import (
    REAL_LATENT_GRID,
    REAL_TEXT_TOKENS,
    TeacherShape,
    rollout_flops,
)

COST_AXES = {  # key -> what the axis measures
    "flops_run": "FLOP bound, config that ran",
    "flops_real": "FLOP bound at the real 8.6B config (a projection: this run's quality at the real per-step costs)",
    "measured_dit": "measured DiT",
    "measured_end_to_end": "measured end-to-end",
}
MARGIN_AXES = ("flops_run", "flops_real", "measured_dit")
# the spread of the measured DiT speedup over the videos (eval/timing.speedup_spread): figures
# speedup_measured_dit_q25 / _q75 (printed beside the pooled speedup) / _min / _max
MEASURED_SPREAD_PREFIX = "speedup_measured_dit_"
MEASURED_SPREAD_PARTS = ("q25", "q75", "min", "max")


def real_config_flops(result: dict, method: str, predictor_config: dict | None,
                      residual_blocks: int | None = None) -> int:
    """DiT FLOPs of `method`'s recorded steps of one result, at the real config (REAL_LATENT_GRID, REAL_TEXT_TOKENS,
    the same context frames per chunk; no text prefill). residual_blocks: the Teacher blocks of its block-residual
    steps (B rows)."""
    config = preset_config("worldplay_480p_i2v")
    shape = TeacherShape.from_config(config)
    letters = result["methods"][method]["step_kinds"]
    kind = lambda chunk, step: LETTER_KINDS[letters[chunk][step]]  # noqa: E731
    real_predictor = None if predictor_config is None else {**predictor_config, "hidden_size": shape.hidden_size}
    mode = EXACT_CONTEXT if "@" not in method else method.split("@", 1)[1]
    height, width = REAL_LATENT_GRID
    return rollout_flops(shape, height * width, REAL_TEXT_TOKENS, result["context_frames_per_chunk"], kind,
                         num_steps=len(letters[0]), predictor_config=real_predictor, context_mode=mode,
                         residual_blocks=residual_blocks)["total"]


def _unit_values(results: Sequence[dict], method: str, path: Sequence[str]) -> np.ndarray:
    """One number per unit from each result's method entry (NaN where missing)."""
    values = []
    for result in results:
        node = result["methods"].get(method)
        for key in path:
            node = None if node is None else node.get(key) if isinstance(node, dict) else node[key]
        values.append(math.nan if node is None else float(node))
    return np.asarray(values)


def _truth_values(results: Sequence[dict], method: str, path: Sequence[str]) -> np.ndarray | None:
    if any("against_ground_truth" not in result for result in results):
        return None
    values = []
    for result in results:
        node = result["against_ground_truth"]["methods"][method]
        for key in path:
            node = node[key]
        values.append(float(node))
    return np.asarray(values)


def _revisit_values(results: Sequence[dict], method: str, figure: str) -> float | None:
    values = [result["revisits"]["methods"][method][figure] for result in results if result.get("revisits")]
    return float(np.mean(values)) if values else None


@dataclass
class RowResult:
    spec: RowSpec
    costs: dict[str, float]  # axis -> fraction of the reference's cost
    psnr: np.ndarray  # per unit, vs F-F-F-F
    quality: Estimate  # mean PSNR vs F-F-F-F, with its interval
    figures: dict[str, float | None] = field(default_factory=dict)
    vs_baseline: Estimate | None = None
    margins: dict[str, tuple[Estimate, str]] = field(default_factory=dict)
    on_front: bool = False

    def speedup(self, axis: str) -> float:
        return 1.0 / self.costs[axis]


def analyse(results: Sequence[dict], specs: Sequence[RowSpec], predictor_configs: dict[str, dict], *,
            baseline: str = DEFAULT_BASELINE, resamples: int = 2000, seed: int = 0, unit: str = "scene") -> dict:
    """Every row's costs, quality with interval, difference from `baseline`, margin over the baselines' front
    (on `MARGIN_AXES`), and whether it is on the front of all measured rows (on the real-config FLOP axis).
    predictor_configs: {checkpoint label: its predictor config} (for the real-config FLOPs); unit: what the
    bootstrap resamples, "scene" (a case with all its videos and seeds) or "video" (its seeds together)."""
    if unit not in BOOTSTRAP_UNITS:
        raise ValueError(f"bootstrap unit {unit!r}: expected one of {BOOTSTRAP_UNITS}")
    videos = [result.get("video_key", result["key"]) for result in results]
    units = Units.from_keys(videos if unit == "video" else [result["case_id"] for result in results], videos)
    num_videos = len(dict.fromkeys(videos))
    weights = units.weights(resamples, seed)
    lpips = next((key for key in results[0]["methods"][specs[1].key]["metrics"] if key.startswith("lpips")), None)

    def total(method: str, path: Sequence[str]) -> float:
        return float(np.nansum(_unit_values(results, method, path)))

    reference_cost = {
        "flops_run": total(REFERENCE, ("flops", "total")),
        "flops_real": float(sum(real_config_flops(result, REFERENCE, None) for result in results)),
        "measured_dit": total(REFERENCE, ("timings", "dit_s")),
        "measured_end_to_end": total(REFERENCE, ("timings", "end_to_end_s")),
    }
    rows: list[RowResult] = []
    for spec in specs:
        config = predictor_configs.get(spec.checkpoint) if spec.checkpoint else None
        blocks = None if spec.blocks is None else len(spec.blocks)
        costs = {
            "flops_run": total(spec.key, ("flops", "total")) / reference_cost["flops_run"],
            "flops_real": sum(real_config_flops(result, spec.key, config, blocks) for result in results)
            / reference_cost["flops_real"],
            "measured_dit": total(spec.key, ("timings", "dit_s")) / reference_cost["measured_dit"],
            "measured_end_to_end": total(spec.key, ("timings", "end_to_end_s"))
            / reference_cost["measured_end_to_end"],
        }
        if spec.key == REFERENCE:
            psnr = np.full(len(results), np.inf)
        else:
            psnr = _unit_values(results, spec.key, ("metrics", "psnr_full"))
        row = RowResult(spec, costs, psnr, Estimate.from_samples(weighted_mean(weights, psnr)))
        spread = speedup_spread(videos, _unit_values(results, REFERENCE, ("timings", "dit_s")),
                                _unit_values(results, spec.key, ("timings", "dit_s")))
        row.figures.update({f"{MEASURED_SPREAD_PREFIX}{part}": spread[part] for part in MEASURED_SPREAD_PARTS})
        if spec.key != REFERENCE:
            figures = {
                "ssim": np.nanmean(_unit_values(results, spec.key, ("metrics", "ssim"))),
                "temporal_delta_mse": np.nanmean(_unit_values(results, spec.key, ("metrics", "temporal_delta_mse"))),
                "last_chunk_psnr": np.nanmean([result["methods"][spec.key]["per_chunk"][-1]["psnr_full"]
                                               for result in results]),
            }
            if lpips is not None:
                figures["lpips"] = np.nanmean(_unit_values(results, spec.key, ("metrics", lpips)))
            row.figures.update({key: float(value) for key, value in figures.items()})
        truth = _truth_values(results, spec.key, ("after_first_chunk", "psnr_full"))
        if truth is not None:
            row.figures["gt_psnr_after_first_chunk"] = float(np.mean(truth))
            row.figures["gt_ssim_after_first_chunk"] = float(np.mean(
                _truth_values(results, spec.key, ("after_first_chunk", "ssim"))))
        for figure in ("self_psnr", "return_minus_first_visit"):
            row.figures[f"revisit_{figure}"] = _revisit_values(results, spec.key, figure)
        row.figures["full_steps_per_chunk"] = float(np.mean([
            np.mean([letters.count("F") for letters in result["methods"][spec.key]["step_kinds"][1:]])
            for result in results]))
        rows.append(row)
    by_key = {row.spec.key: row for row in rows}
    if baseline not in by_key:
        raise ValueError(f"--baseline {baseline}: no such row (rows: {', '.join(by_key)})")
    for row in rows:
        if row.spec.key not in (REFERENCE, baseline):
            row.vs_baseline = paired_difference(FrontRow(row.spec.key, 0, row.psnr),
                                                FrontRow(baseline, 0, by_key[baseline].psnr), weights)
    for axis in MARGIN_AXES:
        front_rows = [FrontRow(row.spec.key, row.costs[axis], row.psnr) for row in rows if row.spec.baseline]
        for row in rows:
            if not row.spec.baseline:
                row.margins[axis] = margin_over_front(FrontRow(row.spec.key, row.costs[axis], row.psnr), front_rows,
                                                      weights)
    on_front = pareto_rows([row.costs["flops_real"] for row in rows], [row.quality.value for row in rows])
    for row, flag in zip(rows, on_front):
        row.on_front = flag
    return {"rows": rows, "num_videos": num_videos, "num_units": len(results), "baseline": baseline,
            "resamples": resamples, "lpips_key": lpips, "weights": weights, "bootstrap_unit": unit,
            "num_clusters": units.num_clusters}
