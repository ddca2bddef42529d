"""The leaderboard's rows (predictor_training/eval/leaderboard.py): the k-step samplers, the
2-step sampler against the 2-step Euler solver, real-config FLOPs, row specs, short labels, the baseline, and a
multi-role training state read for its Predictor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from predictor_training.eval.leaderboard import LeaderboardRows, RowSpec, build_rows, real_config_flops, sampler_plans
from predictor_training.eval.methods import PlannedMethod
from predictor_training.eval.run import EvalSettings, build_runtime, open_dataset
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.schedule import StepPlan
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.flops import REAL_LATENT_GRID, REAL_TEXT_TOKENS, TeacherShape, teacher_chunk_step_flops
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
    from predictor_training.runtime.checkpoint import RunState, save_training_state
    from predictor_training.runtime.inference_weights import read_inference_config
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


def test_plot_labels_stay_inside_and_apart():
    """Labels of the right half point left (the plot's right edge cut them), two rows at one cost, close in PSNR,
    get labels one line apart, and a long label that would cover a higher row's point moves a line down."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from predictor_training.eval.leaderboard import label_points

    fig, ax = plt.subplots()
    label_points(ax, [("3-step", 1.15, 56.0), ("1-step", 1.64, 30.6), ("cache", 1.641, 30.2), ("2-step", 1.35, 44.5)])
    placed = {text.get_text(): text for text in ax.texts}
    plt.close(fig)
    assert placed["3-step"].get_ha() == "left" and placed["1-step"].get_ha() == "right"
    assert placed["1-step"].xyann[1] - placed["cache"].xyann[1] == 8
    assert placed["2-step"].xyann == (3, 2)
    # a long label pointing left over a higher row's point at another cost moves down; a short one does not
    fig, ax = plt.subplots()
    label_points(ax, [("3-step", 1.15, 56.0), ("mixture", 1.50, 33.3), ("P a long Predictor label F-R-R-P", 1.58, 32.8),
                      ("P short", 1.30, 32.8)])
    placed = {text.get_text(): text for text in ax.texts}
    plt.close(fig)
    assert placed["P a long Predictor label F-R-R-P"].xyann == (-4, -6) and placed["P short"].xyann == (3, 2)


# ---------------------------------------------------------------------------------------------------------------
# The analysis on hand-made per-unit results: costs on every axis, quality, intervals, the front and the margins
# ---------------------------------------------------------------------------------------------------------------
PREDICTOR_CONFIG = {"variant": "v4", "fusion_streams": ["anchor", "prev_chunk", "context"], "hidden_size": 64}


def _spec(key: str, plan: str) -> RowSpec:
    family = "reference" if key == "reference" else "predictor" if key.startswith("predictor") else (
        "sampler" if key.startswith("sampler") else "cache")
    return RowSpec(key, family, plan, key, key, checkpoint="ck" if family == "predictor" else None)


def _entry(letters: list[str], flops: float, dit_s: float, end_to_end_s: float, psnr: float | None = None,
           **figures) -> dict:
    """One row's entry of one unit's result, as the eval writes it (only the fields the analysis reads)."""
    entry = {"step_kinds": letters, "flops": {"total": flops},
             "timings": {"dit_s": dit_s, "end_to_end_s": end_to_end_s}}
    if psnr is not None:
        entry["metrics"] = {"psnr_full": psnr, "ssim": figures.get("ssim", 0.5), "lpips": figures.get("lpips", 0.1),
                            "temporal_delta_mse": figures.get("temporal_delta_mse", 0.01)}
        entry["per_chunk"] = [{"psnr_full": 99.0}, {"psnr_full": figures.get("last_chunk_psnr", psnr)}]
    return entry


# (key, plan, step kinds of chunk 1, FLOPs on the config that ran, DiT seconds, end-to-end seconds) per unit
COST_ROWS = [("reference", "F-F-F-F", "FFFF", 100.0, 10.0, 20.0),
             ("sampler_1step_frrr", "F-R-R-R", "FRRR", 40.0, 3.0, 9.0),
             ("sampler_2step_frrf", "F-R-R-F", "FRRF", 60.0, 5.0, 12.0),
             ("predictor_ck_frrp", "F-R-R-P", "FRRP", 45.0, 4.0, 10.0),
             ("predictor_ck_fppp", "F-P-P-P", "FPPP", 50.0, 4.5, 11.0)]
# PSNR per unit: video a under two seeds, video b under one
PSNR = {"sampler_1step_frrr": [20.0, 22.0, 30.0], "sampler_2step_frrf": [30.0, 30.0, 36.0],
        "predictor_ck_frrp": [28.0, 28.0, 34.0], "predictor_ck_fppp": [35.0, 35.0, 37.0]}


def _cost_results() -> list[dict]:
    results = []
    for unit, video in enumerate(["a", "a", "b"]):
        methods = {key: _entry(["FFFF", letters], flops, dit, e2e, PSNR.get(key, [None] * 3)[unit])
                   for key, _, letters, flops, dit, e2e in COST_ROWS}
        results.append({"key": f"{video}_seed{unit}", "video_key": video, "case_id": f"scene_{video}",
                        "context_frames_per_chunk": [0, 4], "methods": methods})
    return results


def _video_mean(per_unit: list[float]) -> float:
    """The mean over videos of each video's mean over its seeds (units a, a, b)."""
    return ((per_unit[0] + per_unit[1]) / 2 + per_unit[2]) / 2


def _mix_db(lam: float, psnr_a: float, psnr_b: float) -> float:
    return -10 * math.log10(lam * 10 ** (-psnr_a / 10) + (1 - lam) * 10 ** (-psnr_b / 10))


def _front(lam_sampler_mix: float, lam_with_reference: float) -> tuple[float, str]:
    """The best of: the 1-step sampler; it time-shared with the 2-step one (a fraction lam of the chunks); it
    time-shared with the reference (MSE 0: lam x its MSE)."""
    frrr, frrf = PSNR["sampler_1step_frrr"], PSNR["sampler_2step_frrf"]
    mixed = _video_mean([_mix_db(lam_sampler_mix, a, b) for a, b in zip(frrr, frrf)])
    with_reference = _video_mean(frrr) - 10 * math.log10(lam_with_reference)
    return max(_video_mean(frrr), mixed, with_reference), (
        f"{lam_sampler_mix:.2f} x sampler_1step_frrr + {1 - lam_sampler_mix:.2f} x sampler_2step_frrf")


def test_costs_quality_and_margins_of_hand_made_results():
    """Costs: summed row work over summed reference work, per axis (FLOPs 45 / 100, DiT 4 / 10, end-to-end 10 / 20
    for F-R-R-P); at the real config the recorded steps are counted again: per chunk c the context prefill P_c and
    its steps (Full F_c, Predictor Q_c, velocity reuse free). Quality: videos count once (a: 2 seeds, b: 1). The
    margin of F-R-R-P is over the baselines' front at its own cost on each axis, the Predictors never in it:
        FLOP run  0.45: the 1-step sampler (0.4) with the 2-step one (0.6), lam = 0.15 / 0.2 = 0.75
        DiT       0.40: 0.3 with 0.5, lam = 0.5
        FLOP real  c_P: c_R with c_F, lam = (c_F - c_P) / (c_F - c_R) = 1 - Q_1 / F_1"""
    from predictor_training.eval.leaderboard import analyse
    from predictor_training.teacher.flops import context_prefill_flops, predictor_step_flops

    specs = [_spec(key, plan) for key, plan, *_ in COST_ROWS]
    analysis = analyse(_cost_results(), specs, {"ck": PREDICTOR_CONFIG}, baseline="sampler_1step_frrr",
                       resamples=200, seed=0)
    rows = {row.spec.key: row for row in analysis["rows"]}
    assert analysis["num_videos"] == 2 and analysis["num_units"] == 3
    shape = TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
    tokens = REAL_LATENT_GRID[0] * REAL_LATENT_GRID[1]
    prefill = [context_prefill_flops(shape, tokens, REAL_TEXT_TOKENS, n) for n in (0, 4)]
    full = [teacher_chunk_step_flops(shape, tokens, REAL_TEXT_TOKENS, n) for n in (0, 4)]
    predictor = predictor_step_flops(shape, {**PREDICTOR_CONFIG, "hidden_size": shape.hidden_size}, tokens,
                                     REAL_TEXT_TOKENS, 4)
    assert 3 * predictor < full[1]  # 2 of 54 blocks: three Predictor steps cost less than one Full step
    chunk0 = prefill[0] + 4 * full[0]
    reference = chunk0 + prefill[1] + 4 * full[1]
    real = {"sampler_1step_frrr": chunk0 + prefill[1] + full[1],
            "sampler_2step_frrf": chunk0 + prefill[1] + 2 * full[1],
            "predictor_ck_frrp": chunk0 + prefill[1] + full[1] + predictor,
            "predictor_ck_fppp": chunk0 + prefill[1] + full[1] + 3 * predictor}
    for key, _, _, flops, dit, e2e in COST_ROWS:
        expected = {"flops_run": flops / 100, "flops_real": real.get(key, reference) / reference,
                    "measured_dit": dit / 10, "measured_end_to_end": e2e / 20}
        assert rows[key].costs == pytest.approx(expected, rel=1e-12), key
    for key, per_unit in PSNR.items():
        assert rows[key].quality.value == pytest.approx(_video_mean(per_unit), rel=1e-12), key
    assert rows["reference"].quality.value == math.inf
    assert rows["predictor_ck_frrp"].vs_baseline.value == pytest.approx((28 - 21 + 34 - 30) / 2)  # 5.5
    assert rows["sampler_2step_frrf"].vs_baseline.value == pytest.approx((30 - 21 + 36 - 30) / 2)  # 7.5
    assert rows["sampler_1step_frrr"].vs_baseline is None
    c_r, c_f, c_p = (real[key] / reference for key in ("sampler_1step_frrr", "sampler_2step_frrf",
                                                        "predictor_ck_frrp"))
    fronts = {"flops_run": _front(0.75, (1 - 0.45) / (1 - 0.4)), "measured_dit": _front(0.5, (1 - 0.4) / (1 - 0.3)),
              "flops_real": _front(1 - predictor / full[1], (1 - c_p) / (1 - c_r))}
    assert (c_f - c_p) / (c_f - c_r) == pytest.approx(1 - predictor / full[1], rel=1e-9)
    for axis, (front, members) in fronts.items():
        margin, where = rows["predictor_ck_frrp"].margins[axis]
        assert margin.value == pytest.approx(_video_mean(PSNR["predictor_ck_frrp"]) - front, rel=1e-9), axis
        assert where == members, axis
        assert margin.low <= margin.value <= margin.high
    # the real-config FLOP front of every row: F-P-P-P is cheaper and better than the 2-step sampler
    assert {key: row.on_front for key, row in rows.items()} == {
        "reference": True, "sampler_1step_frrr": True, "sampler_2step_frrf": False, "predictor_ck_frrp": True,
        "predictor_ck_fppp": True}


def test_figures_of_hand_made_results():
    """SSIM, LPIPS, temporal-delta error, last chunk PSNR: means over the videos (one seed each); Full steps per
    chunk over chunks 1.. (chunk 0 is always F-F-F-F); ground truth on chunks 1.. (not the whole video); revisit
    figures over the videos that revisit a camera (a and b, not c)."""
    from predictor_training.eval.leaderboard import analyse

    kinds = {"reference": ["FFFF"] * 3, "sampler_1step_frrr": ["FFFF", "FRRR", "FRRR"],
             "teacache_full1.5": ["FFFF", "FAFA", "FAAA"]}
    specs = [_spec("reference", "F-F-F-F"), _spec("sampler_1step_frrr", "F-R-R-R"),
             _spec("teacache_full1.5", "F-A-A-A")]
    results = []
    for index, video in enumerate("abc"):
        methods = {key: _entry(kinds[key], 10.0, 1.0, 1.0, None if key == "reference" else 30.0 + index,
                               ssim=0.5 + 0.1 * index, lpips=0.2 * index, temporal_delta_mse=0.01 * index,
                               last_chunk_psnr=20.0 + 2 * index) for key in kinds}
        truth = {key: {"after_first_chunk": {"psnr_full": 25.0 + index, "ssim": 0.6 + 0.1 * index},
                       "metrics": {"psnr_full": 40.0, "ssim": 0.99}} for key in kinds}
        result = {"key": video, "case_id": f"scene_{video}", "context_frames_per_chunk": [0, 4, 8], "methods": methods,
                  "against_ground_truth": {"methods": truth}}
        if video != "c":
            result["revisits"] = {"methods": {key: {"self_psnr": 15.0 + 4 * index,
                                                    "return_minus_first_visit": -3.0 + index} for key in kinds}}
        results.append(result)
    analysis = analyse(results, specs, {}, baseline="sampler_1step_frrr", resamples=100)
    figures = {row.spec.key: row.figures for row in analysis["rows"]}
    assert figures["sampler_1step_frrr"] == pytest.approx({
        "ssim": 0.6, "lpips": 0.2, "temporal_delta_mse": 0.01, "last_chunk_psnr": 22.0,
        "gt_psnr_after_first_chunk": 26.0, "gt_ssim_after_first_chunk": 0.7, "revisit_self_psnr": 17.0,
        "revisit_return_minus_first_visit": -2.5, "full_steps_per_chunk": 1.0, "speedup_measured_dit_q25": 1.0,
        "speedup_measured_dit_q75": 1.0, "speedup_measured_dit_min": 1.0, "speedup_measured_dit_max": 1.0},
        rel=1e-12)
    assert figures["teacache_full1.5"]["full_steps_per_chunk"] == pytest.approx(1.5)  # (2 + 1) / 2
    assert figures["reference"]["full_steps_per_chunk"] == 4.0


def test_teacache_thresholds_are_calibrated_on_the_full_step_counts_they_give():
    """A scripted calibration video (tests/helpers/scripted_chunks.py), three chunks, chunk 0 the reference's. The
    model input changes by 10 % a step in chunk 1 and 20 % in chunk 2, the Teacher's velocity by twice that (its
    hidden grows 1.2x, then 1.4x), so the rescaling fitted on the all-Full rollout is v-change = 2 x input-change and
    the accumulated distance grows by 0.2 a step in chunk 1, 0.4 in chunk 2. Full steps per chunk, chunks 1 and 2:
        threshold in (0.2, 0.4]: chunk 1 F . F . (2), chunk 2 every step (4)        -> 3
                     (0.4, 0.6]: chunk 1 F . . F (2), chunk 2 F . F . (2)           -> 2
                     (0.6, 1.2]: chunk 1 F . . . (1), chunk 2 two (2)            -> 1.5"""
    from predictor_training.eval.leaderboard import calibrate_adaptive
    from tests.helpers.scripted_chunks import ScriptedRuntime

    growth = {0: (1.0, 1.0), 1: (1.1, 1.2), 2: (1.2, 1.4)}  # chunk: (input, hidden) growth per step
    runtime = ScriptedRuntime(model_input=lambda chunk, step: growth[chunk][0] ** step,
                              hidden=lambda chunk, step: growth[chunk][1] ** step)
    rows = build_rows(num_steps=4, shift=5.0, samplers=(), caches=("teacache",), teacache_full_steps=(3, 2, 1.5),
                      mixtures=(), predictor_plans={})
    calibrated = {spec.key: spec.adaptive for spec in calibrate_adaptive(rows, runtime, [{"case_id": "c"}],
                                                                         log=lambda *_: None)}
    for key, (low, high), reached in (("teacache_full3", (0.2, 0.4), 3.0), ("teacache_full2", (0.4, 0.6), 2.0),
                                      ("teacache_full1.5", (0.6, 1.2), 1.5)):
        adaptive = calibrated[key]
        assert adaptive["rescale"] == pytest.approx([2.0, 0.0], abs=1e-5), key  # float32 inputs
        assert low < adaptive["threshold"] <= high and adaptive["calibration_full_steps"] == reached, (key, adaptive)


# ---------------------------------------------------------------------------------------------------------------
# Trained students: their plan on the Teacher's grid, read from their run, one row each
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


def _student_run(tmp_path, name: str, flags: dict, method: str = "kd") -> "Path":
    run = tmp_path / name
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    (run / "ema" / "model").mkdir(parents=True)
    (run / "ema" / "model" / "config.json").write_text("{}")
    (run / "lora_student.safetensors").write_bytes(b"")
    (run / "train_config.json").write_text(json.dumps({"method": method, "flags": flags}))
    return run


def test_students_are_read_from_their_run_and_get_a_row_each(tmp_path, monkeypatch):
    """A student's recipe comes from its run's train_config.json (method, student_steps, student_shift, train); the
    EMA is told apart by its folder; labels repeat-proof; the rows run every chunk on the student and join the
    front as baselines; a folder with no run above it, or a run that trained no student, is refused."""
    from predictor_training.eval.leaderboard import read_student, student_labels
    from predictor_training.runtime.errors import UserInputError

    one = _student_run(tmp_path, "kd1", {"student_steps": 1, "student_shift": 5.0, "train": "full"})
    two = _student_run(tmp_path, "dmd2", {"student_steps": 2, "student_shift": 5.0 / 3.0, "train": "lora",
                                          "generator": "student"}, method="dmd2")
    students = student_labels([read_student(one / "model"), read_student(two / "ema" / "model"),
                               read_student(two / "lora_student.safetensors"), read_student(one / "model")])
    assert [student.label for student in students] == ["kd_1step_full_1", "dmd2_2step_lora_ema", "dmd2_2step_lora",
                                                       "kd_1step_full_2"]
    assert (students[0].steps, students[0].shift, students[0].ema, students[1].ema) == (1, 5.0, False, True)
    monkeypatch.chdir(tmp_path)  # a path relative to the working directory, as a command line gives it
    assert (read_student(Path("dmd2") / "ema" / "model").ema, read_student(Path("kd1") / "model").ema) == (True, False)
    rows = build_rows(num_steps=4, shift=5.0, samplers=[], caches=[], teacache_full_steps=[], mixtures=[],
                      predictor_plans={}, students=students[:2])
    student_rows = [row for row in rows if row.family == "student"]
    assert [(row.key, row.plan, row.student) for row in student_rows] == [
        ("student_kd_1step_full_1_srrr", "S-R-R-R", "kd_1step_full_1"),
        ("student_dmd2_2step_lora_ema_srrs", "S-R-R-S", "dmd2_2step_lora_ema")]
    assert all(row.baseline and not row.step_plan.chunk0_full for row in student_rows)
    assert "student" not in rows[0].record() and student_rows[0].record()["student"] == "kd_1step_full_1"
    predictor_run = _student_run(tmp_path, "dmd2_predictor", {"student_steps": 4, "student_shift": 5.0,
                                                              "generator": "predictor"}, method="dmd2")
    for bad in (predictor_run / "model", tmp_path / "nowhere", tmp_path):
        with pytest.raises(UserInputError):
            read_student(bad)


def test_a_lora_student_is_the_teacher_with_its_adapter_merged(world, tmp_path):
    """A LoRA student loads as the Teacher with the adapter merged into its weights: every adapted linear gives what
    the Teacher gives with the adapter active (W x + scale B A x), and no adapter runs at inference."""
    from predictor_training.eval.leaderboard import StudentSource, load_student
    from predictor_training.teacher.adapters import active_adapter, add_lora, adapter, named_lora_parameters, save_lora

    teacher = _teacher(world)
    add_lora(teacher, "student", 4, 8.0, trainable=False)
    with torch.no_grad():
        for key, parameter in named_lora_parameters(teacher, "student").items():
            if "lora_B" in key:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)))
    path = save_lora(teacher, "student", tmp_path / "lora_student.safetensors")
    source = TeacherSource(world["root"] / "teacher", None, "--teacher", None)
    student = load_student(StudentSource(path=path, run_dir=tmp_path, method="kd", train="lora", steps=1, shift=5.0,
                                         ema=False), source, torch.device("cpu"), torch.float32)
    assert active_adapter(student) in (None, "student")
    x = torch.randn(3, teacher.double_blocks[0].img_attn_q.base_layer.in_features,
                    generator=torch.Generator().manual_seed(6))
    with adapter(teacher, "student"):
        adapted = teacher.double_blocks[0].img_attn_q(x)
    merged_layer = student.double_blocks[0].img_attn_q
    merged = merged_layer.base_layer(x) if hasattr(merged_layer, "base_layer") else merged_layer(x)
    torch.testing.assert_close(merged, adapted)
    with adapter(teacher, None):
        assert not torch.allclose(teacher.double_blocks[0].img_attn_q(x), adapted)


