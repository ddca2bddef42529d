"""Held-out validation of the fvtools methods while they train (--val_every; predictor_training/eval/validation.py
ClipRolloutValidation): on the tiny method world, a run that validates every step trains bit-identically to one that
never does, and logs its val/* figures, best.json, the contact sheets and val_curve.png."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fvtools.train_df_sft as df_sft
import fvtools.train_dmd2 as dmd2
import fvtools.train_kd as kd
import predictor_training.recipes.kd as kd_recipe
from predictor_training.data.ode_cache import OdeCacheDataset
from predictor_training.eval.validation import ClipRolloutValidation
from predictor_training.methods.rewards import default_vae_folder
from predictor_training.runtime.precision import precision_policy
from tests.helpers.method_world import ENV, dmd2_argv, write_dmd2_world, write_method_world, write_ode_cache
from tests.helpers.random_states import validated_keeping_random_states


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("fvval"))


def _log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


def _training(log: list[dict]) -> list[dict]:
    """Each logged row without its validation figures and timings."""
    return [{key: value for key, value in row.items() if not key.startswith(("val/", "time/", "memory/"))}
            for row in log]


def _val_rows(log: list[dict], metric: str) -> dict[int, dict]:
    return {row["step"]: {key: value for key, value in row.items() if key.startswith("val/") and key != "val/seconds"}
            for row in log if metric in row}


def _same_weights(a: Path, b: Path) -> None:
    left, right = load_file(a), load_file(b)
    assert sorted(left) == sorted(right)
    assert all(torch.equal(left[key], right[key]) for key in left)


def _check_validated(run_dir: Path, log: list[dict], metric: str, steps: list[int]) -> dict[int, dict]:
    figures = _val_rows(log, metric)
    assert sorted(figures) == steps
    assert all(0 < row[metric] < 100 for row in figures.values())
    assert figures[steps[0]] != figures[steps[-1]]  # the model trained between them
    best = json.loads((run_dir / "best.json").read_text())
    assert best["metric"] == metric and best["step"] == max(figures, key=lambda step: (figures[step][metric], -step))
    assert (run_dir / "validation" / f"step_{steps[-1]:05d}.png").is_file()
    assert (run_dir / "val_curve.png").is_file()
    return figures


# ---------------------------------------------------------------------------------------------------------------
# df_sft
# ---------------------------------------------------------------------------------------------------------------
def _df_sft(world, out: Path, *extra: str) -> list[dict]:
    argv = ["--preset", "demo", "--teacher", str(world["teacher"]), "--dataset_root", str(world["videos"]),
            "--output_dir", str(out), "--no_progress", "--max_steps", "3", "--warmup_steps", "1",
            "--ckpt_every", "-1", "--val_every", "0", *extra]
    assert df_sft.main(argv) == 0
    return _log(out)


@pytest.mark.slow
def test_df_sft_validation_leaves_training_unchanged_and_resumes_exactly(world, tmp_path):
    plain = _df_sft(world, tmp_path / "plain")
    validated = _df_sft(world, tmp_path / "validated", "--val_every", "1")
    assert _training(validated) == _training(plain)
    _same_weights(tmp_path / "plain" / "model" / "diffusion_pytorch_model.safetensors",
                  tmp_path / "validated" / "model" / "diffusion_pytorch_model.safetensors")
    figures = _check_validated(tmp_path / "validated", validated, "val/psnr_vs_truth", [1, 2, 3])
    assert all(row["val/videos"] == 1.0 for row in figures.values())  # the world has one holdout clip
    assert all("val/ssim_last_chunk_vs_truth" in row for row in figures.values())
    # Resumed at step 2, the run validates at the same steps with the same figures.
    _df_sft(world, tmp_path / "cut", "--val_every", "1", "--stop_at_step", "2")
    resumed = _df_sft(world, tmp_path / "cut", "--val_every", "1")
    assert _val_rows(resumed, "val/psnr_vs_truth") == figures


def test_df_sft_refuses_validation_on_teacher_samples(world, tmp_path, capsys):
    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "dataset_config.json").write_text("{}")  # parse_args only checks that the dataset is marked built
    argv = ["--teacher", str(world["teacher"]), "--no_action_ckpt", "--dataset_root", str(samples), "--data",
            "teacher_samples"]
    assert df_sft.parse_args(argv).val_every == 0  # off by default
    with pytest.raises(SystemExit):
        df_sft.parse_args([*argv, "--val_every", "5"])
    assert "--val_every=5 with --data teacher_samples" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# kd
# ---------------------------------------------------------------------------------------------------------------
def _kd_argv(world, cache: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "demo", "--teacher", str(world["teacher"]), "--cache_root", str(cache), "--output_dir",
            str(out), "--no_progress", "--max_steps", "3", "--warmup_steps", "1", "--ckpt_every", "-1",
            "--eval_samples", "1", "--val_every", "0", *extra]


def _kd(world, cache: Path, out: Path, *extra: str) -> list[dict]:
    assert kd.main(_kd_argv(world, cache, out, *extra)) == 0
    return _log(out)


def test_kd_validation_leaves_training_unchanged(world, tmp_path, capsys):
    cache = write_ode_cache(world, tmp_path / "cache", steps=8)
    plain = _kd(world, cache, tmp_path / "plain")
    vae = default_vae_folder(world["videos"]) / "vae"  # --val_vae names the VAE folder itself
    validated = _kd(world, cache, tmp_path / "validated", "--val_every", "1", "--val_vae", str(vae))
    assert _training(validated) == _training(plain)
    _same_weights(tmp_path / "plain" / "model" / "diffusion_pytorch_model.safetensors",
                  tmp_path / "validated" / "model" / "diffusion_pytorch_model.safetensors")
    figures = _check_validated(tmp_path / "validated", validated, "val/psnr_vs_teacher", [1, 2, 3])
    assert all(row["val/videos"] == 1.0 for row in figures.values())
    # The validation as kd's own build makes it (ClipRolloutValidation) moves no global random state, on its first
    # call (which draws and caches its inputs) or later.
    args = kd.parse_args(_kd_argv(world, cache, tmp_path / "checked", "--val_every", "1", "--val_vae", str(vae)))
    state_indices = kd_recipe.student_state_indices(args.student_steps, args.student_shift,
                                                    OdeCacheDataset(cache, "train").stored_sigmas)
    parts = kd_recipe.build(args, ENV, precision_policy(args.precision, ENV.device), state_indices=state_indices,
                            run_dir=tmp_path / "checked")
    assert isinstance(parts.validation, ClipRolloutValidation)
    validated_keeping_random_states(parts.validation, [1, 2])
    # The cache of this test records no source dataset: without --val_vae validation is refused by name.
    with pytest.raises(SystemExit):
        kd.parse_args(["--teacher", str(world["teacher"]), "--cache_root", str(cache), "--val_every", "5"])
    assert "pass --val_vae" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# dmd2
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dmd2_world(tmp_path_factory) -> dict[str, Path]:
    return write_dmd2_world(tmp_path_factory.mktemp("dmd2"))


@pytest.mark.parametrize("generator", ["predictor", "student"])
def test_dmd2_validation_leaves_training_unchanged(dmd2_world, tmp_path, generator):
    extra = ["--max_steps", "2", "--generator_every", "1", "--monitor_every", "1", "--ckpt_every", "1",
             "--val_every", "0"]
    if generator == "student":
        extra = ["--generator", "student", "--train", "lora", "--lora_rank", "4", "--lora_alpha", "4", *extra]

    def argv(out: Path, *more: str) -> list[str]:
        args = dmd2_argv(dmd2_world, out, *extra, *more)
        if generator == "student":
            args.remove("--init_from")
            args.remove(str(dmd2_world["init"]))
        return args

    plain, validated = tmp_path / "plain", tmp_path / "validated"
    assert dmd2.main(argv(plain)) == 0
    assert dmd2.main(argv(validated, "--val_every", "1")) == 0
    assert _training(_log(validated)) == _training(_log(plain))
    weights = sorted(path.relative_to(plain) for path in plain.rglob("*.safetensors"))
    assert weights
    for name in weights:
        _same_weights(plain / name, validated / name)
    figures = _check_validated(validated, _log(validated), "val/psnr_vs_truth", [1, 2])
    for row in figures.values():
        assert 0 < row["val/psnr_vs_teacher"] <= 100  # 100: identical (a fresh LoRA student)
        assert row["val/monitor/std_ratio"] > 0 and "val/monitor/chunk1/temporal_ratio" in row
