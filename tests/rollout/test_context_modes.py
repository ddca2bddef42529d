"""Context modes of the AR loop (predictor_training/rollout/ar_rollout.py with
teacher/frame_kv_cache.py): where `exact` and `incremental` must agree they do, to float round-off; cached K/V are
re-placed at their compacted RoPE position and their own ProPE camera; `last_step` caches without an extra pass;
cached modes refuse to train through the context."""

from __future__ import annotations

import pytest
import torch

from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig
from predictor_training.rollout.policy import StepOutput
from predictor_training.teacher.layers import apply_rope
from tests.helpers.recording_models import RecordingTeacher
from tests.helpers.tiny_teacher import make_tiny_teacher, tiny_rollout_inputs, tiny_text_kv


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
HEIGHT, WIDTH = 2, 3


@pytest.fixture(scope="module")
def teacher():
    return make_tiny_teacher()


@pytest.fixture(scope="module")
def text_kv(teacher):
    return tiny_text_kv(teacher)


def rollout(teacher, text_kv, mode: str, num_latents: int, **config) -> ARRollout:
    """A turning, advancing camera (every frame has its own ProPE matrix), tests/helpers/tiny_teacher.py's inputs."""
    inputs = tiny_rollout_inputs(teacher, num_latents=num_latents, height=HEIGHT, width=WIDTH)
    return ARRollout(teacher, text_kv, inputs, RolloutConfig(context_mode=mode, **config))


def assert_same_kv(first, second, atol: float) -> None:
    assert first.num_frames == second.num_frames and first.num_layers == second.num_layers
    for layer_a, layer_b in zip(first.layers, second.layers):
        for name in ("rope_k", "rope_v", "prope_k", "prope_v"):
            torch.testing.assert_close(getattr(layer_a, name), getattr(layer_b, name), atol=atol, rtol=0)


def test_exact_and_incremental_agree_when_the_context_is_one_earlier_chunk(teacher, text_kv):
    """Chunk 1's context is chunk 0's frames, and chunk 0 had no context: the incremental pass over chunk 0 sees
    exactly what the exact prefill of chunk 1 sees, so the K/V and the whole 2-chunk video agree to round-off. From
    chunk 2 on the exact prefill lets frames 0-3 attend to frames 4-7, the cached K/V do not: they differ."""
    exact, incremental = (rollout(teacher, text_kv, mode, 12) for mode in ("exact", "incremental"))
    for chunk in (exact, incremental):
        chunk.run_chunk(0)
    assert incremental.frame_cache.frames == [0, 1, 2, 3]
    assert exact.frame_cache is None
    assert_same_kv(exact.prefill_context(1).kv, incremental.prefill_context(1).kv, atol=1e-6)
    for chunk in (exact, incremental):
        chunk.run_chunk(1)
    torch.testing.assert_close(exact.latents[:, :, :8], incremental.latents[:, :, :8], atol=1e-6, rtol=0)
    for chunk in (exact, incremental):
        chunk.run_chunk(2)
    assert not torch.allclose(exact.latents[:, :, 8:], incremental.latents[:, :, 8:], atol=1e-4)
    assert incremental.frame_cache.frames == list(range(8))  # the last chunk is never cached


def test_cached_kv_are_replaced_at_their_compacted_position_and_own_camera(teacher, text_kv):
    """Assemble a non-contiguous selection [4..7, 0..3] and compare with a direct computation: RoPE of the frame's
    compacted position (a one-frame table starting there) and ProPE with the inverse of the frame's projection
    matrix, inverted in float64 by torch.linalg.inv."""
    run = rollout(teacher, text_kv, "incremental", 12)
    run.run_chunk(0)
    run.run_chunk(1)
    selection = [4, 5, 6, 7, 0, 1, 2, 3]
    raw = run.frame_cache.gather(selection)
    _, viewmats, Ks = run.frame_inputs(selection)
    kv = teacher.assemble_context_kv(raw, viewmats, Ks, HEIGHT, WIDTH)
    tokens = HEIGHT * WIDTH
    for layer, (k, v) in zip(kv.layers, raw):
        for position, frame in enumerate(selection):
            rows = slice(position * tokens, (position + 1) * tokens)
            table = teacher.rope_table(1, HEIGHT, WIDTH, start=position)
            torch.testing.assert_close(layer.rope_k[:, :, rows], apply_rope(k[:, :, rows], table), atol=1e-6, rtol=0)
            torch.testing.assert_close(layer.rope_v[:, :, rows], v[:, :, rows])
            # P = diag(fx, fy, 1, 1) @ w2c for this frame; ProPE stores P^-1 applied to every 4-vector of K and V.
            focal = torch.diag(torch.tensor([Ks[0, position, 0, 0], Ks[0, position, 1, 1], 1.0, 1.0],
                                            dtype=torch.float64))
            inverse = torch.linalg.inv(focal @ viewmats[0, position].double())
            for stored, raw_tensor in ((layer.prope_k, k), (layer.prope_v, v)):
                vectors = raw_tensor[:, :, rows].double().unflatten(-1, (-1, 4))
                expected = (vectors @ inverse.T).flatten(-2)
                torch.testing.assert_close(stored[:, :, rows].double(), expected, atol=1e-5, rtol=1e-5)


def test_last_step_caches_without_an_extra_pass_and_needs_a_full_step(teacher, text_kv):
    recording = RecordingTeacher(teacher, "frame_kv_pass")
    run = rollout(recording, text_kv, "last_step", 12)
    run.run()
    assert recording.calls["frame_kv_pass"] == [] and run.frame_cache.frames == list(range(8))
    assert torch.isfinite(run.latents).all()

    replaced = rollout(teacher, text_kv, "last_step", 12)
    no_full_step = lambda call: StepOutput(velocity=torch.zeros_like(call.latent))  # noqa: E731
    with pytest.raises(RuntimeError, match="needs at least one Full Teacher step"):
        replaced.run(step_fn=no_full_step)


def test_cached_modes_refuse_to_train_through_the_context(teacher, text_kv):
    run = rollout(teacher, text_kv, "incremental", 12)
    run.run_chunk(0)
    with pytest.raises(ValueError, match="cannot train through the context"):
        run.prefill_context(1, grad=True)
