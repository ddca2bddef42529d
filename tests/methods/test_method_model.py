"""The method model (predictor_training/methods/method_model.py): an exported model's
config.json holds no local folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from predictor_training.methods.method_model import MethodModel, export_method_model
from predictor_training.runtime.distributed import DistEnv
from predictor_training.teacher import WorldPlayTransformer
from tests.helpers.method_world import write_method_world


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("fvtools"))


def test_exported_model_config_holds_no_local_folder(world, tmp_path):
    """A model loaded from a folder exports a config.json without that folder's path (from_pretrained records it as
    _name_or_path, and save_config would write it: the shipped world Teacher carried the build machine's path)."""
    model = WorldPlayTransformer.from_pretrained(str(world["teacher"]))
    assert model.config.get("_name_or_path") == str(world["teacher"])
    folder = export_method_model(MethodModel(model=model, role=None, mode="full"), tmp_path, {}, ENV)
    assert "_name_or_path" not in json.loads((folder / "config.json").read_text())
    exported = WorldPlayTransformer.from_pretrained(str(folder))
    assert torch.equal(exported.img_in.proj.weight, model.img_in.proj.weight)
