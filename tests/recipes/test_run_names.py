"""Run names from the effective flags of the entry scripts, presets, and argparse-style
refusals of bad flags (no traceback)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import train_predictor_disca
import train_predictor_v4
import train_predictor_v4_rollout
from predictor_training.runtime.run_directory import plain_flags, run_name, subset_tag
from tests.helpers.offline_dataset import write_tiny_dataset


REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def dataset_root(tmp_path) -> Path:
    """Enough of a dataset for the flag checks (they look for dataset_config.json)."""
    root = tmp_path / "dataset"
    root.mkdir()
    (root / "dataset_config.json").write_text(json.dumps({}))
    return root


def test_run_name_of_the_recipe_defaults(dataset_root):
    args = train_predictor_v4.parse_args(["--dataset_root", str(dataset_root)])
    assert run_name(plain_flags(args), world_size=8, device_type="cuda") == (
        "predictor_v4_prefeature_blocks1-52_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab")
    args = train_predictor_disca.parse_args(["--dataset_root", str(dataset_root), "--source_blocks", "0,53",
                                             "--block_warmup_steps", "-1", "--tracker", "none"])
    assert run_name(plain_flags(args), world_size=16, device_type="cuda") == (
        "predictor_disca_blocks0-53_fp32master_16gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmupnone_notracker")


def test_presets_replace_defaults_and_explicit_flags_still_win(dataset_root, tmp_path):
    init = tmp_path / "init.safetensors"
    init.write_bytes(b"")
    common = ["--dataset_root", str(dataset_root), "--init_from", str(init)]
    demo = train_predictor_v4_rollout.parse_args([*common, "--preset", "demo", "--max_steps", "6"])
    assert (demo.source_blocks, demo.precision, demo.max_steps, demo.tracker) == ((1, 10), "fp32", 6, "none")
    assert run_name(plain_flags(demo), world_size=2, device_type="cpu",
                    subset=subset_tag(demo.subset_cases, demo.subset_seed)) == (
        "predictor_v4_rollout_fppp_demo_blocks1-10_fp32_2cpu_flr5e-4_blr5e-5_schedsteps6_swarmup2_bwarmup2_notracker")
    overfit = train_predictor_v4_rollout.parse_args([*common, "--preset", "overfit8"])
    assert run_name(plain_flags(overfit), world_size=8, device_type="cuda",
                    subset=subset_tag(overfit.subset_cases, overfit.subset_seed)) == (
        "predictor_v4_rollout_fppp_blocks1-52_overfit8_seed20260721_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000"
        "_swarmup8_bwarmup8_swanlab")


def test_rollout_run_names_record_the_schedule_and_context_mode(dataset_root, tmp_path):
    """--replace_steps and --context_mode reach the run name (the default F-P-P-P exact name is unchanged); the
    overfit8 FPPF preset is the notes' run: F-P-P-F over a 300-step schedule."""
    init = tmp_path / "init.safetensors"
    init.write_bytes(b"")
    common = ["--dataset_root", str(dataset_root), "--init_from", str(init), "--tracker", "none"]

    def name(*flags):
        args = train_predictor_v4_rollout.parse_args([*common, *flags])
        return run_name(plain_flags(args), world_size=8, device_type="cuda",
                        subset=train_predictor_v4_rollout.run_tags(args))

    assert name().startswith("predictor_v4_rollout_fppp_blocks1-52_fp32master_8gpu_")
    assert name("--replace_steps", "1,2").startswith("predictor_v4_rollout_fppf_blocks1-52_fp32master_")
    assert name("--replace_steps", "1,3", "--context_mode", "incremental").startswith(
        "predictor_v4_rollout_fpfp_blocks1-52_ctxincremental_fp32master_")
    assert name("--preset", "overfit8_fppf") == (
        "predictor_v4_rollout_fppf_blocks1-52_overfit8_seed20260721_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps300"
        "_swarmup8_bwarmup8_notracker")
    with pytest.raises(SystemExit):
        train_predictor_v4_rollout.parse_args([*common, "--replace_steps", "0,1"])


