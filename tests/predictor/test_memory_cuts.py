"""The memory cuts (predictor_training/predictor/memory_cuts.py): undone within the
context manager, restored after it, unknown names refused."""

from __future__ import annotations

import pytest


def test_undone_cuts_are_restored():
    from predictor_training.predictor.self_rollout import ChunkGraph
    from predictor_training.teacher import layers
    from predictor_training.teacher import double_stream_block
    from predictor_training.predictor.memory_cuts import cuts_undone
    before = (layers.RMSNorm.forward, double_stream_block.RELEASE_ATTENTION_INPUTS, ChunkGraph.release_context)
    with cuts_undone():
        assert double_stream_block.RELEASE_ATTENTION_INPUTS is False and layers.RMSNorm.forward is not before[0]
    assert (layers.RMSNorm.forward, double_stream_block.RELEASE_ATTENTION_INPUTS, ChunkGraph.release_context) == before
    with pytest.raises(ValueError, match="unknown cuts"):
        with cuts_undone(("no_such_cut",)):
            pass
