"""The leaderboard's rows (predictor_training/eval/leaderboard.py): the k-step samplers, the
2-step sampler against the 2-step Euler solver, real-config FLOPs, row specs, short labels, the baseline, and a
multi-role training state read for its Predictor."""

from __future__ import annotations

import json

import pytest
import torch

from predictor_training.eval.leaderboard import LeaderboardRows, RowSpec, build_rows, real_config_flops, sampler_plans
from predictor_training.eval.methods import PlannedMethod
from predictor_training.eval.run import EvalSettings, build_runtime, open_dataset
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.schedule import Schedule, StepPlan
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
        case_root=root / "encoded", num_latents=num_latents, checkpoints=[], schedule=Schedule((1, 2, 3)),
        dtype=torch.float32, vae_dtype=torch.float32, output_root=root / "unused")


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
