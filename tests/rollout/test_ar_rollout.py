"""The Teacher's AR chunk loop (predictor_training/rollout/ar_rollout.py) on a tiny random
Teacher: initial noise and condition channels, step hooks (the Teacher's own, velocity reuse), bf16 state, bad
inputs. The golden F-F-F-F trajectory of set A is in tests/conformance/test_trajectory.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from predictor_training.rollout.ar_rollout import (
    ARRollout,
    RolloutConfig,
    build_cond_latents,
    make_initial_noise,
    record_rollout,
)
from predictor_training.rollout.policy import ChunkPolicy
from predictor_training.rollout.recorder import TrajectoryRecorder
from tests.helpers.tiny_teacher import make_tiny_teacher, tiny_rollout_inputs, tiny_text_kv


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_teacher():
    return make_tiny_teacher()


def test_initial_noise_and_condition_channels():
    noise = make_initial_noise(7, (1, 4, 8, 2, 3))
    assert torch.equal(noise, torch.randn(1, 4, 8, 2, 3, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(make_initial_noise(7, (1, 4, 8, 2, 3), dtype=torch.bfloat16), noise.bfloat16())
    assert not torch.equal(make_initial_noise(8, (1, 4, 8, 2, 3)), noise)
    image_cond = torch.randn(1, 4, 1, 2, 3)
    cond = build_cond_latents(image_cond, 8)
    assert cond.shape == (1, 5, 8, 2, 3)
    assert torch.equal(cond[:, :4, 0], image_cond[:, :, 0]) and bool((cond[:, 4, 0] == 1).all())
    assert not cond[:, :, 1:].any()


def test_hook_that_runs_the_teacher_reproduces_the_plain_rollout(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher)
    config = RolloutConfig(prefeature_layers=(0, 1))
    plain, recorder = record_rollout(tiny_teacher, text_kv, inputs, config)
    seen = []

    def full_step(call):
        seen.append((call.chunk_index, call.step_index, call.rope_start, call.context.num_frames))
        assert (call.previous is None) == (call.step_index == 0)
        assert (call.previous_chunk is None) == (call.chunk_index == 0)
        assert call.model_input.shape == (1, 9, 4, 2, 3) and call.timestep.dtype == torch.float32
        return call.run_teacher()

    hooked = ARRollout(tiny_teacher, text_kv, inputs, config).run(step_fn=full_step)
    assert torch.equal(hooked, plain.latents)
    assert seen == [(c, k, 4 * c, 4 * c) for c in range(3) for k in range(4)]
    # loop identities (predictor_training/conformance/golden/README.md F.3, item 7) on a different model and grid
    for chunk in recorder.chunks:
        for before, after in zip(chunk.steps, chunk.steps[1:]):
            assert torch.equal(before.latent_out, after.latent_in)
        assert torch.equal(chunk.final_latent, chunk.steps[-1].latent_out)
        start = 4 * chunk.chunk_index
        assert torch.equal(chunk.steps[0].latent_in, inputs.noise[:, :, start:start + 4])
        if chunk.ctx_indices:
            index = torch.tensor(chunk.ctx_indices)
            cond = build_cond_latents(inputs.image_cond, 12)
            expected = torch.cat([plain.latents[:, :, index], cond[:, :, index]], dim=1)
            assert torch.equal(chunk.ctx_input, expected)
            assert sorted(chunk.prefeatures) == [0, 1]
            assert chunk.prefeatures[0].shape == (1, len(index) * 6, tiny_teacher.config.hidden_size)


def test_after_commit_sees_the_committed_chunk_and_its_writes_are_the_next_contexts(tiny_teacher):
    """`ChunkPolicy.after_commit`: the running latents hold the chunk's final latent by then, and what it writes
    there (teacher forcing's data) is what later chunks read as context."""
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher)
    data = torch.randn(inputs.noise.shape, generator=torch.Generator().manual_seed(5))
    rollout = ARRollout(tiny_teacher, text_kv, inputs, RolloutConfig())
    committed, contexts = [], {}

    def after_commit(run):
        frames = rollout.chunk_frames(run.chunk_index)
        committed.append(torch.equal(rollout.latents[:, :, frames], run.final_latent))
        rollout.write_chunk(run.chunk_index, data[:, :, frames])

    def full_step(call):
        if call.step_index == 0 and call.context.indices:
            contexts[call.chunk_index] = (call.context.indices, call.context.model_input[:, :data.shape[1]])
        return call.run_teacher()

    latents = rollout.run_chunks(ChunkPolicy(full_step, on_commit=after_commit))
    assert committed == [True] * 3 and torch.equal(latents, data)
    assert sorted(contexts) == [1, 2]
    for indices, context_latents in contexts.values():
        assert torch.equal(context_latents, data[:, :, indices])


