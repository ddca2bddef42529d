"""The DMD generators' chunks (predictor_training/methods/chunk_generators.py) on the
tiny dmd2 world: the composite's sample is its trajectory's final latent, with the Predictor's graph also when the
chunk ends on a Full step (F-P-P-F)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fvtools.train_dmd2 as dmd2
from predictor_training.data.video_latents import VideoLatentDataset
from tests.helpers.method_world import build_dmd2_step, write_dmd2_world


CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_dmd2_world(tmp_path_factory.mktemp("dmd2"))


@pytest.mark.parametrize("replace_steps", ["1,2,3", "1,2"], ids=["F-P-P-P", "F-P-P-F"])
def test_the_composite_sample_is_its_final_latent_with_the_predictor_graph(world, tmp_path, replace_steps):
    """The sample the scores see is the trajectory's final latent, bit for bit: F-P-P-P hands on that very tensor
    (as before the F-P-P-F fix); F-P-P-F recomputes it with a graph, to the same values."""
    _, step, generator_role, _, teacher, _ = build_dmd2_step(world, tmp_path, "--replace_steps", replace_steps)
    item = VideoLatentDataset(world["videos"], "train")[0]
    data = item["latents"][None].float()
    noise = torch.randn(data.shape, generator=torch.Generator().manual_seed(3))
    rollout = dmd2.CompositeRollout(teacher, generator_role.module, item, noise, 5, step.config, step.settings, CPU,
                                    None)
    chunk = rollout.produce(1)
    final = rollout.graph.final_latent
    if replace_steps == "1,2,3":
        assert rollout.trailing_full_steps() == [] and chunk.sample is final
    else:
        assert rollout.trailing_full_steps() == [3] and not final.requires_grad
        assert chunk.sample.requires_grad and torch.equal(chunk.sample, final)
    with torch.no_grad():  # a generator step that is not due: no graph, no recomputation
        assert rollout.differentiable_sample(rollout.graph) is final
