"""Timing of an evaluation rollout (predictor_training/eval/timing.py): the stopwatch's summary, a method's timing
record (rollout and decode apart, end to end = text prefill + rollout + decode), and a timed rollout on a tiny
Teacher that times what it should and changes no value."""

from __future__ import annotations

import time

import pytest
import torch

from predictor_training.eval.timing import Stopwatch, TimedRollout, method_timings
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig
from tests.helpers.tiny_teacher import make_tiny_teacher, tiny_rollout_inputs, tiny_text_kv

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_the_summary_counts_totals_and_keeps_the_fastest():
    stopwatch = Stopwatch(CPU)
    for seconds in (3.0, 1.0, 2.0):
        stopwatch.add("full_step", seconds)
    stopwatch.add("predictor_step", 0.5)
    assert stopwatch.summary() == {
        "full_step": {"count": 3, "total_s": 6.0, "mean_s": 2.0, "min_s": 1.0},
        "predictor_step": {"count": 1, "total_s": 0.5, "mean_s": 0.5, "min_s": 0.5},
    }


def test_measure_times_the_block_under_its_name():
    stopwatch = Stopwatch(CPU)
    with stopwatch.measure("sleep"):
        time.sleep(0.02)
    with stopwatch.measure("nothing"):
        pass
    summary = stopwatch.summary()
    assert summary["sleep"]["count"] == 1 and summary["sleep"]["total_s"] >= 0.02
    assert summary["nothing"]["total_s"] < summary["sleep"]["total_s"]


def test_a_methods_record_keeps_rollout_and_decode_apart_and_sums_end_to_end():
    stopwatch = Stopwatch(CPU)
    stopwatch.add("rollout", 2.0)
    stopwatch.add("vae_decode", 0.25)
    stopwatch.add("full_step", 0.5)
    stopwatch.add("full_step", 1.5)
    record = method_timings(stopwatch, text_prefill_s=0.125)
    assert record == {"text_prefill_s": 0.125, "rollout_s": 2.0, "vae_decode_s": 0.25, "dit_s": 2.125,
                      "end_to_end_s": 2.375,
                      "calls": {"full_step": {"count": 2, "total_s": 2.0, "mean_s": 1.0, "min_s": 0.5}}}
    without_text = method_timings(stopwatch, text_prefill_s=None)  # stored text K/V: no prefill to count
    assert without_text["text_prefill_s"] is None and without_text["dit_s"] == 2.0
    assert without_text["end_to_end_s"] == 2.25


@pytest.fixture(scope="module")
def tiny():
    teacher = make_tiny_teacher()
    return teacher, tiny_text_kv(teacher)


@pytest.mark.parametrize("mode", ["exact", "incremental"])
def test_a_timed_rollout_times_its_context_work_and_changes_no_value(tiny, mode):
    """12 latents = 3 chunks: chunks 1 and 2 have a context (4 and 8 frames); in the incremental mode the contexts
    are assembled from cached K/V and the two chunks before the last are cached."""
    teacher, text_kv = tiny
    config = RolloutConfig(context_mode=mode)
    stopwatch = Stopwatch(CPU)
    timed = TimedRollout(teacher, text_kv, tiny_rollout_inputs(teacher), config, stopwatch=stopwatch)
    latents = timed.run()
    plain = ARRollout(teacher, text_kv, tiny_rollout_inputs(teacher), config).run()
    assert torch.equal(latents, plain)
    assert timed.context_frames == [0, 4, 8]
    calls = stopwatch.summary()
    if mode == "exact":
        assert set(calls) == {"context_prefill"} and calls["context_prefill"]["count"] == 2
    else:
        assert set(calls) == {"context_assembly", "context_cache"}
        assert calls["context_assembly"]["count"] == 2 and calls["context_cache"]["count"] == 2
