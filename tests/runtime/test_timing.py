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


def test_rotated_rounds_start_one_call_later_each_round():
    """rotate: round r runs the calls from the r-th (mod 3) on, so each call runs first once in three rounds; the
    times stay each call's own, in round order (call c takes c + 1 s plus 10 s in round 2)."""
    clock = {"now": 0.0, "calls": 0}
    order = []

    def call(name, seconds):
        def run():
            order.append(name)
            clock["calls"] += 1
            clock["now"] += seconds + (10.0 if 6 < clock["calls"] <= 9 else 0.0)
        return run

    calls = {"a": call("a", 1.0), "b": call("b", 2.0), "c": call("c", 3.0)}
    result = timing.interleaved(calls, repeats=3, warmup=0, rotate=True, clock=lambda: clock["now"])
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert result["a"]["times_s"] == [1.0, 1.0, 11.0] and result["c"]["times_s"] == [3.0, 3.0, 13.0]
    assert result["b"]["median_s"] == 2.0 and result["b"]["min_s"] == 2.0
