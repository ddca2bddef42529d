"""Counter-based random streams: a generator is a pure function of integers (seed, step, rank, stream, ...).

Method code never draws from the global RNG. A draw that must be reproducible after a resume (noise levels, noise,
which chunks a step trains) takes a generator made from the run's seed and counters the run can restore (its
micro-step, its rank), so a resumed run draws exactly what the uninterrupted run drew.
"""

from __future__ import annotations

import numpy as np
import torch

# Put in a rank's place for a stream every rank must draw alike (no rank has this number). A literal 0 would not do:
# SeedSequence ignores trailing zeros, so (seed, step, 0) is the stream (seed, step) of rank 0.
ALL_RANKS = 2**31 - 1


def stream_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from several non-negative integers (seed, epoch, position, ...)."""
    return int(np.random.SeedSequence([int(value) for value in values]).generate_state(2, dtype=np.uint64)[0]
               >> np.uint64(1))


def stream_generator(*values: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A `torch.Generator` on `device` seeded with `stream_seed(*values)`."""
    return torch.Generator(device=device).manual_seed(stream_seed(*values))
