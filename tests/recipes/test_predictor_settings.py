"""What the two Predictor recipes build alike (predictor_training/recipes/predictor_settings.py): each Predictor
script's flags give its settings (the common `PredictorSettings` and its own), the trained role from them and the
validation. The recipes end to end: tests/recipes/test_offline.py, tests/recipes/test_train_predictor_v4_rollout.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import train_predictor_disca
import train_predictor_v4
import train_predictor_v4_rollout
from predictor_training.recipes.offline import OfflineSettings
from predictor_training.recipes.predictor_settings import PredictorSettings, held_out_validation, predictor_role
from predictor_training.recipes.rollout import RolloutSettings
from predictor_training.rollout.schedule import StepPlan
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.flags import settings_from_flags
from tests.helpers.rollout_setup import make_predictor, make_teacher

pytestmark = pytest.mark.usefixtures("one_thread")

ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
SETTINGS = PredictorSettings(
    source_blocks=(0, 1), gradient_checkpointing=False, fusion_lr=3e-4, blocks_lr=2e-5, adam_beta1=0.8,
    adam_beta2=0.9, weight_decay=0.05, scheduler_warmup_steps=4, max_steps=40, block_warmup_steps=6, grad_clip=0.5,
    velocity_weight=1.0, hidden_weight=0.1, dataset_root=Path("unused"), val_every=0, val_split=None, val_videos=1,
    val_vae=None, val_ground_truth=None)


@pytest.mark.parametrize("script, settings_class", [(train_predictor_v4, OfflineSettings),
                                                    (train_predictor_disca, OfflineSettings),
                                                    (train_predictor_v4_rollout, RolloutSettings)])
def test_each_predictor_script_gives_its_settings(script, settings_class):
    """Every field, common or the recipe's own, is a flag of the script's (or the plan its flags give): its default
    reaches the settings."""
    args = script.build_parser().parse_args(["--dataset_root", "unused"])
    settings = settings_from_flags(settings_class, args)
    assert isinstance(settings, PredictorSettings)
    assert {field.name for field in dataclasses.fields(PredictorSettings)} < set(vars(args))
    assert all(getattr(settings, field.name) == getattr(args, field.name) for field in dataclasses.fields(settings))


def test_the_predictor_role_trains_both_groups_at_their_rates():
    predictor = make_predictor(make_teacher())
    role = predictor_role(predictor, SETTINGS, ENV)
    assert role.name == "predictor" and role.raw_module is predictor and role.module is predictor  # no DDP group
    assert role.grad_clip == 0.5 and role.updates == 0
    groups = {group["name"]: group for group in role.optimizer.param_groups}
    assert {name: group["initial_lr"] for name, group in groups.items()} == {"fusion": 3e-4, "blocks": 2e-5}
    assert all(group["betas"] == (0.8, 0.9) and group["weight_decay"] == 0.05 for group in groups.values())
    trained = {id(param) for group in groups.values() for param in group["params"]}
    assert trained == {id(param) for param in predictor.parameters() if param.requires_grad}
    assert role.lr_schedule.settings() == {"warmup_steps": 4, "max_steps": 40, "block_delay_steps": 6}


def test_the_validation_follows_the_settings(tmp_path):
    """None with val_every 0; otherwise the Predictor recipes' validation, which first needs its VAE (none here:
    none beside the Teacher's folder either)."""
    teacher = make_teacher()
    common = dict(teacher=teacher, predictor=make_predictor(teacher), teacher_folder=tmp_path / "teacher", env=ENV,
                  run_dir=tmp_path / "run", plan=StepPlan.from_steps((1, 2, 3)), rollout_config=None)
    assert held_out_validation(SETTINGS, **common) is None
    with pytest.raises(MissingFileError, match="--val_every 2: no VAE"):
        held_out_validation(dataclasses.replace(SETTINGS, val_every=2), **common)
