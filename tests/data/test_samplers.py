"""BucketBatchSampler: one n_ctx per batch, deterministic per epoch, disjoint and equal-length across ranks."""

from __future__ import annotations

import itertools

import pytest

from predictor_training.data.samplers import BucketBatchSampler


# the v4 layout: 400 trajectories x chunks 1..7 x 3 pairs, n_ctx of chunks 1..7 for 32 latents
CHUNK_N_CTX = (4, 8, 12, 16, 20, 20, 20)
N_CTX_LIST = [n for _ in range(400) for n in CHUNK_N_CTX for _ in range(3)]


def rank_batches(num_replicas, epoch, n_ctx_list=N_CTX_LIST, batch_size=16, seed=0, drop_last=True):
    result = []
    for rank in range(num_replicas):
        sampler = BucketBatchSampler(n_ctx_list, batch_size, num_replicas, rank, seed, drop_last)
        sampler.set_epoch(epoch)
        result.append(list(sampler))
    return result


def test_every_batch_holds_one_n_ctx_and_batch_size_items():
    for batches in rank_batches(2, epoch=0):
        for batch in batches:
            assert len(batch) == 16
            assert len({N_CTX_LIST[index] for index in batch}) == 1


def test_deterministic_per_epoch_and_different_across_epochs():
    first = rank_batches(2, epoch=3)
    again = rank_batches(2, epoch=3)
    assert first == again
    other_epoch = rank_batches(2, epoch=4)
    assert first[0] != other_epoch[0] and first[1] != other_epoch[1]
    other_seed = rank_batches(2, epoch=3, seed=1)
    assert first[0] != other_seed[0]


def test_order_depends_only_on_seed_and_epoch():
    sampler = BucketBatchSampler(N_CTX_LIST, 16, 8, 5, seed=7)
    sampler.set_epoch(2)
    consumed_once = list(sampler)
    sampler.set_epoch(9)
    list(sampler)
    sampler.set_epoch(2)
    assert list(sampler) == consumed_once  # iterating other epochs in between changes nothing
    fresh = BucketBatchSampler(N_CTX_LIST, 16, 8, 5, seed=7)
    fresh.load_state_dict(sampler.state_dict())
    assert list(fresh) == consumed_once


@pytest.mark.parametrize("num_replicas", [2, 8])
def test_ranks_are_disjoint_with_equal_counts(num_replicas):
    for epoch in (0, 1):
        per_rank = rank_batches(num_replicas, epoch)
        counts = {len(batches) for batches in per_rank}
        assert len(counts) == 1
        assert counts.pop() == len(BucketBatchSampler(N_CTX_LIST, 16, num_replicas, 0, 0))
        indices = [index for batches in per_rank for batch in batches for index in batch]
        assert len(indices) == len(set(indices))


def test_drop_last_counts_follow_bucket_sizes():
    # buckets: n_ctx 4: 30 items, n_ctx 8: 17 items -> 1 + 1 full batches of 16 with drop_last
    n_ctx_list = [4] * 30 + [8] * 17
    assert len(BucketBatchSampler(n_ctx_list, 16, 1, 0, 0, drop_last=True)) == 2
    assert len(BucketBatchSampler(n_ctx_list, 16, 1, 0, 0, drop_last=False)) == 4
    assert len(BucketBatchSampler(n_ctx_list, 16, 2, 0, 0, drop_last=True)) == 1
    assert len(BucketBatchSampler(n_ctx_list, 16, 3, 0, 0, drop_last=False)) == 2  # 4 batches padded to 6


@pytest.mark.parametrize("num_replicas", [1, 3, 8])
def test_padding_covers_every_index_with_equal_counts(num_replicas):
    n_ctx_list = [4] * 30 + [8] * 17 + [12] * 5
    per_rank = rank_batches(num_replicas, epoch=1, n_ctx_list=n_ctx_list, drop_last=False)
    assert len({len(batches) for batches in per_rank}) == 1
    all_batches = list(itertools.chain.from_iterable(per_rank))
    assert all(len(batch) == 16 and len({n_ctx_list[i] for i in batch}) == 1 for batch in all_batches)
    assert {index for batch in all_batches for index in batch} == set(range(len(n_ctx_list)))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="rank must be in"):
        BucketBatchSampler(N_CTX_LIST, 16, 2, 2, 0)
    with pytest.raises(ValueError, match="no full batch per rank"):
        BucketBatchSampler([4] * 10, 16, 1, 0, 0, drop_last=True)
    with pytest.raises(ValueError, match=r"n_ctx_list\[1\]"):
        BucketBatchSampler([4, -1], 1, 1, 0, 0)
    sampler = BucketBatchSampler(N_CTX_LIST, 16, 2, 0, 0)
    with pytest.raises(ValueError, match="'num_replicas' is 4"):
        sampler.load_state_dict({**sampler.state_dict(), "num_replicas": 4})


def test_resume_through_resumable_batches_replays_the_rest_of_the_epoch():
    from predictor_training.data.batches import ResumableBatches

    n_ctx_list = [4] * 40 + [8] * 24 + [20] * 33
    dataset = list(range(len(n_ctx_list)))

    def stream():
        sampler = BucketBatchSampler(n_ctx_list, 4, num_replicas=2, rank=1, seed=3)
        return ResumableBatches(sampler, dataset, collate_fn=list, batch_size=None, seed=3)

    uninterrupted = stream()
    expected = [next(uninterrupted) for _ in range(len(BucketBatchSampler(n_ctx_list, 4, 2, 1, 3)) + 5)]
    first = stream()
    consumed = [next(first) for _ in range(7)]
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    rest = [next(resumed) for _ in range(len(expected) - 7)]
    assert consumed + rest == expected  # crosses into the next epoch too
