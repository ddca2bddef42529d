"""The eval's library entry point (predictor_training/eval/run.py) on the tiny eval world: an empty
schedule reproduces the reference, ground truth refused before the run, run names and context-mode lists (the dtype
choice and the Teacher check: tests/eval/test_settings.py)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from predictor_training.eval import (
    REUSE_HIDDEN,
    REUSE_VELOCITY,
    EvalSettings,
    ReferenceMethod,
    default_run_name,
    label_checkpoints,
    parse_context_modes,
    read_predictor_checkpoint,
    run_evaluation,
)
from predictor_training.eval.run import MethodRows
from predictor_training.rollout.schedule import StepPlan, parse_replace_steps
from predictor_training.runtime.distributed import init_distributed
from predictor_training.teacher.source import TeacherSource
from tests.helpers.eval_world import (
    CLI_FRAMES,
    CLI_LATENTS,
    RUN_DIR_NAME,
    STEP,
    eval_settings,
    write_eval_world,
    write_ground_truth,
)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("eval_world"))


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_no_replaced_steps_reproduce_the_reference(world, tmp_path):
    """The library entry point without the command line: an empty schedule makes every method the reference."""
    root = world["root"]
    settings = EvalSettings(
        teacher_source=TeacherSource(root / "teacher", None, "--teacher", None), vae=root / "vae",
        sample_table=root / "samples" / "holdout25.jsonl", split="holdout25", case_source="encoded",
        case_root=root / "encoded", num_latents=CLI_LATENTS, checkpoints=[world["ckpt"]],
        plan=StepPlan.from_steps(parse_replace_steps("")), dtype=torch.float32, vae_dtype=torch.float32,
        output_root=tmp_path, max_videos=1, num_side_by_side=0, lpips_random_backbone=True, warmup_chunks=1,
        progress=False,
    )
    report = run_evaluation(settings, init_distributed("gloo"))
    run_dir = tmp_path / f"{RUN_DIR_NAME}_ckptstep{STEP}_ffff_holdout25"
    assert report["out_dir"] == run_dir and report["computed"] == ["c000__a0"] and report["skipped"] == 0
    methods = _json(run_dir / "aggregate.json")["methods"]
    for name in (REUSE_VELOCITY, REUSE_HIDDEN, f"predictor_ckptstep{STEP}"):
        metrics = methods[name]["metrics"]
        assert metrics["mse"] == 0 and metrics["psnr_full"] == "inf" and metrics["ssim"] == 1.0
        assert metrics["identical_frames"] == metrics["num_frames"] == (CLI_LATENTS - 1) * 4 + 1
        assert methods[name]["speedup"]["flop_bound_dit"] == 1.0
    assert "| inf |" in (run_dir / "table.md").read_text() and "| inf |" in report["table"]


def test_missing_ground_truth_fails_before_anything_runs(world, tmp_path):
    truth = write_ground_truth(tmp_path / "truth", ("c000__a0",))  # the split also has c000__a2
    with pytest.raises(FileNotFoundError, match=re.escape(str(truth / "c000__a2.mp4"))) as error:
        run_evaluation(eval_settings(world, tmp_path / "out", ground_truth=truth), init_distributed("gloo"))
    assert "1 of 2 rows" in str(error.value) and str(truth / "c000__a0") not in str(error.value)
    assert not (tmp_path / "out").exists()  # refused before the run directory, so before any rollout


class CountedReference(ReferenceMethod):
    """The reference, keeping the (chunk, step) of every step it runs."""

    def __init__(self, steps: list):
        self.steps = steps

    def run_step(self, call, *args, **kwargs):
        self.steps.append((call.chunk_index, call.step_index))
        return super().run_step(call, *args, **kwargs)


class ReferenceOnly(MethodRows):
    """Method rows of the counted reference alone."""

    def __init__(self):
        self.steps = []

    def record(self) -> list:
        return ["counted reference"]

    def build(self, teacher, predictors) -> list:
        return [CountedReference(self.steps)]


def test_ground_truth_of_another_length_is_an_error_naming_the_file(world, tmp_path):
    truth = write_ground_truth(tmp_path / "truth", ("c000__a0",), num_frames=CLI_FRAMES - 1)
    rows = ReferenceOnly()
    expected = f"{truth / 'c000__a0'}: ground-truth frame count is {CLI_FRAMES - 1}, expected {CLI_FRAMES}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        run_evaluation(eval_settings(world, tmp_path / "out", ground_truth=truth, max_videos=1),
                       init_distributed("gloo"), rows)
    assert rows.steps == [], "a rollout ran before the ground truth's shape was checked"


def test_run_names_follow_the_convention(world):
    ckpt = read_predictor_checkpoint(world["ckpt"])
    other = dataclasses.replace(ckpt, step=300)
    foreign = dataclasses.replace(ckpt, run_name="disca_run", step=300)
    fppp, fppf = StepPlan.from_steps((1, 2, 3)), StepPlan.from_steps((1, 2))
    assert default_run_name([ckpt], fppp, "holdout50") == f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout50"
    assert default_run_name([ckpt, other], fppf, "train") == f"{RUN_DIR_NAME}_ckptstep5+300_fppf_train"
    assert default_run_name([], fppp, "holdout25") == "reuse_fppp_holdout25"
    assert default_run_name([ckpt], fppp, "holdout50", ("exact",)) == (
        f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout50")
    assert default_run_name([ckpt], fppp, "holdout50", ("last_step", "incremental")) == (
        f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout50_ctx-incremental+last_step")
    assert default_run_name([], fppf, "train", ("exact", "last_step")) == "reuse_fppf_train_ctx-last_step"
    # Two runs of the recipes' long names pass 255 characters: the first run's part, the count of the others and a
    # digest of the full name stand for them, the same every time (a rerun resumes).
    long_a = dataclasses.replace(ckpt, run_name="predictor_v4_prefeature_" + "x" * 110, step=2000)
    long_b = dataclasses.replace(ckpt, run_name="predictor_v4_rollout_fppp_" + "y" * 110, step=2000)
    name = default_run_name([long_a, long_b], fppp, "holdout25", ("exact", "incremental"))
    assert len(name) <= 255 and name == default_run_name([long_a, long_b], fppp, "holdout25", ("exact", "incremental"))
    assert re.fullmatch(rf"{long_a.run_name}_ckptstep2000__and1more_[0-9a-f]{{8}}_fppp_holdout25_ctx-incremental",
                        name), name
    single = dataclasses.replace(ckpt, run_name="r" * 300)
    assert len(default_run_name([single], fppf, "train")) == 255
    assert default_run_name([ckpt], StepPlan.from_steps((3,), (1, 2)), "holdout25") == (
        f"{RUN_DIR_NAME}_ckptstep{STEP}_frrp_holdout25")
    # exact is always run, first; the others in the order of CONTEXT_MODES, each once
    assert parse_context_modes("exact") == ("exact",) and parse_context_modes("incremental") == ("exact", "incremental")
    assert parse_context_modes(" last_step,exact,incremental,last_step") == ("exact", "incremental", "last_step")
    with pytest.raises(ValueError, match="--context_modes 'exact,': expected a comma-separated list"):
        parse_context_modes("exact,")
    labelled = label_checkpoints([ckpt, foreign])
    assert [item.label for item in labelled] == [f"{RUN_DIR_NAME}_ckptstep{STEP}", "disca_run_ckptstep300"]
    assert [item.panel for item in labelled] == [f"#1 ckptstep{STEP}", "#2 ckptstep300"]
    assert label_checkpoints([ckpt])[0].panel == f"ckptstep{STEP}"
    with pytest.raises(ValueError, match="twice"):
        label_checkpoints([ckpt, ckpt])
