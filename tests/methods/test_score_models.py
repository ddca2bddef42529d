"""Score models for distribution matching (predictor_training/methods/score_models.py) on a tiny Teacher with a LoRA
adapter: x0 = x_sigma - sigma v, the score's adapter active during its calls only, and a chunk's estimate read from
the history of the chunks before it (teacher forcing; `write_chunk` / `copy_history` for Self-Forcing)."""

from __future__ import annotations

import pytest
import torch

from predictor_training.data.synthetic import clip_item
from predictor_training.methods.score_models import ScoreModel
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.teacher.adapters import active_adapter, add_lora, set_active_adapter
from tests.helpers.tiny_teacher import make_tiny_teacher

CPU = torch.device("cpu")
CHUNKS, GRID = 2, (2, 3)
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def teacher():
    """The tiny Teacher with a "real" LoRA adapter whose B matrices are random (so it changes the model)."""
    model = make_tiny_teacher()
    add_lora(model, "real", 4, 4.0)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B.real" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    set_active_adapter(model, None)
    return model.requires_grad_(False)


def clip(teacher):
    """One clip of 2 chunks: random image condition and stored text K/V, the synthetic turning camera."""
    item = clip_item(teacher.config, chunks=CHUNKS, grid=GRID, text_tokens=4, host="cpu")
    generator = torch.Generator().manual_seed(1)
    for name in ("image_cond", "text_k", "text_v"):
        item[name] = torch.randn(item[name].shape, generator=generator)
    history = torch.randn(1, teacher.config.out_channels, 4 * CHUNKS, *GRID, generator=generator)
    return item, history


def noisy_chunk(teacher, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, teacher.config.out_channels, 4, *GRID, generator=generator),
            torch.full((4,), 0.6))


def test_x0_is_the_noisy_latent_minus_sigma_times_the_velocity(teacher):
    item, history = clip(teacher)
    score = ScoreModel(teacher, None, "real_score").clip(history, item, RolloutConfig(), CPU, memory_seed=0)
    assert score.num_chunks == CHUNKS
    noisy, sigma = noisy_chunk(teacher)
    with torch.no_grad():
        velocity = score.velocity(1, noisy, sigma)
        x0 = score.x0(1, noisy, sigma)
    assert velocity.dtype == x0.dtype == torch.float32 and velocity.shape == noisy.shape
    torch.testing.assert_close(x0, noisy - 0.6 * velocity, rtol=0, atol=1e-6)


def test_the_scores_adapter_runs_during_its_calls_only(teacher):
    item, history = clip(teacher)
    noisy, sigma = noisy_chunk(teacher)
    base = ScoreModel(teacher, None, "teacher").clip(history, item, RolloutConfig(), CPU, memory_seed=0)
    real = ScoreModel(teacher, "real", "real_score").clip(history, item, RolloutConfig(), CPU, memory_seed=0)
    with torch.no_grad():
        base_velocity = base.velocity(1, noisy, sigma)
        real_velocity = real.velocity(1, noisy, sigma)
        assert active_adapter(teacher) is None  # restored after the call
        again = base.velocity(1, noisy, sigma)
    assert not torch.allclose(base_velocity, real_velocity)
    assert torch.equal(base_velocity, again)
    with ScoreModel(teacher, "real", "real_score").active():
        assert active_adapter(teacher) == "real"
    assert active_adapter(teacher) is None


def test_a_chunk_reads_the_history_before_it_and_nothing_after(teacher):
    item, history = clip(teacher)
    noisy, sigma = noisy_chunk(teacher)
    config = RolloutConfig()
    score = ScoreModel(teacher, None, "fake_score")
    with torch.no_grad():
        reference = score.clip(history, item, config, CPU, memory_seed=0).velocity(1, noisy, sigma)
        later_changed = history.clone()
        later_changed[:, :, 4:] += 1.0  # chunk 1 itself: not its own context
        assert torch.equal(score.clip(later_changed, item, config, CPU, memory_seed=0).velocity(1, noisy, sigma),
                           reference)
        earlier_changed = history.clone()
        earlier_changed[:, :, :4] += 1.0  # chunk 0: the context of chunk 1
        moved = score.clip(earlier_changed, item, config, CPU, memory_seed=0)
        assert not torch.allclose(moved.velocity(1, noisy, sigma), reference)
        # Self-Forcing: the generator's own chunk 0 copied in, or written chunk by chunk, is that context
        moved.copy_history(history, 1)
        assert torch.equal(moved.history[:, :, :4], history[:, :, :4])
        assert torch.equal(moved.history[:, :, 4:], earlier_changed[:, :, 4:])  # only the frames before chunk 1
        torch.testing.assert_close(moved.velocity(1, noisy, sigma), reference, rtol=0, atol=1e-6)
        written = score.clip(earlier_changed, item, config, CPU, memory_seed=0)
        written.write_chunk(0, history[:, :, :4])
        torch.testing.assert_close(written.velocity(1, noisy, sigma), reference, rtol=0, atol=1e-6)
