"""AdamW groups and the two-group warmup + cosine LR schedule against hand-written tables."""

import math

import pytest
import torch
from torch import nn

from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer, count_group_params, lr_multiplier


# warmup 4, max 12, block delay 2. Warmup: (step+1)/4. Cosine over the 8 steps after warmup:
# progress p = (step - 4) / 8, multiplier 0.5 * (1 + cos(pi * p)).
SMALL_TABLE = [
    # step, fusion, blocks
    (0, 0.25, 0.0),
    (1, 0.50, 0.0),
    (2, 0.75, 0.75),
    (3, 1.00, 1.00),
    (4, 1.00, 1.00),  # p = 0
    (6, 0.5 + math.sqrt(2) / 4, 0.5 + math.sqrt(2) / 4),  # p = 1/4: 0.5 * (1 + sqrt(2)/2)
    (8, 0.50, 0.50),  # p = 1/2
    (10, 0.5 - math.sqrt(2) / 4, 0.5 - math.sqrt(2) / 4),  # p = 3/4
    (12, 0.0, 0.0),  # p = 1: exactly 0 at max_steps
]


# The offline recipe: warmup 100, block warmup 100, max 2000 (blocks follow the global multiplier after step 100).
RECIPE_TABLE = [
    (0, 0.01, 0.0),
    (49, 0.50, 0.0),
    (99, 1.00, 0.0),
    (100, 1.00, 1.00),
    (1050, 0.50, 0.50),
    (2000, 0.0, 0.0),
]


@pytest.mark.parametrize("step, fusion, blocks", SMALL_TABLE)
def test_lr_multiplier_small_table(step, fusion, blocks):
    assert lr_multiplier(step, warmup_steps=4, max_steps=12) == pytest.approx(fusion, abs=1e-12)
    assert lr_multiplier(step, warmup_steps=4, max_steps=12, delay_steps=2) == pytest.approx(blocks, abs=1e-12)


@pytest.mark.parametrize("step, fusion, blocks", RECIPE_TABLE)
def test_lr_multiplier_recipe_table(step, fusion, blocks):
    assert lr_multiplier(step, warmup_steps=100, max_steps=2000) == pytest.approx(fusion, abs=1e-12)
    assert lr_multiplier(step, warmup_steps=100, max_steps=2000, delay_steps=100) == pytest.approx(blocks, abs=1e-12)


ADAMW = {"betas": (0.9, 0.95), "weight_decay": 0.01}


def current_lrs(schedule) -> dict[str, float]:
    """LR per group name for the next update."""
    return {group["name"]: group["lr"] for group in schedule.optimizer.param_groups}


def test_lr_multiplier_blocks_exactly_zero_during_delay_and_no_warmup_case():
    assert all(lr_multiplier(s, warmup_steps=4, max_steps=12, delay_steps=3) == 0.0 for s in range(3))
    # warmup 0: cosine from the first step
    assert lr_multiplier(0, warmup_steps=0, max_steps=4) == 1.0
    assert lr_multiplier(2, warmup_steps=0, max_steps=4) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(step=13, warmup_steps=4, max_steps=12),
        dict(step=-1, warmup_steps=4, max_steps=12),
        dict(step=0, warmup_steps=12, max_steps=12),
        dict(step=0, warmup_steps=4, max_steps=12, delay_steps=12),
    ],
)
def test_lr_multiplier_rejects_out_of_range(kwargs):
    with pytest.raises(ValueError):
        lr_multiplier(**kwargs)


def _two_group_model():
    torch.manual_seed(0)
    return nn.ModuleDict({"fusion": nn.Linear(3, 4), "blocks": nn.Linear(4, 2)})


def _optimizer(model, fusion_lr=1e-4, blocks_lr=1e-5):
    return build_optimizer(
        {"fusion": list(model["fusion"].parameters()), "blocks": list(model["blocks"].parameters())},
        {"fusion": fusion_lr, "blocks": blocks_lr}, **ADAMW,
    )


