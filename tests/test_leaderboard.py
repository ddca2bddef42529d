"""The leaderboard (tools/leaderboard.py, predictor_training/eval/{leaderboard,front,caches}.py): step plans, the
training-free caches' formulas on constructed inputs, the k-step samplers, TeaCache's calibration, the bootstrap on a
known distribution, the front on a hand-made table, and one end-to-end run on the tiny eval world."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from predictor_training.eval.caches import (
    AdaptiveSkip,
    TaylorForecast,
    calibrate_threshold,
    fit_rescale,
    taylor_forecast,
)
from predictor_training.eval.front import (
    FrontRow,
    Units,
    front_at,
    margin_over_front,
    mse_to_psnr,
    paired_difference,
    pareto_rows,
    psnr_to_mse,
)
from predictor_training.eval.leaderboard import (
    LeaderboardRows,
    RowSpec,
    build_rows,
    calibrate_adaptive,
    full_steps_per_chunk,
    real_config_flops,
    sampler_plans,
)
from predictor_training.eval.methods import DoneStep, PlannedMethod
from predictor_training.eval.run import EvalSettings, build_runtime, open_dataset
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs, StepOutput
from predictor_training.rollout.schedule import Schedule, StepPlan
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.flops import (
    REAL_LATENT_GRID,
    REAL_TEXT_TOKENS,
    TeacherShape,
    teacher_chunk_step_flops,
)
from predictor_training.teacher.source import TeacherSource
from tests.eval_world import CLI_LATENTS, LONG_LATENTS, REPO_ROOT, write_eval_world

TOOL = REPO_ROOT / "tools" / "leaderboard.py"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("leaderboard_world"))


def _teacher(world) -> WorldPlayTransformer:
    return WorldPlayTransformer.from_pretrained(str(world["root"] / "teacher")).eval().requires_grad_(False)


def _settings(world, split: str = "holdout50") -> EvalSettings:
    root = world["root"]
    num_latents = LONG_LATENTS if split == "holdout50" else CLI_LATENTS
    return EvalSettings(
        teacher_source=TeacherSource(root / "teacher", None, "--teacher", None), vae=root / "vae",
        sample_table=root / "samples" / f"{split}.jsonl", split=split, case_source="encoded",
        case_root=root / "encoded", num_latents=num_latents, checkpoints=[], schedule=Schedule((1, 2, 3)),
        dtype=torch.float32, vae_dtype=torch.float32, output_root=root / "unused")


# ---------------------------------------------------------------------------------------------------------------
# 1. Step plans and rows
# ---------------------------------------------------------------------------------------------------------------
def test_step_plan_letters_mixtures_and_errors():
    plan = StepPlan.parse("F-R-R-R|F-R-R-F")
    assert [plan.letter(chunk, 3) for chunk in range(6)] == ["F", "R", "F", "R", "F", "R"]  # chunk 0 Full
    assert plan.letter(1, 1) == "R" and plan.tag == "frrr+frrf" and plan.full_steps() == 1.5
    assert StepPlan.parse("FRRP", chunk0_full=False).letter(0, 3) == "P"
    assert StepPlan.from_schedule(Schedule((1, 2)), "H").text == "F-H-H-F"
    for bad in ("R-F-F-F", "F-X-F-F", "F-R-R", "F-R-R-R|F-R"):
        with pytest.raises(ValueError):
            StepPlan.parse(bad)


def test_samplers_are_every_step_subset_that_keeps_step_zero():
    plans = sampler_plans(4, (1, 2, 3))
    assert [plan for _, plan in plans] == ["F-R-R-R", "F-F-R-R", "F-R-F-R", "F-R-R-F", "F-F-F-R", "F-F-R-F",
                                           "F-R-F-F"]
    rows = build_rows(num_steps=4, shift=5.0, samplers=(2,), caches=("taylor", "teacache"), teacache_full_steps=(2,),
                      mixtures=("F-R-R-R|F-R-R-F", "F-R-R-P"), predictor_plans={"ck": ["F-P-P-P", "F-R-R-P"]},
                      context_modes=("exact", "incremental"))
    keys = [row.key for row in rows]
    assert keys == ["reference", "sampler_2step_ffrr", "sampler_2step_frfr", "sampler_2step_frrf", "taylor_fftt",
                    "taylor_ftft", "taylor_fttf", "teacache_full2", "plan_frrr+frrf", "predictor_ck_fppp",
                    "predictor_ck_fppp@incremental", "predictor_ck_frrp", "predictor_ck_frrp@incremental",
                    "reference@incremental"]
    by_key = {row.key: row for row in rows}
    assert by_key["sampler_2step_frrf"].display == "2-step sampler σ{1, 0.625}"
    assert by_key["sampler_2step_frfr"].display == "2-step sampler σ{1, 0.8333}"
    assert not by_key["predictor_ck_frrp"].baseline and by_key["plan_frrr+frrf"].baseline


def test_two_step_sampler_on_the_grid_equals_the_two_step_euler_solver(world):
    """Velocity reuse at F-R-F-R is the 2-step Euler sampler: at shift 5 the 2-step grid is sigma {1, 0.8333}, the
    4-step grid's steps 0 and 2."""
    teacher = _teacher(world)
    settings = _settings(world)
    dataset = open_dataset(settings)
    method = PlannedMethod("frfr", StepPlan.parse("F-R-F-R", chunk0_full=False), {"R": _velocity_reuse()}, "frfr")
    runtime = build_runtime(settings, teacher, [method], dataset, torch.device("cpu"), decoder=False)
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    text_kv, _ = runtime.text_kv(case)
    planned = runtime.rollout(method, text_kv, item, case, Stopwatch(torch.device("cpu"))).latents
    inputs = RolloutInputs.from_seed(item["seed"], case["image_cond"], item["viewmats"], item["Ks"], item["action"])
    two_step = ARRollout(teacher, text_kv, inputs, RolloutConfig(num_steps=2)).run()
    assert torch.allclose(planned, two_step, atol=1e-5, rtol=1e-5)
    four_step = ARRollout(teacher, text_kv, inputs, RolloutConfig()).run()
    assert not torch.allclose(planned, four_step, atol=1e-3)


