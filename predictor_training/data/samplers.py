"""Batch sampler that buckets items by their number of context frames (v4 offline training).

Context K/V of different lengths cannot share a batch without padding the attention, so every batch holds items of
one ``n_ctx`` value. The order of one epoch is a pure function of ``(seed, epoch)``:

1. each bucket (n_ctx value, ascending) is shuffled with a generator seeded by ``(seed, epoch)`` and cut into batches
   of ``batch_size``; an incomplete tail batch is dropped (``drop_last=True``) or filled up with the bucket's first
   shuffled items (``drop_last=False``, those items then appear twice in the epoch);
2. the batches of all buckets are shuffled together with the same generator;
3. the global batch list is dealt round-robin to ranks (batch ``i`` goes to rank ``i % num_replicas``) after making
   its length a multiple of ``num_replicas``: ``drop_last=True`` drops the surplus batches at the end of the shuffled
   list, ``drop_last=False`` repeats batches from its start.

So every rank yields the same number of batches, and with ``drop_last=True`` no index appears twice anywhere in an
epoch (ranks are disjoint). ``len(sampler)`` is the same for every epoch. Resuming mid-epoch: call ``set_epoch`` and
skip the first ``position`` batches (``ResumableBatches`` does this), which gives the same remaining batches.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

_EPOCH_SEED_STRIDE = 1_000_003  # a prime, so (seed, epoch) pairs map to distinct generator seeds in practice


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """CPU generator for one epoch's shuffles."""
    generator = torch.Generator()
    generator.manual_seed(int(seed) * _EPOCH_SEED_STRIDE + int(epoch))
    return generator


class BucketBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset indices, one ``n_ctx`` value per list, this rank's share of the epoch.

    Args:
        n_ctx_list: n_ctx of every dataset item, in index order (``PairDataset.n_ctx_list()``).
        batch_size: items per batch on one rank.
        num_replicas: number of ranks (world size).
        rank: this rank, 0 <= rank < num_replicas.
        seed: shuffle seed, the same on every rank.
        drop_last: drop incomplete batches and surplus batches (True) or pad them by repetition (False).
    """

    def __init__(
        self,
        n_ctx_list: Sequence[int],
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        seed: int = 0,
        drop_last: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.batch_size = int(batch_size)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.buckets = self._group_by_n_ctx(n_ctx_list)
        self._batches_per_rank = self._count_batches_per_rank()
        if self._batches_per_rank == 0:
            sizes = {n_ctx: len(indices) for n_ctx, indices in self.buckets.items()}
            raise ValueError(
                f"no full batch per rank: bucket sizes {sizes}, batch_size {batch_size}, num_replicas {num_replicas}"
            )

    @staticmethod
    def _group_by_n_ctx(n_ctx_list: Sequence[int]) -> dict[int, list[int]]:
        buckets: dict[int, list[int]] = defaultdict(list)
        for index, n_ctx in enumerate(n_ctx_list):
            if int(n_ctx) != n_ctx or n_ctx < 0:
                raise ValueError(f"n_ctx_list[{index}] = {n_ctx!r}, expected an int >= 0")
            buckets[int(n_ctx)].append(index)
        if not buckets:
            raise ValueError("n_ctx_list is empty")
        return dict(sorted(buckets.items()))

    def _count_batches_per_rank(self) -> int:
        if self.drop_last:
            total = sum(len(indices) // self.batch_size for indices in self.buckets.values())
            return total // self.num_replicas
        total = sum(-(-len(indices) // self.batch_size) for indices in self.buckets.values())
        return -(-total // self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order ``__iter__`` yields (call on every rank before iterating)."""
        self.epoch = int(epoch)

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of ``epoch`` in dealing order, length ``len(self) * num_replicas``."""
        generator = epoch_generator(self.seed, epoch)
        batches: list[list[int]] = []
        for indices in self.buckets.values():
            shuffled = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
            batches += self._cut(shuffled)
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        wanted = self._batches_per_rank * self.num_replicas
        while len(batches) < wanted:  # drop_last=False: repeat from the start
            batches += batches[: wanted - len(batches)]
        return batches[:wanted]

    def _cut(self, shuffled: list[int]) -> list[list[int]]:
        size = self.batch_size
        full = [shuffled[start : start + size] for start in range(0, len(shuffled) - size + 1, size)]
        tail = shuffled[len(full) * size :]
        if tail and not self.drop_last:
            filler = (shuffled * (size // len(shuffled) + 1))[: size - len(tail)]
            full.append(tail + filler)
        return full

    def __iter__(self) -> Iterator[list[int]]:
        batches = self.global_batches(self.epoch)
        return iter(batches[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self._batches_per_rank

    def state_dict(self) -> dict:
        """What decides the order: seed, epoch and the layout (the position inside the epoch is the caller's)."""
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "batch_size": self.batch_size,
            "num_replicas": self.num_replicas,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the epoch; ValueError naming the field when seed or layout differ from this sampler's."""
        for name in ("seed", "batch_size", "num_replicas", "drop_last"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"sampler state field {name!r} is {state[name]!r}, this sampler has {getattr(self, name)!r}"
                )
        self.set_epoch(state["epoch"])
