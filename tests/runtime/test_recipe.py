"""What a recipe's build returns (predictor_training/runtime/recipe.py)."""

from __future__ import annotations

import torch

from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role


def test_each_build_gets_its_own_loop_position():
    """RecipeParts' run_state is fresh per build (resume_roles fills it in place): two builds never share one."""
    model = torch.nn.Linear(2, 2)
    role = Role("predictor", model, torch.optim.AdamW(model.parameters()), None, module=model)
    first = RecipeParts(roles=[role], step_fn=lambda item, *, sync, due: {}, models=[model])
    second = RecipeParts(roles=[role], step_fn=first.step_fn, models=[model])
    first.run_state.global_step = 7
    assert second.run_state.global_step == 0 and first.run_state is not second.run_state
    assert first.validation is None and first.derived == {} and first.derived is not second.derived
