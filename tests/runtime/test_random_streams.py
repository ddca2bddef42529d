"""Counter-based random streams (predictor_training/runtime/random_streams.py): a generator is a pure function of its
integers, every integer and its position count, the seed fits 63 bits, and ALL_RANKS names a stream no rank has."""

from __future__ import annotations

import torch

from predictor_training.runtime.random_streams import ALL_RANKS, stream_generator, stream_seed


def test_the_seed_is_a_pure_function_of_every_value_and_its_position():
    assert stream_seed(3, 7, 1) == stream_seed(3, 7, 1)
    neighbours = {stream_seed(3, 7, 1), stream_seed(4, 7, 1), stream_seed(3, 8, 1), stream_seed(3, 7, 2),
                  stream_seed(7, 3, 1), stream_seed(1, 7, 3), stream_seed(3, 7), stream_seed(3, 7, 1, 1)}
    assert len(neighbours) == 8  # each value, the order and the count change the stream


def test_seeds_are_63_bit_and_do_not_collide_over_many_counters():
    seeds = [stream_seed(0, step, rank) for step in range(2000) for rank in range(4)]
    assert all(0 <= seed < 2**63 for seed in seeds)  # fits torch's manual_seed as a non-negative int64
    assert len(set(seeds)) == len(seeds)
    assert max(seeds) > 2**61  # the whole range is used, not the low bits only


def test_all_ranks_is_not_the_stream_of_any_rank():
    """A literal 0 in the rank's place would be rank 0's stream: trailing zeros do not change a SeedSequence."""
    assert stream_seed(5, 9, 0) == stream_seed(5, 9)
    shared = stream_seed(5, 9, ALL_RANKS)
    assert shared not in {stream_seed(5, 9, rank) for rank in range(1024)} | {stream_seed(5, 9)}


def test_the_generator_replays_its_stream_whatever_the_global_state():
    torch.manual_seed(1)
    first = torch.randn(5, generator=stream_generator(2, 11, 0))
    torch.manual_seed(2)
    torch.rand(100)  # the global stream moves; the counter-based one does not
    again = torch.randn(5, generator=stream_generator(2, 11, 0))
    assert torch.equal(first, again)
    assert stream_generator(2, 11, 0).initial_seed() == stream_seed(2, 11, 0)
    assert not torch.equal(first, torch.randn(5, generator=stream_generator(2, 11, 1)))


def test_adjacent_streams_look_independent():
    """The first uniform draw of 4000 consecutive steps: mean 1/2, and consecutive draws uncorrelated."""
    draws = torch.tensor([float(torch.rand(1, generator=stream_generator(0, step))) for step in range(4000)])
    assert abs(float(draws.mean()) - 0.5) < 0.02
    centred = draws - draws.mean()
    correlation = float((centred[1:] * centred[:-1]).mean() / centred.var())
    assert abs(correlation) < 0.05
