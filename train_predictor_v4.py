"""Offline teacher-forcing training of the v4 Predictor on stored Teacher pairs (docs/offline.md).

v4: the two copied Teacher blocks see the context K/V of their source layers (rebuilt from the stored pre-features
by the frozen projector) and a third fusion stream, the previous chunk's hidden of the same step. Pairs 0-1, 1-2,
2-3 of chunks 1-7; batches are bucketed by the number of context frames, so one batch has one context length.

Tiny CPU run (the demo dataset comes from `bash tools/launch_predictor_v4_training.sh`):

    python train_predictor_v4.py --preset demo --dataset_root demo_data/dataset --max_steps 20

Real run (8 GPUs; the run directory is named from the flags):

    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh
    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh --source_blocks 0,53 --fusion_lr 5e-4
    torchrun --nproc_per_node 8 train_predictor_v4.py --dataset_root /data/predictor_v4 --tracker swanlab
"""

from __future__ import annotations

import argparse
import sys

from predictor_training.data.batches import ResumableBatches
from predictor_training.data.dataset_config import resolve_teacher_source
from predictor_training.data.provenance import run_provenance
from predictor_training.data.pair_dataset import PairDataset, v4_pair_batches, v4_pair_dataset
from predictor_training.recipes.offline import OfflineSettings, build_offline, finish_offline_args, offline_config
from predictor_training.runtime.checkpoint import checkpoint_meta
from predictor_training.runtime.distributed import DistEnv, log0
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
    settings_from_flags,
)
from predictor_training.eval.leaderboard_command import leaderboard_command
from predictor_training.runtime.launch import distributed_run, early_exit, resume_roles, run_training
from predictor_training.runtime.precision import PrecisionPolicy, precision_policy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.run_directory import plan_run
from predictor_training.teacher.source import TeacherSource, check_source_blocks, load_teacher

VARIANT = "v4"

# The CPU demo on the demo world: blocks 1,10 of its 12-block Teacher (as 1,52 of the real 54); fp32, no tracker.
# real_size: the recipe at the size the memory rehearsal plans for (tools/estimate_memory.py: its defaults).
PRESETS = {
    "demo": ["--experiment", "predictor_v4_prefeature_demo", "--source_blocks", "1,10", "--precision", "fp32",
             "--max_steps", "240", "--scheduler_warmup_steps", "10", "--block_warmup_steps", "10",
             "--batch_size", "8", "--ckpt_every", "40", "--tracker", "none", "--num_workers", "0",
             "--val_every", "240", "--val_videos", "1"],
    "real_size": ["--source_blocks", "1,52", "--precision", "fp32master", "--batch_size", "16",
                  "--gradient_checkpointing"],
}


def build_parser() -> argparse.ArgumentParser:
    """The offline v4 recipe's flags: every default below is the recipe (docs/offline.md)."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(parser, pairs="0-1,1-2,2-3", num_workers=4)
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52", gradient_checkpointing=True)
    add_optimization_args(parser, fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000, scheduler_warmup_steps=100,
                          block_warmup_steps=100, batch_size=16, grad_accum=1, weight_decay=0.01,
                          adam_beta1=0.9, adam_beta2=0.95, grad_clip=1.0)
    add_loss_args(parser, velocity_weight=1.0, hidden_weight=0.1)
    add_run_args(parser, experiment="predictor_v4_prefeature", precision="fp32master", ckpt_every=100, keep_last=20,
                 log_every=10, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-predictor")
    add_validation_args(parser, val_every=0, val_videos=4)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return finish_offline_args(build_parser(), argv, PRESETS)


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


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, teacher_source: TeacherSource,
          context_timestep: float, run_dir=None, load_teacher=load_teacher) -> RecipeParts:
    """Steps 3-5: the offline recipe's Teacher -> v4 Predictor -> AdamW -> role -> pair step
    (`recipes/offline.py build_offline`, shared with disca). Seams: `load_teacher`."""
    return build_offline(settings_from_flags(OfflineSettings, args), env, policy, variant=VARIANT,
                         teacher_source=teacher_source, context_timestep=context_timestep, run_dir=run_dir,
                         load_teacher=load_teacher)


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    # 1. The inputs, checked before anything is created (in the launcher's --print_run_dir dry run too): the
    #    dataset, and the source blocks against its Teacher. Then the run directory, named from the flags; a second
    #    launch continues it or finds it finished. A checkpoint it would resume must record this `meta`.
    teacher_source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
    check_source_blocks(args.source_blocks, teacher_source)
    check_data(args)
    meta = checkpoint_meta(VARIANT, args.source_blocks, args.precision)
    start = plan_run(args, meta=meta, inputs=[(teacher_source.origin, teacher_source.folder)])
    if (code := early_exit(args, start)) is not None:
        return code
    with distributed_run(args, start) as env:
        policy = precision_policy(args.precision, env.device)
        # 2. Data (see build_data).
        dataset, batches, context_timestep = build_data(args, env)
        # 3-5. Teacher -> Predictor, AdamW, the DDP-wrapped role and the pair step (see build). Resume (--resume, or
        #      the run directory's own unfinished run) restores the role and the data position.
        parts = build(args, env, policy, teacher_source=teacher_source, context_timestep=context_timestep,
                      run_dir=start.run_dir)
        run_state = resume_roles(start, parts.roles, batches, meta, parts.run_state)
        parts.derived["provenance"] = run_provenance(start, env, teacher=teacher_source.folder,
                                                     action_ckpt=teacher_source.action_ckpt, parent=None,
                                                     data_root=args.dataset_root)
        # 6. Config and summary.
        config = offline_config(args, variant=VARIANT, start=start, env=env, policy=policy, dataset=dataset,
                                batches=batches, parts=parts, context_timestep=context_timestep)
        # 7. Train: the pair step and the shared loop.
        run_training(args, start, env, roles=parts.roles, batches=batches, step_fn=parts.step_fn,
                     run_state=run_state, config=config, meta=meta, validation=parts.validation)
        # 8. Where this Predictor stands against the samplers and caches at its cost (docs/leaderboard.md).
        log0("next, the leaderboard: " + leaderboard_command(start.run_dir, dataset_root=args.dataset_root,
                                                             world_size=env.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
