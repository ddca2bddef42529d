"""The Predictor checkpoints an evaluation reads (predictor_training/eval/predictor_checkpoints.py): a training
state of several roles gives its Predictor."""

from __future__ import annotations

import pytest
import torch

from predictor_training.teacher import WorldPlayTransformer
from tests.helpers.eval_world import write_eval_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("predictor_checkpoints_world"))


def _teacher(world) -> WorldPlayTransformer:
    return WorldPlayTransformer.from_pretrained(str(world["root"] / "teacher")).eval().requires_grad_(False)


def test_a_training_state_of_several_roles_gives_its_predictor(world, tmp_path):
    """An adversarial run's training_latest.pt holds the predictor and the discriminator: the eval and the
    leaderboard read its "predictor" role (that role's weights, not an error asking which)."""
    from predictor_training.eval.predictor_checkpoints import load_predictor, read_predictor_checkpoint
    from predictor_training.predictor.model import build_predictor
    from predictor_training.runtime.checkpoint import RunState, save_training_state
    from predictor_training.runtime.inference_weights import read_inference_config
    from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer
    from predictor_training.runtime.roles import Role

    teacher = _teacher(world)
    torch.manual_seed(7)
    predictor = build_predictor(teacher, "v4", read_predictor_checkpoint(world["ckpt"]).meta["source_blocks"])
    discriminator = torch.nn.Linear(2, 1)
    roles = [Role(name, module, optimizer, WarmupCosineSchedule(optimizer, warmup_steps=1, max_steps=4), module=module)
             for name, module in (("discriminator", discriminator), ("predictor", predictor))
             for optimizer in [build_optimizer({"all": [p for p in module.parameters() if p.requires_grad]},
                                               {"all": 1e-3}, betas=(0.9, 0.95), weight_decay=0.0)]]
    path = tmp_path / "training_latest.pt"
    save_training_state(path, roles=roles, run_state=RunState(global_step=3), config=read_inference_config(world["ckpt"]),
                        meta={"variant": "v4", "source_blocks": list(predictor.source_blocks), "precision": "fp32"})
    loaded = load_predictor(teacher, read_predictor_checkpoint(path))
    expected = predictor.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())
