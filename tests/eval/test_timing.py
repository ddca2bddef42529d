"""Timing of an evaluation rollout (predictor_training/eval/timing.py): the stopwatch's summary, a method's timing
record (rollout and decode apart, end to end = text prefill + rollout + decode), and a timed rollout on a tiny
Teacher that times what it should and changes no value."""

from __future__ import annotations

import time

import pytest
import torch

from predictor_training.eval.timing import (
    Stopwatch,
    TimedRollout,
    method_timings,
    repeated_timings,
    speedup_spread,
    timing_statistic,
)
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


def test_repeated_timings_take_the_median_or_the_min_of_the_scored_rollout_and_the_repeats():
    """Scored rollout 2.0 s, repeats 3.0 and 1.0: median 2.0, min 1.0; DiT and end to end follow the rollout time,
    the text prefill and the decode (timed once) stay."""
    stopwatch = Stopwatch(CPU)
    stopwatch.add("rollout", 2.0)
    stopwatch.add("vae_decode", 0.25)
    record = method_timings(stopwatch, text_prefill_s=0.125)
    median = repeated_timings(record, [3.0, 1.0], "median")
    assert median["rollout_s"] == 2.0 and median["rollout_repeats_s"] == [2.0, 3.0, 1.0]
    assert median["timing"] == {"repeats": 3, "statistic": "median"}
    least = repeated_timings(record, [3.0, 1.0], "min")
    assert (least["rollout_s"], least["dit_s"], least["end_to_end_s"]) == (1.0, 1.125, 1.375)
    assert least["text_prefill_s"] == 0.125 and least["vae_decode_s"] == 0.25
    assert repeated_timings(method_timings(stopwatch, None), [4.0, 6.0], "median")["dit_s"] == 4.0
    assert timing_statistic([4.0, 1.0, 3.0, 2.0], "median") == 2.5
    with pytest.raises(ValueError):
        timing_statistic([1.0], "mean")


def test_the_spread_of_per_video_speedups():
    """Per video the reference time over the row's, a video's seeds summed first: a (10 + 10) / (5 + 5) = 2,
    b 12 / 4 = 3, c 8 / 8 = 1, d 10 / 2 = 5; quartiles of (1, 2, 3, 5) by linear interpolation: 1.75, 2.5, 3.5."""
    spread = speedup_spread(list("aabcd"), [10.0, 10.0, 12.0, 8.0, 10.0], [5.0, 5.0, 4.0, 8.0, 2.0])
    assert spread == pytest.approx({"median": 2.5, "q25": 1.75, "q75": 3.5, "min": 1.0, "max": 5.0, "videos": 4})
    with pytest.raises(ValueError):
        speedup_spread(["a"], [1.0, 2.0], [1.0])


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