def test_the_headline_decomposes_a_row_into_its_gain_over_one_step_and_its_extra_teacher_steps():
    """On the FLOP axis of the config that ran one Full step per chunk costs what the 2-step sampler costs more than
    the 1-step one, 0.60 - 0.40 = 0.20 of F-F-F-F; F-R-R-P costs 0.45, 0.05 more than the 1-step sampler: +0.25
    Teacher steps per chunk, F-P-P-P (0.50) +0.5. Its gain over the 1-step sampler: videos a (seeds 28 - 20 and
    28 - 22) and b (34 - 30): ((8 + 6) / 2 + 4) / 2 = +5.5 dB. Scene and video resampling agree here (one video
    per scene)."""
    from predictor_training.eval.leaderboard import analyse, extra_teacher_steps, headline_lines

    specs = [_spec(key, plan) for key, plan, *_ in COST_ROWS]
    analysis = analyse(_cost_results(), specs, {"ck": PREDICTOR_CONFIG}, baseline="sampler_1step_frrr",
                       resamples=200, seed=0)
    extra = extra_teacher_steps(analysis["rows"])
    assert extra["predictor_ck_frrp"] == pytest.approx(0.25) and extra["predictor_ck_fppp"] == pytest.approx(0.5)
    assert extra["sampler_2step_frrf"] == pytest.approx(1.0) and extra["reference"] == pytest.approx(3.0)
    line = next(line for line in headline_lines(analysis) if "predictor_ck_frrp" in line)
    assert "+5.50" in line and "+0.25 Teacher steps per chunk" in line and "over the 1-step sampler" in line
    assert analysis["bootstrap_unit"] == "scene" and analysis["num_clusters"] == 2
    by_video = analyse(_cost_results(), specs, {"ck": PREDICTOR_CONFIG}, baseline="sampler_1step_frrr",
                       resamples=200, seed=0, unit="video")
    for scene_row, video_row in zip(analysis["rows"], by_video["rows"]):
        assert scene_row.quality.to_dict() == video_row.quality.to_dict()


