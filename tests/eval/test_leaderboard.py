"""The leaderboard's rows (predictor_training/eval/leaderboard.py): the k-step samplers, the
2-step sampler against the 2-step Euler solver, row specs, short labels, the baseline, a student's plan, and the
rows in the eval's loop."""

from __future__ import annotations

import pytest
import torch

from predictor_training.eval.leaderboard import LeaderboardRows, RowSpec, build_rows, sampler_plans
from predictor_training.eval.methods import PlannedMethod
from predictor_training.eval.run import build_runtime, open_dataset
from predictor_training.eval.settings import EvalSettings
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.schedule import StepPlan
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.flops import TeacherShape
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
        case_root=root / "encoded", num_latents=num_latents, checkpoints=[], plan=StepPlan.from_steps((1, 2, 3)),
        dtype=torch.float32, vae_dtype=torch.float32, output_root=root / "unused")


def test_samplers_are_every_step_subset_that_keeps_step_zero():
    plans = sampler_plans(4, (1, 2, 3))
    assert [plan for _, plan in plans] == ["F-R-R-R", "F-F-R-R", "F-R-F-R", "F-R-R-F", "F-F-F-R", "F-F-R-F",
                                           "F-R-F-F"]
    rows = build_rows(num_steps=4, shift=5.0, samplers=(2,), caches=("taylor", "teacache"), teacache_full_steps=(2,),
                      mixtures=("F-R-R-R|F-R-R-F", "F-R-R-P"), predictor_plans={"ck": ["F-P-P-P", "F-R-R-P"]},
                      context_modes=("exact", "incremental"), counterparts=())
    keys = [row.key for row in rows]
    assert keys == ["reference", "sampler_2step_ffrr", "sampler_2step_frfr", "sampler_2step_frrf", "taylor_fftt",
                    "taylor_ftft", "taylor_fttf", "teacache_full2", "plan_frrr+frrf", "predictor_ck_fppp",
                    "predictor_ck_fppp@incremental", "predictor_ck_frrp", "predictor_ck_frrp@incremental",
                    "reference@incremental"]
    by_key = {row.key: row for row in rows}
    assert by_key["sampler_2step_frrf"].display == "2-step sampler σ{1, 0.625}"
    assert by_key["sampler_2step_frfr"].display == "2-step sampler σ{1, 0.8333}"
    assert not by_key["predictor_ck_frrp"].baseline and by_key["plan_frrr+frrf"].baseline


def test_every_predictor_plan_has_its_exact_cost_training_free_rows():
    """With H and B for P (the default --counterparts): F-R-R-P gets F-R-R-H (what the untrained Predictor computes)
    and F-R-R-B (the block-residual cache, blocks 0,-1), a mixture with P its mixture; a plan another row already
    runs (F-H-H-H, F-B-B-B at the 1-step sampler's plan) is not repeated. The tool's defaults: both letters, the
    block-residual cache among the caches, TeaCache at 1.1, 1.2, 1.3 and 2 Full steps per chunk."""
    from predictor_training.eval.leaderboard import CACHES, COUNTERPART_LETTERS, DEFAULT_RESIDUAL_BLOCKS

    assert COUNTERPART_LETTERS == ("H", "B") and DEFAULT_RESIDUAL_BLOCKS == (0, -1) and "block_residual" in CACHES
    rows = build_rows(num_steps=4, shift=5.0, samplers=(1,), caches=("reuse_hidden", "block_residual"),
                      teacache_full_steps=(), mixtures=("F-R-R-R|F-R-R-P",),
                      predictor_plans={"a": ["F-R-R-P", "F-P-P-P"], "b": ["F-R-R-P"]})
    by_key = {row.key: row for row in rows}
    assert [row.key for row in rows if row.family != "predictor"] == [
        "reference", "sampler_1step_frrr", "reuse_hidden_fhhh", "block_residual_fbbb", "reuse_hidden_frrh",
        "block_residual_frrb", "reuse_hidden_frrr+frrh", "block_residual_frrr+frrb"]
    assert by_key["reuse_hidden_frrh"].plan == "F-R-R-H" and by_key["reuse_hidden_frrh"].baseline
    assert by_key["block_residual_frrb"].blocks == (0, -1) and by_key["reuse_hidden_frrh"].blocks is None
    assert by_key["block_residual_fbbb"].blocks == (0, -1) and by_key["block_residual_frrr+frrb"].family == "mixture"
    only_h = build_rows(num_steps=4, shift=5.0, samplers=(1,), caches=(), teacache_full_steps=(), mixtures=(),
                        predictor_plans={"a": ["F-R-R-P"]}, counterparts=("H",), residual_blocks=(1, -2))
    assert [row.key for row in only_h if row.family == "cache"] == ["reuse_hidden_frrh"]
    with pytest.raises(Exception, match="--counterparts"):
        build_rows(num_steps=4, shift=5.0, samplers=(1,), caches=(), teacache_full_steps=(), mixtures=(),
                   predictor_plans={}, counterparts=("T",))
    method = LeaderboardRows([by_key["block_residual_frrb"]]).build(_StubTeacher(), {})[0]
    assert method.residual_blocks == 2 and method.block_cache.blocks == (0, 11)


