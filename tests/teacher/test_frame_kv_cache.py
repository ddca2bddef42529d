"""The frame K/V cache (predictor_training/teacher/frame_kv_cache.py): its memory is what
the formula says, and the context modes' rules."""

from __future__ import annotations

import dataclasses

import pytest

from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig
from predictor_training.teacher.frame_kv_cache import CONTEXT_MODES, FrameKVCache, cache_bytes_per_frame
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


def test_cache_memory_matches_the_formula(teacher, text_kv):
    run = rollout(teacher, text_kv, "incremental", 12)
    run.run()
    config = teacher.config
    expected = cache_bytes_per_frame(config.mm_double_blocks_depth, config.hidden_size, HEIGHT * WIDTH, 4)
    assert run.frame_cache.bytes_per_frame() == expected
    assert run.frame_cache.total_bytes() == 8 * expected
    # real 480p config: 54 blocks, hidden 2048, 30 x 52 latent tokens per frame, bf16
    assert cache_bytes_per_frame(54, 2048, 30 * 52, 2) == 2 * 54 * 1560 * 2048 * 2


def test_mode_rules():
    assert CONTEXT_MODES == ("exact", "incremental", "last_step")
    with pytest.raises(ValueError, match="context mode must be one of"):
        RolloutConfig(context_mode="approximate")
    with pytest.raises(ValueError, match="prefeature_layers"):
        RolloutConfig(context_mode="incremental", prefeature_layers=(1,))
    with pytest.raises(KeyError, match="not in the K/V cache"):
        FrameKVCache(2, 6).gather([0])
    assert dataclasses.replace(RolloutConfig(), context_mode="last_step").context_mode == "last_step"
