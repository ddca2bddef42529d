"""Throughput of the offline pair loader next to the training step's consumption rate.

    python benchmarks/bench_loader.py                         # synthetic demo-sized dataset in a temporary folder
    python benchmarks/bench_loader.py --root DS --source-layers 1 52 --batch-size 16 --workers 0 2 8

For each worker count, ``PairDataset`` -> ``BucketBatchSampler`` -> ``DataLoader(collate_pairs)`` is timed over
``--batches`` batches (after ``--warmup`` batches, which absorb worker start-up; workers persist across epochs). When
``predictor_training.predictor.model`` is importable, one training step (context projection, forward, loss, backward,
AdamW) of a fresh Predictor on a Teacher of preset ``--teacher-preset`` (random weights, CPU fp32) on one such batch
is timed too, and the loader/step ratio is printed (> 1: the loader keeps up with training). Otherwise the step
rate is reported as unavailable. Nothing is written except the synthetic dataset, which lives in a temporary folder
that is removed at the end.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from predictor_training.data.pair_dataset import (
    PairDataset,
    collate_pairs,
)
from predictor_training.data.dataset_config import config_field, read_dataset_config
from predictor_training.data.samplers import BucketBatchSampler
from predictor_training.data.synthetic import SyntheticSpec, write_synthetic_dataset


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=None,
                        help="existing dataset root; default: build a synthetic one in a temporary folder")
    parser.add_argument("--split", default="train", help="manifest split to read")
    parser.add_argument("--source-layers", type=int, nargs=2, default=(0, 3),
                        help="the Predictor's two source blocks (must be in the dataset's prefeature_layers)")
    parser.add_argument("--variant", choices=("v4", "disca"), default="v4",
                        help="v4 reads context pre-features and the previous-chunk hidden; disca reads neither")
    parser.add_argument("--batch-size", type=int, default=16, help="items per batch (per rank)")
    parser.add_argument("--workers", type=int, nargs="+", default=(0, 2), help="DataLoader worker counts to time")
    parser.add_argument("--batches", type=int, default=40, help="timed batches per worker count")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches before timing (worker start-up), >= 1")
    parser.add_argument("--step-repeats", type=int, default=5, help="timed forward+backward repeats of the step")
    parser.add_argument("--no-step", action="store_true",
                        help="time the loader only (e.g. on real data, where a random full-size Teacher is too big)")
    parser.add_argument("--teacher-preset", default="demo",
                        help="Teacher preset whose blocks the timed Predictor copies (and whose sizes the synthetic "
                             "dataset uses)")
    parser.add_argument("--cases", type=int, default=12, help="synthetic dataset: train cases")
    parser.add_argument("--actions", type=int, default=4, help="synthetic dataset: actions per case")
    parser.add_argument("--height", type=int, default=4, help="synthetic dataset: latent grid height")
    parser.add_argument("--width", type=int, default=6, help="synthetic dataset: latent grid width")
    parser.add_argument("--num-chunks", type=int, default=8, help="synthetic dataset: chunks per trajectory")
    parser.add_argument("--max-context", type=int, default=20, help="synthetic dataset: context frames cap")
    parser.add_argument("--seed", type=int, default=0, help="sampler and synthetic-data seed")
    args = parser.parse_args(argv)
    for name in ("batch_size", "batches", "warmup", "step_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(workers < 0 for workers in args.workers):
        parser.error("--workers values must be >= 0")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic dataset
# ---------------------------------------------------------------------------------------------------------------------
def build_synthetic_dataset(folder: Path, args: argparse.Namespace) -> Path:
    """Write a dataset in the docs/dataset.md layout with the sizes of ``--teacher-preset`` (random tensors)."""

    from predictor_training.teacher.config import preset_config

    teacher = preset_config(args.teacher_preset)
    hidden, heads = teacher["hidden_size"], teacher["heads_num"]
    spec = SyntheticSpec(
        cases={f"c{i:04d}": "train" for i in range(args.cases)},
        actions=tuple(range(args.actions)),
        num_chunks=args.num_chunks,
        channels=teacher["out_channels"],
        height=args.height,
        width=args.width,
        hidden=hidden,
        depth=teacher["mm_double_blocks_depth"],
        heads=heads,
        head_dim=hidden // heads,
        prefeature_layers=tuple(sorted(set(args.source_layers))),
        max_context=args.max_context,
        seed=args.seed,
    )
    write_synthetic_dataset(folder, spec)
    return folder


# ---------------------------------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class LoaderFigures:
    workers: int
    batches_per_s: float
    items_per_s: float
    megabytes_per_s: float


def batch_bytes(batch) -> int:
    """Bytes of all tensors in a collated batch."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(batch_bytes(value) for value in batch.values())
    return 0


def make_loader(dataset: PairDataset, args: argparse.Namespace, workers: int) -> tuple[DataLoader, BucketBatchSampler]:
    """Loader over this rank's bucketed batches; workers persist across epochs (``sampler.set_epoch`` between)."""
    sampler = BucketBatchSampler(dataset.n_ctx_list(), args.batch_size, num_replicas=1, rank=0, seed=args.seed)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_pairs, num_workers=workers,
                        persistent_workers=workers > 0)
    return loader, sampler


