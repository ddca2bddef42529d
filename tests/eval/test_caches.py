"""The training-free caches of the leaderboard (predictor_training/eval/caches.py): TaylorSeer's
forecast on constructed trajectories and with one Full step, TeaCache's calibration and its adaptive rule, and the
adaptive skipping's Full-step target on the tiny eval world."""

from __future__ import annotations

import pytest
import torch

from predictor_training.eval.caches import (
    AdaptiveSkip,
    TaylorForecast,
    calibrate_threshold,
    fit_rescale,
    taylor_forecast,
)
from predictor_training.eval.leaderboard import LeaderboardRows, build_rows, calibrate_adaptive, full_steps_per_chunk
from predictor_training.eval.methods import DoneStep, PlannedMethod
from predictor_training.eval.run import EvalSettings, build_runtime, open_dataset
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.ar_rollout import StepOutput
from predictor_training.rollout.schedule import Schedule, StepPlan
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import TeacherSource
from tests.helpers.eval_world import CLI_LATENTS, LONG_LATENTS, write_eval_world


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
# The caches' formulas on constructed inputs
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
