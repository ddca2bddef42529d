"""ResumableBatches (predictor_training/data/batches.py): a resumed stream continues with the
exact next batch for every kind of sampler, and samplers it cannot replay, or a foreign state, are refused."""

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from predictor_training.data.batches import ResumableBatches


# ------------------------------------------------------------------------------------------------ data
class IndexDataset(torch.utils.data.Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index


def collate_indices(items):
    return list(items)


class ToyBucketBatchSampler:
    """Like a bucketing sampler: per epoch, shuffle with (seed, epoch), then batch within 'length' buckets."""

    def __init__(self, size, batch_size, seed):
        self.size, self.batch_size, self.seed, self.epoch = size, batch_size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        buckets = {0: [i for i in order if i % 2 == 0], 1: [i for i in order if i % 2 == 1]}
        for bucket in buckets.values():
            for start in range(0, len(bucket), self.batch_size):
                yield bucket[start : start + self.batch_size]


SAMPLERS = {
    "distributed": lambda: (DistributedSampler(IndexDataset(14), num_replicas=2, rank=1, shuffle=True, seed=3), 2),
    "random": lambda: (RandomSampler(IndexDataset(10), generator=torch.Generator()), 3),
    "sequential": lambda: (SequentialSampler(IndexDataset(7)), 2),
    "bucket_batch_sampler": lambda: (ToyBucketBatchSampler(9, 2, seed=5), None),
    "torch_batch_sampler": lambda: (BatchSampler(RandomSampler(IndexDataset(8), generator=torch.Generator()), 3, False), None),
}


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
def test_resumable_batches_continue_with_the_exact_next_batch(kind):
    def make():
        sampler, batch_size = SAMPLERS[kind]()
        return ResumableBatches(sampler, IndexDataset(20), collate_indices, batch_size=batch_size, seed=11)

    reference = make()
    per_epoch = reference.batches_per_epoch()
    stream = [next(reference) for _ in range(3 * per_epoch + 1)]
    assert reference.epoch == 3 and reference.position == 1
    if kind != "sequential":  # set_epoch / reseeding really changes the order between epochs
        assert stream[:per_epoch] != stream[per_epoch : 2 * per_epoch]
    for cut in (1, per_epoch, per_epoch + 2):
        first = make()
        head = [next(first) for _ in range(cut)]
        resumed = make()
        resumed.load_state_dict(first.state_dict())
        tail = [next(resumed) for _ in range(len(stream) - cut)]
        assert head + tail == stream, (kind, cut)


def test_resumable_batches_refuse_unreplayable_samplers_and_bad_state():
    with pytest.raises(ValueError, match="generator"):
        ResumableBatches(RandomSampler(IndexDataset(4)), IndexDataset(4), collate_indices, batch_size=2).batches_per_epoch()
    with pytest.raises(TypeError, match="cannot replay"):
        ResumableBatches([0, 1, 2], IndexDataset(4), collate_indices, batch_size=2).batches_per_epoch()
    batches = ResumableBatches(SequentialSampler(IndexDataset(4)), IndexDataset(4), collate_indices, batch_size=2, seed=1)
    with pytest.raises(ValueError, match="seed"):
        batches.load_state_dict({"epoch": 0, "position": 1, "seed": 2})
    with pytest.raises(ValueError, match="past"):
        batches.load_state_dict({"epoch": 0, "position": 3, "seed": 1})
