"""The benchmarks' timing helper (predictor_training/runtime/timing.py): calls interleaved round by round, the
warm-up rounds left out, min and median of each call's own times. A fake clock (its `clock`) makes the durations
exact."""

from __future__ import annotations

import predictor_training.runtime.timing as timing


def test_rounds_interleave_the_calls_and_leave_the_warmup_out():
    clock = {"now": 0.0, "round": 0}
    order = []

    def slow():  # 10 s in round 0, 11 s in round 1, ...
        order.append("slow")
        clock["now"] += 10.0 + clock["round"]

    def fast():  # 1 s, and ends the round
        order.append("fast")
        clock["now"] += 1.0
        clock["round"] += 1

    result = timing.interleaved({"slow": slow, "fast": fast}, repeats=3, warmup=2, clock=lambda: clock["now"])
    assert order == ["slow", "fast"] * 5
    assert result["slow"]["times_s"] == [12.0, 13.0, 14.0]  # rounds 2, 3, 4: the warm-up rounds 0, 1 are left out
    assert result["fast"]["times_s"] == [1.0, 1.0, 1.0]
    assert result["slow"]["min_s"] == 12.0 and result["slow"]["median_s"] == 13.0


def test_median_of_an_even_count_and_no_warmup():
    clock = {"now": 0.0}
    durations = iter([4.0, 1.0, 3.0, 2.0])

    def call():
        clock["now"] += next(durations)

    result = timing.interleaved({"only": call}, repeats=4, warmup=0, clock=lambda: clock["now"])
    assert result == {"only": {"times_s": [4.0, 1.0, 3.0, 2.0], "min_s": 1.0, "median_s": 2.5}}
