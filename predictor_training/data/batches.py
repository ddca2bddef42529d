"""Resumable batch streams for the training loop: the exact next batch after a resume, the same order on every rank.

`ResumableBatches` wraps a sampler and a dataset into an endless stream over epochs; `one_item_per_rank_batches`
is the stream of the rollout-style recipes (one trajectory or clip per rank per micro-batch).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.random_streams import stream_seed


def _prepare_sampler_epoch(sampler, epoch: int, seed: int) -> None:
    """Make `sampler`'s order for `epoch` a pure function of (seed, epoch)."""
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)  # DistributedSampler, bucketing batch samplers
    elif isinstance(sampler, BatchSampler):
        _prepare_sampler_epoch(sampler.sampler, epoch, seed)
    elif isinstance(sampler, RandomSampler):
        if sampler.generator is None:
            raise ValueError("ResumableBatches: a RandomSampler needs an explicit generator= so its order can be replayed")
        sampler.generator.manual_seed(stream_seed(seed, epoch))
    elif not isinstance(sampler, SequentialSampler):
        raise TypeError(
            f"ResumableBatches: cannot replay the order of {type(sampler).__name__}; use a sampler with set_epoch(), "
            "a RandomSampler with a generator, a SequentialSampler, or a BatchSampler over one of those"
        )


class ResumableBatches:
    """An endless stream of collated batches over epochs that can resume at the exact next batch.

    sampler: yields dataset indices (DistributedSampler, RandomSampler(generator=...), SequentialSampler) when
        `batch_size` is given, or lists of indices (a batch sampler, e.g. bucketing by context length) when
        `batch_size` is None. `set_epoch(epoch)` is called at each epoch start where the sampler has it.
    State: (epoch, position) = batches already handed out in the current epoch. The order of an epoch is
    recomputed from (seed, epoch) on resume and the first `position` batches are skipped without loading them.
    Worker seeds come from an explicit generator seeded by (seed, epoch, position); for an exact resume a
    dataset should draw no random numbers in `__getitem__` (draw them in `step_fn`).
    """

    def __init__(
        self,
        sampler,
        dataset,
        collate_fn: Callable,
        *,
        batch_size: int | None = None,
        drop_last: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
    ):
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"ResumableBatches: batch_size={batch_size}; expected >= 1 or None for a batch sampler")
        self.sampler = sampler
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._epoch_batches: tuple[int, list[list[int]]] | None = None
        self._iterator = None

    # -- epoch order --------------------------------------------------------------------------------
    def _group(self, items: Iterable) -> list[list[int]]:
        if self.batch_size is None:
            batches = []
            for item in items:
                if not isinstance(item, (list, tuple)):
                    raise TypeError(
                        f"ResumableBatches: batch_size=None expects a batch sampler yielding lists of indices, got {type(item).__name__}"
                    )
                batches.append([int(index) for index in item])
            return batches
        indices = [int(index) for index in items]
        batches = [indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """Index lists of every batch of `epoch`, in order (cached for the current epoch)."""
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            _prepare_sampler_epoch(self.sampler, epoch, self.seed)
            batches = self._group(iter(self.sampler))
            if not batches:
                raise ValueError(f"ResumableBatches: epoch {epoch} has no batches (dataset/sampler too small?)")
            self._epoch_batches = (epoch, batches)
        return self._epoch_batches[1]

    def batches_per_epoch(self) -> int:
        return len(self.epoch_batches(self.epoch))

    # -- iteration ----------------------------------------------------------------------------------
    def _open_epoch(self) -> None:
        remaining = self.epoch_batches(self.epoch)[self.position :]
        generator = torch.Generator().manual_seed(stream_seed(self.seed, self.epoch, self.position))
        loader = DataLoader(
            self.dataset,
            batch_sampler=remaining,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=generator,
        )
        self._iterator = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            if self._iterator is None:
                self._open_epoch()
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.epoch += 1
                self.position = 0
                continue
            self.position += 1
            return batch

    # -- resume -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"ResumableBatches.load_state_dict: saved seed={state['seed']}, this run uses {self.seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if position > len(self.epoch_batches(epoch)):
            raise ValueError(
                f"ResumableBatches.load_state_dict: position {position} is past the {len(self.epoch_batches(epoch))} "
                f"batches of epoch {epoch} (different dataset, batch size or world size?)"
            )
        self.epoch, self.position = epoch, position
        self._iterator = None


# ------------------------------------------------------------------------------------------------ helpers
def first_item(items: list[dict]) -> dict:
    """Collate of one item per micro-batch (a whole trajectory or clip): the item itself."""
    if len(items) != 1:
        raise ValueError(f"expected one item per micro-batch, got {len(items)}")
    return items[0]


def one_item_per_rank_batches(dataset, env: DistEnv, *, seed: int, num_workers: int) -> ResumableBatches:
    """One dataset item per rank per micro-batch from a DistributedSampler (shuffled, drop_last), so ranks never
    share one and every rank has the same number per epoch."""
    if len(dataset) < env.world_size:
        raise ValueError(f"{len(dataset)} items cannot give one to each of {env.world_size} ranks")
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed,
                                 drop_last=True)
    return ResumableBatches(sampler, dataset, first_item, batch_size=1, drop_last=True, num_workers=num_workers,
                            seed=seed)
