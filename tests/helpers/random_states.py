"""Checks that a validation pass leaves every random stream of the training as it found it:
`validated_keeping_random_states(validation, steps)` calls a recipe's validation (as its `build` made it) at each
step and compares the Python, NumPy and torch random states before and after each call."""

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


def validated_keeping_random_states(validation, steps) -> dict[int, dict]:
    """`validation(step)` at each of `steps`; each call must leave every global random state as it found it (a
    recipe whose training draws from them would otherwise train differently when it validates). Returns each step's
    figures."""
    figures = {}
    for step in steps:
        before = global_random_states()
        figures[step] = validation(step)
        assert same_random_states(before, global_random_states()), f"validation at step {step} moved a random state"
    return figures
