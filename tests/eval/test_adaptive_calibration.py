"""The calibration of the leaderboard's adaptive rows (predictor_training/eval/adaptive_calibration.py): TeaCache
thresholds calibrated on the Full step counts they give."""

from __future__ import annotations

import pytest

from predictor_training.eval.leaderboard import build_rows


def test_teacache_thresholds_are_calibrated_on_the_full_step_counts_they_give():
    """A scripted calibration video (tests/helpers/scripted_chunks.py), three chunks, chunk 0 the reference's. The
    model input changes by 10 % a step in chunk 1 and 20 % in chunk 2, the Teacher's velocity by twice that (its
    hidden grows 1.2x, then 1.4x), so the rescaling fitted on the all-Full rollout is v-change = 2 x input-change and
    the accumulated distance grows by 0.2 a step in chunk 1, 0.4 in chunk 2. Full steps per chunk, chunks 1 and 2:
        threshold in (0.2, 0.4]: chunk 1 F . F . (2), chunk 2 every step (4)        -> 3
                     (0.4, 0.6]: chunk 1 F . . F (2), chunk 2 F . F . (2)           -> 2
                     (0.6, 1.2]: chunk 1 F . . . (1), chunk 2 two (2)            -> 1.5"""
    from predictor_training.eval.adaptive_calibration import calibrate_adaptive
    from tests.helpers.scripted_chunks import ScriptedRuntime

    growth = {0: (1.0, 1.0), 1: (1.1, 1.2), 2: (1.2, 1.4)}  # chunk: (input, hidden) growth per step
    runtime = ScriptedRuntime(model_input=lambda chunk, step: growth[chunk][0] ** step,
                              hidden=lambda chunk, step: growth[chunk][1] ** step)
    rows = build_rows(num_steps=4, shift=5.0, samplers=(), caches=("teacache",), teacache_full_steps=(3, 2, 1.5),
                      mixtures=(), predictor_plans={})
    calibrated = {spec.key: spec.adaptive for spec in calibrate_adaptive(rows, runtime, [{"case_id": "c"}],
                                                                         log=lambda *_: None)}
    for key, (low, high), reached in (("teacache_full3", (0.2, 0.4), 3.0), ("teacache_full2", (0.4, 0.6), 2.0),
                                      ("teacache_full1.5", (0.6, 1.2), 1.5)):
        adaptive = calibrated[key]
        assert adaptive["rescale"] == pytest.approx([2.0, 0.0], abs=1e-5), key  # float32 inputs
        assert low < adaptive["threshold"] <= high and adaptive["calibration_full_steps"] == reached, (key, adaptive)
