"""The block-residual cache (B; predictor_training/eval/caches.py) and the Teacher call it runs
(`WorldPlayTransformer.chunk_step_blocks`): the skipped spans, the Full step it equals with every block run, the Full
step it equals when the residual is this very input's, its place in the AR rollout (its Full steps are the Teacher's,
its residuals the chunk's last Full step's) and its FLOPs (the blocks it runs + embed + final layer; at the real
config within a few per cent of a Predictor step)."""

from __future__ import annotations

import pytest
import torch

from predictor_training.eval.caches import BlockResidual, resolve_blocks
from predictor_training.eval.leaderboard_analysis import real_config_flops
from predictor_training.eval.methods import PlannedMethod, VelocityReuse, make_step_fn
from predictor_training.eval.timing import Stopwatch, TimedRollout
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig
from predictor_training.rollout.schedule import StepPlan
from predictor_training.teacher import WorldPlayTransformer, preset_config, randomize_zero_initialised_
from predictor_training.teacher.flops import (
    REAL_LATENT_GRID,
    REAL_TEXT_TOKENS,
    TeacherShape,
    block_residual_step_flops,
    embed_flops,
    final_layer_flops,
    image_block_flops,
    linear_flops,
    predictor_step_flops,
    rollout_flops,
    teacher_chunk_step_flops,
)
from predictor_training.teacher.model import skipped_block_spans
from tests.helpers.tiny_teacher import GRID, image_inputs, text_inputs, tiny_rollout_inputs, tiny_text_kv

DEPTH = 5


@pytest.fixture(scope="module")
def deep():
    """A tiny Teacher with 5 double blocks (random zero-initialised layers), its text K/V, a prefilled context of 3
    frames and a chunk's inputs."""
    torch.manual_seed(0)
    model = WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=DEPTH)
    randomize_zero_initialised_(model, torch.Generator().manual_seed(1), scale=0.5)
    model = model.eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(7)
    text_kv = model.text_prefill(**text_inputs(model, generator))
    context_kv, _ = model.context_prefill(**image_inputs(model, 3, generator, 14.0), text_kv=text_kv)
    chunk = image_inputs(model, 4, generator, 833.3333)
    return model, text_kv, context_kv, chunk


def _deep_rollout_teacher() -> WorldPlayTransformer:
    torch.manual_seed(0)
    model = WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=DEPTH)
    randomize_zero_initialised_(model, torch.Generator().manual_seed(1))
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------------------
# The spans and the block choice
# ---------------------------------------------------------------------------------------------------------------
def test_skipped_spans_are_the_maximal_runs_of_blocks_not_run():
    assert skipped_block_spans(12, (0, 11)) == [(1, 10)]
    assert skipped_block_spans(12, (1, 10)) == [(0, 0), (2, 9), (11, 11)]
    assert skipped_block_spans(5, (2,)) == [(0, 1), (3, 4)]
    assert skipped_block_spans(4, (3, 0, 1, 2)) == []
    assert resolve_blocks((0, -1), 54) == (0, 53) and resolve_blocks((-2, 1), 12) == (1, 10)
    for bad in ((0, 0), (0, 12), (-13,)):
        with pytest.raises(ValueError):
            resolve_blocks(bad, 12)
    with pytest.raises(ValueError, match="distinct"):
        skipped_block_spans(4, (1, 1))


# ---------------------------------------------------------------------------------------------------------------
# The Teacher call
# ---------------------------------------------------------------------------------------------------------------
def test_every_block_run_is_the_full_step_and_the_kept_hiddens_are_its_own(deep):
    model, text_kv, context_kv, chunk = deep
    trace: dict = {}
    full = model.chunk_step(**chunk, text_kv=text_kv, context_kv=context_kv, return_final_hidden=True, trace=trace)
    output, hiddens = model.chunk_step_blocks(**chunk, text_kv=text_kv, context_kv=context_kv,
                                              keep_hidden=range(DEPTH + 1))
    torch.testing.assert_close(output.velocity, full.velocity, rtol=0, atol=0)
    torch.testing.assert_close(output.final_hidden, full.final_hidden, rtol=0, atol=0)
    torch.testing.assert_close(hiddens[0], trace["img_tokens_in"], rtol=0, atol=0)
    for index in range(1, DEPTH):
        torch.testing.assert_close(hiddens[index], trace[f"layer{index - 1}.img_out"], rtol=0, atol=0)
    torch.testing.assert_close(hiddens[DEPTH], full.final_hidden, rtol=0, atol=0)


