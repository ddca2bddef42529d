"""fvtools/train_df_sft.py (diffusion-forcing SFT) on tiny models (CPU).

Data: the video-latent demo (three procedural clips of 8 latents at 2 x 3 through the demo's tiny random encoders:
two train, one holdout); the model: the demo Teacher config (4 blocks, width 64). Covered: overfitting two clips,
LoRA training only the adapter, exact resume (also FSDP2 on 2 gloo ranks), strict flags, the dry run on the meta
device. One noise level per chunk (the recipe's step alone) is tested in tests/recipes/test_df_sft.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

import fvtools.train_df_sft as df_sft
import predictor_training.recipes.df_sft as df_sft_recipe
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.runtime.checkpoint import RunState, read_training_state
from predictor_training.runtime.distributed import DistEnv
from predictor_training.methods.method_model import MethodSettings, build_method_model
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.precision import precision_policy
from predictor_training.runtime.provenance import weights_sha256
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.adapters import load_lora, read_lora_header
from predictor_training.teacher.source import TeacherSource
from tests.helpers.method_world import df_sft_args, write_method_world


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("fvtools"))


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# df_sft
# ---------------------------------------------------------------------------------------------------------------
def test_df_sft_overfits_two_clips_from_scratch(world, tmp_path):
    # 80 steps at noise levels in [0.6, 1] (the velocity error is the x0 error over sigma, so the lowest levels are
    # the slowest to fit): the loss falls ~6.9-fold (160 steps in [0.2, 1] gave ~6.8); the first 16 steps are the
    # warmup, the untrained model's loss. A negated loss diverges, a model that does not learn stays near 1x.
    out = tmp_path / "overfit"
    argv = ["--preset", "demo", "--teacher", str(world["teacher"]), "--dataset_root", str(world["videos"]),
            "--output_dir", str(out), "--max_steps", "80", "--lr", "3e-3", "--warmup_steps", "16", "--sigma_min",
            "0.6", "--ckpt_every", "-1", "--no_progress", "--val_every", "0"]
    assert df_sft.main(argv) == 0
    losses = _losses(out)
    first, last = sum(losses[:16]) / 16, sum(losses[-16:]) / 16
    assert last * 5 <= first, f"loss fell from {first:.4f} to {last:.4f} only"
    exported = WorldPlayTransformer.from_pretrained(str(out / "model"))  # the result loads as a Teacher folder
    state = read_training_state(out / "training_latest.pt")["roles"]["student"]["model"]
    assert torch.equal(exported.state_dict()["img_in.proj.weight"], state["img_in.proj.weight"])


def test_df_sft_lora_changes_only_the_adapter(world, tmp_path):
    args = df_sft_args(world, tmp_path / "lora", "--train", "lora", "--lora_rank", "4", "--lora_alpha", "4",
                        "--lr", "1e-2", "--max_steps", "3", "--warmup_steps", "0")
    policy = precision_policy("fp32", CPU)
    source = TeacherSource(args.teacher, None, "--teacher", None)
    method_model = build_method_model(source, settings_from_flags(MethodSettings, args), ENV, policy,
                                      role_name="student")
    lora_names = set(method_model.role.raw_module.state_dict())
    before = {name: tensor.clone() for name, tensor in method_model.model.state_dict().items()}
    dataset = VideoLatentDataset(world["videos"], "train")
    step = df_sft_recipe.DiffusionForcingStep(method_model, df_sft_recipe.RolloutConfig(state_dtype=torch.float32),
                                              args, ENV, RunState())
    for _ in range(3):
        method_model.role.zero_grad()
        step(dataset[0], sync=True, due=frozenset({"student"}))
        method_model.role.step()
    after = method_model.model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed, "nothing trained"
    assert all(".lora_" in name for name in changed), sorted(changed)[:5]
    assert all(name.replace(".student.", ".").replace(".", "/") in lora_names for name in changed)
    # The script's own run: the checkpoint and the export hold the adapter only, and the export loads.
    out = tmp_path / "lora_run"
    assert df_sft.main(["--preset", "demo", "--teacher", str(world["teacher"]), "--dataset_root",
                        str(world["videos"]), "--output_dir", str(out), "--train", "lora", "--lora_rank", "4",
                        "--lora_alpha", "4", "--max_steps", "3", "--warmup_steps", "0", "--no_progress",
                        "--val_every", "0"]) == 0
    saved = read_training_state(out / "training_latest.pt")["roles"]["student"]["model"]
    assert set(saved) == lora_names
    assert read_lora_header(out / "lora_student.safetensors")["lora_config"]["rank"] == 4
    provenance = read_lora_header(out / "lora_student.safetensors")["metadata"]["provenance"]  # runtime/provenance.py
    assert provenance["teacher_sha256"] == weights_sha256(world["teacher"]) and provenance["parent_sha256"] is None
    assert provenance["names"]["dataset_config"].endswith("video_dataset_config.json")
    fresh = WorldPlayTransformer.from_pretrained(str(world["teacher"]))
    load_lora(fresh, out / "lora_student.safetensors")
    tensors = safetensors.torch.load_file(str(out / "lora_student.safetensors"))
    assert any(name.endswith("lora_B.weight") and tensor.abs().sum() > 0 for name, tensor in tensors.items())


def test_df_sft_resume_equals_an_uninterrupted_run(world, tmp_path, capsys):
    """The continued launch runs steps 4..6 from the saved state (a restart from step 0 would log the same
    deterministic losses, so the steps it ran are checked too)."""
    common = ["--max_steps", "6", "--warmup_steps", "1", "--ckpt_every", "3"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert df_sft.main([*map(str, _argv(world, whole)), *common]) == 0
    assert df_sft.main([*map(str, _argv(world, split)), *common, "--stop_at_step", "3"]) == 0
    assert len(_losses(split)) == 3
    capsys.readouterr()
    assert df_sft.main([*map(str, _argv(world, split)), *common]) == 0  # the directory's own run continues
    assert "4..6 of a 6-step schedule" in capsys.readouterr().out
    assert _losses(split) == _losses(whole)


def _argv(world, out: Path) -> list[str]:
    return ["--preset", "demo", "--teacher", world["teacher"], "--dataset_root", world["videos"], "--output_dir", out,
            "--no_progress", "--val_every", "0"]  # validation: tests/recipes/test_method_validation.py


def test_df_sft_flags_and_config_are_strict(world, tmp_path, capsys):
    config = tmp_path / "recipe.yaml"
    config.write_text("lr: 1e-4\nchunks_per_clip: 3\n")
    args = df_sft_args(world, tmp_path / "cfg", "--config", str(config))
    assert args.lr == 1e-4 and isinstance(args.lr, float) and args.chunks_per_clip == 3
    config.write_text("learning_rate: 1e-4\n")
    with pytest.raises(SystemExit) as exit_info:
        df_sft_args(world, tmp_path / "cfg", "--config", str(config))
    assert exit_info.value.code == 2
    assert "unknown flag 'learning_rate'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        df_sft_args(world, tmp_path / "cfg", "--sigma_min", "0.5", "--sigma_max", "0.4")
    assert "--sigma_min=0.5 --sigma_max=0.4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        df_sft_args(world, tmp_path / "cfg", "--data", "teacher_samples")
    assert "expected a dataset folder with dataset_config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        df_sft.parse_args(["--teacher", str(world["teacher"])])
    assert "--dataset_root missing" in capsys.readouterr().err


def test_dry_run_counts_the_real_config_on_the_meta_device(capsys):
    assert df_sft.main(["--dry_run", "worldplay_480p_i2v"]) == 0
    report = capsys.readouterr().out
    assert "8,557,933,856 parameters" in report
    assert "role student: LoRA rank 64: 141,557,760 trained parameters" in report


def test_df_sft_fsdp_two_ranks_resume_equals_an_uninterrupted_run(world, tmp_path):
    """--train full under torchrun: FSDP2 shards, gradients through the context prefill (a dataclass of tensors that
    require grad passes FSDP's forward hooks), and a stop + continue that reproduces the uninterrupted losses."""
    import itertools
    import os
    import subprocess
    import sys

    numbers = itertools.count()

    def launch(out: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(Path(df_sft.__file__)), *map(str, _argv(world, out)), "--max_steps", "4", "--warmup_steps",
                   "1", "--chunks_per_clip", "1", "--ckpt_every", "2", *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                              os.environ.get("PYTHONPATH", "")])}
        console = tmp_path / f"launch_{next(numbers)}.log"
        with console.open("w") as file:
            return subprocess.Popen(command, stdout=file, stderr=subprocess.STDOUT, env=env), console

    def finish(*launches: tuple[subprocess.Popen, Path]) -> None:
        try:
            for process, console in launches:
                assert process.wait(timeout=300) == 0, console.read_text()[-6000:]
        finally:
            for process, _ in launches:
                if process.poll() is None:
                    process.kill()
                    process.wait()

    whole, split = tmp_path / "whole", tmp_path / "split"
    # The uninterrupted run is independent of the split one: it runs while the split one stops and continues (most
    # of a launch is three processes importing torch; a standalone rendezvous takes its own free port).
    uninterrupted = launch(whole)
    try:
        finish(launch(split, "--stop_at_step", "2"))
        assert len(_losses(split)) == 2
        finish(launch(split))  # the directory's own run continues
    finally:
        finish(uninterrupted)
    assert len(_losses(whole)) == 4 and _losses(split) == _losses(whole)
    config = json.loads((whole / "train_config.json").read_text())
    assert config["derived"]["world_size"] == 2
    exported = WorldPlayTransformer.from_pretrained(str(whole / "model"))
    assert exported.img_in.proj.weight.shape == WorldPlayTransformer.from_pretrained(
        str(world["teacher"])).img_in.proj.weight.shape
