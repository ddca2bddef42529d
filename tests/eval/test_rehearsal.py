"""The eval's rollout under the memory rehearsal (predictor_training/eval/rehearsal.py; tools/estimate_memory.py
--recipe eval)."""

from __future__ import annotations

import pytest

from predictor_training.eval.rehearsal import rehearse_eval_rollout


@pytest.mark.parametrize("mode", ["exact", "incremental"])
def test_eval_fake_run_matches_the_real_cpu_run(mode):
    """tools/eval_predictor.py's rollout (EvalRuntime.rollout, F-P-P-P, inference only) of 3 chunks on the tiny
    Teacher: fake against real CPU tensors, same peak within 1 %, the memory selection's real context sizes."""
    settings = dict(chunks=3, grid=(2, 3), text_tokens=8, replace_steps=(1, 2, 3), context_mode=mode,
                    source_blocks=(0, 1))
    fake = rehearse_eval_rollout("tiny", **settings)
    real = rehearse_eval_rollout("tiny", **settings, fake=False)
    assert abs(real.peak - fake.peak) <= 0.01 * real.peak, (real.peak, fake.peak)
    assert fake.peak_phase == real.peak_phase == "forward"
    assert fake.notes["context_frames_per_chunk"] == real.notes["context_frames_per_chunk"] == [0, 4, 8]
    assert fake.by_category["gradients"] == fake.by_category["optimizer_state"] == 0
