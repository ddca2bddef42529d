"""tools/leaderboard.py: the plans each checkpoint runs at (its run's trained plan read back), its error path (a
user's mistake is one line, a bug keeps its traceback), and end to end on the tiny eval world (slow): its table,
intervals and plots, a rerun that resumes and keeps the calibration, calibration on the evaluated split or on final
refused."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from predictor_training.rollout.schedule import StepPlan
from tests.helpers.eval_world import REPO_ROOT, write_eval_world


TOOL = REPO_ROOT / "tools" / "leaderboard.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("leaderboard_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


leaderboard = _load_tool()


# ---------------------------------------------------------------------------------------------------------------
# The plans of each checkpoint
# ---------------------------------------------------------------------------------------------------------------
def _run_flags(*argv: str) -> dict:
    """The flags a rollout run records (train_config.json "flags", read back from JSON) for these arguments."""
    import train_predictor_v4_rollout as rollout
    from predictor_training.runtime.flags import parse_recipe_args
    from predictor_training.runtime.run_directory import plain_flags

    args = parse_recipe_args(rollout.build_parser(), ["--dataset_root", "unused", *argv], rollout.PRESETS)
    return json.loads(json.dumps(plain_flags(args)))


def test_a_runs_trained_plan_is_read_back_from_its_flags():
    """P at the run's --replace_steps, R at its --reuse_steps, F elsewhere: an F-R-R-P run (--preset frrp: reuse 1,2,
    replace 3) goes on the board at F-R-R-P; a run without the flags (the offline recipes train every step) at
    F-P-P-P."""
    assert StepPlan.from_flags(_run_flags("--preset", "frrp")).text == "F-R-R-P"
    assert StepPlan.from_flags(_run_flags("--replace_steps", "1,2")).text == "F-P-P-F"
    assert StepPlan.from_flags(_run_flags()).text == "F-P-P-P"
    assert StepPlan.from_flags({}).text == "F-P-P-P"
    assert StepPlan.from_flags({"replace_steps": "3", "reuse_steps": "1,2"}).text == "F-R-R-P"


def test_every_checkpoint_runs_at_its_trained_plan_and_every_predictor_plan():
    """--predictor_plans trained,F-P-P-P and --plans F-R-R-R|F-R-R-F,F-R-R-P: the F-R-R-P run's trained plan is
    F-R-R-P (listed once), an F-P-P-P run's is F-P-P-P (listed once); the mixture has no P and runs no Predictor."""
    args = argparse.Namespace(predictor_plans="trained,F-P-P-P", plans=["F-R-R-R|F-R-R-F", "F-R-R-P"])
    checkpoints = [SimpleNamespace(label="frrp_run", run_flags={"replace_steps": [3], "reuse_steps": [1, 2]}),
                   SimpleNamespace(label="fppp_run", run_flags={"replace_steps": [1, 2, 3], "reuse_steps": []})]
    assert leaderboard.predictor_plans(args, checkpoints) == {"frrp_run": ["F-R-R-P", "F-P-P-P"],
                                                              "fppp_run": ["F-P-P-P", "F-R-R-P"]}


def test_by_default_an_f_r_r_p_predictor_faces_the_training_free_rows_at_its_exact_schedule(tmp_path):
    """The tool's defaults: a checkpoint trained at F-R-R-P is on the board beside F-R-R-H (hidden reuse: what it
    computes untrained) and F-R-R-B (the block-residual cache, the first and the last block); every cache runs at
    every sampler plan (the block-residual cache among them), TeaCache at 1.1, 1.2, 1.3 and 2 Full steps per chunk
    calibrated on 8 videos, and the measured columns take the median of 3 interleaved rollouts."""
    argv = _argv(tmp_path, "--caches", leaderboard.build_parser().get_default("caches"))
    (tmp_path / "samples" / "train.jsonl").write_text("")
    args = leaderboard.parse_args(leaderboard.build_parser(), argv)
    assert args.counterparts == ["H", "B"] and args.block_residual_blocks == [0, -1]
    assert args.teacache_full_steps == [1.1, 1.2, 1.3, 2.0] and args.calibration_videos == 8
    assert args.timing_repeats == 3 and args.timing_statistic == "median"
    assert "block_residual" in args.caches
    frrp = SimpleNamespace(label="frrp_run", run_flags={"replace_steps": [3], "reuse_steps": [1, 2]})
    rows = leaderboard.build_rows(num_steps=4, shift=5.0, samplers=args.samplers, caches=args.caches,
                                  teacache_full_steps=args.teacache_full_steps, mixtures=args.plans,
                                  predictor_plans=leaderboard.predictor_plans(args, [frrp]),
                                  counterparts=args.counterparts, residual_blocks=args.block_residual_blocks)
    plans = {row.plan: row for row in rows if row.baseline}
    assert plans["F-R-R-H"].key == "reuse_hidden_frrh" and plans["F-R-R-B"].key == "block_residual_frrb"
    assert plans["F-R-R-B"].blocks == (0, -1) and "F-B-B-F" in plans and "predictor_frrp_run_frrp" in {
        row.key for row in rows}
    assert [row.key for row in rows if row.adaptive] == ["teacache_full1.1", "teacache_full1.2", "teacache_full1.3",
                                                          "teacache_full2"]
    with pytest.raises(SystemExit):
        leaderboard.parse_args(leaderboard.build_parser(), _argv(tmp_path, "--block_residual_blocks", "0,0"))


