"""The offline recipe's wiring, shared by its two variants (`train_predictor_v4.py`, `train_predictor_disca.py`;
docs/offline.md; each script holds its flags and their defaults): the cross-flag checks, the build (Teacher ->
Predictor -> optimizer -> role -> pair step), the run's config and summary, and the steps `run_recipe` runs
(`offline_recipe`). The scripts keep what differs: their presets and data (`check_data`, `build_data`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, resolve_teacher_source
from predictor_training.data.provenance import run_provenance
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.pair_step import pair_step
from predictor_training.recipes.flags import format_pairs
from predictor_training.recipes.predictor_settings import (
    PredictorSettings, held_out_validation, log_leaderboard_command, predictor_role,
)
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, StepPlan
from predictor_training.runtime.checkpoint import checkpoint_meta
from predictor_training.runtime.distributed import DistEnv, log0, seed_everything
from predictor_training.runtime.flags import check_args, parse_recipe_args
from predictor_training.runtime.launch import Launch, Recipe, RunPlan
from predictor_training.runtime.logger import log_summary, recipe_summary_rows
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.run_directory import RunStart, environment_summary, run_config, write_train_config
from predictor_training.teacher.source import TeacherSource, check_source_blocks, describe_teacher, load_teacher


def finish_offline_args(parser: argparse.ArgumentParser, argv, presets: dict) -> argparse.Namespace:
    """--preset / --config applied, then the cross-flag checks (an error names the flag and exits 2)."""
    args = parse_recipe_args(parser, argv, presets)
    check_args(parser, args, dataset_config_name=DATASET_CONFIG_NAME)
    return args


@dataclass(frozen=True)
class OfflineSettings(PredictorSettings):
    """What `build_offline` builds from, named as the offline scripts' flags (`flags.settings_from_flags`): the
    Predictor recipes' values (`PredictorSettings`; the loss's weights are the pair loss's) and the `seed` its
    fusion/head is initialised from."""

    seed: int


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
    validation = held_out_validation(settings, teacher=teacher, predictor=predictor,
                                     teacher_folder=teacher_source.folder, env=env, run_dir=run_dir,
                                     plan=StepPlan.from_steps(DEFAULT_REPLACE_STEPS), rollout_config=None,
                                     autocast_dtype=policy.autocast_dtype)
    del teacher
    seed_everything(settings.seed, rank=env.rank)
    # 4-5. The one trained role (AdamW over two groups with the warmup + cosine schedule; the DDP-wrapped Predictor)
    #      and the pair step.
    role = predictor_role(predictor, settings, env)
    step_fn = partial(pair_step, model=role.module, predictor=predictor, policy=policy,
                      context_timestep=context_timestep, velocity_weight=settings.velocity_weight,
                      hidden_weight=settings.hidden_weight)
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
        context_timestep=context_timestep, provenance=parts.derived["provenance"], environment=environment_summary(),
        **start.recorded(),
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


@dataclass(frozen=True)
class OfflineData:
    """An offline variant's data step: its pairs, this rank's resumable batches, the dataset's context timestep."""

    dataset: object
    batches: object
    context_timestep: float


def offline_recipe(variant: str, *, check_data: Callable, build_data: Callable, build: Callable) -> Recipe:
    """The offline variant's steps for `runtime/launch.run_recipe`, from the script's `check_data(args)`,
    `build_data(args, env) -> (pairs, batches, context timestep)` and `build(args, env, policy, *, teacher_source,
    context_timestep, run_dir) -> RecipeParts`:

    1. the inputs, checked before anything is created (in the launcher's --print_run_dir dry run too): the Teacher
       (--teacher, else the dataset's), the source blocks against it, the dataset (`check_data`);
    2. the data (`build_data`);
    3. Teacher -> Predictor, AdamW, the DDP-wrapped role and the pair step (`build`), and the run's provenance;
    4. the config and summary (`offline_config`);
    after the shared loop: the command that puts the Predictor on the leaderboard (docs/leaderboard.md).
    """
    def plan(args: argparse.Namespace) -> RunPlan:
        teacher_source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
        check_source_blocks(args.source_blocks, teacher_source)
        check_data(args)
        return RunPlan(meta=checkpoint_meta(variant, args.source_blocks, args.precision),
                       inputs=[(teacher_source.origin, teacher_source.folder)], checked=teacher_source)

    def data(launch: Launch) -> OfflineData:
        return OfflineData(*build_data(launch.args, launch.env))

    def build_parts(launch: Launch) -> RecipeParts:
        teacher_source = launch.plan.checked
        parts = build(launch.args, launch.env, launch.policy, teacher_source=teacher_source,
                      context_timestep=launch.data.context_timestep, run_dir=launch.start.run_dir)
        parts.derived["provenance"] = run_provenance(launch.start, launch.env, teacher=teacher_source.folder,
                                                     action_ckpt=teacher_source.action_ckpt, parent=None,
                                                     data_root=launch.args.dataset_root)
        return parts

    def summarize(launch: Launch) -> dict:
        return offline_config(launch.args, variant=variant, start=launch.start, env=launch.env, policy=launch.policy,
                              dataset=launch.data.dataset, batches=launch.data.batches, parts=launch.parts,
                              context_timestep=launch.data.context_timestep)

    return Recipe(plan=plan, data=data, build=build_parts, summarize=summarize, after=log_leaderboard_command)
