"""The trajectory recorder (predictor_training/rollout/recorder.py): what it keeps of each chunk and step, and that
it refuses records out of order. What a recorded rollout holds is tested in tests/rollout/test_ar_rollout.py."""

from __future__ import annotations

import pytest
import torch

from predictor_training.rollout.policy import ChunkContext
from predictor_training.rollout.recorder import StepRecord, TrajectoryRecorder


def test_the_recorder_keeps_detached_copies_in_its_dtype():
    recorder = TrajectoryRecorder(dtype=torch.bfloat16)
    context = ChunkContext(indices=[0, 1], model_input=torch.randn(1, 3, 2, 1, 1, requires_grad=True),
                           prefeatures={1: torch.randn(1, 2, 4), 0: torch.randn(1, 2, 4)})
    recorder.on_context(0, 0, context)
    latent = torch.randn(1, 1, 4, 1, 1, requires_grad=True)
    recorder.on_step(0, 0, StepRecord(latent_in=latent, timestep=torch.zeros(4, dtype=torch.float64),
                                      velocity=2 * latent, final_hidden=None, latent_out=3 * latent))
    recorder.on_chunk_end(0, latent)
    chunk = recorder.chunks[0]
    assert chunk.ctx_indices == [0, 1] and chunk.ctx_vec is None and list(chunk.prefeatures) == [0, 1]
    assert chunk.ctx_input.dtype == torch.bfloat16 and not chunk.ctx_input.requires_grad
    step = chunk.steps[0]
    assert step.velocity.dtype == torch.bfloat16 and not step.velocity.requires_grad and step.final_hidden is None
    assert step.timestep.dtype == torch.bfloat16  # every floating tensor takes the recorder's dtype
    assert torch.equal(chunk.final_latent, latent.detach().bfloat16())
    latent.data.zero_()
    assert bool((chunk.final_latent != 0).any())  # a copy, not a view


def test_the_recorder_refuses_records_out_of_order():
    recorder = TrajectoryRecorder()
    with pytest.raises(RuntimeError, match="recorder got chunk 1 after 0 chunks"):
        recorder.on_context(1, 4, ChunkContext(indices=[]))
    recorder.on_context(0, 0, ChunkContext(indices=[]))
    step = StepRecord(*(torch.zeros(1) for _ in range(5)))
    with pytest.raises(RuntimeError, match="recorder got step 1 of chunk 0 out of order"):
        recorder.on_step(0, 1, step)