def test_videos_of_one_scene_are_resampled_together():
    """Both videos made scenes of one case: the scene bootstrap has one cluster, so every resample draws the same
    units and the interval closes on the estimate; resampling videos keeps two clusters and an open interval."""
    from predictor_training.eval.leaderboard import analyse

    results = _cost_results()
    for result in results:
        result["case_id"] = "one_scene"
    specs = [_spec(key, plan) for key, plan, *_ in COST_ROWS]
    scene = analyse(results, specs, {"ck": PREDICTOR_CONFIG}, resamples=200, seed=0)
    video = analyse(results, specs, {"ck": PREDICTOR_CONFIG}, resamples=200, seed=0, unit="video")
    assert (scene["num_clusters"], video["num_clusters"]) == (1, 2)
    row, other = scene["rows"][1].quality, video["rows"][1].quality
    assert row.low == row.value == row.high and other.low < other.value < other.high


def test_the_measured_speedup_carries_the_spread_of_its_per_video_speedups():
    """Four videos (video a under two seeds): reference DiT seconds 10, 10 | 12 | 8 | 10, the 1-step sampler's
    5, 5 | 4 | 8 | 2: per-video speedups 20/10 = 2, 3, 1, 5 (a video's seeds summed); pooled 50 / 24; quartiles of
    (1, 2, 3, 5): 1.75, 3.5. The table prints the interquartile range beside the pooled speedup, the CSV and JSON
    every part."""
    from predictor_training.eval.leaderboard import analyse, csv_text, markdown, row_record, speedup_cell

    reference_s, sampler_s = [10.0, 10.0, 12.0, 8.0, 10.0], [5.0, 5.0, 4.0, 8.0, 2.0]
    results = []
    for unit, video in enumerate("aabcd"):
        methods = {"reference": _entry(["FFFF", "FFFF"], 100.0, reference_s[unit], reference_s[unit] + 1),
                   "sampler_1step_frrr": _entry(["FFFF", "FRRR"], 40.0, sampler_s[unit], sampler_s[unit] + 1,
                                                30.0)}
        results.append({"key": f"{video}{unit}", "video_key": video, "case_id": video,
                        "context_frames_per_chunk": [0, 4], "methods": methods})
    specs = [_spec("reference", "F-F-F-F"), _spec("sampler_1step_frrr", "F-R-R-R")]
    analysis = analyse(results, specs, {}, baseline="sampler_1step_frrr", resamples=100)
    row = analysis["rows"][1]
    assert row.speedup("measured_dit") == pytest.approx(50 / 24)
    assert {key: value for key, value in row.figures.items() if key.startswith("speedup_measured_dit_")} == \
        pytest.approx({"speedup_measured_dit_q25": 1.75, "speedup_measured_dit_q75": 3.5,
                       "speedup_measured_dit_min": 1.0, "speedup_measured_dit_max": 5.0})
    assert speedup_cell(row, "measured_dit") == "2.08× [1.75, 3.50]" and speedup_cell(row, "flops_run") == "2.50×"
    assert "| 2.08× [1.75, 3.50] |" in markdown(analysis, {"split": "s"})
    assert row_record(row)["figures"]["speedup_measured_dit_q75"] == pytest.approx(3.5)
    header, line = csv_text(analysis).splitlines()[0::2]
    assert "speedup_measured_dit_q25" in header.split(",") and "1.75" in line


