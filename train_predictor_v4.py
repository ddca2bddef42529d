"""Offline teacher-forcing training of the v4 Predictor on stored Teacher pairs (SPEC §5, notes §4 "v4").

v4: the two copied Teacher blocks see the context K/V of their source layers (rebuilt from the stored pre-features
by the frozen projector) and a third fusion stream, the previous chunk's hidden of the same step. Pairs 0-1, 1-2,
2-3 of chunks 1-7; batches are bucketed by the number of context frames.

Tiny CPU run (demo data from `bash tools/launch_predictor_v4_training.sh`, or tools/make_demo_assets.py +
tools/build_predictor_dataset.py):

    python train_predictor_v4.py --dataset_root demo_data/dataset --output_dir checkpoints/v4_tiny \
        --source_blocks 1,2 --precision fp32 --batch_size 4 --max_steps 20 --scheduler_warmup_steps 2 \
        --block_warmup_steps 2 --fusion_lr 1e-3 --blocks_lr 1e-4 --ckpt_every 10 --num_workers 0

Real run (8 GPUs, run directory named by the convention, torchrun.log in it):

    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh
    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh "" 0,53          # blocks [0,53]
    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh RUN_DIR 1,52 RUN_DIR/training_latest.pt

or by hand: torchrun --nproc_per_node 8 train_predictor_v4.py --dataset_root ... --output_dir ... --tracker swanlab
"""

from __future__ import annotations

import argparse
import sys

from predictor_training.offline_training import add_offline_args, run_offline_training
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

VARIANT = "v4"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(parser, pairs="0-1,1-2,2-3")
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52")
    add_optimization_args(parser, OptimDefaults(fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000,
                                                scheduler_warmup_steps=100, block_warmup_steps=100,
                                                batch_size=16, grad_accum=1))
    add_run_args(parser, ckpt_every=100, keep_last=20)
    add_tracker_args(parser)
    add_offline_args(parser, VARIANT)
    args = parser.parse_args(argv)
    check_common_args(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run_offline_training(args, VARIANT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
