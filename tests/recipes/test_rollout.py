"""The rollout recipe's wiring in the package (predictor_training/recipes/rollout.py): the latent-gradient check
and its schedule rule. The recipe end to end: tests/recipes/test_train_predictor_v4_rollout.py."""

from __future__ import annotations

import math

import pytest

from predictor_training.recipes.rollout import check_latent_grads, latent_grad_check


@pytest.mark.parametrize("replace_steps, checked", [((1, 2, 3), True), ((1, 2), True), ((2, 3), True),
                                                    ((1, 3), False), ((3,), False), ((1,), False)])
def test_the_latent_path_is_checked_only_with_consecutive_predictor_steps(replace_steps, checked):
    """F-P-P-P, F-P-P-F, F-F-P-P have a Predictor-made latent entering a Predictor step; F-P-F-P and F-R-R-P do not."""
    assert (latent_grad_check(replace_steps) is check_latent_grads) == checked


@pytest.mark.parametrize("value", [0.0, math.nan, -1.0])
def test_a_cut_latent_path_stops_the_run(value):
    with pytest.raises(RuntimeError, match="latent_grad_l1_min"):
        check_latent_grads(7, {"latent_grad_l1_min": value})
    check_latent_grads(7, {"latent_grad_l1_min": 1e-9})  # any gradient passes
