"""Diffusion-forcing SFT of the AR world model: flow matching with one noise level per chunk (docs/methods/df_sft.md).

Per micro-batch every rank takes one clip (video latents, or a Teacher F-F-F-F sample) and trains
`--chunks_per_clip` of its chunks, each at its own noise level sigma drawn from `--sigma_sampler` inside
[--sigma_min, --sigma_max]. Chunk c is noised, `x = (1 - sigma) x0 + sigma n`, and the model predicts the velocity
`n - x0` given the clip's clean history as context, built exactly as in the AR loop (memory selection on the clip's
cameras, context prefill at timestep 14, compacted RoPE; `predictor_training/rollout/teacher_forcing.py`), with the clip's
camera/action and text conditioning. Loss: the FP32 mean squared error, averaged over the trained chunks, with one
backward per chunk (only the last chunk's backward of the last micro-batch reduces gradients across ranks).

Context (`--context_noise`): `clean` (default) is teacher forcing on the true history, the context the AR loop
itself builds at inference; `independent` is the diffusion-forcing variant: every chunk of the clip is noised at
its own level (drawn like the trained chunks' levels, from its own random stream) and the context prefill sees each
selected frame noisy, at its own chunk's timestep. Memory points: a Teacher sample (`--data teacher_samples`) selects
its context with its own seed's points and its dataset's memory settings, exactly the frames the Teacher's rollout
selected; a video clip (no rollout made it) draws them per micro-step.

What trains (`--train`): a LoRA on the Teacher (the real model: `--train lora`), or every parameter of a model of
the Teacher's architecture, from the Teacher's weights or from scratch (`--train full --init_weights scratch`, FSDP2
under torchrun). Data (`--data`): a video-latent dataset (`tools/build_video_latent_dataset.py`), or a Teacher-
trajectory dataset (`tools/build_predictor_dataset.py`) whose final latents are the data - this is how a "real
score" adapter for DMD is trained, since the distilled 4-step Teacher is no score model below sigma = 0.625.

Validation (`--val_every N`, off by default; the demo every 50 steps): the model's own 4-step AR rollout (the
distilled schedule) of the first `--val_videos` clips of `--val_split` (default the dataset's held-out split) from
fixed noise, decoded by the dataset's VAE (`--val_vae`) and scored against the clip's decoded latents:
val/psnr_vs_truth, val/ssim_vs_truth and their last-chunk values (predictor_training/eval/validation.py ClipRolloutValidation). Not
with `--data teacher_samples` (refused: its truth is the Teacher's own rollout, not a video).

    python fvtools/train_df_sft.py --teacher /models/worldplay/transformer --dataset_root /data/video_latents
    python fvtools/train_df_sft.py --dry_run worldplay_480p_i2v      # parameter counts at real size, no memory
    bash tools/launch_fvtools_df_sft.sh                              # 8 GPUs; without GPU and data: the CPU demo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
from predictor_training.data.provenance import run_provenance
from predictor_training.data.teacher_samples import TeacherSampleDataset
from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_CONFIG_NAME
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.eval.validation import resolve_video_val_inputs
from predictor_training.methods.method_model import (
    dry_run_report,
    export_method_model,
    method_meta,
)
from predictor_training.recipes.df_sft import METHOD, ROLE, build
from predictor_training.recipes.flags import (
    add_method_model_args, add_method_optimization_args, add_sigma_args, add_validation_args, check_action_ckpt,
)
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.teacher_forcing import CONTEXT_NOISE_MODES
from predictor_training.runtime.distributed import DistEnv, log0
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_run_args, add_tracker_args, check_args, parse_recipe_args
from predictor_training.runtime.launch import Launch, Recipe, RunPlan, run_recipe
from predictor_training.runtime.logger import log_summary, method_summary_rows
from predictor_training.runtime.provenance import with_provenance
from predictor_training.runtime.recipe import RecipeData, RecipeParts
from predictor_training.runtime.run_directory import (
    environment_summary,
    method_run_name,
    run_config,
    write_train_config,
)
from predictor_training.teacher.config import DISTILLED_SHIFT

DATA_KINDS = {"video_latents": VIDEO_CONFIG_NAME, "teacher_samples": DATASET_CONFIG_NAME}

PRESETS = {
    # The CPU demo: a model of the demo world Teacher's config (12 blocks, width 64) trained from scratch on the
    # demo world's video latents (48 train clips of 32 latents), FP32, no tracker.
    # --no_action_ckpt: the demo world's Teacher (and a df_sft model/ export) holds its action weights.
    "demo": ["--experiment", "df_sft_demo", "--train", "full", "--init_weights", "scratch", "--precision", "fp32",
             "--lr", "1e-3", "--max_steps", "300", "--warmup_steps", "20", "--chunks_per_clip", "2",
             "--no-gradient_checkpointing", "--ckpt_every", "100", "--keep_last", "2", "--tracker", "none",
             "--num_workers", "0", "--val_every", "50", "--val_videos", "1", "--no_action_ckpt"],
    # The recipe at the size the memory rehearsal plans for (tools/estimate_memory.py): its defaults.
    "real_size": ["--train", "lora", "--precision", "fp32master", "--gradient_checkpointing"],
}


def parse_args(argv=None) -> argparse.Namespace:
    """The df_sft recipe: every default below is the recipe (docs/methods/df_sft.md)."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_root", type=Path, default=None,
                      help="dataset root: a video-latent dataset (video_dataset_config.json) or, with --data "
                           "teacher_samples, a Teacher-trajectory dataset (dataset_config.json); required to train")
    data.add_argument("--data", choices=sorted(DATA_KINDS), default="video_latents",
                      help="video_latents: VAE latents of real videos; teacher_samples: the Teacher's own F-F-F-F "
                           "final latents (a real-score adapter; needs --train lora) (default %(default)s)")
    data.add_argument("--split", type=str, default="train", help="manifest split to train on (default %(default)s)")
    data.add_argument("--chunks_per_clip", type=int, default=4,
                      help="chunks of each clip trained per micro-batch, drawn without replacement, each at its own "
                           "noise level (default %(default)s; the clip's chunk count caps it)")
    data.add_argument("--num_workers", type=int, default=2,
                      help="DataLoader worker processes per rank, 0 = main process (default %(default)s)")
    data.add_argument("--verify_dataset", action="store_true",
                      help="check size and sha256 of every dataset file before training (each tensor's checksum is "
                           "checked when it is read in any case)")
    data.add_argument("--context_noise", choices=CONTEXT_NOISE_MODES, default="clean",
                      help="clean: the context is the clip's clean history prefilled at the context timestep 14 "
                           "(teacher forcing, what the AR loop feeds at inference); independent: diffusion forcing, "
                           "every chunk of the clip noised at its own level drawn from --sigma_sampler in "
                           "[--sigma_min, --sigma_max], the context prefill seeing each context frame at its chunk's "
                           "timestep 1000 sigma (default %(default)s)")
    add_sigma_args(parser, sampler="uniform", sigma_min=0.0, sigma_max=1.0, shift=DISTILLED_SHIFT, logit_mean=0.0, logit_std=1.0)
    add_method_model_args(parser, train="lora", init_weights="teacher", lora_rank=64, lora_alpha=64.0,
                          gradient_checkpointing=True, context_grad=True)
    add_method_optimization_args(parser, lr=1e-4, max_steps=2000, warmup_steps=100, grad_accum=1, weight_decay=0.01,
                                 adam_beta1=0.9, adam_beta2=0.999, grad_clip=1.0)
    add_run_args(parser, experiment=METHOD, precision="fp32master", ckpt_every=200, keep_last=5, log_every=10, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-fvtools")
    add_validation_args(parser, val_every=0, val_videos=2)
    args = parse_recipe_args(parser, argv, PRESETS)
    if args.dry_run is not None:
        return args
    missing = [f"--{flag}" for flag in ("teacher", "dataset_root") if getattr(args, flag) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} missing (or pass --dry_run CONFIG)")
    check_args(parser, args, dataset_config_name=DATA_KINDS[args.data])
    # Rules only this recipe has.
    if args.chunks_per_clip < 1:
        parser.error(f"--chunks_per_clip={args.chunks_per_clip}: expected >= 1")
    if args.data == "teacher_samples" and args.train == "full":
        parser.error("--data teacher_samples with --train full: the samples carry the Teacher's text K/V, which a "
                     "model whose text stream trains cannot use; train a LoRA, or use a video-latent dataset")
    check_validation_args(parser, args)
    check_action_ckpt(parser, args,
                      reads_teacher_weights=not (args.train == "full" and args.init_weights == "scratch"))
    return args


def check_validation_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Validation rolls the model out on held-out video clips and scores it against their true video: a
    video-latent dataset only (a Teacher-sample dataset's truth is the Teacher's own rollout, which a real-score
    adapter is not meant to reproduce in 4 steps)."""
    if args.val_every > 0 and args.data == "teacher_samples":
        parser.error(f"--val_every={args.val_every} with --data teacher_samples: held-out validation scores the "
                     "model's own 4-step rollout against real videos, which only a video-latent dataset holds; "
                     "pass --val_every 0")
    args.val_vae, args.val_split = resolve_video_val_inputs(
        parser, METHOD, val_every=args.val_every, val_vae=args.val_vae, val_split=args.val_split,
        val_ground_truth=args.val_ground_truth, dataset_root=args.dataset_root, split=args.split)


def open_dataset(args, verify: bool):
    """The clips of --split (video latents or Teacher samples)."""
    if args.data == "video_latents":
        return VideoLatentDataset(args.dataset_root, args.split, verify=verify)
    return TeacherSampleDataset(args.dataset_root, args.split, verify=verify)


def build_data(args, env: DistEnv):
    """The clips of --split and one clip per rank per micro-batch (shuffled, resumable)."""
    dataset = open_dataset(args, verify=args.verify_dataset)
    return dataset, one_item_per_rank_batches(dataset, env, seed=args.seed, num_workers=args.num_workers)


def build_rollout_config(args, dataset, policy) -> RolloutConfig:
    """The AR loop's context rules for the teacher-forced clips: for Teacher samples the ones their rollouts ran
    with (dataset_config.json: memory window, context timestep, chunk size), for video latents the distilled
    pipeline's defaults."""
    if args.data == "teacher_samples":
        return RolloutConfig.from_dataset_config(dataset.config, str(args.dataset_root / DATASET_CONFIG_NAME),
                                                 state_dtype=torch.float32, autocast_dtype=policy.autocast_dtype)
    return RolloutConfig(state_dtype=torch.float32, autocast_dtype=policy.autocast_dtype)


def check_inputs(args: argparse.Namespace) -> RunPlan:
    """1. The dataset, opened before anything is created (in the launcher's --print_run_dir dry run too); the run
    is named from the flags."""
    open_dataset(args, verify=False)
    return RunPlan(meta=method_meta(METHOD, train=args.train, precision=args.precision, lora_rank=args.lora_rank),
                   naming=method_run_name)


def load_data(launch: Launch) -> RecipeData:
    """2. Data: one clip per rank per micro-batch, and the AR loop's context rules for it."""
    dataset, batches = build_data(launch.args, launch.env)
    return RecipeData(batches=batches, dataset=dataset,
                      values={"rollout_config": build_rollout_config(launch.args, dataset, launch.policy)})


def build_run(launch: Launch) -> RecipeParts:
    """3. The trained model (LoRA on the Teacher, or every parameter), its optimizer and schedule, the step and the
    validation (see build), and the run's provenance. Resume (--resume, or the run directory's own unfinished run)
    then restores the role and the data position."""
    args, start = launch.args, launch.start
    parts = build(args, launch.env, launch.policy, rollout_config=launch.data.values["rollout_config"],
                  run_dir=start.run_dir)
    parts.derived["provenance"] = run_provenance(start, launch.env, teacher=args.teacher,
                                                 action_ckpt=args.action_ckpt, parent=None,
                                                 data_root=args.dataset_root)
    return parts


def summarize(launch: Launch) -> dict:
    """4. The run's config (train_config.json on rank 0) and the summary block; returns the config."""
    args, start, env, policy, dataset, parts = (launch.args, launch.start, launch.env, launch.policy,
                                                launch.data.dataset, launch.parts)
    method_model = parts.objects["method_model"]
    config = run_config(
        args, run_name=start.run_name, method=METHOD, world_size=env.world_size, device=str(env.device),
        backend=env.backend, global_batch=env.world_size * args.grad_accum, num_clips=len(dataset),
        num_latents=dataset.num_latents, trainable_parameters=method_model.trainable_parameter_count(),
        provenance=parts.derived["provenance"], environment=environment_summary(), **start.recorded(),
    )
    if env.is_main:
        write_train_config(start.run_dir, config)
    log_summary("diffusion-forcing SFT", {
        **method_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(),
                              trained=method_model.describe(), first_step=parts.run_state.global_step + 1,
                              stop_step=start.stop_step),
        "data": f"{args.dataset_root} ({args.data}, split {args.split}): {len(dataset)} clips of "
                f"{dataset.num_latents} latents; {args.chunks_per_clip} chunks per clip, sigma "
                f"{args.sigma_sampler} in [{args.sigma_min}, {args.sigma_max}]; {args.context_noise} context",
        "batch": f"1 clip per rank x {env.world_size} ranks x {args.grad_accum} accumulation",
    })
    if parts.validation is not None:
        log0(f"validation every {args.val_every} steps: {parts.validation.describe()}")
    return config


def export(launch: Launch) -> None:
    """After the loop: the result exported (a LoRA file or a Teacher folder)."""
    exported = export_method_model(launch.parts.objects["method_model"], launch.start.run_dir,
                                   with_provenance({**launch.plan.meta, "step": launch.run_state.global_step},
                                                   launch.config), launch.env)
    log0(f"exported the trained {launch.args.train} model: {exported}")


@command
def main(argv=None) -> int:
    """--dry_run prints the parameter counts; otherwise the recipe's steps in order, the shared loop between
    summarize and export (`runtime/launch.run_recipe`)."""
    args = parse_args(argv)
    if args.dry_run is not None:
        print(dry_run_report(args.dry_run, {ROLE: args.train}, lora_rank=args.lora_rank))
        return 0
    return run_recipe(args, Recipe(plan=check_inputs, data=load_data, build=build_run, summarize=summarize,
                                   after=export))


if __name__ == "__main__":
    sys.exit(main())
