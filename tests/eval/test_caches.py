"""The training-free caches of the leaderboard (predictor_training/eval/caches.py): TaylorSeer's
forecast on constructed trajectories and with one Full step, TeaCache's calibration and its adaptive rule, and the
adaptive skipping's Full-step target on the tiny eval world."""

from __future__ import annotations

import pytest
import torch

from predictor_training.eval.caches import (
    AdaptiveSkip,
    PreviousChunkReuse,
    TaylorForecast,
    calibrate_threshold,
    fit_rescale,
    taylor_forecast,
)
from predictor_training.eval.adaptive_calibration import calibrate_adaptive, full_steps_per_chunk
from predictor_training.eval.leaderboard import LeaderboardRows, build_rows
from predictor_training.eval.methods import DoneStep, PlannedMethod
from predictor_training.eval.run import build_runtime, open_dataset
from predictor_training.eval.settings import EvalSettings
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.policy import StepOutput
from predictor_training.rollout.schedule import StepPlan
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import TeacherSource
from tests.helpers.eval_world import CLI_LATENTS, LONG_LATENTS, write_eval_world
from tests.helpers.scripted_chunks import SIGMAS, ScriptedTeacher, numbers, run_chunks


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
        case_root=root / "encoded", num_latents=num_latents, checkpoints=[], plan=StepPlan.from_steps((1, 2, 3)),
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


# ---------------------------------------------------------------------------------------------------------------
# Every cache row over three chunks of a scripted Teacher (tests/helpers/scripted_chunks.py: the Full step of
# chunk c, step k returns h = (c + 1) x (1, 3, 4, 8)[k] and v = -h; the final layer is v = 2 h + sigma)
# ---------------------------------------------------------------------------------------------------------------
def _row(plan: str, letter: str, filler, adaptive=None) -> PlannedMethod:
    return PlannedMethod(plan, StepPlan.parse(plan), {letter: filler} if filler else {}, plan, adaptive=adaptive)


def _velocities(hiddens: list[float]) -> list[float]:
    """The final layer's velocity of a forecast hidden at each step: v = 2 h + sigma."""
    return [2 * h + sigma for h, sigma in zip(hiddens, SIGMAS)]


def test_taylor_rows_forecast_from_the_chunks_last_two_full_steps():
    """F-F-T-T: the line through (1, h0) and (15/16, h1), slope (h1 - h0) / (15/16 - 1) = -16 (h1 - h0):
        step 2 (sigma 5/6):  h1 + (5/6 - 15/16) (-16) (h1 - h0) = h1 + 5/3 (h1 - h0)   -> (c + 1) (3 + 10/3)
        step 3 (sigma 5/8):  h1 + (5/8 - 15/16) (-16) (h1 - h0) = h1 + 5 (h1 - h0)     -> (c + 1) (3 + 10)
    F-F-F-T: the last two Full steps (15/16, h1 = 3) and (5/6, h2 = 4): slope 1 / (-5/48) = -9.6,
        step 3: 4 + (5/8 - 5/6) (-9.6) = 4 + 2 = 6                                      -> (c + 1) 6
    Chunk 0 is F-F-F-F: the Teacher's."""
    teacher = ScriptedTeacher()
    outputs, kinds, _ = run_chunks(_row("F-F-T-T", "T", TaylorForecast(teacher)))
    assert numbers(outputs, 0, "final_hidden") == pytest.approx([1, 3, 4, 8])
    for chunk in (1, 2):
        scale = chunk + 1
        expected = [scale * 1, scale * 3, scale * (3 + 10 / 3), scale * 13]
        assert numbers(outputs, chunk, "final_hidden") == pytest.approx(expected, rel=1e-5)
        assert numbers(outputs, chunk, "velocity")[2:] == pytest.approx(_velocities(expected)[2:], rel=1e-5)
        assert [kinds[(chunk, step)] for step in range(4)] == ["full", "full", "forecast", "forecast"]
    outputs, _, _ = run_chunks(_row("F-F-F-T", "T", TaylorForecast(teacher)))
    for chunk in (1, 2):
        assert numbers(outputs, chunk, "final_hidden")[3] == pytest.approx((chunk + 1) * 6, rel=1e-5)


