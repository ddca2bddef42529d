"""The causal KD step of predictor_training/recipes/kd.py on tiny models (CPU, single process): the student's noise
levels index the ODE cache's states (`student_state_indices`), and every chunk step of `CausalKDStep` sees a cached
state at the timestep of that state's sigma, on the student's grid.

The clip: tests/helpers/memory_clip.py (a demo-config Teacher, 32 latents, of which 8 are cached here). The script's
own runs and flags are tested in tests/recipes/test_train_kd.py; the student's context (the cache rollout's memory
points) in tests/recipes/test_kd_memory_points.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fvtools.train_kd as kd
import predictor_training.recipes.kd as kd_recipe
from predictor_training.data.ode_cache import CacheJob, CacheSettings, OdeCacheDataset, build_cache
from predictor_training.methods.method_model import MethodModel, MethodSettings, build_method_model
from predictor_training.rollout.scheduler import flow_match_sigmas
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.precision import precision_policy
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import TeacherSource
from tests.helpers.memory_clip import ROLLOUT_SEED, write_memory_clip
from tests.helpers.recording_models import RecordingTeacher


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)
STUDENT = frozenset({"student"})
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> dict:
    """A demo-config Teacher folder (random weights) and a 32-latent i2v condition with encoder outputs."""
    return write_memory_clip(tmp_path_factory.mktemp("kd_memory"))


def _recording(method_model: MethodModel) -> tuple[MethodModel, RecordingTeacher]:
    """`method_model` calling its model through a `RecordingTeacher` of its context prefills and chunk steps."""
    recording = RecordingTeacher(method_model.model, "context_prefill", "chunk_step")
    return dataclasses.replace(method_model, model=recording), recording


def _inputs(recording: RecordingTeacher, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden_states, timestep) of every recorded call of `name`: the context prefills' selected frames, or the
    chunk steps' noisy chunks."""
    return [(call["args"][0].detach(), call["args"][1].detach()) for call in recording.calls[name]]


def test_student_state_indices_table():
    eight = flow_match_sigmas(8, 5.0)[:-1].tolist()  # a cache of 8 steps at shift 5, every state stored
    assert kd_recipe.student_state_indices(4, 5.0, eight) == [0, 2, 4, 6]
    assert kd_recipe.student_state_indices(2, 5.0, eight) == [0, 4]
    assert kd_recipe.student_state_indices(8, 5.0, eight) == list(range(8))
    assert kd_recipe.student_state_indices(4, 5.0, eight[::2]) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rebuild the cache with --store_grid 3"):
        kd_recipe.student_state_indices(3, 5.0, eight)


def test_kd_feeds_each_state_at_its_own_level_on_the_students_grid(clip, tmp_path):
    """Every chunk step of a KD step sees a cached state and the timestep of that state's sigma, and that sigma is
    one of the student's levels (4 steps at shift 5) - on a cache of 8 stored states, an index off by one feeds a
    state between the student's levels."""
    teacher = WorldPlayTransformer.from_pretrained(str(clip["teacher"])).eval().requires_grad_(False)
    condition = dict(clip["condition"])
    for name in ("viewmats", "Ks", "action"):
        condition[name] = condition[name][:8]
    job = CacheJob(0, "train0", "train", ROLLOUT_SEED, ("train", 0))
    settings = CacheSettings(steps=8, shift=5.0, store_grid=8, compute_dtype="float32", storage_dtype="float32")
    build_cache(teacher, [job], lambda job: condition, settings, tmp_path / "cache", env=ENV, inputs={"test": True})
    args = kd.parse_args(["--preset", "demo", "--val_every", "0", "--teacher", str(clip["teacher"]), "--cache_root",
                          str(tmp_path / "cache"), "--output_dir", str(tmp_path / "kd"), "--chunks_per_clip", "2",
                          "--no_progress"])
    dataset = OdeCacheDataset(tmp_path / "cache", "train")
    item = dataset[0]
    method_model = build_method_model(TeacherSource(args.teacher, None, "--teacher", None),
                                      settings_from_flags(MethodSettings, args), ENV, precision_policy("fp32", CPU),
                                      role_name="student")
    student_sigmas = flow_match_sigmas(4, 5.0)[:-1]
    seen = set()
    for micro_step in range(6):
        recorded_model, recording = _recording(method_model)
        step = kd_recipe.CausalKDStep(recorded_model, kd_recipe.RolloutConfig(state_dtype=torch.float32),
                                      kd_recipe.student_state_indices(4, 5.0, dataset.stored_sigmas), args, ENV,
                                      RunState(micro_step=micro_step))
        step(item, sync=True, due=STUDENT)
        steps = _inputs(recording, "chunk_step")
        assert len(steps) == 2
        for hidden, timestep in steps:
            sigma = float(timestep[0]) / 1000.0
            assert torch.equal(timestep, timestep[:1].expand(4))
            assert torch.isclose(student_sigmas, torch.tensor(sigma), atol=1e-6).any(), (sigma, student_sigmas)
            state = int(torch.isclose(item["sigmas"], torch.tensor(sigma), atol=1e-6).nonzero()[0])
            matches = [chunk for chunk in range(2)
                       if torch.equal(hidden[0, :4], item["states"][state][:, 4 * chunk:4 * chunk + 4])]
            assert matches, f"the state fed at sigma {sigma} is not the cached state at that sigma"
            seen.add(round(sigma, 4))
    assert len(seen) >= 3  # the draws cover the student's levels
