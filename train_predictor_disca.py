"""Offline teacher-forcing training of the disca Predictor: no context, no previous-chunk hidden (train.md § 1).

disca: the two copied Teacher blocks see only the text K/V of their source layers; the fusion merges the current
noisy input with the anchor hidden. Pairs 0-1, 1-2, 2-3 of chunks 1-7 (the user's 8400-pair set; `--include_chunk0`
adds chunk 0), drawn by a plain DistributedSampler (no bucketing: every item has the same shapes).

The flags and the training itself are train_predictor_v4.py's (`offline_parser`, `train_offline`); this file holds
what differs: disca's data and presets.

Tiny CPU run (the demo dataset comes from `bash tools/launch_predictor_disca_training.sh`):

    python train_predictor_disca.py --preset demo --dataset_root demo_data/dataset --max_steps 20

Real run (8 GPUs; the run directory is named from the flags, see train.md § Run names):

    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh
    DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh "" 0,53
    torchrun --nproc_per_node 8 train_predictor_disca.py --dataset_root /data/predictor_v4 --tracker swanlab
"""

from __future__ import annotations

import argparse
import sys

from torch.utils.data import DistributedSampler

from predictor_training.data.batches import ResumableBatches
from predictor_training.data.dataset_config import config_field, read_dataset_config
from predictor_training.data.pair_dataset import PairDataset, collate_pairs
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.errors import UserInputError, command
from predictor_training.runtime.run_directory import launch_world
from train_predictor_v4 import finish_offline_args, offline_parser, train_offline

VARIANT = "disca"

# The CPU demo on the demo world: blocks 1,10 of its 12-block Teacher (as 1,52 of the real 54); fp32, no tracker.
PRESETS = {
    "demo": ["--experiment", "predictor_disca_demo", "--source_blocks", "1,10", "--precision", "fp32",
             "--max_steps", "240", "--scheduler_warmup_steps", "10", "--block_warmup_steps", "10",
             "--batch_size", "8", "--ckpt_every", "40", "--tracker", "none", "--num_workers", "0",
             "--val_every", "240", "--val_videos", "1"],
}


def parse_args(argv=None) -> argparse.Namespace:
    """The offline recipe's flags and defaults (train_predictor_v4.py) plus disca's own."""
    parser = offline_parser(__doc__, experiment="predictor_disca")
    parser.add_argument_group("disca").add_argument(
        "--include_chunk0", action="store_true",
        help="also train on chunk 0 (the user's recipe used chunks 1-7: 400 trajectories x 7 x 3 = 8400 pairs)")
    return finish_offline_args(parser, argv, PRESETS)


def open_dataset(args: argparse.Namespace, *, verify: bool = False, check_tensors: bool = True) -> PairDataset:
    """disca's pairs: no context or previous-chunk hidden (chunks 1-7, or 0-7 with --include_chunk0)."""
    return PairDataset(args.dataset_root, split=args.split, pairs=args.pairs, with_prefeatures=False,
                       with_prev_chunk_hidden=False, source_layers=tuple(args.source_blocks), verify=verify,
                       include_chunk0=args.include_chunk0, check_tensors=check_tensors)


def check_data(args: argparse.Namespace) -> None:
    """The dataset opened as the run will read it (no tensor read) and one batch per rank: a problem ends the
    launch before anything is created."""
    pairs = len(open_dataset(args, check_tensors=False))
    world_size, _ = launch_world(args.backend)
    if pairs < args.batch_size * world_size:
        raise UserInputError(f"--batch_size {args.batch_size}: {args.dataset_root} split {args.split} has {pairs} "
                             f"pairs, which cannot fill one batch on each of {world_size} ranks; expected "
                             f"--batch_size <= {pairs // world_size}")


def build_data(args: argparse.Namespace, env: DistEnv) -> tuple[PairDataset, ResumableBatches, float]:
    """disca's data -> (pairs, this rank's resumable batches, the dataset's context timestep), from a plain
    DistributedSampler; incomplete batches are dropped, so every rank sees the same number.
    """
    dataset = open_dataset(args, verify=args.verify_dataset)
    context_timestep = float(config_field(read_dataset_config(args.dataset_root), "context_timestep",
                                          args.dataset_root))
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    batches = ResumableBatches(sampler, dataset, collate_pairs, batch_size=args.batch_size, drop_last=True,
                               num_workers=args.num_workers, pin_memory=env.device.type == "cuda", seed=args.seed)
    return dataset, batches, context_timestep


@command
def main(argv=None) -> int:
    return train_offline(parse_args(argv), VARIANT, build_data, check_data)


if __name__ == "__main__":
    sys.exit(main())