def test_taylor_with_one_full_step_carries_the_slope_across_chunks():
    """F-T-T-T: h_k = h_0 + (h'_k - h'_0), h' the previous chunk's outputs as this row made them.
        chunk 1: h_0 = 2, chunk 0 (the Teacher's) 1, 3, 4, 8   -> 2, 2 + 2, 2 + 3, 2 + 7 = 2, 4, 5, 9
        chunk 2: h_0 = 3, chunk 1 (forecasts)     2, 4, 5, 9   -> 3, 3 + 2, 3 + 3, 3 + 7 = 3, 5, 6, 10
    The Teacher runs step 0 of every scheduled chunk only."""
    outputs, _, teacher_calls = run_chunks(_row("F-T-T-T", "T", TaylorForecast(ScriptedTeacher())))
    assert numbers(outputs, 1, "final_hidden") == pytest.approx([2, 4, 5, 9], rel=1e-6)
    assert numbers(outputs, 2, "final_hidden") == pytest.approx([3, 5, 6, 10], rel=1e-6)
    assert numbers(outputs, 2, "velocity")[1:] == pytest.approx(_velocities([3, 5, 6, 10])[1:], rel=1e-6)
    assert teacher_calls == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0)]


def test_previous_chunk_rows_reuse_the_same_step_of_the_chunk_before():
    """F-C-C-C: steps 1..3 of chunk 1 are chunk 0's (h 3, 4, 8; v -3, -4, -8), and chunk 2's are chunk 1's, the
    same numbers again; F-F-C-C takes step 2 and 3 only."""
    outputs, _, _ = run_chunks(_row("F-C-C-C", "C", PreviousChunkReuse()))
    for chunk, step0 in ((1, 2), (2, 3)):
        assert numbers(outputs, chunk, "final_hidden") == [step0, 3, 4, 8]
        assert numbers(outputs, chunk, "velocity") == [-step0, -3, -4, -8]
    outputs, _, _ = run_chunks(_row("F-F-C-C", "C", PreviousChunkReuse()))
    assert numbers(outputs, 1, "velocity") == [-2, -6, -4, -8] and numbers(outputs, 2, "velocity") == [-3, -9, -4, -8]


def test_teacache_row_skips_by_the_rescaled_change_and_adds_the_last_full_steps_residual():
    """F-A-A-A, threshold 0.45, rescaling 2 x: model inputs (= embedded = modulated input)
        chunk 0: 1, 1, 1, 1                F-F-F-F, not the rule's (chunk 0 is the reference's)
        chunk 1: 1.2^k: change 0.2 a step  accumulated 0.4 skip, 0.8 Full (reset), 0.4 skip
        chunk 2: 1.25^k: change 0.25       accumulated 0.5 >= 0.45 at every step: all Full
    A skipped step: hidden = its input + (h - input) of the last Full step, v = 2 hidden + sigma:
        chunk 1 step 1: 1.2 + (2 - 1) = 2.2;  step 3: 1.728 + (8 - 1.44) = 8.288
    The rescaling is fitted on consecutive Full steps: (input change, velocity change) of chunk 2's steps 1..3 with
    v = -3 (1, 3, 4, 8): (0.25, 2/1), (0.25, 1/3), (0.25, 4/4)."""
    growth = {0: 1.0, 1: 1.2, 2: 1.25}
    rule = AdaptiveSkip(ScriptedTeacher(), threshold=0.45, rescale=(2.0, 0.0))
    outputs, kinds, _ = run_chunks(_row("F-A-A-A", "A", None, adaptive=rule),
                                   model_input=lambda chunk, step: growth[chunk] ** step)
    assert [kinds[(1, step)] for step in range(4)] == ["full", "cache_residual", "full", "cache_residual"]
    assert [kinds[(2, step)] for step in range(4)] == ["full"] * 4
    hidden = numbers(outputs, 1, "final_hidden")
    assert hidden == pytest.approx([2, 2.2, 8, 8.288], rel=1e-6)
    assert numbers(outputs, 1, "velocity") == pytest.approx([-2, 2 * 2.2 + 15 / 16, -8, 2 * 8.288 + 5 / 8], rel=1e-6)
    observed = [value for pair in rule.observed for value in pair]
    assert observed == pytest.approx([0.25, 2.0, 0.25, 1 / 3, 0.25, 1.0], rel=1e-6)


