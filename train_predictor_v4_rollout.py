"""On-policy recursive F-P-P-P self-rollout fine-tuning of the v4 Predictor (SPEC §6, user notes §8).

Stage 2 after offline teacher forcing: the Predictor starts from an offline v4 checkpoint (`--init_from`, model
weights only; the optimizer and LR schedule start fresh) and learns on the states it visits itself. Per optimizer
step every rank rolls out ONE whole trajectory (case, action) of the sample table: chunk 0 F-F-F-F without
gradients, chunks 1..7 F-P-P-P with a per-chunk backward of chunk_loss / 7 (`predictor_training.rollout_utils`).
The Teacher labels are computed online on the student's own latents; no stored Teacher trajectory is read, only
the offline dataset's case files (image condition + exact text K/V of every layer).

DDP: each rank holds the frozen Teacher, the DDP Predictor and its own trajectory; chunks 1..6 run under
`no_sync()` (forwards and backward), chunk 7's backward all-reduces once; then clip, AdamW, schedule.

Tiny CPU run (demo data and a short offline v4 checkpoint first: `bash tools/launch_predictor_v4_training.sh`):

    python train_predictor_v4_rollout.py --dataset_root demo_data/dataset --output_dir checkpoints/rollout_tiny \
        --init_from checkpoints/<offline demo run>/training_latest.pt --source_blocks 1,2 --precision fp32 \
        --max_steps 6 --scheduler_warmup_steps 2 --block_warmup_steps 2 --ckpt_every 3 --num_workers 0

Launchers (8 GPUs, run directory named by the convention; with no GPU the first runs the whole CPU demo):

    bash tools/launch_predictor_v4_rollout_training.sh [RUN_DIR] [RESUME]
    bash tools/launch_predictor_v4_rollout_overfit8_training.sh
"""

from __future__ import annotations

import argparse
import sys

from predictor_training.rollout_training import add_rollout_args, check_rollout_args, run_rollout_training
from predictor_training.training_setup import (
    OptimDefaults,
    add_data_args,
    add_optimization_args,
    add_predictor_args,
    add_run_args,
    add_teacher_args,
    add_tracker_args,
    check_common_args,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(parser, pairs=None)
    add_rollout_args(parser)
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52")
    add_optimization_args(parser, OptimDefaults(fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000,
                                                scheduler_warmup_steps=100, block_warmup_steps=100,
                                                batch_size=1, grad_accum=1))
    add_run_args(parser, ckpt_every=100, keep_last=20)
    add_tracker_args(parser)
    args = parser.parse_args(argv)
    check_common_args(args)
    check_rollout_args(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run_rollout_training(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
