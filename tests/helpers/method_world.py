"""The tiny world the fvtools method tests train on (df_sft, kd, dmd2, nft), built once per test
module: `write_method_world` (a demo-config Teacher and a 3-clip video-latent dataset), a trained-looking v4
Predictor, an ODE cache of its clips (`write_ode_cache`), the dmd2 world (`write_dmd2_world`, with a real-score LoRA),
the dmd2 command line on it (`dmd2_argv`) and one dmd2 step built by the recipe's own `build` from the script's flags
(`build_dmd2_step`); the nft and df_sft command lines on the method world (`nft_argv`, `df_sft_args`)."""

from __future__ import annotations

from pathlib import Path

import torch

import fvtools.train_df_sft as train_df_sft
import fvtools.train_dmd2 as train_dmd2
import predictor_training.recipes.dmd2 as dmd2
from predictor_training.data import video_latent_build as vb
from predictor_training.data.ode_cache import CacheJob, CacheSettings, build_cache
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.precision import precision_policy
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.adapters import add_lora, save_lora
from predictor_training.world import video_latent_demo as vd


def write_method_world(root: Path) -> dict[str, Path]:
    """A demo-config Teacher folder (random weights, every path active, the same whichever tests ran before) and a
    3-clip video-latent demo dataset (two train clips, one holdout) under `root`.
    Returns {"root", "teacher", "videos"}."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        teacher = WorldPlayTransformer.from_preset("demo")
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(0))
    teacher.save_pretrained(str(root / "teacher"))
    options = vb.VideoBuildOptions(
        clips=vd.demo_tables(root / "demo"), encoders=root / "demo" / vd.DEMO_ENCODERS_DIR, out=root / "videos",
        height=vd.DEMO_HEIGHT, width=vd.DEMO_WIDTH, num_frames=vd.DEMO_NUM_FRAMES, dtype="float32", device="cpu",
        demo=root / "demo", demo_clips=3, demo_holdout=1,
    )
    assert vb.run(options, prepare_demo=vd.prepare_demo_inputs) == 0
    return {"root": root, "teacher": root / "teacher", "videos": root / "videos"}


def write_trained_looking_predictor(teacher_dir: Path, out: Path, generator: torch.Generator) -> Path:
    """A v4 Predictor on blocks 1, 2 of the Teacher in `teacher_dir`, its zero-initialised output layers made
    non-zero from `generator` (so every parameter gets a gradient through the latent path), saved as inference
    weights at `out`."""
    from predictor_training.predictor.model import build_predictor
    from predictor_training.runtime.checkpoint import checkpoint_meta
    from predictor_training.runtime.inference_weights import save_inference_weights
    predictor = build_predictor(WorldPlayTransformer.from_pretrained(str(teacher_dir)), "v4", (1, 2))
    with torch.no_grad():
        for param in predictor.parameters():
            if param.requires_grad and not param.abs().sum() > 0:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    save_inference_weights(out, predictor, dtype=torch.float32,
                           metadata={**checkpoint_meta("v4", (1, 2), "fp32"), "step": 0})
    return out


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)


def write_ode_cache(world, out: Path, steps: int = 8) -> Path:
    """An 8-step (or `steps`) ODE cache of the world's three clips (train 0, 1 and holdout 0; seeds 100..102) under
    `out`, built in this process; returns `out`."""
    teacher = WorldPlayTransformer.from_pretrained(str(world["teacher"])).eval().requires_grad_(False)
    datasets = {split: VideoLatentDataset(world["videos"], split) for split in ("train", "holdout")}
    jobs = [CacheJob(index, f"{split}{position}", split, 100 + index, (split, position))
            for index, (split, position) in enumerate([("train", 0), ("train", 1), ("holdout", 0)])]
    settings = CacheSettings(steps=steps, shift=5.0, store_grid=4, compute_dtype="float32", storage_dtype="float32")
    build_cache(teacher, jobs, lambda job: datasets[job.condition[0]][job.condition[1]], settings, out, env=ENV,
                inputs={"test": True})
    return out


def write_dmd2_world(root: Path) -> dict[str, Path]:
    """The method world under `root`, a trained-looking v4 Predictor on blocks 1, 2 to start from and a real-score
    LoRA file on its Teacher. Returns {"teacher", "videos", "init", "real_lora"}."""
    write_method_world(root)
    teacher = WorldPlayTransformer.from_pretrained(str(root / "teacher"))
    generator = torch.Generator().manual_seed(1)
    init = write_trained_looking_predictor(root / "teacher", root / "predictor_init.safetensors", generator)
    # A real-score LoRA file on the Teacher (random B, so it differs from the Teacher).
    add_lora(teacher, "real_score", 4, 4.0)
    with torch.no_grad():
        for name, param in teacher.named_parameters():
            if ".lora_B.real_score" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    save_lora(teacher, "real_score", root / "real_score_lora.safetensors")
    return {"teacher": root / "teacher", "videos": root / "videos", "init": init,
            "real_lora": root / "real_score_lora.safetensors"}


def dmd2_argv(world, out: Path, *extra) -> list[str]:
    return ["--preset", "demo", "--teacher", str(world["teacher"]), "--dataset_root", str(world["videos"]),
            "--real_score", str(world["teacher"]), "--init_from", str(world["init"]), "--source_blocks", "1,2",
            "--output_dir", str(out), "--max_steps", "4", "--warmup_steps", "0", "--monitor_every", "2",
            "--ckpt_every", "-1", "--no_progress", "--val_every", "0", *map(str, extra)]


def build_dmd2_step(world, tmp_path, *extra, wrap_score=None):
    """(args, step_fn, generator role, fake role, teacher, real score) built by the recipe's own `build` (with its
    `wrap_score` seam: the scores as the step calls them)."""
    argv = dmd2_argv(world, tmp_path / "run", *extra)
    if "student" in extra:
        argv.remove("--init_from")
        argv.remove(str(world["init"]))
    args = train_dmd2.parse_args(argv)
    parts = dmd2.build(args, ENV, precision_policy("fp32", CPU),
                       rollout_config=dmd2.RolloutConfig(state_dtype=torch.float32), wrap_score=wrap_score)
    step = parts.step_fn
    return args, step, *parts.roles, step.teacher, step.real


def nft_argv(world, out: Path, *extra: str) -> list[str]:
    """fvtools/train_nft.py's command line on the method world: a rank-4 LoRA policy, 4 steps, groups of 2."""
    return ["--teacher", str(world["teacher"]), "--no_action_ckpt", "--dataset_root", str(world["videos"]),
            "--output_dir", str(out), "--train", "lora", "--lora_rank", "4", "--lora_alpha", "4", "--precision", "fp32", "--lr", "1e-2",
            "--max_steps", "4", "--warmup_steps", "0", "--samples_per_group", "2", "--chunks_per_sample", "1",
            "--monitor_every", "100", "--no-gradient_checkpointing", "--tracker", "none", "--num_workers", "0",
            "--no_progress", *extra]


def df_sft_args(world, out: Path, *extra: str):
    """fvtools/train_df_sft.py's flags, parsed, on the method world (demo preset, no validation)."""
    return train_df_sft.parse_args(["--preset", "demo", "--teacher", str(world["teacher"]), "--dataset_root",
                                    str(world["videos"]), "--output_dir", str(out), "--no_progress", "--val_every",
                                    "0", *extra])