def _velocity_reuse():
    from predictor_training.eval.methods import VelocityReuse

    return VelocityReuse()


# ---------------------------------------------------------------------------------------------------------------
# 2. The caches' formulas on constructed inputs
# ---------------------------------------------------------------------------------------------------------------
def _done(step: int, sigma: float, hidden: torch.Tensor, full: bool = True) -> DoneStep:
    return DoneStep(step, sigma, StepOutput(velocity=hidden.new_zeros(1), final_hidden=hidden), full)


def test_taylor_forecast_of_a_linear_trajectory_is_exact():
    generator = torch.Generator().manual_seed(0)
    base, slope = torch.randn(1, 6, 8, generator=generator), torch.randn(1, 6, 8, generator=generator)
    hidden = lambda sigma: base + sigma * slope  # noqa: E731
    forecast = taylor_forecast(_done(0, 1.0, hidden(1.0)), _done(1, 0.9375, hidden(0.9375)), 0.625)
    assert torch.allclose(forecast, hidden(0.625), atol=1e-6)
    assert not torch.allclose(forecast, hidden(0.9375), atol=1e-3)  # not a reuse


def test_taylor_with_one_full_step_takes_the_slope_of_the_previous_chunk(world):
    """F-T-T-T: h_k = h_0 + (h'_k - h'_0) of the previous chunk; and the velocity is the final layer of it."""
    teacher = _teacher(world)
    generator = torch.Generator().manual_seed(1)
    tokens, hidden_size = 4 * 6, teacher.config.hidden_size
    previous = [StepOutput(torch.zeros(1), torch.randn(1, tokens, hidden_size, generator=generator)) for _ in range(4)]
    h0 = torch.randn(1, tokens, hidden_size, generator=generator)

    class Call:
        chunk_index, step_index = 2, 3
        timestep = torch.full((4,), 625.0)
        action = torch.zeros(1, 4)
        latent = torch.zeros(1, teacher.config.in_channels, 4, 2, 3)
        previous_chunk = previous

    output = TaylorForecast(teacher).fill(Call(), [_done(0, 1.0, h0)])
    expected = h0 + previous[3].final_hidden - previous[0].final_hidden
    assert torch.allclose(output.final_hidden, expected, atol=1e-6)
    assert output.velocity.shape == (1, teacher.config.in_channels, 4, 2, 3)


def test_calibration_finds_the_threshold_of_a_monotone_count():
    count = lambda threshold: 4.0 - 3.0 * min(threshold / 0.3, 1.0)  # noqa: E731 (4 Full steps at 0, 1 at >= 0.3)
    threshold, reached = calibrate_threshold(count, 2.5)
    assert abs(reached - 2.5) < 1e-3 and abs(threshold - 0.15) < 1e-3
    assert fit_rescale([(0.1, 0.2), (0.2, 0.4), (0.3, 0.6)]) == pytest.approx((2.0, 0.0), abs=1e-9)


