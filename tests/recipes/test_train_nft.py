"""fvtools/train_nft.py (DiffusionNFT) on tiny models (CPU, single process).

Data: the video-latent demo (three procedural clips of 8 latents at 2 x 3, two train, one holdout, through the
demo's tiny random encoders and VAE); the model: the demo Teacher config (4 blocks, width 64). The NFT loss itself
(sign, zero advantage, toy convergence) and the rewards are tested in tests/methods/; the 2-rank path runs here and
in the launcher demo; the recipe's step and build (one real step, advantages, sampling) in tests/recipes/test_nft.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fvtools.train_nft as nft
import predictor_training.recipes.nft as nft_recipe
from predictor_training.runtime.checkpoint import read_training_state
from predictor_training.runtime.flags import settings_from_flags
from tests.helpers.method_world import nft_argv, write_method_world
from tests.helpers.two_ranks import assert_finished, run_two_ranks


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("nft"))


def test_flags_are_checked(world, tmp_path, capsys):
    with pytest.raises(SystemExit):
        nft.parse_args(nft_argv(world, tmp_path, "--rewards", "aesthetic:1"))
    assert "unknown reward 'aesthetic'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nft.parse_args(nft_argv(world, tmp_path, "--samples_per_group", "1"))
    assert "argument --samples_per_group: expected >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nft.parse_args(nft_argv(world, tmp_path, "--reference_video", "none"))
    assert "--reference_video none has none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nft.parse_args(nft_argv(world, tmp_path, "--reference_video", "ground_truth"))
    assert "--ground_truth=None: expected a folder" in capsys.readouterr().err


def test_sigma_and_advantage_flags(world, tmp_path, capsys):
    """Defaults: the sampler's sigma grid and the global advantage std. A continuous range below the distilled
    Teacher's lowest trained sigma is refused for a policy that starts from it, unless forced."""
    args = nft.parse_args(nft_argv(world, tmp_path))
    assert (args.train_sigmas, args.advantage_std, args.sigma_min) == ("sampler_grid", "global", 0.625)
    grid = nft.sampler_sigma_grid(args.sample_steps, args.sample_shift)
    assert nft.describe_train_sigmas(settings_from_flags(nft.TrainSigmas, args), grid) == \
        "on the sampler's grid {1, 0.9375, 0.8333, 0.625}"
    assert nft.parse_args(nft_argv(world, tmp_path, "--train_sigmas", "range")).sigma_min == 0.625
    with pytest.raises(SystemExit):
        nft.parse_args(nft_argv(world, tmp_path, "--train_sigmas", "range", "--sigma_min", "0.2"))
    error = capsys.readouterr().err
    assert "--sigma_min=0.2 with --train_sigmas range" in error and "--allow_sigma_below_teacher" in error
    forced = nft.parse_args(nft_argv(world, tmp_path, "--train_sigmas", "range", "--sigma_min", "0.2",
                                  "--allow_sigma_below_teacher"))
    assert forced.sigma_min == 0.2
    scratch = nft.parse_args(nft_argv(world, tmp_path, "--train", "full", "--init_weights", "scratch", "--train_sigmas",
                                   "range", "--sigma_min", "0.2"))  # not the distilled Teacher: no floor
    assert scratch.sigma_min == 0.2
    with pytest.raises(SystemExit):
        nft.parse_args(nft_argv(world, tmp_path, "--sigma_min", "0.7"))
    assert "--sigma_min=0.7 with --train_sigmas sampler_grid" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        nft.parse_args(nft_argv(world, tmp_path, "--advantage_std", "batch"))
    assert "invalid choice: 'batch'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------------------------
def _log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


def test_resume_equals_an_uninterrupted_run(world, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    common = ["--ckpt_every", "2", "--monitor_every", "3"]
    assert nft.main(nft_argv(world, whole, *common)) == 0
    assert nft.main(nft_argv(world, split, *common, "--stop_at_step", "2")) == 0
    assert nft.main(nft_argv(world, split, *common)) == 0  # the directory's own run continues at step 3
    timing = ("time/", "memory/")
    strip = [{key: value for key, value in record.items() if not key.startswith(timing)} for record in _log(whole)]
    resumed = [{key: value for key, value in record.items() if not key.startswith(timing)} for record in _log(split)]
    assert resumed == strip  # rewards, advantages, sample checksums, losses, monitors: bit for bit
    assert strip[2]["samples/checksum"] != strip[1]["samples/checksum"]
    saved = {run: read_training_state(run / "training_latest.pt")["roles"][nft_recipe.ROLE]
             for run in (whole, split)}
    for name, tensor in saved[whole]["model"].items():  # the policy
        assert torch.equal(tensor, saved[split]["model"][name])
    assert saved[whole]["ema"]["updates"] == saved[split]["ema"]["updates"] == 4
    for name, tensor in saved[whole]["ema"]["weights"].items():  # the old policy
        assert torch.equal(tensor, saved[split]["ema"]["weights"][name])
    assert any(not torch.equal(tensor, saved[whole]["model"][name])  # old policy lags (ramp_slow decay > 0)
               for name, tensor in saved[whole]["ema"]["weights"].items())
    # after training: policy vs reference, same noise
    report = json.loads((whole / nft_recipe.EVAL_NAME).read_text())
    assert len(report["clips"]) == 1 and report["split"] == "holdout" and report["step"] == 4
    assert set(report["reward_policy"]) == {"reference_agreement", "smoothness", "total"}
    assert report["reward_policy"]["total"] != report["reward_reference"]["total"]
    assert json.loads((split / nft_recipe.EVAL_NAME).read_text()) == report


def test_two_ranks_gather_the_groups_and_keep_the_policy_identical(world, tmp_path):
    """torchrun x2 (gloo): one group per rank, advantages over the gathered table, 2 steps with a checkpoint after
    each. The loop's checkpoint refuses replicas that differ over ranks, so finishing proves the all-reduced LoRA
    policy stayed identical on both ranks; the held-out comparison is sharded over the ranks and gathered."""
    run_dir = tmp_path / "run"
    result = run_two_ranks("fvtools/train_nft.py", *nft_argv(world, run_dir, "--max_steps", "2", "--ckpt_every", "1",
                                                          "--eval_clips", "1"))
    assert_finished(result)
    assert read_training_state(run_dir / "training_latest.pt")["world_size"] == 2
    log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    assert [record["step"] for record in log] == [1, 2]
    assert all(torch.isfinite(torch.tensor(record["loss"])) for record in log)
    assert (run_dir / "nft_eval.json").is_file()


def test_validation_reports_held_out_rewards_and_changes_no_training(world, tmp_path):
    plain, validated = tmp_path / "plain", tmp_path / "validated"
    assert nft.main(nft_argv(world, plain, "--max_steps", "2")) == 0
    assert nft.main(nft_argv(world, validated, "--max_steps", "2", "--val_every", "1", "--val_videos", "1")) == 0
    timing = ("time/", "memory/", "val/")
    assert ([{k: v for k, v in row.items() if not k.startswith(timing)} for row in _log(validated)]
            == [{k: v for k, v in row.items() if not k.startswith(timing)} for row in _log(plain)])
    figures = [row for row in _log(validated) if "val/psnr_vs_truth" in row]
    assert [row["step"] for row in figures] == [1, 2]
    for row in figures:
        assert {"val/reward/total", "val/reward_reference/total", "val/psnr_vs_reference"} <= set(row)
    assert figures[0]["val/reward_reference/total"] == figures[1]["val/reward_reference/total"]  # a fixed reference
    assert (validated / "best.json").is_file() and (validated / "val_curve.png").is_file()