def test_the_teacache_rows_say_what_they_reached_here_and_on_the_calibration_videos():
    """A TeaCache row calibrated to 1.2 (1.21 on the calibration videos) that ran 1.92 Full steps per chunk here is
    marked as not reaching its target; one at 2 that ran 2.05 reached it (within 0.1)."""
    from predictor_training.eval.leaderboard import RowResult, teacache_notes
    from predictor_training.eval.front import Estimate

    def row(target, calibration, here):
        spec = RowSpec(f"teacache_full{target:g}", "cache", "F-A-A-A", f"TeaCache {target:g}", "t",
                       adaptive={"target_full_steps": target, "threshold": 0.0884, "rescale": [1.0, 0.0],
                                 "calibration_full_steps": calibration})
        return RowResult(spec, {}, None, Estimate(1.0, 0.0, 2.0), figures={"full_steps_per_chunk": here})

    lines = teacache_notes([row(1.2, 1.214, 1.915), row(2.0, 2.0, 2.05)])
    assert "| TeaCache 1.2 | 1.2 | 0.0884 | 1.21 | 1.92 | no: ran +0.72 from its target |" in lines
    assert "| TeaCache 2 | 2 | 0.0884 | 2.00 | 2.05 | yes |" in lines
    assert teacache_notes([]) == []


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