def test_adaptive_rule_accumulates_until_the_threshold_and_resets_when_it_computes():
    """Relative L1 changes of 0.3 per step and a threshold of 0.5: skip (0.3), compute (0.6, reset), skip (0.3);
    a skipped step adds the residual of the last computed step to its own embedded input."""

    class Teacher:
        def modulated_input(self, model_input, timestep, action):
            return model_input, model_input, None

        def final_projection(self, hidden, vec, tokens):
            return hidden

        def unpatchify(self, tokens, frames, height, width):
            return tokens

    class Call:
        def __init__(self, step, value):
            self.step_index, self.chunk_index = step, 1
            self.model_input = torch.full((1, 4), value)
            self.latent = torch.zeros(1, 1, 4, 1, 1)
            self.timestep, self.action, self.previous = None, None, None
            self.run_teacher = lambda: StepOutput(velocity=self.model_input * 0, final_hidden=self.model_input + 10)

    rule = AdaptiveSkip(Teacher(), threshold=0.5)
    values = [1.0, 1.3, 1.69, 2.197]  # each 30 % above the one before
    kinds, outputs = [], []
    for step, value in enumerate(values):
        output, kind = rule.step(Call(step, value), False, Stopwatch("cpu"), torch.no_grad)
        kinds.append(kind)
        outputs.append(output)
    assert kinds == ["full", "cache_residual", "full", "cache_residual"]
    assert torch.allclose(outputs[1].final_hidden, torch.full((1, 4), 1.3 + 10.0))  # embedded + cached residual 10
    assert rule.accumulated == pytest.approx(0.3)


def test_adaptive_skipping_hits_its_full_step_target(world):
    """TeaCache calibrated to 2 Full steps per chunk on the train split's video (one scheduled chunk) runs 2 on it, 4 at threshold 0 (every step computed), and skips with a cached residual."""
    teacher = _teacher(world)
    settings = _settings(world, "train")
    dataset = open_dataset(settings)
    runtime = build_runtime(settings, teacher, [], dataset, torch.device("cpu"), decoder=False)
    rows = build_rows(num_steps=4, shift=5.0, samplers=(), caches=("teacache",), teacache_full_steps=(2.0,),
                      mixtures=(), predictor_plans={})
    calibrated = calibrate_adaptive(rows, runtime, [dataset[0]], log=lambda *_: None)
    spec = calibrated[1]
    assert spec.adaptive["threshold"] > 0 and spec.adaptive["calibration_full_steps"] == 2.0
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    text_kv, _ = runtime.text_kv(case)
    method = LeaderboardRows(calibrated).build(teacher, {})[1]
    stopwatch = Stopwatch(torch.device("cpu"))
    kinds = runtime.rollout(method, text_kv, item, case, stopwatch).step_kinds
    assert full_steps_per_chunk(kinds) == pytest.approx(spec.adaptive["calibration_full_steps"])
    assert "cache_residual" in kinds.values() and stopwatch.summary()["cache_step"]["count"] >= 1
    every = AdaptiveSkip(teacher, 0.0)
    always = PlannedMethod("all", StepPlan.parse("F-A-A-A"), {}, "all", adaptive=every)
    assert full_steps_per_chunk(runtime.rollout(always, text_kv, item, case, Stopwatch("cpu")).step_kinds) == 4.0


# ---------------------------------------------------------------------------------------------------------------
# 3. Statistics: the bootstrap on a known distribution, the front on a hand-made table
# ---------------------------------------------------------------------------------------------------------------
def test_paired_bootstrap_recovers_a_known_mean_difference():
    rng = np.random.default_rng(0)
    videos, seeds, mu, sigma = 200, 2, 0.4, 1.0
    per_video = rng.normal(mu, sigma, videos)
    base = rng.normal(20, 3, videos * seeds)  # shared per-unit level: pairing removes it
    row = base + np.repeat(per_video, seeds)
    units = Units(np.repeat(np.arange(videos), seeds))
    weights = units.weights(2000, seed=1)
    estimate = paired_difference(FrontRow("a", 0, row), FrontRow("b", 0, base), weights)
    half_width = 1.96 * sigma / math.sqrt(videos)
    assert estimate.value == pytest.approx(per_video.mean(), abs=1e-9)
    assert estimate.low < mu < estimate.high and estimate.excludes_zero
    assert (estimate.high - estimate.low) == pytest.approx(2 * half_width, rel=0.15)
    # the same data with no difference: the interval contains 0
    assert not paired_difference(FrontRow("a", 0, base), FrontRow("b", 0, base + 0.0), weights).excludes_zero


