"""The CPU tools choose their thread count so that jobs sharing a machine do not oversubscribe it."""

from __future__ import annotations

import pytest

from predictor_training.runtime.cpu_threads import choose_cpu_threads


def test_an_explicit_count_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_cpu_threads(5, cores=2, busy=0.0) == (5, "--threads")
    with pytest.raises(ValueError, match="--threads=0"):
        choose_cpu_threads(0)


def test_omp_num_threads_is_respected(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_cpu_threads(None, cores=16, busy=0.0)[0] == 3


@pytest.mark.parametrize("cores, busy, ranks, expected", [
    (2, 0.0, 1, 2),    # a quiet 2-core machine: both cores
    (2, 1.0, 1, 1),    # one other job running: one core left
    (2, 2.7, 1, 1),    # overloaded: never below one thread
    (16, 4.0, 2, 6),   # 12 free cores over 2 ranks
])
def test_free_cores_are_split_over_the_ranks(monkeypatch, cores, busy, ranks, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads, why = choose_cpu_threads(None, ranks_on_host=ranks, cores=cores, busy=busy)
    assert threads == expected
    assert f"{cores} cores" in why and f"{ranks} rank" in why


def test_tools_that_make_data_ignore_the_load(monkeypatch):
    """Their outputs must not depend on what else runs: the thread count changes float rounding."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    quiet = choose_cpu_threads(None, cores=2, busy=0.0, load_aware=False)
    busy = choose_cpu_threads(None, cores=2, busy=1.7, load_aware=False)
    assert quiet == busy and quiet[0] == 2
    assert choose_cpu_threads(None, ranks_on_host=2, cores=16, busy=9.0, load_aware=False)[0] == 8