def test_calibration_ties_go_to_more_full_steps():
    """Full steps per chunk 4 below a threshold of 0.1, 3 below 0.3, 2 below 0.6, then 1: the target 2.5 is as far
    from 3 as from 2, and the tie goes to the higher quality, 3 Full steps (a threshold in [0.1, 0.3))."""
    def count(threshold: float) -> float:
        return 4.0 if threshold < 0.1 else 3.0 if threshold < 0.3 else 2.0 if threshold < 0.6 else 1.0

    threshold, reached = calibrate_threshold(count, 2.5)
    assert reached == 3.0 and 0.1 <= threshold < 0.3
    threshold, reached = calibrate_threshold(count, 2.0)
    assert reached == 2.0 and 0.3 <= threshold < 0.6
    assert fit_rescale([(0.1, 0.3), (0.2, 0.5), (0.4, 0.9)]) == pytest.approx((2.0, 0.1), abs=1e-9)  # y = 2 x + 0.1


def test_calibration_videos_are_spread_over_the_scenes():
    """12 scenes x 4 paths in table order (as the demo's train split): the first rows of the table are one scene's
    paths; spread_rows takes evenly spaced scenes first, scene j at its row j mod 4 (so the paths vary), and a
    second row of a scene only once every scene has one."""
    from predictor_training.eval.caches import spread_rows

    keys = [(f"s{row // 4:03d}", row % 4) for row in range(48)]
    assert spread_rows(keys, 2) == [0, 47]  # s000 path 0, s011 path 3 (the old choice was s000 paths 0 and 1)
    eight = spread_rows(keys, 8)
    assert eight == [0, 10, 15, 21, 26, 32, 37, 47] and len({keys[index][0] for index in eight}) == 8
    assert {keys[index][1] for index in eight} == {0, 1, 2, 3}
    fourteen = spread_rows(keys, 14)
    assert len({keys[index][0] for index in fourteen[:12]}) == 12 and len(set(fourteen)) == 14
    assert sorted(spread_rows(keys, 100)) == list(range(48))
    assert spread_rows([("a", 0), ("b", 0), ("b", 1)], 3) == [0, 2, 1]


def test_calibration_rolls_out_each_threshold_once_across_targets():
    """Three targets bisected on one scripted video: a threshold tried for one target (0, 1, 0.5, ...) is not rolled
    out again for the next, and every target still gets its own threshold."""
    from tests.helpers.scripted_chunks import ScriptedRuntime

    runtime = ScriptedRuntime(model_input=lambda chunk, step: 1.1 ** (step * (chunk + 1)),
                              hidden=lambda chunk, step: 1.2 ** (step * (chunk + 1)))
    rows = build_rows(num_steps=4, shift=5.0, samplers=(), caches=("teacache",), teacache_full_steps=(1.2, 1.5, 3),
                      mixtures=(), predictor_plans={})
    calibrated = calibrate_adaptive(rows, runtime, [{"case_id": "c"}], log=lambda *_: None)
    tried = [(method.adaptive.threshold, tuple(method.adaptive.rescale)) for method in runtime.methods]
    assert len(tried) == len(set(tried)) < 1 + 3 * 14
    assert len({spec.adaptive["threshold"] for spec in calibrated[1:]}) == 3
