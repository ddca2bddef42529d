"""benchmarks/gpu_acceptance.py: the --tiny run (the same code at tiny size on the CPU) writes every section, and the
figures it reports are computed from what it measured.

One run (module fixture) with a memory-estimates file in `tools/estimate_memory.py --json`'s format (JSON lines);
the checks: the JSON's sections and fields, speedups = the reference's DiT seconds / the schedule's, the FLOP bounds
= the FLOP totals' ratio, the Full step's TFLOP/s = its FLOPs / its best time, the fraction of the matmul peak, the
BF16-vs-FP32 numerics (non-zero, small, finite), the markdown table; plus the refusal without CUDA, a budget too
small for anything but the models (every section skipped with a line), and bad estimate files.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import gpu_acceptance


SECTIONS = ("speed_calls", "rollouts", "memory", "numerics")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("acceptance")
    estimates = folder / "estimates.jsonl"
    estimates.write_text("\n".join(json.dumps(row) for row in [
        {"name": "v4 offline, blocks [1, 52], batch 16, 20 context frames", "peak_gib": 66.5, "peak_rounded_gib": 67.18},
        {"name": "disca offline, blocks [1, 52], batch 16", "peak_gib": 30.76},
        {"name": "rollout F-P-P-P, 8 chunks, context exact, blocks [1, 52], one trajectory", "peak_gib": 48.96},
    ]) + "\n")
    torch.set_num_threads(1)
    report = gpu_acceptance.main(["--tiny", "--out_dir", str(folder / "out"), "--memory_estimates", str(estimates),
                                  "--repeats", "2", "--budget_s", "3600"])
    return report, folder / "out"


@pytest.mark.slow
def test_tiny_run_writes_every_section_from_measured_times(tiny_run):
    report, out = tiny_run
    on_disk = json.loads((out / "gpu_acceptance.json").read_text())
    assert on_disk["mode"] == "tiny" and on_disk["skipped"] == []
    assert all(section in on_disk for section in SECTIONS)
    env = on_disk["environment"]
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__
    assert on_disk["speed_calls"]["sdpa_kernels"]  # the profiler saw the attention kernel

    # 1. Per call: measured times, FLOPs from teacher/flops.py, TFLOP/s = FLOPs / best time.
    calls = on_disk["speed_calls"]["calls"]
    assert sorted(calls) == ["cache_pass", "context_prefill", "full_step", "predictor_step"]
    for record in calls.values():
        assert len(record["times_s"]) == 2 and record["min_s"] == min(record["times_s"]) > 0
        assert record["tflops"] == pytest.approx(record["flops"] / record["min_s"] / 1e12)
    assert all(record["flops"] > 0 for record in calls.values())
    assert calls["cache_pass"]["flops"] == calls["full_step"]["flops"]  # the K/V pass is one chunk step
    peak = on_disk["matmul_peak"]
    assert peak["tflops"] == pytest.approx(2 * peak["n"] ** 3 / peak["seconds"] / 1e12)
    assert on_disk["full_step_fraction_of_peak"] == pytest.approx(calls["full_step"]["tflops"] / peak["tflops"])

    # 2. Rollouts: speedups are ratios of the measured DiT seconds; bounds are ratios of the FLOP totals.
    rollouts = on_disk["rollouts"]
    assert rollouts["chunks"] == 8
    reference = rollouts["rollouts"]["F-F-F-F exact"]
    assert reference["context_frames"][0] == 0 and max(reference["context_frames"]) > 0
    for name in ("F-P-P-P exact", "F-P-P-P incremental"):
        record, speedup = rollouts["rollouts"][name], rollouts["speedups"][name]
        assert record["dit_s"] > 0 and record["calls"]["predictor_step"]["count"] == 3 * (rollouts["chunks"] - 1)
        assert speedup["measured"] == pytest.approx(reference["dit_s"] / record["dit_s"])
        assert speedup["flop_bound"] == pytest.approx(reference["flops"]["total"] / record["flops"]["total"])
        assert speedup["fraction_of_bound"] == pytest.approx(speedup["measured"] / speedup["flop_bound"])
    # (at tiny size a Predictor step costs about a Full step: the bound is near 1; the cached context still saves)
    assert rollouts["speedups"]["F-P-P-P incremental"]["flop_bound"] > rollouts["speedups"]["F-P-P-P exact"][
        "flop_bound"]
    assert "context_cache" in rollouts["rollouts"]["F-P-P-P incremental"]["calls"]

    # 3. Memory: every recipe ran one step (finite loss and grad norm); no allocator on the CPU, the estimate is read.
    memory = on_disk["memory"]
    assert sorted(memory) == ["disca", "rollout", "v4"]
    for recipe, row in memory.items():
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
        assert row["max_allocated_gib"] is None and row["estimate_error"] is None
    assert memory["v4"]["batch_size"] == 16 and memory["v4"]["estimate_gib"] == 67.18  # the rounded peak
    assert memory["v4"]["teacher_not_in_recipe_gib"] > 0 and memory["rollout"]["teacher_not_in_recipe_gib"] == 0
    assert (memory["disca"]["estimate_gib"], memory["rollout"]["estimate_gib"]) == (30.76, 48.96)

    # 4. Numerics: BF16 differs from FP32 (it ran in BF16), a little; FP32 on this device is the golden vectors'.
    conformance = on_disk["numerics"]["conformance"]
    assert "ctx.layer0.k_vision" in conformance["bf16_vs_fp32"]
    velocities = [name for name in conformance["bf16_vs_fp32"] if name.endswith(".velocity")]
    assert velocities
    for name in velocities:
        record = conformance["bf16_vs_fp32"][name]
        assert record["finite"] and 0 < record["max_rel"] < 0.05  # BF16 rounding, not a broken input
    assert conformance["fp32_device_vs_golden_worst_abs"] < 1e-3
    chunks = on_disk["numerics"]["rollout_2chunks"]["chunks"]
    assert sorted(chunks) == ["chunk0", "chunk1"] and all(0 < chunk["max_rel"] < 0.5 for chunk in chunks.values())

    # 5. The markdown table.
    table = (out / "gpu_acceptance.md").read_text()
    for heading in ("## Per call", "## Rollouts (8 chunks)", "## Memory of one training step", "## Numerics"):
        assert heading in table
    assert f"| F-P-P-P exact | {rollouts['rollouts']['F-P-P-P exact']['dit_s']:.3f} |" in table
    assert report["elapsed_s"] == on_disk["elapsed_s"]


def test_refuses_without_cuda_unless_tiny(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_acceptance.parse_args([])
    error = capsys.readouterr().err
    assert "CUDA is not available" in error and "pass --tiny" in error
    assert gpu_acceptance.parse_args(["--tiny"]).tiny


def test_a_budget_too_small_skips_every_section_with_a_line(tmp_path, capsys):
    torch.set_num_threads(1)
    report = gpu_acceptance.main(["--tiny", "--out_dir", str(tmp_path), "--budget_s", "0.001"])
    skipped = [entry["section"] for entry in report["skipped"]]
    assert skipped == ["speed_calls", "memory v4", "memory disca", "memory rollout", "rollouts", "numerics"]
    printed = capsys.readouterr().out
    assert all(entry["line"] in printed for entry in report["skipped"])
    assert "skipped rollouts: planned" in (tmp_path / "gpu_acceptance.md").read_text()
    assert report["memory"] == {} and "rollouts" not in report


def test_memory_estimates_are_read_in_every_format_and_bad_files_refused(tmp_path):
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"name": "v4 offline, blocks [1, 52], batch 8", "peak_gib": 40.0}\n'
                     '{"name": "rollout F-P-P-P, 8 chunks", "peak_rounded_gib": 49.5, "peak_gib": 49.0}\n')
    read = gpu_acceptance.read_memory_estimates(lines)
    assert read["v4"] == {"gib": 40.0, "name": "v4 offline, blocks [1, 52], batch 8", "batch_size": 8}
    assert read["rollout"]["gib"] == 49.5 and "disca" not in read
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"disca": 30.0}))
    assert gpu_acceptance.read_memory_estimates(plain)["disca"]["gib"] == 30.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"name": "kd full", "peak_gib": 3.0}]))
    with pytest.raises(ValueError, match=r"--memory_estimates .*bad.json: report 'kd full' names no recipe"):
        gpu_acceptance.read_memory_estimates(bad)
    bad.write_text("not json {")
    with pytest.raises(ValueError, match="neither JSON nor JSON lines"):
        gpu_acceptance.read_memory_estimates(bad)


@pytest.mark.slow
def test_real_size_calls_run_on_fake_tensors_with_the_expected_shapes():
    """The per-call code at the real worldplay_480p_i2v size, nothing allocated (CPU, fake tensors)."""
    torch.set_num_threads(1)
    result = gpu_acceptance.main(["--shapes"])
    real = gpu_acceptance.REAL
    assert result["teacher_parameters"] > 8e9
    assert result["shapes"]["full_step"] == [1, 32, 4, real.height, real.width]
    assert result["shapes"]["predictor_step"] == [1, 32, 4, real.height, real.width]
    assert result["shapes"]["context_prefill"][-2:] == [real.context_frames * real.height * real.width, 128]
    assert result["shapes"]["cache_pass"][-2] == 4 * real.height * real.width
    assert result["context_frames"] == [0, 4, 8, 12, 16, 20, 20, 20]
    assert result["flop_bounds"]["F-P-P-P incremental"] == pytest.approx(3.39, abs=0.01)  # benchmarks/results/2026-12-01-context-modes-and-speed.md
    assert sum(result["plan_s"].values()) < 480  # the default budget holds the plan at 400 TFLOP/s


@pytest.mark.parametrize("script", ["train_predictor_v4", "train_predictor_disca", "train_predictor_v4_rollout"])
def test_the_memory_steps_take_the_values_the_recipes_parse_at_real_size(script):
    """The acceptance run builds each recipe from named values (benchmarks/ imports no entry script): they must be
    what the script parses at --preset real_size, or its memory table measures another configuration."""
    import importlib

    from predictor_training.recipes.rehearsal import recipe_flags

    flags = vars(recipe_flags(importlib.import_module(script), ["--dataset_root", "unused"]))
    stated = {**gpu_acceptance.REAL_SIZE_VALUES, "precision": gpu_acceptance.REAL_SIZE_PRECISION,
              "source_blocks": gpu_acceptance.REAL.source_blocks}
    if script == "train_predictor_v4_rollout":
        stated.update(replace_steps=gpu_acceptance.REAL_SIZE_REPLACE_STEPS, reuse_steps=(),
                      context_mode=gpu_acceptance.REAL_SIZE_CONTEXT_MODE)
    else:
        stated.update(batch_size=gpu_acceptance.REAL.offline_batch)
    for name in ("dataset_root", "val_split", "val_videos", "val_vae", "val_ground_truth"):  # no validation runs
        stated.pop(name)
    assert {name: flags[name] for name in stated} == stated
