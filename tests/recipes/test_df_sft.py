"""The diffusion-forcing SFT step of predictor_training/recipes/df_sft.py on tiny models (CPU): one noise level per
chunk, another for the next chunk of the same clip.

Data: the video-latent demo of tests/helpers/method_world.py; the model: the demo Teacher config (4 blocks, width 64).
The script's own runs (overfitting, LoRA, resume, FSDP, flags, dry run) are tested in tests/recipes/test_train_df_sft.py;
the step's context and memory points in tests/recipes/test_kd_memory_points.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import predictor_training.recipes.df_sft as df_sft_recipe
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.methods.method_model import MethodSettings, build_method_model
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.precision import precision_policy
from predictor_training.teacher.source import TeacherSource
from tests.helpers.method_world import df_sft_args, write_method_world
from tests.helpers.recording_models import RecordingTeacher


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("fvtools"))


def test_df_sft_draws_one_noise_level_per_chunk(world, tmp_path):
    args = df_sft_args(world, tmp_path / "sigmas", "--chunks_per_clip", "2", "--sigma_min", "0.0")
    policy = precision_policy("fp32", CPU)
    source = TeacherSource(args.teacher, None, "--teacher", None)
    method_model = build_method_model(source, settings_from_flags(MethodSettings, args), ENV, policy,
                                      role_name="student")
    recording = RecordingTeacher(method_model.model, "chunk_step")
    dataset = VideoLatentDataset(world["videos"], "train")
    rollout_config = df_sft_recipe.RolloutConfig(state_dtype=torch.float32)
    step = df_sft_recipe.DiffusionForcingStep(dataclasses.replace(method_model, model=recording), rollout_config, args,
                                              ENV, RunState())
    metrics = step(dataset[0], sync=True, due=frozenset({"student"}))
    seen = [call["args"][1] for call in recording.calls["chunk_step"]]  # the per-frame timestep [4]
    assert len(seen) == 2
    for timestep in seen:
        assert torch.all(timestep == timestep[0])  # one level for the 4 frames of a chunk
    assert seen[0][0] != seen[1][0]  # and another for the next chunk of the same clip
    assert metrics["sigma/spread"] > 0
    assert all(param.grad is not None for param in method_model.role.parameters[:5])
