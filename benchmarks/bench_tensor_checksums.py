"""What the per-tensor checksum check costs when pair items are loaded: with and without it, side by side.

    python benchmarks/bench_tensor_checksums.py                    # tiny synthetic dataset in a temporary folder
    python benchmarks/bench_tensor_checksums.py --hidden 1024 --height 8 --width 12 --repeats 7

Builds a tiny dataset in the docs/dataset.md layout (``predictor_training/data/synthetic.py``, the writer the reader
tests use, so the manifest carries a CRC-32 per tensor), warms the page cache with one untimed pass, then times full passes over every
v4 pair item in alternating order. A pass is what the offline trainer's loader does without workers: the items of
``BucketBatchSampler`` batches (``--batch-size``) through ``PairDataset.__getitem__`` and ``collate_pairs``, so every
byte read is also used once (safetensors maps the file, so an item that nobody touches costs almost nothing):

* ``off``: ``PairDataset(..., check_tensors=False)``: no checksum is computed;
* ``on (first pass)``: a fresh ``PairDataset`` (the default): every tensor is hashed the first time it is read. This
  is the worst case, the first epoch of a process;
* ``on (later pass)``: the same object again: every tensor was checked already, nothing is hashed.

Prints the median seconds per pass, items/s and the ratio to ``off``. Also prints the hash rate of CRC-32 (the
checksum used) next to sha256, blake2b and md5 on the dataset's own tensor bytes, which is why CRC-32 was chosen.
Nothing is written outside the temporary folder, which is removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch

from predictor_training.data.pair_dataset import PairDataset, collate_pairs
from predictor_training.data.samplers import BucketBatchSampler
from predictor_training.data.synthetic import SyntheticSpec, write_synthetic_dataset
from predictor_training.data.shards import load_tensors

SOURCE_LAYERS = (0, 2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=3, help="train cases of the synthetic dataset")
    parser.add_argument("--actions", type=int, default=2, help="trajectories per case")
    parser.add_argument("--num-chunks", type=int, default=8, help="chunks per trajectory (4 latents each)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size D of the stored hidden states")
    parser.add_argument("--height", type=int, default=4, help="latent grid height")
    parser.add_argument("--width", type=int, default=6, help="latent grid width")
    parser.add_argument("--batch-size", type=int, default=4, help="items per collated batch")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per variant (the median is reported)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tensors")
    args = parser.parse_args(argv)
    if min(args.cases, args.actions, args.batch_size, args.repeats) < 1 or args.num_chunks < 2:
        parser.error("--cases, --actions, --batch-size and --repeats must be >= 1 and --num-chunks >= 2")
    return args


def build_dataset(folder: Path, args: argparse.Namespace) -> Path:
    heads = 4 if args.hidden % 4 == 0 else 1
    spec = SyntheticSpec(
        cases={f"c{index:03d}": "train" for index in range(args.cases)},
        actions=tuple(range(args.actions)), num_chunks=args.num_chunks, height=args.height, width=args.width,
        hidden=args.hidden, heads=heads, head_dim=args.hidden // heads, prefeature_layers=SOURCE_LAYERS,
        max_context=20, seed=args.seed,
    )
    write_synthetic_dataset(folder, spec)
    return folder


def one_pass(dataset: PairDataset, batch_size: int) -> float:
    """Seconds to read and collate every item once (bucketed batches, drop_last=False)."""
    sampler = BucketBatchSampler(dataset.n_ctx_list(), batch_size, num_replicas=1, rank=0, seed=0, drop_last=False)
    start = time.perf_counter()
    for batch in sampler:
        collate_pairs([dataset[index] for index in batch])
    return time.perf_counter() - start


def hash_rates(root: Path) -> dict[str, float]:
    """MB/s of each hash over the tensor bytes of the dataset's first trajectory file (best of 3)."""
    path = sorted((root / "trajectories").glob("*.safetensors"))[0]
    buffers = [tensor.contiguous().reshape(-1).view(torch.uint8).numpy() for tensor in load_tensors(path).values()]
    total = sum(buffer.nbytes for buffer in buffers)
    hashes = {
        "crc32 (used)": lambda data: zlib.crc32(data),
        "sha256": lambda data: hashlib.sha256(data).digest(),
        "blake2b": lambda data: hashlib.blake2b(data).digest(),
        "md5": lambda data: hashlib.md5(data).digest(),
    }
    rates = {}
    for name, function in hashes.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(20):
                for buffer in buffers:
                    function(buffer)
            best = min(best, time.perf_counter() - start)
        rates[name] = 20 * total / best / 1e6
    return rates


def run(root: Path, args: argparse.Namespace) -> None:
    def fresh(check: bool) -> PairDataset:
        return PairDataset(root, "train", source_layers=SOURCE_LAYERS, check_tensors=check)

    items = len(fresh(False))
    file_bytes = sum(path.stat().st_size for path in root.rglob("*.safetensors"))
    print(f"dataset {root}: {items} v4 items, {file_bytes / 2**20:.2f} MiB of shards, hidden {args.hidden}, grid "
          f"{args.height}x{args.width}, torch threads {torch.get_num_threads()}")
    one_pass(fresh(False), args.batch_size)  # page cache, first-call overheads
    times: dict[str, list[float]] = {"off": [], "on (first pass)": [], "on (later pass)": []}
    for repeat in range(args.repeats):
        order = [False, True] if repeat % 2 == 0 else [True, False]
        for check in order:
            dataset = fresh(check)
            seconds = one_pass(dataset, args.batch_size)
            if check:
                times["on (first pass)"].append(seconds)
                times["on (later pass)"].append(one_pass(dataset, args.batch_size))
            else:
                times["off"].append(seconds)
    base = statistics.median(times["off"])
    print(f"{'variant':<18} {'s/pass':>9} {'items/s':>9} {'ratio to off':>13}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<18} {median:>9.4f} {items / median:>9.1f} {median / base:>12.3f}x")
    rates = "; ".join(f"{name} {rate:,.0f} MB/s" for name, rate in hash_rates(root).items())
    print(f"hash rates on the stored tensor bytes: {rates}")


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_tensor_checksums_") as folder:
        run(build_dataset(Path(folder), args), args)


if __name__ == "__main__":
    main()
