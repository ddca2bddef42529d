"""The dmd2 memory rehearsal (tools/estimate_memory.py --recipe dmd2: fvtools/train_dmd2.py's own step on fake
tensors) on the tiny Teacher: against the same code on real CPU tensors, and the tool for each generator and real
score the recipe offers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from predictor_training.teacher import WorldPlayTransformer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import estimate_memory

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY = ["--config", "tiny", "--text_tokens", "8", "--latent_grid", "2x3", "--source_blocks", "0,1"]


@pytest.mark.parametrize("generator,real_score", [("predictor", "lora"), ("student", "model")])
def test_dmd2_fake_run_matches_the_real_cpu_run(generator, real_score):
    """One DistributionMatchingStep with both roles due on a monitor step (2 chunks) and the loop's clip + AdamW +
    EMA, on fake tensors against the same code on real CPU tensors, both tracked: every phase's peak within 1 %, the
    peak in the same phase and the same part of the step, both roles' gradients and AdamW state present."""
    args = estimate_memory.parse_args(["--recipe", "dmd2", *TINY, "--chunks", "2", "--world_size", "1",
                                       "--generator", generator, "--real_score", real_score])
    fake = estimate_memory.rehearse_dmd2(args)
    real = estimate_memory.rehearse_dmd2(args, fake=False)
    assert set(fake.phase_peaks) == set(real.phase_peaks) == {"setup", "forward", "backward", "optimizer"}
    for phase, value in real.phase_peaks.items():
        assert abs(fake.phase_peaks[phase] - value) <= 0.01 * value, (phase, fake.phase_peaks, real.phase_peaks)
    assert fake.peak_phase == real.peak_phase
    assert fake.notes["peak_in"] == real.notes["peak_in"]
    after, real_after = fake.notes["live_after_step"], real.notes["live_after_step"]
    assert after["gradients"] > 0 and after["optimizer_state"] > 0
    for category in ("parameters", "gradients", "optimizer_state"):  # (activations: the CPU kernels' scalars)
        assert after[category] == real_after[category], (category, after, real_after)


# Each generator and each real score at least once (predictor-lora and student-model run in the test above).
@pytest.mark.parametrize("extra", [
    ["--generator", "predictor", "--real_score", "model"],
    ["--generator", "predictor", "--real_score", "teacher", "--replace_steps", "1,2"],
    ["--generator", "student", "--real_score", "lora"],
], ids=lambda extra: "-".join(extra[1::2]))
def test_tool_runs_dmd2_at_tiny_size(extra, capsys):
    """The tool's --recipe dmd2 (2 chunks, DDP buckets for the Predictor
    over the default 8 ranks): one report with the recipe's roles named, where the peak is, and a second BF16
    Teacher-sized model among the parameters exactly when the real score is a model folder."""
    argv = ["--recipe", "dmd2", *TINY, "--chunks", "2", "--json", *extra]
    assert estimate_memory.main(argv) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(reports) == 1
    report = reports[0]
    generator, real_score = extra[1], extra[3]
    assert report["name"].startswith(f"dmd2 {'Predictor' if generator == 'predictor' else 'LoRA rank 64 student'}")
    assert {"forward", "backward", "optimizer"} <= set(report["phase_peaks_gib"])
    assert report["peak_in"]
    assert report["by_category_gib"]["parameters"] > 0
    assert report["live_after_step"]["optimizer_state"] > 0
    assert (report["live_after_step"]["ddp_buckets"] > 0) == (generator == "predictor")
    if "--replace_steps" in extra:
        assert "F-P-P-F" in report["name"]
    teacher = sum(param.numel() for param in WorldPlayTransformer.from_preset("tiny").parameters()) * 2  # BF16
    assert (report["live_after_step"]["parameters"] >= 2 * teacher) == (real_score == "model")


def test_dmd2_flags_are_checked():
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "dmd2", "--generator", "unknown"])
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "dmd2", "--real_score", "folder"])