@pytest.mark.parametrize("flags, message", [
    (["--fusion_lr", "0"], "--fusion_lr=0.0: expected > 0"),
    (["--scheduler_warmup_steps", "2000"], "--scheduler_warmup_steps=2000: expected in [0, max_steps=2000)"),
    (["--velocity_weight", "0", "--hidden_weight", "0"], "nothing would be trained"),
    (["--source_blocks", "3"], "expected two distinct indices"),
])
def test_bad_flags_exit_like_argparse(dataset_root, capsys, flags, message):
    with pytest.raises(SystemExit) as refused:
        train_predictor_v4.parse_args(["--dataset_root", str(dataset_root), *flags])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and ": error: " in err and message in err, err  # one line, no usage block


def test_bad_flag_on_the_command_line_has_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "train_predictor_v4.py"), "--dataset_root",
                             str(tmp_path), "--max_steps", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "--max_steps=0: expected >= 1" in result.stderr, result.stderr


def test_print_run_dir_names_the_run_without_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    dataset = write_tiny_dataset(tmp_path / "dataset")  # the dry run checks the dataset and its Teacher
    flags = ["--dataset_root", str(dataset), "--output_root", str(tmp_path / "runs"), "--fusion_lr", "5e-4",
             "--source_blocks", "0,1", "--max_steps", "12", "--scheduler_warmup_steps", "2",
             "--block_warmup_steps", "2", "--backend", "gloo"]
    assert train_predictor_v4.main([*flags, "--print_run_dir"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "runs" / (
        "predictor_v4_prefeature_blocks0-1_fp32master_8cpu_flr5e-4_blr1e-5_schedsteps12_swarmup2_bwarmup2_swanlab"))
    assert "new run in" in err
    assert not (tmp_path / "runs").exists()


def test_config_file_values_go_through_the_flags_types_and_unknown_keys_are_errors(dataset_root, tmp_path, capsys):
    config = tmp_path / "recipe.yaml"
    config.write_text("fusion_lr: 5e-4\nsource_blocks: [0, 53]\ngradient_checkpointing: false\nmax_steps: 300\n")
    args = train_predictor_v4.parse_args(["--dataset_root", str(dataset_root), "--config", str(config),
                                          "--max_steps", "400"])
    assert args.fusion_lr == 5e-4 and isinstance(args.fusion_lr, float)  # YAML reads 5e-4 as a string
    assert args.source_blocks == (0, 53) and args.gradient_checkpointing is False
    assert args.max_steps == 400  # the command line wins over the file
    config.write_text("fusion_lrr: 1e-3\n")
    with pytest.raises(SystemExit) as refused:
        train_predictor_v4.parse_args(["--dataset_root", str(dataset_root), "--config", str(config)])
    assert refused.value.code == 2
    assert "unknown flag 'fusion_lrr'; did you mean 'fusion_lr'?" in capsys.readouterr().err
    config.write_text("verify_dataset: 1\n")
    with pytest.raises(SystemExit):
        train_predictor_v4.parse_args(["--dataset_root", str(dataset_root), "--config", str(config)])
    assert "verify_dataset=1; expected true or false" in capsys.readouterr().err


@pytest.mark.parametrize("script, flags, message", [
    ("train_adversarial", ["--r1_every", "0"], "argument --r1_every: expected >= 1, got 0"),
    ("train_adversarial", ["--discriminator_adam_beta1", "1"], "argument --discriminator_adam_beta1: expected in [0, 1)"),
    ("train_adversarial", ["--discriminator_grad_clip", "0"], "argument --discriminator_grad_clip: expected > 0, or -1"),
    ("train_nft", ["--beta", "nan"], "argument --beta: expected > 0, got nan"),
    ("train_nft", ["--sample_steps", "x"], "argument --sample_steps: invalid int value: 'x'"),
    ("train_dmd2", ["--ema_decay", "1"], "argument --ema_decay: expected in [0, 1), or -1, got 1"),
    ("train_dmd2", ["--anchor_weight", "-0.5"], "argument --anchor_weight: expected >= 0, got -0.5"),
    ("train_dmd2", ["--truth_weight", "-1"], "argument --truth_weight: expected >= 0, got -1"),
])
def test_method_flag_ranges_are_refused_by_argparse(capsys, script, flags, message):
    """The methods' range checks are argparse `type=` validators (runtime/flags.py): the error names the flag and
    the value, before any other check runs."""
    module = importlib.import_module(f"fvtools.{script}")
    with pytest.raises(SystemExit) as refused:
        module.parse_args(flags)
    assert refused.value.code == 2
    assert message in capsys.readouterr().err
