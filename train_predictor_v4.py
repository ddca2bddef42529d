"""Offline teacher-forcing training of the v4 Predictor on stored Teacher pairs (train.md § 1).

v4: the two copied Teacher blocks see the context K/V of their source layers (rebuilt from the stored pre-features
by the frozen projector) and a third fusion stream, the previous chunk's hidden of the same step. Pairs 0-1, 1-2,
2-3 of chunks 1-7; batches are bucketed by the number of context frames, so one batch has one context length.

Tiny CPU run (the demo dataset comes from `bash tools/launch_predictor_v4_training.sh`):

    python train_predictor_v4.py --preset demo --dataset_root demo_data/dataset --max_steps 20

Real run (8 GPUs; the run directory is named from the flags, see train.md § Run names):

    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh
    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh --source_blocks 0,53 --fusion_lr 5e-4
    torchrun --nproc_per_node 8 train_predictor_v4.py --dataset_root /data/predictor_v4 --tracker swanlab
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Callable

import torch

from predictor_training.data.batches import ResumableBatches
from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, resolve_teacher_source
from predictor_training.data.pair_dataset import PairDataset, v4_pair_batches, v4_pair_dataset
from predictor_training.eval.validation import predictor_validation
from predictor_training.predictor.model import build_predictor
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS
from predictor_training.predictor.pair_step import pair_step
from predictor_training.runtime.checkpoint import checkpoint_meta
from predictor_training.runtime.distributed import DistEnv, log0, seed_everything, wrap_ddp
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import (
    add_data_args,
    add_loss_args,
    add_optimization_args,
    add_predictor_args,
    add_run_args,
    add_teacher_args,
    add_tracker_args,
    add_validation_args,
    check_args,
    format_pairs,
    parse_recipe_args,
)
from predictor_training.runtime.launch import distributed_run, early_exit, resume_roles, run_training
from predictor_training.runtime.logger import log_summary, recipe_summary_rows
from predictor_training.runtime.optim import build_optimizer_and_schedule
from predictor_training.runtime.precision import precision_policy
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import environment_summary, plan_run, run_config, write_train_config
from predictor_training.teacher.source import check_source_blocks, describe_teacher, load_teacher

VARIANT = "v4"

# The CPU demo on the demo world: blocks 1,10 of its 12-block Teacher (as 1,52 of the real 54); fp32, no tracker.
PRESETS = {
    "demo": ["--experiment", "predictor_v4_prefeature_demo", "--source_blocks", "1,10", "--precision", "fp32",
             "--max_steps", "240", "--scheduler_warmup_steps", "10", "--block_warmup_steps", "10",
             "--batch_size", "8", "--ckpt_every", "40", "--tracker", "none", "--num_workers", "0",
             "--val_every", "240", "--val_videos", "1"],
}


def offline_parser(description: str, *, experiment: str) -> argparse.ArgumentParser:
    """The offline recipe's flags (v4 and disca): every default below is the recipe (train.md § Configuration);
    `experiment` names the variant's runs."""
    parser = CommandParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(parser, pairs="0-1,1-2,2-3", num_workers=4)
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52", gradient_checkpointing=True)
    add_optimization_args(parser, fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000, scheduler_warmup_steps=100,
                          block_warmup_steps=100, batch_size=16, grad_accum=1, weight_decay=0.01,
                          adam_beta1=0.9, adam_beta2=0.95, grad_clip=1.0)
    add_loss_args(parser, velocity_weight=1.0, hidden_weight=0.1)
    add_run_args(parser, experiment=experiment, precision="fp32master", ckpt_every=100, keep_last=20,
                 log_every=1, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-predictor")
    add_validation_args(parser, val_every=0, val_videos=4)
    return parser


def finish_offline_args(parser: argparse.ArgumentParser, argv, presets: dict) -> argparse.Namespace:
    """--preset / --config applied, then the cross-flag checks (an error names the flag and exits 2)."""
    args = parse_recipe_args(parser, argv, presets)
    check_args(parser, args, dataset_config_name=DATASET_CONFIG_NAME)
    return args


def parse_args(argv=None) -> argparse.Namespace:
    return finish_offline_args(offline_parser(__doc__, experiment="predictor_v4_prefeature"), argv, PRESETS)


def check_data(args: argparse.Namespace) -> None:
    """v4's dataset opened as the run will read it (manifest, files, pairs, pre-feature layers; no tensor read),
    so a problem ends the launch before anything is created."""
    v4_pair_dataset(args.dataset_root, split=args.split, pairs=args.pairs, source_layers=args.source_blocks,
                    check_tensors=False)


def build_data(args: argparse.Namespace, env: DistEnv) -> tuple[PairDataset, ResumableBatches, float]:
    """v4's data -> (pairs, this rank's resumable batches, the dataset's context timestep).

    Pairs with the context pre-features and the previous chunk's hidden (chunks 1-7), in batches of one context
    length (BucketBatchSampler), the same number of batches on every rank (`pair_dataset.v4_pair_batches`, shared
    with fvtools/train_adversarial.py).
    """
    return v4_pair_batches(args.dataset_root, split=args.split, pairs=args.pairs, source_layers=args.source_blocks,
                           batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers,
                           verify=args.verify_dataset, env=env)


OfflineData = Callable[[argparse.Namespace, DistEnv], tuple[PairDataset, ResumableBatches, float]]


def train_offline(args: argparse.Namespace, variant: str, build_data: OfflineData,
                  check_data: Callable[[argparse.Namespace], None]) -> int:
    """The offline recipe of both variants; `build_data(args, env)` -> (pairs, this rank's batches, the dataset's
    context timestep) and `check_data(args)` (the dataset opened, nothing read) are what differ between them."""
    # 1. The inputs, checked before anything is created (in the launcher's --print_run_dir dry run too): the
    #    dataset, and the source blocks against its Teacher. Then the run directory, named from the flags; a second
    #    launch continues it or finds it finished. A checkpoint it would resume must record this `meta`.
    teacher_source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
    check_source_blocks(args.source_blocks, teacher_source)
    check_data(args)
    meta = checkpoint_meta(variant, args.source_blocks, args.precision)
    start = plan_run(args, meta=meta, inputs=[(teacher_source.origin, teacher_source.folder)])
    if (code := early_exit(args, start)) is not None:
        return code
    with distributed_run(args, start) as env:
        policy = precision_policy(args.precision, env.device)

        # 2. Data (see build_data).
        dataset, batches, context_timestep = build_data(args, env)

        # 3. Teacher -> Predictor. The Predictor shares the few frozen Teacher modules it runs; dropping our
        #    reference to the Teacher frees every other block.
        teacher = load_teacher(teacher_source, env.device, policy.frozen_dtype)
        log0(describe_teacher(teacher_source, teacher))
        torch.manual_seed(args.seed)  # the same fusion/head initialisation on every rank
        predictor = build_predictor(teacher, variant, args.source_blocks, args.gradient_checkpointing)
        teacher_layers = teacher.num_layers
        # Held-out F-P-P-P videos every --val_every steps keep the whole Teacher (it rolls out the reference), in
        # the dataset's AR loop.
        validation = predictor_validation(args, teacher=teacher, predictor=predictor,
                                          teacher_folder=teacher_source.folder, replace_steps=DEFAULT_REPLACE_STEPS,
                                          rollout_config=None, autocast_dtype=policy.autocast_dtype, env=env,
                                          run_dir=start.run_dir)
        del teacher
        seed_everything(args.seed, rank=env.rank)

        # 4. AdamW over two groups (fusion + head, blocks) and the warmup + cosine schedule.
        optimizer, lr_schedule = build_optimizer_and_schedule(predictor, args)

        # 5. The one trained role: the DDP-wrapped Predictor with its optimizer and schedule. Resume (--resume, or
        #    the run directory's own unfinished run) restores it and the data position.
        model = wrap_ddp(predictor, env)
        role = Role("predictor", predictor, optimizer, lr_schedule, module=model, grad_clip=args.grad_clip)
        run_state = resume_roles(start, [role], batches, meta)

        # 6. Config and summary.
        global_batch = args.batch_size * env.world_size * args.grad_accum
        config = run_config(
            args, run_name=start.run_name, variant=variant, world_size=env.world_size, device=str(env.device),
            backend=env.backend, global_batch=global_batch, num_pairs=len(dataset),
            num_trajectories=len(dataset.trajectories), micro_batches_per_epoch=batches.batches_per_epoch(),
            predictor=predictor.predictor_config(), teacher_double_blocks=teacher_layers,
            context_timestep=context_timestep, environment=environment_summary(),
        )
        if env.is_main:
            write_train_config(start.run_dir, config)
        log_summary(f"offline Predictor training ({variant})", {
            **recipe_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(), optimizer=optimizer,
                                  first_step=run_state.global_step + 1, stop_step=start.stop_step),
            "model": f"{variant}, source blocks {list(args.source_blocks)}, pairs {format_pairs(args.pairs)}",
            "data": f"{args.dataset_root} split {args.split}: {len(dataset.trajectories)} trajectories -> "
                    f"{len(dataset)} pairs; {batches.batches_per_epoch()} micro-batches per rank per epoch",
            "batch": f"{args.batch_size} per rank x {env.world_size} ranks x {args.grad_accum} accumulation = "
                     f"{global_batch} global",
        })

        # 7. Train: the pair step and the shared loop.
        step_fn = partial(pair_step, model=model, predictor=predictor, policy=policy,
                          context_timestep=context_timestep, velocity_weight=args.velocity_weight,
                          hidden_weight=args.hidden_weight)
        run_training(args, start, env, roles=[role], batches=batches, step_fn=step_fn, run_state=run_state,
                     config=config, meta=meta, validation=validation)
    return 0


@command
def main(argv=None) -> int:
    return train_offline(parse_args(argv), VARIANT, build_data, check_data)


if __name__ == "__main__":
    sys.exit(main())