def _cost(core_hours, flops, steps, missing=()):
    return {"core_hours": core_hours, "flops": flops, "steps": steps, "lineage_complete": not missing,
            "complete": {"core_hours": not missing, "flops": not missing}, "runs": [],
            "missing": [{"link": "init_from", "path": path} for path in missing], "notes": []}


def test_each_trained_row_carries_its_own_training_cost_in_the_table_csv_json_and_plot(tmp_path):
    """Two Predictors of two checkpoints: each row gets its own checkpoint's training cost (a lower bound marked ≥
    with its missing parent counted), the training-free rows none, in the markdown, the CSV, the JSON and the
    plot labels."""
    import csv
    from dataclasses import replace

    from predictor_training.eval.leaderboard import analyse, markdown, point_label, write_leaderboard

    specs = [_spec(key, plan) for key, plan, *_ in COST_ROWS]
    specs = [replace(spec, checkpoint="other") if spec.key == "predictor_ck_fppp" else spec for spec in specs]
    analysis = analyse(_cost_results(), specs, {"ck": PREDICTOR_CONFIG, "other": PREDICTOR_CONFIG},
                       baseline="sampler_1step_frrr", resamples=50, seed=0)
    analysis["training_costs"] = {"ck": _cost(1.5, 2.0e18, 480), "other": _cost(0.25, 7.0e17, 96, ["gone.pt"])}
    rows = {row.spec.key: row for row in analysis["rows"]}
    text = markdown(analysis, {"split": "holdout25"})
    section = text.split("## Training cost of the trained rows")[1].split("\n## ")[0]
    lines = {line.split(" | ")[0].removeprefix("| "): line for line in section.splitlines() if line.startswith("| ")}
    assert set(lines) == {"row", "---", "predictor_ck_frrp", "predictor_ck_fppp"}
    frrp = lines["predictor_ck_frrp"].split(" | ")
    assert frrp[1] == f"{rows['predictor_ck_frrp'].quality.value:.2f}"
    assert frrp[4:8] == ["1.5", "2e+18", "480", "complete |"]
    assert lines["predictor_ck_fppp"].split(" | ")[4:8] == ["≥ 0.25", "≥ 7e+17", "96", "incomplete (1 missing) |"]
    assert point_label("P", analysis["training_costs"]["other"]) == "P [train ≥ 7e+17 FLOP, ≥ 0.25 core-h]"
    assert point_label("sampler", None) == "sampler"
    from predictor_training.eval.training_cost import cost_columns, unknown_cost
    assert cost_columns(unknown_cost("w.safetensors", "no recipe")) == {
        "train core-h (demo CPU)": "?", "train FLOPs (real config)": "?", "lineage": "unknown"}
    write_leaderboard(tmp_path, analysis, {"split": "holdout25"})
    table = {row["key"]: row for row in csv.DictReader((tmp_path / "leaderboard.csv").open())}
    assert (table["predictor_ck_frrp"]["train_core_hours"], table["predictor_ck_frrp"]["train_flops_real"]) == \
        ("1.5", "2e+18")
    assert table["predictor_ck_fppp"]["train_lineage_complete"] == "0"
    assert table["sampler_2step_frrf"]["train_core_hours"] == ""
    record = json.loads((tmp_path / "leaderboard.json").read_text())
    assert record["training_costs"]["other"]["flops"] == 7.0e17
    assert {row["key"]: row["checkpoint"] for row in record["rows"]}["predictor_ck_fppp"] == "other"