@pytest.mark.parametrize("blocks", [(0, 4), (1, 3), (2,), (0, 1)])
def test_with_the_residual_of_this_very_input_a_block_residual_step_is_the_full_step(deep, blocks):
    """Each skipped span a..b stood in for by x_out(b) - x_in(a) of the Full step on the same input: the same step,
    up to float rounding; the residual of another step (another timestep) or the negated residual is not."""
    model, text_kv, context_kv, chunk = deep
    spans = skipped_block_spans(DEPTH, blocks)
    full, hiddens = model.chunk_step_blocks(**chunk, text_kv=text_kv, context_kv=context_kv,
                                            keep_hidden=range(DEPTH + 1))
    own = {first: hiddens[last + 1] - hiddens[first] for first, last in spans}
    step, _ = model.chunk_step_blocks(**chunk, text_kv=text_kv, context_kv=context_kv, run_blocks=blocks,
                                      span_residuals=own)
    torch.testing.assert_close(step.velocity, full.velocity, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step.final_hidden, full.final_hidden, rtol=1e-5, atol=1e-5)
    negated, _ = model.chunk_step_blocks(**chunk, text_kv=text_kv, context_kv=context_kv, run_blocks=blocks,
                                         span_residuals={first: -value for first, value in own.items()})
    assert (negated.velocity - full.velocity).abs().max() > 1e-2
    other_input = {**chunk, "timestep": torch.full((4,), 500.0)}
    _, other = model.chunk_step_blocks(**other_input, text_kv=text_kv, context_kv=context_kv,
                                       keep_hidden=range(DEPTH + 1))
    stale = {first: other[last + 1] - other[first] for first, last in spans}
    cached, _ = model.chunk_step_blocks(**chunk, text_kv=text_kv, context_kv=context_kv, run_blocks=blocks,
                                        span_residuals=stale)
    assert (cached.velocity - full.velocity).abs().max() > 1e-3


def test_a_block_residual_step_needs_one_residual_per_span(deep):
    model, text_kv, context_kv, chunk = deep
    hidden = torch.zeros(1, 4 * GRID[0] * GRID[1], model.config.hidden_size)
    with pytest.raises(ValueError, match="one residual each"):
        model.chunk_step_blocks(**chunk, text_kv=text_kv, context_kv=context_kv, run_blocks=(0, 4),
                                span_residuals={})
    with pytest.raises(ValueError, match="one residual each"):
        model.chunk_step_blocks(**chunk, text_kv=text_kv, context_kv=context_kv, run_blocks=(0, 4),
                                span_residuals={2: hidden})


# ---------------------------------------------------------------------------------------------------------------
# In the AR rollout
# ---------------------------------------------------------------------------------------------------------------
def test_in_the_rollout_its_full_steps_are_the_teachers_and_its_residuals_the_chunks_last_full_steps():
    """At every step of an AR rollout (context and text K/V of the rollout): `full_step` is `run_teacher()` bit for
    bit, and a B step right after it on the same call is the Full step (its residual is this input's own)."""
    teacher = _deep_rollout_teacher()
    cache = BlockResidual(teacher, (0, -1))
    assert cache.blocks == (0, DEPTH - 1) and cache.spans == [(1, DEPTH - 2)]
    checked = []

    def step_fn(call):
        reference = call.run_teacher()
        full = cache.full_step(call)
        torch.testing.assert_close(full.velocity, reference.velocity, rtol=0, atol=0)
        torch.testing.assert_close(full.final_hidden, reference.final_hidden, rtol=0, atol=0)
        again = cache.fill(call, [])
        torch.testing.assert_close(again.velocity, reference.velocity, rtol=1e-5, atol=1e-5)
        checked.append((call.chunk_index, call.step_index, call.context.num_frames))
        return reference

    rollout = ARRollout(teacher, tiny_text_kv(teacher), tiny_rollout_inputs(teacher), RolloutConfig())
    rollout.run(step_fn)
    assert len(checked) == 12 and max(frames for _, _, frames in checked) > 0  # later chunks attend to context


