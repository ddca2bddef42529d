"""The memory rehearsal's tracker (predictor_training/runtime/memory_tracker.py): its byte accounting against
hand-counted allocations."""

from __future__ import annotations

import torch

from predictor_training.runtime.memory_tracker import MemoryTracker


def test_tracker_counts_storages_views_and_releases():
    tracker = MemoryTracker()
    with tracker:
        a = torch.ones(1000)                 # 4000 B
        view = a[10:]                        # same storage: nothing new
        b = a * 2                            # 4000 B -> 8000 live
        del a                                # the view keeps the storage
        assert tracker.live == 8000
        del view                             # -> 4000
        c = torch.zeros(250, dtype=torch.float64)  # 2000 B -> 6000
        assert tracker.live == 6000
    assert tracker.peak == 8000
    assert [record.shape for record in tracker.peak_records()] == [(1000,), (1000,)]
    assert {record.op for record in tracker.peak_records()} == {"ones", "mul"}
    del b, c
