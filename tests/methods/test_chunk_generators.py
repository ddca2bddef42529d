"""The DMD generators' chunks (predictor_training/methods/chunk_generators.py) on the
tiny dmd2 world: the composite's sample is the chunk's final latent, with the Predictor's graph also when the chunk
ends on a Full step (F-P-P-F); the Teacher's reference chunks on its own history and on data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import predictor_training.recipes.dmd2 as dmd2
from predictor_training.data.video_latents import VideoLatentDataset
from tests.helpers.method_world import build_dmd2_step, write_dmd2_world


CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_dmd2_world(tmp_path_factory.mktemp("dmd2"))


def _teacher_calls(teacher) -> tuple[list, object]:
    """(calls, hook handle): one entry per Teacher pass (its first block's image-stream K projection)."""
    calls = []
    return calls, teacher.double_blocks[0].img_attn_k.register_forward_hook(lambda *_: calls.append(1))


@pytest.mark.parametrize("replace_steps", ["1,2,3", "1,2"], ids=["F-P-P-P", "F-P-P-F"])
def test_the_composite_sample_is_its_final_latent_with_the_predictor_graph(world, tmp_path, replace_steps):
    """The sample `score_chunk` gets is the chunk's final latent as committed into the history, bit for bit, with a
    graph that reaches the Predictor; F-P-P-F re-runs its trailing Full step for it (one more Teacher pass) only
    where grad is enabled. Without grad (a generator step that is not due) the same values, no graph."""
    _, step, generator_role, _, teacher, _ = build_dmd2_step(world, tmp_path, "--replace_steps", replace_steps)
    item = VideoLatentDataset(world["videos"], "train")[0]
    data = item["latents"][None].float()
    noise = torch.randn(data.shape, generator=torch.Generator().manual_seed(3))
    teacher_passes, samples = {}, {}
    for grad in (False, True):
        rollout = dmd2.CompositeRollout(teacher, generator_role.module, item, noise, 5, step.config, step.settings,
                                        CPU, None)
        chunks = []

        def score_chunk(chunk):
            chunks.append(chunk)
            if grad:
                chunk.sample.sum().backward()

        calls, hook = _teacher_calls(teacher)
        with torch.set_grad_enabled(grad):
            rollout.run(score_chunk)
        hook.remove()
        (chunk,) = chunks
        assert chunk.chunk_index == 1 and chunk.sample.requires_grad == grad
        assert torch.equal(chunk.sample, rollout.history[:, :, 4:8])
        teacher_passes[grad], samples[grad] = len(calls), chunk.sample.detach()
    assert rollout.trailing_full_steps() == ([] if replace_steps == "1,2,3" else [3])
    assert teacher_passes[True] - teacher_passes[False] == len(rollout.trailing_full_steps())
    assert torch.equal(samples[True], samples[False])
    assert generator_role.parameters_with_grad() != []


@pytest.mark.parametrize("on_data", [False, True], ids=["own-history", "data"])
def test_teacher_chunks_are_the_teachers_rollout_of_the_noise(world, tmp_path, on_data):
    """`teacher_chunks` gives the Teacher's F-F-F-F of the asked chunks: on its own history the plain rollout's
    latents; on data, each chunk made on the data of the chunks before it (chunk 0 as on its own history)."""
    from predictor_training.rollout.ar_rollout import ARRollout, RolloutInputs
    from predictor_training.rollout.teacher_forcing import clip_text_kv
    _, step, _, _, teacher, _ = build_dmd2_step(world, tmp_path)
    item = VideoLatentDataset(world["videos"], "train")[0]
    data = item["latents"][None].float()
    noise = torch.randn(data.shape, generator=torch.Generator().manual_seed(3))
    chunks = dmd2.teacher_chunks(teacher, item, noise, 5, [0, 1], step.config, CPU, data if on_data else None)
    text_kv = clip_text_kv(teacher, item, CPU, None, grad=False)
    with torch.no_grad():
        plain = ARRollout(teacher, text_kv, RolloutInputs.from_clip(item, noise, 5), step.config, device=CPU).run()
        assert torch.equal(chunks[:, :, :4], plain[:, :, :4])
        if not on_data:
            assert torch.equal(chunks, plain)
            return
        history = noise.clone()
        history[:, :, :4] = data[:, :, :4]  # chunk 1 reads the data of chunk 0 as its context
        on_history = ARRollout(teacher, text_kv, RolloutInputs.from_clip(item, history, 5), step.config, device=CPU)
        on_history.run(chunks=[1])
    assert torch.equal(chunks[:, :, 4:], on_history.latents[:, :, 4:8])
    assert not torch.equal(chunks[:, :, 4:], plain[:, :, 4:])


class _LinearClip:
    """A stand-in score clip whose velocity is v(x, sigma) = x - 0.5 at every sigma (linear: every step is worked
    out by hand in the test); one chunk of 4 frames, no context."""

    class _Frames:
        @staticmethod
        def chunk_frames(chunk_index):
            return slice(4 * chunk_index, 4 * chunk_index + 4)

    def __init__(self, history):
        self.history = history
        self.forced = type("Forced", (), {"rollout": self._Frames()})()
        self.calls = []

    def velocity(self, chunk_index, latent, sigma):
        self.calls.append((latent.clone(), float(sigma[0])))
        return latent - 0.5


class _LinearStudent:
    def __init__(self, history):
        self.made = _LinearClip(history)

    def clip(self, *args, **kwargs):
        return self.made


@pytest.mark.parametrize("sampler", ["euler", "renoise"])
def test_the_student_moves_between_steps_by_its_sampler(sampler):
    """Before the exit step, Euler steps along the velocity, x1 = x0_state + (s1 - s0) v; Self-Forcing's re-noising
    puts the x0 estimate x - s0 v back at s1 with fresh noise from the given generator,
    x1 = (1 - s1)(x - s0 v) + s1 n. The exit step's sample is x - s v of the state it reached."""
    from predictor_training.methods.chunk_generators import StudentRollout

    sigmas = torch.tensor([1.0, 0.625, 0.0])
    noise = torch.randn(1, 2, 4, 1, 1, generator=torch.Generator().manual_seed(0))
    student = _LinearStudent(noise.clone())
    renoise = torch.Generator().manual_seed(7) if sampler == "renoise" else None
    rollout = StudentRollout(student, None, noise, noise.clone(), 0, None, CPU, sigmas=sigmas, exit_steps=[1],
                             chunks=[0], self_history=True, context_grad=False, teacher_clip=None, renoise=renoise)
    chunk = rollout.chunk_sample(0)
    (first, sigma_0), (second, sigma_1) = student.made.calls
    assert (sigma_0, sigma_1) == (1.0, 0.625)
    velocity = noise - 0.5
    if sampler == "euler":
        expected = noise + (0.625 - 1.0) * velocity
    else:
        fresh = torch.randn(noise.shape, generator=torch.Generator().manual_seed(7))
        expected = (1 - 0.625) * (noise - 1.0 * velocity) + 0.625 * fresh
    torch.testing.assert_close(second, expected)
    torch.testing.assert_close(chunk.sample, expected - 0.625 * (expected - 0.5))
