"""The memory rehearsal (predictor_training/runtime/memory_rehearsal.py): the tracker's phases and categories as a
rehearsal labels them. The autocast emulation is tested in tests/runtime/test_autocast_rules.py, the tracker's byte
accounting in tests/runtime/test_memory_tracker.py, the tool that uses it in tests/tools/test_estimate_memory.py."""

from __future__ import annotations

import torch

from predictor_training.runtime.memory_rehearsal import Rehearsal


def test_tracker_phases_and_categories():
    """Forward/backward told apart by the autograd engine; parameters, gradients and optimizer state labelled."""
    torch.manual_seed(0)
    with Rehearsal("tiny", cuda_autocast=False) as rehearsal:
        model = torch.nn.Linear(64, 64)
        rehearsal.label_parameters([model])
        rehearsal.watch_gradients(model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        with rehearsal.phase("forward"):
            model(torch.randn(32, 64)).square().sum().backward()
        with rehearsal.phase("optimizer"):
            optimizer.step()
            rehearsal.label_optimizer(optimizer)
        live = rehearsal.tracker.live_by_category()
    params = (64 * 64 + 64) * 4
    assert live["parameters"] == params
    assert live["gradients"] == params
    assert live["optimizer_state"] == 2 * params + 2 * 4  # exp_avg, exp_avg_sq and the two step counters
    assert set(rehearsal.tracker.phase_peaks) == {"setup", "forward", "backward", "optimizer"}