def test_build_optimizer_named_groups_and_hyperparameters():
    model = _two_group_model()
    optimizer = _optimizer(model)
    assert isinstance(optimizer, torch.optim.AdamW)
    groups = {group["name"]: group for group in optimizer.param_groups}
    assert set(groups) == {"fusion", "blocks"}
    assert groups["fusion"]["initial_lr"] == 1e-4 and groups["blocks"]["initial_lr"] == 1e-5
    assert groups["fusion"]["betas"] == (0.9, 0.95) and groups["fusion"]["weight_decay"] == 0.01
    assert count_group_params(optimizer) == {"fusion": 3 * 4 + 4, "blocks": 4 * 2 + 2}


def test_build_optimizer_refuses_non_fp32_frozen_shared_and_mismatched():
    model = _two_group_model()
    bf16 = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp32master"):
        build_optimizer({"fusion": [bf16], "blocks": list(model["blocks"].parameters())}, {"fusion": 1.0, "blocks": 1.0}, **ADAMW)
    frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        build_optimizer({"fusion": [frozen], "blocks": list(model["blocks"].parameters())}, {"fusion": 1.0, "blocks": 1.0}, **ADAMW)
    shared = list(model["fusion"].parameters())
    with pytest.raises(ValueError, match="both"):
        build_optimizer({"fusion": shared, "blocks": shared}, {"fusion": 1.0, "blocks": 1.0}, **ADAMW)
    with pytest.raises(ValueError, match="name different groups"):
        build_optimizer({"fusion": shared}, {"fusion": 1.0, "blocks": 1.0}, **ADAMW)


def test_two_group_schedule_follows_table_and_survives_state_dict():
    model = _two_group_model()
    optimizer = _optimizer(model, fusion_lr=2.0, blocks_lr=0.5)
    schedule = TwoGroupLRSchedule(optimizer, warmup_steps=4, max_steps=12, block_warmup_steps=2)
    table = {step: (fusion, blocks) for step, fusion, blocks in SMALL_TABLE}
    for step in range(13):
        lrs = current_lrs(schedule)
        if step in table:
            assert lrs["fusion"] == pytest.approx(2.0 * table[step][0], abs=1e-12)
            assert lrs["blocks"] == pytest.approx(0.5 * table[step][1], abs=1e-12)
        if step == 6:
            saved = schedule.state_dict()
            lrs_at_save = lrs
        if step < 12:
            schedule.step()
    with pytest.raises(RuntimeError, match="max_steps"):
        schedule.step()

    fresh_optimizer = _optimizer(_two_group_model(), fusion_lr=2.0, blocks_lr=0.5)
    resumed = TwoGroupLRSchedule(fresh_optimizer, warmup_steps=4, max_steps=12, block_warmup_steps=2)
    resumed.load_state_dict(saved)
    assert resumed.step_count == 6 and current_lrs(resumed) == lrs_at_save


def test_two_group_schedule_refuses_different_settings_and_wrong_groups():
    model = _two_group_model()
    schedule = TwoGroupLRSchedule(_optimizer(model), warmup_steps=4, max_steps=12, block_warmup_steps=2)
    other = TwoGroupLRSchedule(_optimizer(model), warmup_steps=4, max_steps=20, block_warmup_steps=2)
    with pytest.raises(ValueError, match="max_steps=12.*max_steps=20"):
        other.load_state_dict(schedule.state_dict())
    single = build_optimizer({"fusion": list(model.parameters())}, {"fusion": 1.0}, **ADAMW)
    with pytest.raises(ValueError, match="expected exactly"):
        TwoGroupLRSchedule(single, warmup_steps=1, max_steps=4, block_warmup_steps=None)


@pytest.mark.parametrize("none_value", [None, -1])
def test_no_block_warmup_means_blocks_follow_fusion(none_value):
    model = _two_group_model()
    schedule = TwoGroupLRSchedule(_optimizer(model, 1.0, 1.0), warmup_steps=4, max_steps=12,
                                  block_warmup_steps=none_value)
    for _ in range(5):
        lrs = current_lrs(schedule)
        assert lrs["fusion"] == lrs["blocks"] > 0
        schedule.step()
    with pytest.raises(ValueError):
        TwoGroupLRSchedule(_optimizer(model), warmup_steps=4, max_steps=12, block_warmup_steps=-2)
