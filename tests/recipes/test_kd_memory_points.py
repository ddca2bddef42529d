"""Teacher-forced clips select the context frames of the rollout that made their history (issue 22).

KD's ODE-cache samples and DF-SFT's Teacher samples are the Teacher's own AR rollouts, whose memory points are
`make_retrieval_points(seed)`. Past `memory_frames` latents the memory is ranked by a Monte-Carlo FOV overlap, so a
student that re-selects the context with other points can condition on other frames than the Teacher's target was
made with. The clip here (tests/helpers/memory_clip.py) is 32 latents on a camera that looks left (latents 4-7), right (8-11), elsewhere
(12-23), then back to the start (24-31): the two memory groups 4-7 and 8-11 overlap the last chunks' view equally in
expectation, so which one joins the context is decided by the point set (a near-tie, where memory matters most).

Also: `--context_noise` of df_sft (clean = the AR loop's context; independent = diffusion forcing). The KD
student's noise levels against the cache's states (`student_state_indices`) are tested in tests/recipes/test_kd.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fvtools.train_df_sft as df_sft
import predictor_training.recipes.df_sft as df_sft_recipe
import fvtools.train_kd as kd
import predictor_training.recipes.kd as kd_recipe
from predictor_training.data import builder
from predictor_training.data.ode_cache import CacheJob, CacheSettings, OdeCacheDataset, build_cache
from predictor_training.methods.method_model import MethodModel, MethodSettings, build_method_model
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.rollout.ar_rollout import RolloutInputs, record_rollout
from predictor_training.rollout.memory_retrieval import make_retrieval_points, select_aligned_memory_frames
from predictor_training.rollout.teacher_forcing import clip_text_kv
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.precision import precision_policy
from predictor_training.runtime.random_streams import stream_seed
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import TeacherSource
from tests.helpers.memory_clip import NUM_LATENTS, ROLLOUT_SEED, write_memory_clip
from tests.helpers.recording_models import RecordingTeacher, frame_indices


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)
STUDENT = frozenset({"student"})
OLD_STREAM_SEED = stream_seed(0, 0, 0, 1)  # the per-micro-step points of (seed 0, micro-step 0, rank 0): group 4-7
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> dict:
    """A demo-config Teacher folder (random weights) and a 32-latent i2v condition with encoder outputs."""
    return write_memory_clip(tmp_path_factory.mktemp("kd_memory"))


def _selection(viewmats: torch.Tensor, seed: int) -> dict[int, list[int]]:
    """The AR loop's context of every chunk of a 32-latent clip under the points of `seed` (default settings)."""
    points = make_retrieval_points(seed)
    return {chunk: select_aligned_memory_frames(viewmats.double(), 4 * chunk, points=points)
            for chunk in range(1, NUM_LATENTS // 4)}


def test_the_clip_is_one_where_the_memory_points_decide_the_context(clip):
    """The precondition of the tests below: the rollout's points and the old per-step points pick other frames."""
    viewmats = clip["condition"]["viewmats"]
    ours, old = _selection(viewmats, ROLLOUT_SEED), _selection(viewmats, OLD_STREAM_SEED)
    differing = [chunk for chunk in ours if ours[chunk] != old[chunk]]
    assert differing == [6, 7], (ours, old)
    assert set(range(8, 12)) <= set(ours[6]) and set(range(4, 8)) <= set(old[6])


def _contexts(recording: RecordingTeacher, history: torch.Tensor) -> dict[int, list[int]]:
    """The context frames of chunks 1..7 of a 32-latent clip whose every chunk ran once, in order: the frames of
    `history` [1, C, 32, H, W] in the input of each of the model's context prefills."""
    prefills = recording.calls["context_prefill"]
    assert len(prefills) == NUM_LATENTS // 4 - 1
    return {chunk: frame_indices(call["args"][0], history) for chunk, call in enumerate(prefills, start=1)}


def _recording(method_model: MethodModel) -> tuple[MethodModel, RecordingTeacher]:
    """`method_model` calling its model through a `RecordingTeacher` of its context prefills and chunk steps."""
    recording = RecordingTeacher(method_model.model, "context_prefill", "chunk_step")
    return dataclasses.replace(method_model, model=recording), recording


# ---------------------------------------------------------------------------------------------------------------
# KD: the student's teacher-forced clip uses the cache sample's own memory points
# ---------------------------------------------------------------------------------------------------------------
def _one_step_cache(clip, out: Path) -> tuple[Path, dict[int, list[int]]]:
    """An ODE cache of one 1-step sample (store_grid 1): its only state is the seed's noise at sigma 1 and its final
    latents are one Euler step, `x - v`. Returns the folder and the contexts its Teacher rollout selected."""
    teacher = WorldPlayTransformer.from_pretrained(str(clip["teacher"])).eval().requires_grad_(False)
    job = CacheJob(0, "train0", "train", ROLLOUT_SEED, ("train", 0))
    settings = CacheSettings(steps=1, shift=5.0, store_grid=1, compute_dtype="float32", storage_dtype="float32")
    recording = RecordingTeacher(teacher, "context_prefill")
    build_cache(recording, [job], lambda job: clip["condition"], settings, out, env=ENV, inputs={"test": True})
    return out, _contexts(recording, OdeCacheDataset(out, "train")[0]["final"][None])


def test_kd_student_context_is_the_cache_rollouts_and_the_teacher_is_its_own_fixed_point(clip, tmp_path):
    """With the Teacher itself as the student, the KD loss at the cached state is exactly 0: same context frames,
    same K/V, same velocity, and `x - 1 * v` is the Teacher's own 1-step result. Before the fix the student drew
    its memory points from (seed, micro-step, rank, 1), selected group 4-7 where the cache's rollout had 8-11 in
    chunks 6 and 7, and the loss was not 0."""
    cache, recorded = _one_step_cache(clip, tmp_path / "cache")
    assert recorded == _selection(clip["condition"]["viewmats"], ROLLOUT_SEED)  # the cache used the seed's points
    args = kd.parse_args(["--preset", "demo", "--val_every", "0",
                          "--teacher", str(clip["teacher"]), "--cache_root", str(cache),
                          "--output_dir", str(tmp_path / "kd"), "--student_steps", "1", "--chunks_per_clip", "8",
                          "--no_progress"])
    dataset = OdeCacheDataset(cache, "train")
    item = dataset[0]
    assert item["seed"] == ROLLOUT_SEED
    method_model = build_method_model(TeacherSource(args.teacher, None, "--teacher", None),
                                      settings_from_flags(MethodSettings, args), ENV, precision_policy("fp32", CPU),
                                      role_name="student")
    state_indices = kd_recipe.student_state_indices(1, 5.0, dataset.stored_sigmas)
    method_model, recording = _recording(method_model)
    step = kd_recipe.CausalKDStep(method_model, kd_recipe.RolloutConfig(state_dtype=torch.float32), state_indices,
                                  args, ENV, RunState())
    metrics = step(item, sync=True, due=STUDENT)
    assert metrics["chunks"] == 8
    assert _contexts(recording, item["final"][None]) == recorded
    assert metrics["loss"] < 1e-12, metrics


# ---------------------------------------------------------------------------------------------------------------
# DF-SFT on Teacher samples: the samples' own memory points (and memory settings); video clips: per-step points
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher_sample(clip) -> dict:
    """One Teacher F-F-F-F sample of the 32-latent clip made as the dataset builder makes it (its rollout settings,
    `RolloutInputs.from_seed(row seed)`), in the `TeacherSampleDataset` item layout; plus the contexts its rollout
    selected and a dataset config with the builder's fields."""
    teacher = WorldPlayTransformer.from_pretrained(str(clip["teacher"])).eval().requires_grad_(False)
    condition = clip["condition"]
    text_kv = clip_text_kv(teacher, condition, CPU, None, grad=False)
    inputs = RolloutInputs.from_seed(ROLLOUT_SEED, condition["image_cond"], condition["viewmats"].double(),
                                     condition["Ks"].double(), condition["action"])
    config = builder.rollout_config((), torch.float32)
    rollout, recorder = record_rollout(teacher, text_kv, inputs, config)
    item = {
        "clip_id": "c000__a0", "case_id": "c000", "action_id": 0, "latent_start": 0,
        "latents": rollout.latents[0].clone(),
        "viewmats": condition["viewmats"], "Ks": condition["Ks"], "action": condition["action"],
        "image_cond": condition["image_cond"],
        "text_k": torch.cat(text_kv.k, dim=0), "text_v": torch.cat(text_kv.v, dim=0),
        "seed": ROLLOUT_SEED,
    }
    dataset_config = {"num_steps": config.num_steps, "shift": config.shift, "chunk_latents": config.chunk_latents,
                      "context_timestep": config.context_timestep,
                      "memory": {"memory_frames": config.memory_frames,
                                 "temporal_context_size": config.temporal_context_size}}
    contexts = {chunk.chunk_index: list(chunk.ctx_indices) for chunk in recorder.chunks if chunk.chunk_index > 0}
    return {"item": item, "contexts": contexts, "config": dataset_config}


def _df_sft_step(clip, tmp_path: Path, data: str, dataset_config: dict, *extra: str
                 ) -> tuple[df_sft_recipe.DiffusionForcingStep, RecordingTeacher]:
    """df_sft's step on one clip of `data`, its model calls recorded."""
    root = tmp_path / "dataset"
    root.mkdir(parents=True, exist_ok=True)
    (root / df_sft.DATA_KINDS[data]).write_text(json.dumps(dataset_config))
    args = df_sft.parse_args(["--preset", "demo", "--val_every", "0",
                              "--teacher", str(clip["teacher"]), "--dataset_root", str(root),
                              "--data", data, "--train", "lora", "--lora_rank", "2", "--lora_alpha", "2",
                              "--chunks_per_clip", "8", "--output_dir", str(tmp_path / "run"), "--no_progress",
                              *extra])
    policy = precision_policy("fp32", CPU)
    method_model, recording = _recording(build_method_model(
        TeacherSource(args.teacher, None, "--teacher", None), settings_from_flags(MethodSettings, args), ENV, policy,
        role_name="student"))
    rollout_config = df_sft.build_rollout_config(args, SimpleNamespace(config=dataset_config), policy)
    return df_sft_recipe.DiffusionForcingStep(method_model, rollout_config, args, ENV, RunState()), recording


def test_df_sft_on_teacher_samples_conditions_on_the_samples_own_context(clip, teacher_sample, tmp_path):
    """Every chunk's context is the one the Teacher's rollout selected for that sample (its recorded ctx_indices);
    before the fix, chunks 6 and 7 drew other points per micro-step and selected group 4-7 instead of 8-11."""
    step, recording = _df_sft_step(clip, tmp_path, "teacher_samples", teacher_sample["config"])
    step(teacher_sample["item"], sync=True, due=STUDENT)
    assert _contexts(recording, teacher_sample["item"]["latents"][None]) == teacher_sample["contexts"]


def test_df_sft_teacher_samples_take_the_datasets_memory_settings(clip, teacher_sample, tmp_path):
    config = json.loads(json.dumps(teacher_sample["config"]))
    config["memory"] = {"memory_frames": 16, "temporal_context_size": 8}
    step, _ = _df_sft_step(clip, tmp_path, "teacher_samples", config)
    assert (step.rollout_config.memory_frames, step.rollout_config.temporal_context_size) == (16, 8)
    del config["memory"]
    with pytest.raises(KeyError, match=r"missing field\(s\) \['memory'\]"):
        _df_sft_step(clip, tmp_path, "teacher_samples", config)


def test_df_sft_on_video_clips_keeps_the_per_step_points(clip, teacher_sample, tmp_path):
    """A video clip has no rollout behind it: its points come from (seed, micro-step, rank, 1), as before."""
    step, recording = _df_sft_step(clip, tmp_path, "video_latents", {})
    item = dict(teacher_sample["item"])
    item.pop("seed")  # video-latent items carry no seed
    step(item, sync=True, due=STUDENT)
    assert _contexts(recording, item["latents"][None]) == _selection(item["viewmats"], OLD_STREAM_SEED)


# ---------------------------------------------------------------------------------------------------------------
# df_sft --context_noise: clean (teacher forcing, the AR loop's context) or independent (diffusion forcing)
# ---------------------------------------------------------------------------------------------------------------
def _inputs(recording: RecordingTeacher, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden_states, timestep) of every recorded call of `name`: the context prefills' selected frames, or the
    chunk steps' noisy chunks."""
    return [(call["args"][0].detach(), call["args"][1].detach()) for call in recording.calls[name]]


def test_clean_context_is_the_history_at_the_context_timestep(clip, teacher_sample, tmp_path):
    step, recording = _df_sft_step(clip, tmp_path, "teacher_samples", teacher_sample["config"])
    assert step.args.context_noise == "clean"
    item = teacher_sample["item"]
    step(item, sync=True, due=STUDENT)
    prefills = _inputs(recording, "context_prefill")
    assert len(prefills) == 7
    for (hidden, timestep), (chunk, indices) in zip(prefills, sorted(teacher_sample["contexts"].items())):
        assert torch.equal(timestep, torch.full((len(indices),), 14.0))
        assert torch.equal(hidden[0, :4], item["latents"][:, indices])


def test_independent_context_noise_is_diffusion_forcing(clip, teacher_sample, tmp_path):
    """Each chunk of the history at its own level; the prefill sees each context frame noisy, at its chunk's
    timestep 1000 sigma; the trained chunks' own inputs are those of the clean run (only the context changed)."""
    item = teacher_sample["item"]
    clean, clean_recording = _df_sft_step(clip, tmp_path / "clean", "teacher_samples", teacher_sample["config"],
                                      "--sigma_min", "0.1")
    clean_loss = clean(item, sync=True, due=STUDENT)["loss"]
    noisy, noisy_recording = _df_sft_step(clip, tmp_path / "noisy", "teacher_samples", teacher_sample["config"],
                                      "--context_noise", "independent", "--sigma_min", "0.1")
    noisy_loss = noisy(item, sync=True, due=STUDENT)["loss"]

    # 1. the context: one level per chunk, inside the bounds, all different; the latents (1 - s) x0 + s n
    context = noisy.noisy_context(item["latents"][None].float(), (0, 0, 0))
    levels = context.sigma.view(-1, 4)
    assert torch.equal(levels, levels[:, :1].expand(-1, 4))
    assert len(set(levels[:, 0].tolist())) == 8 and float(levels.min()) >= 0.1 and float(levels.max()) <= 1.0
    generator = torch.Generator().manual_seed(stream_seed(0, 0, 0, 2))
    drawn = df_sft_recipe.sample_sigmas("uniform", 8, generator, sigma_min=0.1, sigma_max=1.0)
    noise = torch.randn(item["latents"][None].shape, generator=generator)
    sigma = drawn.repeat_interleave(4)[None, None, :, None, None]
    torch.testing.assert_close(context.latents, (1 - sigma) * item["latents"][None] + sigma * noise,
                               rtol=0, atol=1e-6)
    # 2. what the prefill saw: the selected frames of those latents, at their own timesteps
    noisy_prefills = _inputs(noisy_recording, "context_prefill")
    assert len(noisy_prefills) == 7
    for (hidden, timestep), (chunk, indices) in zip(noisy_prefills, sorted(teacher_sample["contexts"].items())):
        torch.testing.assert_close(timestep, 1000.0 * context.sigma[indices], rtol=0, atol=1e-4)
        assert torch.equal(hidden[0, :4], context.latents[0, :, indices])
        assert len(set(timestep.tolist())) == len(set(index // 4 for index in indices))
    # 3. the trained chunks: same noisy inputs and levels as the clean run; the loss differs through the context
    noisy_steps, clean_steps = _inputs(noisy_recording, "chunk_step"), _inputs(clean_recording, "chunk_step")
    assert len(noisy_steps) == len(clean_steps) == 8
    for (noisy_input, noisy_t), (clean_input, clean_t) in zip(noisy_steps, clean_steps):
        assert torch.equal(noisy_input, clean_input) and torch.equal(noisy_t, clean_t)
    assert noisy_loss != clean_loss


def test_noisy_context_needs_the_exact_context_mode(clip, teacher_sample):
    from predictor_training.rollout.ar_rollout import RolloutConfig
    from predictor_training.rollout.teacher_forcing import NoisyContext, TeacherForcedClip

    teacher = WorldPlayTransformer.from_pretrained(str(clip["teacher"]))
    history = teacher_sample["item"]["latents"][None]
    context = NoisyContext(latents=history, sigma=torch.zeros(NUM_LATENTS))
    with pytest.raises(ValueError, match="'incremental' context mode re-uses stored clean K/V"):
        TeacherForcedClip(teacher, history, teacher_sample["item"], RolloutConfig(context_mode="incremental"), CPU,
                          memory_seed=0, text_grad=False, context_grad=False, noisy_context=context)
    with pytest.raises(ValueError, match=r"sigma must be \[T\] = \[32\]"):
        NoisyContext(latents=history, sigma=torch.zeros(8))
