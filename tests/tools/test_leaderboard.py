"""tools/leaderboard.py end to end on the tiny eval world: its table, intervals and plots,
a rerun that resumes and keeps the calibration, calibration on the evaluated split or on final refused."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.eval_world import REPO_ROOT, write_eval_world


TOOL = REPO_ROOT / "tools" / "leaderboard.py"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("leaderboard_world"))


# ---------------------------------------------------------------------------------------------------------------
# End to end: one leaderboard run on the tiny world
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def leaderboard_run(world, tmp_path_factory) -> dict:
    root = world["root"]
    out = tmp_path_factory.mktemp("leaderboard_out")
    argv = ["--teacher", str(root / "teacher"), "--vae", str(root / "vae"), "--samples_dir", str(root / "samples"),
            "--encoded", str(root / "encoded"), "--split", "holdout25", "--num_latents", "8",
            "--ckpt", str(world["ckpt"]), "--lpips_random_backbone", "--output_root", str(out), "--no_progress",
            "--samplers", "1,2", "--caches", "reuse_hidden,teacache", "--teacache_full_steps", "2",
            "--predictor_plans", "F-P-P-P", "--plans", "F-R-R-R|F-R-R-F,F-R-R-P", "--seeds", "2",
            "--resamples", "200", "--run_name", "lb", "--num_side_by_side", "1", "--warmup_chunks", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, str(TOOL), *argv], capture_output=True, text=True, env=env,
                            cwd=REPO_ROOT, timeout=900)
    return {"status": result.returncode, "stdout": result.stdout, "stderr": result.stderr, "dir": out / "lb",
            "argv": argv, "env": env}


def test_leaderboard_writes_its_table_intervals_and_plots(leaderboard_run):
    assert leaderboard_run["status"] == 0, leaderboard_run["stderr"][-3000:]
    run_dir = leaderboard_run["dir"]
    for name in ("leaderboard.md", "leaderboard.csv", "leaderboard.json", "pareto_flops_run.png",
                 "pareto_flops_real.png", "pareto_measured_dit.png", "calibration.json"):
        assert (run_dir / name).is_file(), name
    assert len(list((run_dir / "front" / "side_by_side").glob("*.mp4"))) == 1
    assert len(list((run_dir / "videos").glob("*.json"))) == 4  # 2 videos x 2 seeds
    board = json.loads((run_dir / "leaderboard.json").read_text())
    rows = {row["key"]: row for row in board["rows"]}
    label = next(key for key in rows if key.startswith("predictor_") and key.endswith("_fppp")).split("_fppp")[0]
    assert set(rows) == {"reference", "sampler_1step_frrr", "sampler_2step_ffrr", "sampler_2step_frfr",
                         "sampler_2step_frrf", "reuse_hidden_fhhh", "reuse_hidden_ffhh", "reuse_hidden_fhfh",
                         "reuse_hidden_fhhf", "teacache_full2", "plan_frrr+frrf", f"{label}_fppp", f"{label}_frrp"}
    assert board["num_videos"] == 2 and board["num_units"] == 4
    # the untrained Predictor is hidden reuse: same PSNR at F-P-P-P as F-H-H-H, cost a Predictor step more
    predictor, hidden = rows[f"{label}_fppp"], rows["reuse_hidden_fhhh"]
    assert predictor["psnr_vs_reference"]["value"] == pytest.approx(hidden["psnr_vs_reference"]["value"], abs=1e-9)
    assert predictor["speedup"]["flops_run"] < hidden["speedup"]["flops_run"]
    assert rows["sampler_1step_frrr"]["figures"]["full_steps_per_chunk"] == 1.0
    assert rows["plan_frrr+frrf"]["figures"]["full_steps_per_chunk"] == 1.0  # one scheduled chunk: F-R-R-R
    for key, row in rows.items():
        if key != "reference":
            interval = row["psnr_vs_reference"]
            assert interval["low"] <= interval["value"] <= interval["high"], key
    margin = predictor["margin_over_front"]["flops_real"]
    assert margin["low"] <= margin["value"] <= margin["high"] and margin["front"]
    with open(run_dir / "leaderboard.csv") as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)
    text = (run_dir / "leaderboard.md").read_text()
    assert "Predictors against the front" in text and "1-step sampler σ{1}" in text
    assert "over the samplers/caches front" in leaderboard_run["stdout"]


def test_leaderboard_rerun_resumes_and_keeps_the_calibration(leaderboard_run):
    assert leaderboard_run["status"] == 0
    before = (leaderboard_run["dir"] / "calibration.json").read_bytes()
    result = subprocess.run([sys.executable, str(TOOL), *leaderboard_run["argv"]], capture_output=True, text=True,
                            env=leaderboard_run["env"], cwd=REPO_ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "0 units computed, 4 already finished" in result.stdout
    assert (leaderboard_run["dir"] / "calibration.json").read_bytes() == before


def test_calibrating_on_the_evaluated_split_is_refused(world, tmp_path):
    root = world["root"]
    result = subprocess.run(
        [sys.executable, str(TOOL), "--teacher", str(root / "teacher"), "--vae", str(root / "vae"),
         "--samples_dir", str(root / "samples"), "--encoded", str(root / "encoded"), "--split", "train",
         "--output_root", str(tmp_path)], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 2 and "--calibration_split train is the evaluated --split" in result.stderr
    assert not any(tmp_path.iterdir())


def test_calibrating_on_the_final_split_is_refused(world, tmp_path, capsys):
    """Nothing is chosen on final: TeaCache's threshold is never calibrated on it."""
    sys.path.insert(0, str(TOOL.parent))
    import leaderboard

    root = world["root"]
    with pytest.raises(SystemExit) as exited:
        leaderboard.parse_args(leaderboard.build_parser(), [
            "--teacher", str(root / "teacher"), "--vae", str(root / "vae"), "--samples_dir", str(root / "samples"),
            "--encoded", str(root / "encoded"), "--split", "holdout25", "--calibration_split", "final",
            "--output_root", str(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--calibration_split final: nothing is chosen on the final split" in err
    assert not any(tmp_path.iterdir())