def test_a_block_residual_row_runs_b_steps_after_the_chunks_full_step_and_counts_them():
    """F-B-B-B over three chunks: kinds full / block_residual, every B step one call of the 2 blocks (the B
    filler's stopwatch), the rollout neither the reference's nor the 1-step sampler's; the FLOP count of its
    recorded kinds is the reference's minus 3 x (Full step - block-residual step) per later chunk. A B step in a
    chunk whose Full step it did not see is refused."""
    teacher = _deep_rollout_teacher()
    text_kv, inputs = tiny_text_kv(teacher), tiny_rollout_inputs(teacher)

    def run(method):
        kinds: dict = {}
        stopwatch = Stopwatch(torch.device("cpu"))
        step_fn = make_step_fn(method, StepPlan.from_steps((1, 2, 3)), stopwatch, torch.no_grad, kinds)
        rollout = TimedRollout(teacher, text_kv, inputs, RolloutConfig(), device=torch.device("cpu"),
                               stopwatch=stopwatch)
        latents = rollout.run(step_fn)
        return latents, kinds, stopwatch, rollout

    cache = BlockResidual(teacher, (0, -1))
    planned = PlannedMethod("frbb", StepPlan.parse("F-B-B-B"), {"B": cache}, "b")
    assert planned.residual_blocks == 2
    latents, kinds, stopwatch, rollout = run(planned)
    assert [kinds[(1, step)] for step in range(4)] == ["full", "block_residual", "block_residual", "block_residual"]
    assert stopwatch.summary()["block_residual_step"]["count"] == 3 * 2
    reference, _, _, _ = run(PlannedMethod("ffff", StepPlan.parse("F-F-F-F"), {}, "f"))
    sampler, _, _, _ = run(PlannedMethod("frrr", StepPlan.parse("F-R-R-R"), {"R": VelocityReuse()}, "r"))
    assert (latents - reference).abs().max() > 1e-4 and (latents - sampler).abs().max() > 1e-4
    assert (latents - reference).abs().max() < (sampler - reference).abs().max()  # the blocks do something

    shape = TeacherShape.from_config(teacher.config)
    tokens, text_tokens = 2 * 3, text_kv.num_tokens
    contexts = rollout.context_frames
    assert len(contexts) == 3 and contexts[0] == 0 and contexts[2] > 0
    kinds_of = lambda chunk, step: kinds[(chunk, step)]  # noqa: E731
    counted = rollout_flops(shape, tokens, text_tokens, contexts, kinds_of, residual_blocks=2)
    every_full = rollout_flops(shape, tokens, text_tokens, contexts, lambda chunk, step: "full")
    saved = sum(3 * (teacher_chunk_step_flops(shape, tokens, text_tokens, n)
                     - block_residual_step_flops(shape, 2, tokens, text_tokens, n)) for n in contexts[1:])
    assert counted["total"] == every_full["total"] - saved
    assert counted["block_residual_step"] == sum(3 * block_residual_step_flops(shape, 2, tokens, text_tokens, n)
                                                 for n in contexts[1:])
    with pytest.raises(ValueError, match="residual_blocks"):
        rollout_flops(shape, tokens, text_tokens, contexts, kinds_of)

    stale = BlockResidual(teacher, (0, -1))
    stale.residuals, stale.residual_chunk = {1: torch.zeros(1)}, 0

    class Call:
        chunk_index, step_index = 1, 1

    with pytest.raises(RuntimeError, match="Full step of its chunk"):
        stale.fill(Call(), [])


