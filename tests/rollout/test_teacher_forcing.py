"""Teacher forcing (predictor_training/rollout/teacher_forcing.py): the trained chunks
agree on chunk 0 across ranks and are otherwise drawn uniformly."""

from __future__ import annotations

import pytest
import torch


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


def test_training_chunks_agree_on_chunk_zero_across_ranks():
    """Whether chunk 0 (no context prefill) is trained is the same on every rank, so FSDP ranks call the blocks in
    the same order; the other chunks differ by rank, and each chunk is equally likely overall."""
    from predictor_training.runtime.random_streams import ALL_RANKS, stream_generator
    from predictor_training.rollout.teacher_forcing import draw_training_chunks

    counts = torch.zeros(8)
    for step in range(400):
        draws = [draw_training_chunks(8, 2, stream_generator(0, step, rank), stream_generator(0, step, ALL_RANKS))
                 for rank in range(4)]
        assert len({0 in chunks for chunks in draws}) == 1
        assert all(len(chunks) == len(set(chunks)) == 2 and chunks == sorted(chunks) for chunks in draws)
        for chunks in draws:
            counts[chunks] += 1
    frequency = counts / counts.sum()
    assert torch.allclose(frequency, torch.full((8,), 1 / 8), atol=0.03), frequency
    assert draw_training_chunks(3, 5, stream_generator(1), stream_generator(2)) == [0, 1, 2]