def test_front_mixes_in_mse_and_margins_are_signed():
    units = Units(np.arange(2))
    weights = units.weights(200)
    cheap = FrontRow("cheap", 0.5, np.array([20.0, 20.0]))
    dear = FrontRow("dear", 1.0, np.array([40.0, 40.0]))
    dominated = FrontRow("dominated", 0.9, np.array([19.0, 19.0]))
    front, names = front_at(0.75, [cheap, dear, dominated], weights)
    expected = mse_to_psnr(0.5 * psnr_to_mse(20.0) + 0.5 * psnr_to_mse(40.0))  # 22.97 dB, not the dB mean 30
    assert front[0] == pytest.approx(expected) and names == ["cheap", "dear", "0.500"]
    # at cost 0.6, 80 % of the chunks run the cheap row: 0.8 * 0.5 + 0.2 * 1.0 = 0.6
    mostly_cheap = mse_to_psnr(0.8 * psnr_to_mse(20.0) + 0.2 * psnr_to_mse(40.0))
    assert front_at(0.6, [cheap, dear], weights)[0][0] == pytest.approx(mostly_cheap)
    assert front_at(0.4, [cheap, dear], weights)[0][0] == -np.inf
    above = FrontRow("P", 0.75, np.array([expected + 1.0, expected + 1.0]))
    margin, where = margin_over_front(above, [cheap, dear, dominated], weights)
    assert margin.value == pytest.approx(1.0) and "cheap" in where
    below = FrontRow("P", 0.75, np.array([21.0, 21.0]))
    assert margin_over_front(below, [cheap, dear], weights)[0].value < 0
    faster = margin_over_front(FrontRow("P", 0.4, np.array([21.0, 21.0])), [cheap, dear], weights)
    assert math.isnan(faster[0].value) and faster[1].startswith("none")
    assert pareto_rows([0.5, 1.0, 0.9, 0.75], [20.0, 40.0, 19.0, 30.0]) == [True, True, False, True]


def test_real_config_flops_count_the_recorded_steps():
    """F-R-R-R at the real config = the reference minus three Full chunk steps in every scheduled chunk."""
    contexts = [0, 4, 8, 12, 16, 20, 20, 20]
    result = {"context_frames_per_chunk": contexts, "methods": {
        "reference": {"step_kinds": ["FFFF"] * 8}, "frrr": {"step_kinds": ["FFFF"] + ["FRRR"] * 7}}}
    shape = TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
    tokens = REAL_LATENT_GRID[0] * REAL_LATENT_GRID[1]
    saved = sum(3 * teacher_chunk_step_flops(shape, tokens, REAL_TEXT_TOKENS, n) for n in contexts[1:])
    assert real_config_flops(result, "frrr", None) == real_config_flops(result, "reference", None) - saved
    bound = real_config_flops(result, "reference", None) / real_config_flops(result, "frrr", None)
    assert 1.6 < bound < 1.75  # the context prefill keeps one-Full-step plans under 2x at real size


# ---------------------------------------------------------------------------------------------------------------
# 4. End to end: one leaderboard run on the tiny world
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


def test_row_spec_is_plain_data():
    spec = RowSpec("k", "sampler", "F-R-R-R", "d", "p")
    assert LeaderboardRows([spec]).record() == [{"key": "k", "family": "sampler", "plan": "F-R-R-R", "display": "d",
                                                 "panel": "p", "checkpoint": None, "context_mode": "exact",
                                                 "adaptive": None}]


def test_short_labels_name_the_experiment_and_step_and_only_disambiguate_repeats():
    from pathlib import Path

    from predictor_training.eval.leaderboard import short_labels
    from predictor_training.eval.methods import PredictorCheckpoint

    def ckpt(experiment, step, blocks):
        return PredictorCheckpoint(Path("x"), "run", step, {"variant": "v4", "source_blocks": blocks}, {"variant": "v4"},
                                   {"experiment": experiment})

    checkpoints = [ckpt("predictor_v4_prefeature_demo", 240, [1, 10]), ckpt("predictor_v4_rollout_frrp_demo", 480,
                   [1, 10]), ckpt("predictor_v4_rollout_frrp_demo", 480, [10, 11]), ckpt("x", 5, [0, 1]),
                   ckpt("x", 5, [0, 1])]
    assert short_labels(checkpoints) == ["v4_prefeature_s240", "v4_rollout_frrp_s480_b1-10",
                                         "v4_rollout_frrp_s480_b10-11", "x_s5_b0-1_1", "x_s5_b0-1_2"]


