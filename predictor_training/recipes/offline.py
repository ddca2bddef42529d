"""The offline recipe's wiring, shared by its two variants (`train_predictor_v4.py`, `train_predictor_disca.py`;
docs/offline.md; each script holds its flags and their defaults): the cross-flag checks, the build (Teacher -> Predictor -> optimizer -> role -> pair step) and the run's config and
summary. The scripts keep what differs: their presets and data (`check_data`, `build_data`), and their `main()`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
from predictor_training.eval.validation import predictor_validation
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.pair_step import pair_step
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS
from predictor_training.runtime.distributed import DistEnv, log0, seed_everything, wrap_ddp
from predictor_training.runtime.flags import (
    check_args,
    format_pairs,
    parse_recipe_args,
)
from predictor_training.runtime.logger import log_summary, recipe_summary_rows
from predictor_training.runtime.optim import build_optimizer_and_schedule
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import RunStart, environment_summary, run_config, write_train_config
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher


def finish_offline_args(parser: argparse.ArgumentParser, argv, presets: dict) -> argparse.Namespace:
    """--preset / --config applied, then the cross-flag checks (an error names the flag and exits 2)."""
    args = parse_recipe_args(parser, argv, presets)
    check_args(parser, args, dataset_config_name=DATASET_CONFIG_NAME)
    return args


@dataclass(frozen=True)
class OfflineSettings:
    """What `build_offline` builds from, named as the offline scripts' flags (`flags.settings_from_flags`): the
    Predictor (source_blocks, gradient_checkpointing; its fusion/head initialised from `seed`), its validation
    (val_every, val_split, val_videos, val_vae, val_ground_truth on dataset_root), AdamW over its two groups
    (fusion_lr, blocks_lr, adam_beta1/2, weight_decay; grad_clip) with the warmup + cosine (scheduler_warmup_steps,
    max_steps, block_warmup_steps) and the pair loss's weights (velocity_weight, hidden_weight)."""

    seed: int
    source_blocks: tuple[int, int]
    gradient_checkpointing: bool
    dataset_root: Path
    val_every: int
    val_split: str | None
    val_videos: int
    val_vae: Path | None
    val_ground_truth: Path | None
    fusion_lr: float
    blocks_lr: float
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    scheduler_warmup_steps: int
    max_steps: int
    block_warmup_steps: int
    grad_clip: float
    velocity_weight: float
    hidden_weight: float


def build_offline(settings: OfflineSettings, env: DistEnv, policy: PrecisionPolicy, *, variant: str,
                  teacher_source: TeacherSource, context_timestep: float, run_dir, load_teacher=load_teacher
                  ) -> RecipeParts:
    """Steps 3-5 of the offline recipe (the scripts' `build`): the Teacher, the `variant` Predictor on it, the
    validation, AdamW with the two-group schedule, the DDP-wrapped role and the pair step. The Predictor shares the
    few frozen Teacher modules it runs; the Teacher itself is dropped here (the validation keeps it when on)."""
    # 3. Teacher -> Predictor.
    teacher = load_teacher(teacher_source, env.device, policy.frozen_dtype)
    log0(describe_teacher(teacher_source, teacher))
    torch.manual_seed(settings.seed)  # the same fusion/head initialisation on every rank
    predictor = build_predictor(teacher, variant, settings.source_blocks, settings.gradient_checkpointing)
    teacher_layers = teacher.num_layers
    # Held-out F-P-P-P videos every --val_every steps keep the whole Teacher (it rolls out the reference), in the
    # dataset's AR loop.
    validation = predictor_validation(
        every=settings.val_every, split=settings.val_split, videos=settings.val_videos, vae=settings.val_vae,
        ground_truth=settings.val_ground_truth, dataset_root=settings.dataset_root, teacher=teacher,
        predictor=predictor, teacher_folder=teacher_source.folder, replace_steps=DEFAULT_REPLACE_STEPS,
        rollout_config=None, autocast_dtype=policy.autocast_dtype, env=env, run_dir=run_dir)
    del teacher
    seed_everything(settings.seed, rank=env.rank)
    # 4. AdamW over two groups (fusion + head, blocks) and the warmup + cosine schedule.
    optimizer, lr_schedule = build_optimizer_and_schedule(
        predictor, fusion_lr=settings.fusion_lr, blocks_lr=settings.blocks_lr,
        betas=(settings.adam_beta1, settings.adam_beta2), weight_decay=settings.weight_decay,
        warmup_steps=settings.scheduler_warmup_steps, max_steps=settings.max_steps,
        block_warmup_steps=settings.block_warmup_steps)
    # 5. The one trained role: the DDP-wrapped Predictor with its optimizer and schedule; the pair step.
    model = wrap_ddp(predictor, env)
    role = Role("predictor", predictor, optimizer, lr_schedule, module=model, grad_clip=settings.grad_clip)
    step_fn = partial(pair_step, model=model, predictor=predictor, policy=policy, context_timestep=context_timestep,
                      velocity_weight=settings.velocity_weight, hidden_weight=settings.hidden_weight)
    return RecipeParts(roles=[role], step_fn=step_fn, models=[predictor], validation=validation,
                       derived={"predictor": predictor.predictor_config(), "teacher_double_blocks": teacher_layers})


def offline_config(args: argparse.Namespace, *, variant: str, start: RunStart, env: DistEnv,
                   policy: PrecisionPolicy, dataset, batches, parts: RecipeParts, context_timestep: float) -> dict:
    """Step 6: the run's config (train_config.json on rank 0) and the summary block; returns the config."""
    global_batch = args.batch_size * env.world_size * args.grad_accum
    config = run_config(
        args, run_name=start.run_name, variant=variant, world_size=env.world_size, device=str(env.device),
        backend=env.backend, global_batch=global_batch, num_pairs=len(dataset),
        num_trajectories=len(dataset.trajectories), micro_batches_per_epoch=batches.batches_per_epoch(),
        predictor=parts.derived["predictor"], teacher_double_blocks=parts.derived["teacher_double_blocks"],
        context_timestep=context_timestep, environment=environment_summary(),
    )
    if env.is_main:
        write_train_config(start.run_dir, config)
    log_summary(f"offline Predictor training ({variant})", {
        **recipe_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(),
                              optimizer=parts.roles[0].optimizer, first_step=parts.run_state.global_step + 1,
                              stop_step=start.stop_step),
        "model": f"{variant}, source blocks {list(args.source_blocks)}, pairs {format_pairs(args.pairs)}",
        "data": f"{args.dataset_root} split {args.split}: {len(dataset.trajectories)} trajectories -> "
                f"{len(dataset)} pairs; {batches.batches_per_epoch()} micro-batches per rank per epoch",
        "batch": f"{args.batch_size} per rank x {env.world_size} ranks x {args.grad_accum} accumulation = "
                 f"{global_batch} global",
    })
    return config
