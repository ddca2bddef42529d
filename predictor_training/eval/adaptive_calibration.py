"""Calibration of the leaderboard's adaptive (TeaCache) rows: the rescaling polynomial fitted on all-Full
rollouts of calibration videos, then each row's threshold bisected to its target of Full steps per chunk
(docs/leaderboard.md § TeaCache's targets; the skipping rule itself is eval/caches.py's `AdaptiveSkip`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Sequence

import numpy as np

from predictor_training.eval.caches import AdaptiveSkip, calibrate_threshold, fit_rescale
from predictor_training.eval.leaderboard import RowSpec
from predictor_training.eval.methods import PlannedMethod
from predictor_training.eval.runtime import EvalRuntime
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.schedule import StepPlan


def full_steps_per_chunk(step_kinds: dict[tuple[int, int], str], first_chunk: int = 1) -> float:
    """Mean Full steps per chunk over chunks >= first_chunk of one rollout's recorded step kinds."""
    chunks = sorted({chunk for chunk, _ in step_kinds if chunk >= first_chunk})
    full = sum(kind == "full" for (chunk, _), kind in step_kinds.items() if chunk >= first_chunk)
    return full / max(len(chunks), 1)


def calibrate_adaptive(specs: Sequence[RowSpec], runtime: EvalRuntime, items: Sequence[dict],
                       log=print) -> list[RowSpec]:
    """Thresholds (and TeaCache's rescaling polynomial) of the adaptive rows, on `items` (rows of a calibration
    split, never the evaluated one; `caches.spread_rows` picks them across its scenes): the rescaling is fitted on
    their all-Full rollouts, then each threshold is bisected until the mean Full steps per scheduled chunk is
    closest to its target (a threshold tried for one target is not rolled out again for another).

    A target between two whole numbers of Full steps is reached only through the chunk-to-chunk spread of the
    accumulated distance (docs/leaderboard.md § TeaCache's targets): the row records the count reached on the
    calibration videos (`calibration_full_steps`) and the leaderboard the count it ran on the evaluated split."""
    targets = [spec for spec in specs if spec.adaptive is not None]
    if not targets:
        return list(specs)
    teacher = runtime.teacher
    cases = [(item, runtime.dataset.load_case(item["case_id"])) for item in items]
    cases = [(item, case, runtime.text_kv(case)[0]) for item, case in cases]
    plan = StepPlan.parse(targets[0].plan)

    tried: dict[tuple, tuple[float, list]] = {}

    def rollouts(threshold: float, rescale) -> tuple[float, list]:
        key = (float(threshold), tuple(float(c) for c in rescale))
        if key not in tried:
            tried[key] = roll_out(threshold, rescale)
        return tried[key]

    def roll_out(threshold: float, rescale) -> tuple[float, list]:
        rule = AdaptiveSkip(teacher, threshold, tuple(rescale))
        method = PlannedMethod("calibration", plan, {}, "calibration", adaptive=rule)
        full = []
        for item, case, text_kv in cases:
            rollout = runtime.rollout(method, text_kv, item, case, Stopwatch(runtime.device))
            full.append(full_steps_per_chunk(rollout.step_kinds))
        return float(np.mean(full)), rule.observed

    _, observed = rollouts(0.0, (1.0, 0.0))
    rescale = fit_rescale(observed)
    log(f"[leaderboard] TeaCache rescaling fitted on {len(observed)} consecutive Full steps of {len(items)} "
        f"calibration video(s): {', '.join(f'{c:.4g}' for c in rescale)} (highest power first)")
    calibrated = {}
    for spec in targets:
        target = spec.adaptive["target_full_steps"]
        threshold, reached = calibrate_threshold(lambda value: rollouts(value, rescale)[0], target)
        log(f"[leaderboard] {spec.key}: threshold {threshold:.5g} gives {reached:.3f} Full steps per chunk on the "
            f"calibration videos (target {target:g})")
        calibrated[spec.key] = RowSpec(**{**asdict(spec), "adaptive": {
            "target_full_steps": target, "threshold": threshold, "rescale": list(rescale),
            "calibration_full_steps": reached}})
    return [calibrated.get(spec.key, spec) for spec in specs]