class _StubTeacher:
    """What the rows' fillers read at construction: the number of double blocks (12, as the demo Teacher)."""

    num_layers = 12


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


# ---------------------------------------------------------------------------------------------------------------
# Trained students: their plan on the Teacher's grid (reading them: tests/eval/test_students.py)
# ---------------------------------------------------------------------------------------------------------------
def test_a_students_steps_land_on_the_teachers_grid():
    """The Teacher's 4 steps at shift 5 visit sigma 1, 0.9375, 0.8333, 0.625. One step (sigma 1) is S-R-R-R; two at
    shift 5/3 visit 1 and 5/3 * 0.5 / (1 + 2/3 * 0.5) = 0.625: S-R-R-S; two at shift 5 visit 1 and
    5 * 0.5 / (1 + 4 * 0.5) = 0.8333: S-R-S-R; three at shift 5 visit 1, 0.909, 0.714: off the grid, refused."""
    from predictor_training.eval.leaderboard import student_plan
    from predictor_training.runtime.errors import UserInputError

    assert student_plan(1, 5.0, 4, 5.0) == "S-R-R-R"
    assert student_plan(2, 5.0 / 3.0, 4, 5.0) == "S-R-R-S"
    assert student_plan(2, 5.0, 4, 5.0) == "S-R-S-R"
    assert student_plan(4, 5.0, 4, 5.0) == "S-S-S-S"
    with pytest.raises(UserInputError, match="0.9091"):
        student_plan(3, 5.0, 4, 5.0)

def test_rows_are_timed_k_times_in_rotated_rounds_and_a_b_row_runs_in_the_eval(world, tmp_path):
    """The eval's loop on one video of the tiny world (2 chunks) with --timing_repeats 3 and the median: every row's
    rollout time is the median of the scored rollout and two interleaved rounds (all three kept), DiT = text prefill
    + that, the fingerprint records the timing; the block-residual row (one block run of the world's two) records
    F-R-R-B in chunk 1 and counts its B step's FLOPs at one block."""
    import dataclasses
    import json

    from predictor_training.eval.run import run_evaluation
    from predictor_training.runtime.distributed import init_distributed
    from predictor_training.teacher.flops import block_residual_step_flops
    from tests.helpers.eval_world import HEIGHT, WIDTH, eval_settings

    rows = build_rows(num_steps=4, shift=5.0, samplers=(1,), caches=(), teacache_full_steps=(),
                      mixtures=("F-R-R-B",), predictor_plans={}, residual_blocks=(0,))
    assert [row.key for row in rows] == ["reference", "sampler_1step_frrr", "plan_frrb"]
    settings = dataclasses.replace(eval_settings(world, tmp_path, checkpoints=[], max_videos=1),
                                   timing_repeats=3, timing_statistic="median", lpips_random_backbone=True)
    report = run_evaluation(settings, init_distributed("gloo"), LeaderboardRows(rows))
    result = report["results"][0]
    for key in ("reference", "sampler_1step_frrr", "plan_frrb"):
        timings = result["methods"][key]["timings"]
        assert len(timings["rollout_repeats_s"]) == 3 and timings["timing"] == {"repeats": 3, "statistic": "median"}
        assert timings["rollout_s"] == pytest.approx(sorted(timings["rollout_repeats_s"])[1])
        assert timings["dit_s"] == pytest.approx((timings["text_prefill_s"] or 0.0) + timings["rollout_s"])
    config = json.loads((report["out_dir"] / "eval_config.json").read_text())
    assert config["settings"]["timing"] == {"repeats": 3, "statistic": "median"}
    entry = result["methods"]["plan_frrb"]
    assert entry["step_kinds"] == ["FFFF", "FRRB"]
    teacher = _teacher(world)
    shape = TeacherShape.from_config(teacher.config)
    assert entry["flops"]["block_residual_step"] == block_residual_step_flops(
        shape, 1, HEIGHT * WIDTH, result["text_tokens"], result["context_frames_per_chunk"][1])