def measure_loader(dataset: PairDataset, args: argparse.Namespace, workers: int) -> LoaderFigures:
    """Time ``--batches`` batches after ``--warmup`` untimed ones, cycling epochs as needed."""
    loader, sampler = make_loader(dataset, args, workers)
    total = args.warmup + args.batches
    timed_bytes, timed_items, start, seen, epoch = 0, 0, 0.0, 0, 0
    with tqdm(total=total, desc=f"loader workers={workers}", leave=False) as progress:
        while seen < total:
            sampler.set_epoch(epoch)
            for batch in loader:
                seen += 1
                progress.update(1)
                if seen == args.warmup:
                    start = time.perf_counter()
                elif seen > args.warmup:
                    timed_bytes += batch_bytes(batch)
                    timed_items += len(batch["case_id"])
                if seen == total:
                    break
            epoch += 1
    elapsed = time.perf_counter() - start
    return LoaderFigures(workers, args.batches / elapsed, timed_items / elapsed, timed_bytes / elapsed / 2**20)


def measure_train_step(batch: dict, args: argparse.Namespace, context_timestep: float) -> float:
    """Optimizer steps per second of a fresh Predictor on ``batch``: forward (fp32, CPU), loss, backward, AdamW."""
    from predictor_training.predictor.loss import predictor_loss
    from predictor_training.predictor.model import build_predictor, text_kv_from_stacked
    from predictor_training.teacher import WorldPlayTransformer

    torch.manual_seed(args.seed)
    teacher = WorldPlayTransformer.from_preset(args.teacher_preset).float().eval()
    predictor = build_predictor(teacher, args.variant, tuple(args.source_layers))
    parameters = [p for group in predictor.trainable_parameter_groups().values() for p in group]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    batch_size, _, frames, height, width = batch["noisy_input"].shape

    def one_step() -> None:
        # 1. context K/V from the stored pre-features (v4), frozen projector, no grad
        context = None
        if args.variant == "v4":
            n_ctx = batch["n_ctx"]
            context = predictor.context_from_prefeatures(
                {layer: features.float() for layer, features in batch["ctx_prefeatures"].items()},
                torch.full((batch_size, n_ctx), context_timestep), batch["ctx_action"], batch["ctx_viewmats"],
                batch["ctx_Ks"], height=height, width=width,
            )
        # 2. forward, loss, backward, optimizer step
        pred_hidden, pred_velocity = predictor(
            batch["noisy_input"].float(), batch["anchor_hidden"].float(),
            batch["timestep"][:, None].expand(batch_size, frames), batch["action"], batch["viewmats"], batch["Ks"],
            text_kv_from_stacked(batch["text_k"].float(), batch["text_v"].float(), batch["text_mask"]),
            context=context,
            prev_chunk_hidden=batch["prev_chunk_hidden"].float() if args.variant == "v4" else None,
        )
        loss, _ = predictor_loss(pred_hidden, pred_velocity, batch["target_hidden"], batch["target_velocity"],
                                 velocity_weight=1.0, hidden_weight=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one_step()  # warm-up (allocations, first-call overheads)
    start = time.perf_counter()
    for _ in tqdm(range(args.step_repeats), desc="training step", leave=False):
        one_step()
    return args.step_repeats / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------------
def run(root: Path, args: argparse.Namespace) -> None:
    v4 = args.variant == "v4"
    dataset = PairDataset(root, args.split, with_prefeatures=v4, with_prev_chunk_hidden=v4,
                          source_layers=tuple(args.source_layers))
    print(f"dataset {root}: {len(dataset)} items ({len(dataset.trajectories)} trajectories), "
          f"batch size {args.batch_size}, variant {args.variant}, torch threads {torch.get_num_threads()}")
    figures = [measure_loader(dataset, args, workers) for workers in args.workers]

    if args.no_step:
        step_rate, step_text = None, "not measured (--no-step)"
    else:
        sample = next(iter(make_loader(dataset, args, workers=0)[0]))
        context_timestep = float(config_field(read_dataset_config(root), "context_timestep", root))
        step_rate = measure_train_step(sample, args, context_timestep)
        step_text = (f"{step_rate:.2f} steps/s (Predictor {args.variant} on the {args.teacher_preset} Teacher, "
                     f"forward+backward+AdamW, batch {args.batch_size}, CPU fp32)")

    print(f"{'workers':>8} {'batches/s':>10} {'items/s':>9} {'MiB/s':>8} {'loader/step':>12}")
    for figure in figures:
        ratio = f"{figure.batches_per_s / step_rate:.1f}x" if step_rate else "n/a"
        print(f"{figure.workers:>8} {figure.batches_per_s:>10.1f} {figure.items_per_s:>9.1f} "
              f"{figure.megabytes_per_s:>8.2f} {ratio:>12}")
    print(f"training step: {step_text}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.root is not None:
        run(args.root, args)
        return
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as folder:
        print(f"building a synthetic {args.teacher_preset}-sized dataset in {folder} ...")
        run(build_synthetic_dataset(Path(folder), args), args)


if __name__ == "__main__":
    main()