# ---------------------------------------------------------------------------------------------------------------
# The error path: a user's mistake is one line and exit code 2, a bug keeps its traceback
# ---------------------------------------------------------------------------------------------------------------
def _argv(tmp_path, *extra) -> list[str]:
    (tmp_path / "samples").mkdir(exist_ok=True)
    (tmp_path / "samples" / "holdout25.jsonl").write_text("")
    return ["--vae", str(tmp_path / "vae"), "--samples_dir", str(tmp_path / "samples"), "--encoded",
            str(tmp_path / "encoded"), "--split", "holdout25", "--caches", "", "--output_root", str(tmp_path / "out"),
            "--threads", "1", *extra]


def test_a_baseline_that_is_not_a_row_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PREDICTOR_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited:
        leaderboard.main(_argv(tmp_path, "--samplers", "3", "--baseline", "sampler_1step_frrr"))
    lines = [line for line in capsys.readouterr().err.splitlines() if "cpu threads" not in line]
    assert exited.value.code == 2 and len(lines) == 1
    assert lines[0].split(": error: ", 1)[1].startswith("--baseline sampler_1step_frrr: not a row"), lines


@pytest.mark.parametrize("bug", [ValueError("a bug in the rows"), KeyError("a bug in the rows")])
def test_a_bug_while_building_the_rows_keeps_its_traceback(bug, tmp_path, monkeypatch):
    monkeypatch.delenv("PREDICTOR_DEBUG", raising=False)

    def build_rows(**kwargs):
        raise bug

    monkeypatch.setattr(leaderboard, "build_rows", build_rows)
    with pytest.raises(type(bug)) as raised:
        leaderboard.main(_argv(tmp_path))
    assert raised.value is bug
    assert not (tmp_path / "out").exists()


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
                         "reuse_hidden_fhhf", "teacache_full2", "plan_frrr+frrf", "block_residual_fbbb",
                         "reuse_hidden_frrh", "block_residual_frrb", f"{label}_fppp", f"{label}_frrp"}
    assert board["num_videos"] == 2 and board["num_units"] == 4
    # the world's Teacher has 2 blocks: the block-residual cache at blocks 0,-1 runs both, so F-R-R-B is F-R-R-F
    frrb, frrf = rows["block_residual_frrb"], rows["sampler_2step_frrf"]
    assert frrb["blocks"] == [0, -1] and frrb["speedup"]["flops_run"] == pytest.approx(frrf["speedup"]["flops_run"])
    assert frrb["psnr_vs_reference"]["value"] == pytest.approx(frrf["psnr_vs_reference"]["value"], abs=1e-9)
    # measured columns: 3 timed rollouts per row and video, the bracket the per-video interquartile range
    video = json.loads(next((run_dir / "videos").glob("*.json")).read_text())
    assert len(video["methods"]["reference"]["timings"]["rollout_repeats_s"]) == 3
    spread = rows["sampler_1step_frrr"]["figures"]
    assert spread["speedup_measured_dit_min"] <= spread["speedup_measured_dit_q25"] <= spread[
        "speedup_measured_dit_q75"] <= spread["speedup_measured_dit_max"]
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
    assert "## TeaCache: the targets and what ran" in text and "interquartile range" in text
    assert "over the baselines' front" in leaderboard_run["stdout"]


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