def test_reuse_hook_replaces_steps_and_euler_uses_its_velocity(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher)
    recorder = TrajectoryRecorder()

    def reuse_steps_1_2(call):
        if call.step_index in (1, 2):
            return call.previous
        return call.run_teacher()

    final = ARRollout(tiny_teacher, text_kv, inputs, RolloutConfig(), recorder).run(step_fn=reuse_steps_1_2)
    full, _ = record_rollout(tiny_teacher, text_kv, inputs, RolloutConfig())
    assert not torch.allclose(final, full.latents)
    sigmas = torch.tensor([1.0, 0.9375, 0.8333333, 0.625, 0.0])
    for chunk in recorder.chunks:
        assert torch.equal(chunk.steps[1].velocity, chunk.steps[0].velocity)
        assert torch.equal(chunk.steps[2].velocity, chunk.steps[0].velocity)
        step = chunk.steps[2]
        expected = step.latent_in + step.velocity * (sigmas[3] - sigmas[2])
        torch.testing.assert_close(step.latent_out, expected, rtol=0, atol=1e-6)

    with pytest.raises(TypeError, match="StepOutput"):
        ARRollout(tiny_teacher, text_kv, inputs).run(step_fn=lambda call: call.run_teacher().velocity)


def test_bfloat16_state_rounds_every_write_back(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher, num_latents=8)
    inputs = dataclasses.replace(inputs, noise=inputs.noise.bfloat16())
    config = RolloutConfig(state_dtype=torch.bfloat16)
    rollout, recorder = record_rollout(tiny_teacher, text_kv, inputs, config)
    assert rollout.latents.dtype == torch.bfloat16
    for chunk in recorder.chunks:
        for before, after in zip(chunk.steps, chunk.steps[1:]):
            assert before.latent_out.dtype == torch.float32 and after.latent_in.dtype == torch.bfloat16
            assert torch.equal(before.latent_out.bfloat16(), after.latent_in)
    fp32, _ = record_rollout(tiny_teacher, text_kv, dataclasses.replace(inputs, noise=inputs.noise.float()),
                             RolloutConfig())
    difference = (fp32.latents - rollout.latents.float()).abs().max()
    assert 0 < difference < 0.1


def test_rollout_rejects_bad_inputs(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher)
    with pytest.raises(ValueError, match="prefeature_layers"):
        ARRollout(tiny_teacher, text_kv, inputs, RolloutConfig(prefeature_layers=(5,)))
    with pytest.raises(ValueError, match="multiple of chunk_latents"):
        ARRollout(tiny_teacher, text_kv, tiny_rollout_inputs(tiny_teacher, num_latents=10))
    with pytest.raises(ValueError, match="viewmats"):
        dataclasses.replace(inputs, viewmats=inputs.viewmats[:-1])
    with pytest.raises(ValueError, match="exactly one of memory_points and memory_generator"):
        dataclasses.replace(inputs, memory_points=None)
    rollout = ARRollout(tiny_teacher, text_kv, inputs)
    with pytest.raises(ValueError, match="chunk 1: latent must be"):
        rollout.write_chunk(1, torch.zeros(1, 4, 3, 2, 3))
    rollout.write_chunk(1, torch.ones(1, 4, 4, 2, 3))  # what a caller that denoises a chunk itself commits
    assert bool((rollout.latents[:, :, 4:8] == 1).all())
    assert torch.equal(rollout.latents[:, :, :4], inputs.noise[:, :, :4])
