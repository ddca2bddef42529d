"""tools/dev/compare_demo_baseline.py knows the CPU kind of its baseline: exact on the same kind, the stated
"cross_cpu" tier on another or an unknown one, where a changed computation still fails."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from predictor_training.runtime.cpu_threads import cpu_kind, same_cpu_kind


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "dev"))

import compare_demo_baseline as baseline_check  # noqa: E402


def demo_log(steps: int = 60, noise: float = 0.0, seed: int = 0, loss_scale: float = 1.0) -> list[dict]:
    """A train log shaped like the demo's: a falling loss, its terms, grad norm, LR and counters; `noise` is the
    relative per-step jitter another CPU kind's rounding grows into."""
    generator = random.Random(seed)
    records = []
    for step in range(1, steps + 1):
        jitter = 1 + noise * generator.uniform(-1, 1)
        velocity, hidden = 0.007 * (1 - step / 200) * jitter, 0.138 * (1 - step / 300) * jitter
        records.append({"step": step, "epoch": step // 40, "lr/fusion": 1e-4 * min(1, step / 10),
                        "velocity_mse": velocity, "hidden_mse": hidden,
                        "loss": loss_scale * (velocity + 0.1 * hidden), "grad_norm": 0.02 * jitter,
                        "time/step_s": generator.uniform(0.1, 0.2)})
    return records


def test_the_tier_follows_the_recorded_cpu_kind(tmp_path):
    here = cpu_kind()
    tier, why = baseline_check.choose_tier(tmp_path, here)
    assert tier == "cross_cpu" and "unknown CPU kind" in why  # no machine.json
    (tmp_path / baseline_check.MACHINE_NAME).write_text(json.dumps({**here, "cpu_model": "another box"}))
    assert baseline_check.choose_tier(tmp_path, here)[0] == "exact"  # the model name is for people only
    other = {**here, "cpu_capability": "AVX2" if here["cpu_capability"] != "AVX2" else "AVX512"}
    (tmp_path / baseline_check.MACHINE_NAME).write_text(json.dumps(other))
    tier, why = baseline_check.choose_tier(tmp_path, here)
    assert tier == "cross_cpu" and "tier cross_cpu" in why and other["cpu_capability"] in why
    assert not same_cpu_kind(here, {**here, "mkl_cbwr": "COMPATIBLE" if here["mkl_cbwr"] != "COMPATIBLE" else "AVX2"})


def test_same_kind_is_exact_to_the_bit():
    recorded = demo_log()
    rounded = [dict(record) for record in recorded]
    rounded[30]["loss"] = rounded[30]["loss"] * (1 + 1e-15)
    assert baseline_check.compare_logs(recorded, [dict(record) for record in recorded], "run") == []
    assert len(baseline_check.compare_logs(recorded, rounded, "run")) == 1


def test_another_kind_passes_rounding_drift_and_fails_a_changed_computation():
    recorded = demo_log()
    drifted = demo_log(noise=3e-3, seed=1)  # per-step jitter as on the AVX-512 machine (0.22 % over 20 steps)
    assert baseline_check.compare_logs_within(recorded, demo_log(noise=3e-3, seed=2), "run", "cross_cpu") == []
    assert len(baseline_check.compare_logs(recorded, drifted, "run")) > 100  # exact would call every step different
    changed = baseline_check.compare_logs_within(recorded, demo_log(noise=3e-3, seed=1, loss_scale=1.07), "run",
                                                 "cross_cpu")
    assert changed and all("mean loss" in line for line in changed)
    schedule = [dict(record) for record in drifted]
    schedule[5]["lr/fusion"] *= 1.000001  # the LR schedule is computed the same way everywhere: exact
    assert any("lr/fusion" in line for line in baseline_check.compare_logs_within(recorded, schedule, "run",
                                                                                  "cross_cpu"))


@pytest.mark.parametrize("now, same", [(30.0, True), (30.2, True), (30.4, False)])
def test_eval_metrics_within_the_tier(now, same):
    assert (baseline_check.compare_tree({"psnr": 30.0, "timings": {"x": 1}}, {"psnr": now, "timings": {"x": 9}},
                                        "aggregate", "cross_cpu") == []) is same