def test_a_training_state_of_several_roles_gives_its_predictor(world, tmp_path):
    """An adversarial run's training_latest.pt holds the predictor and the discriminator: the eval and the
    leaderboard read its "predictor" role (that role's weights, not an error asking which)."""
    from predictor_training.eval.run import load_predictor, read_predictor_checkpoint
    from predictor_training.predictor.model import build_predictor
    from predictor_training.runtime.checkpoint import RunState, read_inference_config, save_training_state
    from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer
    from predictor_training.runtime.roles import Role

    teacher = _teacher(world)
    torch.manual_seed(7)
    predictor = build_predictor(teacher, "v4", read_predictor_checkpoint(world["ckpt"]).meta["source_blocks"])
    discriminator = torch.nn.Linear(2, 1)
    roles = [Role(name, module, optimizer, WarmupCosineSchedule(optimizer, warmup_steps=1, max_steps=4), module=module)
             for name, module in (("discriminator", discriminator), ("predictor", predictor))
             for optimizer in [build_optimizer({"all": [p for p in module.parameters() if p.requires_grad]},
                                               {"all": 1e-3}, betas=(0.9, 0.95), weight_decay=0.0)]]
    path = tmp_path / "training_latest.pt"
    save_training_state(path, roles=roles, run_state=RunState(global_step=3), config=read_inference_config(world["ckpt"]),
                        meta={"variant": "v4", "source_blocks": list(predictor.source_blocks), "precision": "fp32"})
    loaded = load_predictor(teacher, read_predictor_checkpoint(path))
    expected = predictor.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in loaded.state_dict().items())


def test_the_baseline_is_a_row_or_refused_before_the_run():
    """--baseline names a row or the command stops before evaluating anything; by default the 1-step sampler, and
    without it (e.g. --samplers 3) the first baseline row after the reference."""
    from predictor_training.eval.leaderboard import choose_baseline

    def rows(samplers):
        return build_rows(num_steps=4, shift=5.0, samplers=samplers, caches=[], teacache_full_steps=[], mixtures=[],
                          predictor_plans={})

    assert choose_baseline(rows([1, 2]), None) == "sampler_1step_frrr"
    assert choose_baseline(rows([3]), None) == "sampler_3step_fffr"
    assert choose_baseline(rows([1, 3]), "sampler_3step_frff") == "sampler_3step_frff"
    with pytest.raises(ValueError, match="--baseline sampler_1step_frrr: not a row"):
        choose_baseline(rows([3]), "sampler_1step_frrr")


def test_a_finished_run_is_told_its_leaderboard_command(tmp_path):
    """The recipes' closing line: the demo form for a dataset whose sample tables lie beside a demo_config.json, the
    real form (the user's $VAE) otherwise; the run's own training state, its trained plan, holdout25 first."""
    from predictor_training.eval.leaderboard import leaderboard_command
    demo, real = tmp_path / "assets", tmp_path / "data"
    (demo / "samples").mkdir(parents=True)
    (demo / "demo_config.json").write_text("{}")
    for root, tables in ((tmp_path / "demo_ds", demo / "samples"), (tmp_path / "real_ds", real / "samples")):
        root.mkdir()
        (root / "dataset_config.json").write_text(json.dumps({
            "splits": ["holdout50", "holdout25", "train"], "sample_tables": [str(tables / "train.jsonl")]}))
    line = leaderboard_command(tmp_path / "run", dataset_root=tmp_path / "demo_ds", world_size=1)
    assert line.startswith(f"python tools/leaderboard.py --demo {demo} --lpips_random_backbone --split holdout25")
    assert line.endswith(f"--ckpt {tmp_path / 'run' / 'training_latest.pt'} --predictor_plans trained")
    line = leaderboard_command(tmp_path / "run", dataset_root=tmp_path / "real_ds", world_size=8)
    assert line.startswith(f"torchrun --nproc_per_node 8 tools/leaderboard.py --samples_dir {real / 'samples'} "
                           f"--dataset_root {tmp_path / 'real_ds'} --vae $VAE")
