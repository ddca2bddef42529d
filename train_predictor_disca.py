"""Offline teacher-forcing training of the disca Predictor: no context, no previous-chunk hidden (SPEC §5, notes §4).

disca: the two copied Teacher blocks see only the text K/V of their source layers; the fusion merges the current
noisy input with the anchor hidden. Pairs 0-1, 1-2, 2-3 of chunks 1-7 (the user's 8400-pair set;
`--include_chunk0` adds chunk 0); a plain DistributedSampler, no bucketing.

Tiny CPU run (demo data from `bash tools/launch_predictor_disca_training.sh`, or tools/make_demo_assets.py +
tools/build_predictor_dataset.py):

    python train_predictor_disca.py --dataset_root demo_data/dataset --output_dir checkpoints/disca_tiny \
        --source_blocks 1,2 --precision fp32 --batch_size 4 --max_steps 20 --scheduler_warmup_steps 2 \
        --block_warmup_steps 2 --fusion_lr 1e-3 --blocks_lr 1e-4 --ckpt_every 10 --num_workers 0

Real run (8 GPUs; blocks [1,52] by default, [0,53] as the second positional argument):

    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh
    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh "" 0,53
    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh \
        RUN_DIR 0,53 RUN_DIR/training_latest.pt
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

VARIANT = "disca"


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