# ---------------------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------------------
def test_a_block_residual_step_costs_its_blocks_the_embedding_and_the_final_layer():
    shape = TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
    tokens = REAL_LATENT_GRID[0] * REAL_LATENT_GRID[1]
    queries, chunk_frames = 4 * tokens, 4
    for context in (0, 4, 20):
        keys = REAL_TEXT_TOKENS + context * tokens + queries
        block = image_block_flops(shape, chunk_frames, queries, keys)
        expected = embed_flops(shape, queries, chunk_frames) + 2 * block + final_layer_flops(shape, queries,
                                                                                            chunk_frames)
        assert block_residual_step_flops(shape, 2, tokens, REAL_TEXT_TOKENS, context) == expected
        full = teacher_chunk_step_flops(shape, tokens, REAL_TEXT_TOKENS, context)
        assert block_residual_step_flops(shape, shape.depth, tokens, REAL_TEXT_TOKENS, context) == full
    with pytest.raises(ValueError):
        block_residual_step_flops(shape, 0, tokens, REAL_TEXT_TOKENS, 4)


def test_at_the_real_config_a_block_residual_step_costs_what_a_predictor_step_costs_less_its_fusion_and_head():
    """v4 Predictor step - B step = the fusion Linear (3 streams) + the residual head (2 Linear D -> D) =
    10 N D^2 = 2.617e11 FLOPs at N = 4 x 30 x 52, D = 2048: 0.057 of one Teacher block at 20 context frames; B is
    0.972 of the Predictor step there (0.940 at 4 frames) and 0.037 of a Full step."""
    shape = TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
    tokens = REAL_LATENT_GRID[0] * REAL_LATENT_GRID[1]
    queries, hidden = 4 * tokens, shape.hidden_size
    v4 = {"variant": "v4", "hidden_size": hidden, "fusion_streams": ["image", "anchor", "prev_chunk"]}
    for context, ratio in ((4, 0.9403), (20, 0.9724)):
        predictor = predictor_step_flops(shape, v4, tokens, REAL_TEXT_TOKENS, context)
        cached = block_residual_step_flops(shape, 2, tokens, REAL_TEXT_TOKENS, context)
        assert predictor - cached == linear_flops(queries, 3 * hidden, hidden) + 2 * linear_flops(queries, hidden,
                                                                                                 hidden)
        assert predictor - cached == 10 * queries * hidden ** 2 == pytest.approx(2.617e11, rel=1e-3)
        assert cached / predictor == pytest.approx(ratio, abs=1e-4)
    full = teacher_chunk_step_flops(shape, tokens, REAL_TEXT_TOKENS, 20)
    assert cached / full == pytest.approx(0.0370, abs=1e-4)


def test_the_real_config_axis_counts_a_b_row_at_its_block_count():
    """F-R-R-B at the real config = F-R-R-F minus, per later chunk, one Full step plus one block-residual step of 2
    blocks."""
    contexts = [0, 4, 8, 12]
    result = {"context_frames_per_chunk": contexts, "methods": {
        "frrf": {"step_kinds": ["FFFF"] + ["FRRF"] * 3}, "frrb": {"step_kinds": ["FFFF"] + ["FRRB"] * 3}}}
    shape = TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
    tokens = REAL_LATENT_GRID[0] * REAL_LATENT_GRID[1]
    difference = sum(teacher_chunk_step_flops(shape, tokens, REAL_TEXT_TOKENS, n)
                     - block_residual_step_flops(shape, 2, tokens, REAL_TEXT_TOKENS, n) for n in contexts[1:])
    assert real_config_flops(result, "frrb", None, 2) == real_config_flops(result, "frrf", None) - difference
    with pytest.raises(ValueError, match="residual_blocks"):
        real_config_flops(result, "frrb", None)
