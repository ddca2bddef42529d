"""Checks that a validation pass leaves every random stream of the training as it found
it: `keeps_random_states(monkeypatch, validation_class)` wraps the class's `__call__`, compares the Python, NumPy and
torch random states before and after each call, and returns the steps it validated."""

from __future__ import annotations

import random

import numpy as np
import torch


def global_random_states() -> tuple:
    """torch's, Python's and NumPy's global random states."""
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def same_random_states(a: tuple, b: tuple) -> bool:
    numpy_a, numpy_b = a[2], b[2]  # ('MT19937', keys, pos, has_gauss, cached_gaussian)
    return (torch.equal(a[0], b[0]) and a[1] == b[1] and numpy_a[0] == numpy_b[0]
            and np.array_equal(numpy_a[1], numpy_b[1]) and numpy_a[2:] == numpy_b[2:])


def keeps_random_states(monkeypatch, validation_class) -> list[int]:
    """Wrap `validation_class.__call__` so that each validation must leave every global random state as it found it
    (a recipe whose training draws from them would otherwise train differently when it validates); returns the list
    of validated steps, filled as the run goes."""
    steps, original = [], validation_class.__call__

    def checked(self, step: int):
        before = global_random_states()
        figures = original(self, step)
        assert same_random_states(before, global_random_states()), f"validation at step {step} moved a random state"
        steps.append(step)
        return figures

    monkeypatch.setattr(validation_class, "__call__", checked)
    return steps
