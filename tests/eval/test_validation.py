"""Held-out validation while training (predictor_training/eval/validation.py, the loop's --val_every).

The rollout recipe on the tiny rollout setup of tests/helpers/rollout_setup.py, with a held-out table and a tiny VAE
beside the Teacher: validation reports the same figures whether the run was interrupted or not, a run that
validates every step trains bit-identically to one that never does, and a validation moves no global random
state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from predictor_training.data.dataset_config import resolve_teacher_source
from predictor_training.data.trajectory_dataset import trajectory_batches
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.precision import precision_policy
from tests.helpers.random_states import validated_keeping_random_states
from tests.helpers.rollout_setup import trainer_args, write_rollout_setup


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from diffusers import AutoencoderKLHunyuanVideo15

    root = tmp_path_factory.mktemp("validation")
    paths = write_rollout_setup(root, num_latents=8, case_ids=["c000", "c001"], actions=(0, 3))
    holdout = paths["table"].with_name("holdout25.jsonl")
    shutil.copy(paths["table"], holdout)
    config_path = paths["dataset"] / "dataset_config.json"
    config = json.loads(config_path.read_text())
    config["sample_tables"].append(str(holdout))
    config_path.write_text(json.dumps(config))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                          spatial_compression_ratio=16, temporal_compression_ratio=4)
    vae.save_pretrained(str(root / "encoders" / "vae"))  # beside the Teacher: the demo assets' layout
    return paths


def argv(paths: dict, run_dir: Path, *extra: str) -> list[str]:
    common = ["--init_from", str(paths["init"]), "--max_steps", "3", "--scheduler_warmup_steps", "1",
              "--block_warmup_steps", "1", "--fusion_lr", "1e-3", "--blocks_lr", "1e-4", "--ckpt_every", "1",
              "--val_videos", "3"]
    return trainer_args(paths, run_dir, *common, *extra)


def run(paths: dict, run_dir: Path, *extra: str) -> list[dict]:
    import train_predictor_v4_rollout as trainer

    assert trainer.main(argv(paths, run_dir, *extra)) == 0
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


def losses(log: list[dict]) -> list[float]:
    return [row["loss"] for row in log]


def val_rows(log: list[dict]) -> dict[int, dict]:
    return {row["step"]: {key: value for key, value in row.items() if key.startswith("val/") and key != "val/seconds"}
            for row in log if "val/psnr_vs_reference" in row}


def test_validation_leaves_training_unchanged_and_resumes_exactly(setup, tmp_path):
    plain = run(setup, tmp_path / "plain")
    validated = run(setup, tmp_path / "validated", "--val_every", "1")
    assert losses(validated) == losses(plain)
    weights = "predictor_step_00003.safetensors"
    a, b = load_file(tmp_path / "plain" / weights), load_file(tmp_path / "validated" / weights)
    assert all(torch.equal(a[key], b[key]) for key in a)

    figures = val_rows(validated)
    assert sorted(figures) == [1, 2, 3]
    assert all(row["val/videos"] == 3.0 for row in figures.values())
    assert all(0 < row["val/psnr_vs_reference"] < 100 for row in figures.values())
    assert figures[1] != figures[3]  # the Predictor trained between them
    best = json.loads((tmp_path / "validated" / "best.json").read_text())
    best_step = max(figures, key=lambda step: figures[step]["val/psnr_vs_reference"])
    assert best["step"] == best_step and best["metric"] == "val/psnr_vs_reference"
    assert (tmp_path / "validated" / "validation" / "step_00003.png").is_file()
    assert (tmp_path / "validated" / "val_curve.png").is_file()

    run(setup, tmp_path / "cut", "--val_every", "1", "--stop_at_step", "2")
    resumed = run(setup, tmp_path / "cut", "--val_every", "1")
    assert val_rows(resumed) == figures


def test_validation_leaves_every_random_state_as_it_found_it(setup, tmp_path):
    """The recipe's validation as its own `build` makes it (PredictorValidation), called at two steps: the first
    call rolls out and caches the references, the second reuses them; neither moves a global random state."""
    import train_predictor_v4_rollout as trainer

    args = trainer.parse_args(argv(setup, tmp_path / "run", "--val_every", "1", "--val_videos", "1"))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
    policy = precision_policy(args.precision, env.device)
    data = trajectory_batches(args.dataset_root, args.split, env, sample_table=None, seed=args.seed, num_workers=0,
                              verify=False, state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype)
    parts = trainer.build(args, env, policy, dataset=data.dataset, rollout_config=data.rollout_config,
                          teacher_source=resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root),
                          run_dir=tmp_path / "run")
    figures = validated_keeping_random_states(parts.validation, [1, 2])
    assert all(row["val/videos"] == 1.0 for row in figures.values())


def test_validation_without_a_vae_is_refused(setup, tmp_path, capsys):
    import train_predictor_v4_rollout as trainer

    with pytest.raises(SystemExit):
        trainer.main(trainer_args(setup, tmp_path / "r", "--init_from", str(setup["init"]), "--val_every", "1",
                                  "--val_vae", str(tmp_path / "missing")))
    assert "--val_vae" in capsys.readouterr().err
