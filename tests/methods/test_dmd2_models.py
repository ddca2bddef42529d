"""The dmd2 roles (predictor_training/methods/dmd2_models.py): the generator's EMA built
from its flags, and a student's EMA exported as its own adapter next to the trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from predictor_training.methods.dmd2_models import generator_ema
from predictor_training.runtime.distributed import DistEnv
from tests.helpers.method_world import build_dmd2_step, write_dmd2_world


@pytest.mark.parametrize("decay, start_step, every, start_update", [(0.99, 200, 5, 40), (0.5, 3, 2, 1), (0.9, 0, 1, 0)])
def test_the_dmd2_generator_ema_comes_from_its_flags(decay, start_step, every, start_update):
    """--ema_start_step counts loop steps (Self-Forcing's ema_start_step); the EMA counts generator updates."""
    ema = generator_ema(torch.nn.Linear(2, 1), decay=decay, start_step=start_step, every=every)
    assert (ema.decay, ema.start_update) == (decay, start_update)
    assert generator_ema(torch.nn.Linear(2, 1), decay=-1, start_step=200, every=5) is None


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_dmd2_world(tmp_path_factory.mktemp("dmd2"))


def test_a_student_ema_is_exported_as_its_own_adapter_and_the_trained_weights_stay(world, tmp_path):
    """--generator student --train lora: export_generator_ema writes ema/lora_student.safetensors holding the EMA's
    shadow, and leaves the trained adapter in the Teacher untouched."""
    from predictor_training.methods.dmd2_models import export_generator_ema
    from predictor_training.methods.method_model import MethodModel
    from predictor_training.teacher.adapters import lora_state_dict

    args, _, role, _, teacher, _ = build_dmd2_step(world, tmp_path, "--generator", "student", "--train", "lora",
                                                   "--lora_rank", "4", "--lora_alpha", "4", "--ema_decay", "0.5",
                                                   "--ema_start_step", "0")
    with torch.no_grad():
        for param in role.parameters:
            param.add_(1.0)
    role.ema.update(role.raw_module)  # shadow = 0.5 (initial) + 0.5 (initial + 1)
    trained = {name: param.detach().clone() for name, param in role.raw_module.named_parameters()}
    path = export_generator_ema(role, tmp_path / "run", 7, meta={"method": "dmd2"}, config={}, keep_last=2, written=[],
                                env=ENV,
                                student_model=MethodModel(teacher, role, "lora", "student"))
    assert path == tmp_path / "run" / "ema" / "lora_student.safetensors"
    for name, param in role.raw_module.named_parameters():
        assert torch.equal(param.detach(), trained[name]), name
    exported = safetensors.torch.load_file(str(path))
    shadow = {name.replace("/", "."): tensor for name, tensor in role.ema.shadow.items()}  # AdapterWeights' keys
    trained_state = lora_state_dict(teacher, "student")
    assert exported.keys() == shadow.keys() == trained_state.keys()
    for key, tensor in exported.items():
        assert torch.equal(tensor, shadow[key]) and not torch.equal(tensor, trained_state[key]), key
