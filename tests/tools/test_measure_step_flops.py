"""tools/measure_step_flops.py: the v4 step at the real config against an independent count built from
teacher/flops.py's analytic pieces (live, one context size, and the committed table's every size), the monitor part
of dmd2 against the analytic Teacher rollout, the table holding every standard key, and (slow) kd's chunk model
checked on a draw it was not built from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from predictor_training.eval.training_cost import STEP_FLOPS_TABLE, find_entry, load_step_flops, training_cost
from predictor_training.teacher import flops
from predictor_training.teacher.config import preset_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import measure_step_flops  # noqa: E402

REAL = flops.TeacherShape.from_config(preset_config("worldplay_480p_i2v"))
TOKENS_PER_FRAME, TEXT_TOKENS = flops.REAL_LATENT_GRID[0] * flops.REAL_LATENT_GRID[1], flops.REAL_TEXT_TOKENS
V4 = {"variant": "v4", "hidden_size": REAL.hidden_size, "fusion_streams": ["image", "anchor", "prev_chunk"]}
# Below this the measured and the independent count agree: the forward has ~12 kFLOPs per context token of small
# matmuls the analytic count leaves out (4e-5 of the step at 20 context frames); the backward agrees exactly.
TOLERANCE = 1e-4


def v4_pair_flops(context_frames: int, shape=REAL, tokens_per_frame=TOKENS_PER_FRAME, text_tokens=TEXT_TOKENS):
    """One v4 pair's training step counted from teacher/flops.py's pieces, not from the code that runs it.

    forward: the context K/V of the 2 source blocks (no gradient: they are read from frozen pre-features) + the
    Predictor step (`predictor_step_flops`). Then the 2 checkpointed blocks run forward again in the backward. The
    backward: each block's linear layers twice (input and weight gradients), its frame modulation once (weight
    gradient: the frame vector is frozen), its ProPE maps once (input gradient: the cameras have none), its
    attention 2.5 times (the flash kernel's backward: the scores again, dV, dP, dQ, dK = 5 matmuls for the
    forward's 2); the fusion and the head twice (the fusion's LayerNorms train, so its input gradient runs too);
    the frozen final layer's projection once (input gradient); the frozen img_in and frame embeddings not at all.
    (teacher/flops.py's own `predictor_training_step_flops` is the rougher 3 x forward + recompute: 8-10 % below,
    since it charges the frozen layers' backward and the attention's at 2x.)"""
    hidden, mlp, linear = shape.hidden_size, shape.mlp_width, flops.linear_flops
    frames, queries = 4, 4 * tokens_per_frame
    keys = text_tokens + context_frames * tokens_per_frame + queries
    modulation = linear(frames, hidden, 6 * hidden)
    linears = 5 * linear(queries, hidden, hidden) + linear(queries, hidden, mlp) + linear(queries, mlp, hidden)
    prope = 4 * 8 * queries * hidden
    attention = 2 * (2 * queries * keys * hidden) * 2
    block = flops.image_block_flops(shape, frames, queries, keys)
    assert block == modulation + linears + prope + attention  # the same pieces as the analytic block
    context = context_frames * tokens_per_frame
    forward = 2 * flops.image_block_flops(shape, context_frames, context, context, kv_only=True) + \
        flops.predictor_step_flops(shape, V4, tokens_per_frame, text_tokens, context_frames)
    backward = (2 * block + 2 * (modulation + 2 * linears + prope + 2.5 * attention)
                + 2 * linear(queries, 3 * hidden, hidden) + 2 * 2 * linear(queries, hidden, hidden)
                + linear(queries, hidden, shape.out_channels))
    return forward, backward


def sizes(*extra):
    return measure_step_flops.parse_args(["--standard", *extra])


def test_v4_at_the_real_config_matches_the_independent_count():
    """The v4 step at 20 context frames, measured now (the real Teacher config on fake tensors, seconds)."""
    args, extra = measure_step_flops.rehearsal_inputs({"recipe": "v4"}, sizes())
    measured = measure_step_flops.step_flops(args, extra, n_ctx=20)
    forward, backward = v4_pair_flops(20)
    assert measured["forward"] == pytest.approx(forward, rel=TOLERANCE)
    assert measured["backward"] == pytest.approx(backward, rel=TOLERANCE)


def test_the_committed_v4_entry_matches_the_independent_count_at_every_context():
    entry = find_entry({"recipe": "v4"}, load_step_flops())
    per_context = {}
    for rehearsal in entry["rehearsals"]:
        frames = int(rehearsal["rehearsal"].removeprefix("context frames "))
        forward, backward = v4_pair_flops(frames)
        assert rehearsal["total"] == pytest.approx(forward + backward, rel=TOLERANCE), frames
        per_context[frames] = rehearsal["total"]
    mix = flops.OFFLINE_CONTEXT_MIX
    assert entry["parts"]["item"] == pytest.approx(sum(per_context[frames] for frames in mix) / len(mix))


def test_every_standard_key_is_in_the_committed_table():
    entries = load_step_flops(STEP_FLOPS_TABLE)
    missing = [key for key in measure_step_flops.STANDARD_KEYS if find_entry(key, entries) is None]
    assert not missing, f"run python tools/measure_step_flops.py --standard --write; missing {missing}"
    for entry in entries:
        assert entry["config"]["teacher"] == "worldplay_480p_i2v" and entry["config"]["chunks"] == 8
        assert all(value >= 0 for value in entry["parts"].values())


def test_the_dmd2_monitor_part_is_the_teachers_rollout():
    """dmd2's collapse monitor rolls the Teacher out F-F-F-F over the clip without a graph: its measured part is
    teacher/flops.py's rollout of 8 chunks (exact context: a prefill per chunk), within the tolerance."""
    context = flops.memory_context_frames(8)
    teacher = flops.rollout_flops(REAL, TOKENS_PER_FRAME, TEXT_TOKENS, context, lambda chunk, step: "full")["total"]
    for key in measure_step_flops.STANDARD_KEYS:
        if key["recipe"] == "dmd2":
            entry = find_entry(key, load_step_flops())
            assert entry["parts"]["monitor"] == pytest.approx(teacher, rel=0.01), key


def test_a_run_at_the_real_config_costs_its_steps(tmp_path):
    """A run directory of the table's F-R-R-P key: FLOPs = the committed per-trajectory figure x global batch x steps."""
    key = {"recipe": "rollout", "replace_steps": [3], "reuse_steps": [1, 2], "context_mode": "exact"}
    config = {"flags": {"replace_steps": [3], "reuse_steps": [1, 2], "context_mode": "exact", "init_from": None,
                        "resume": None}, "derived": {"recipe": "rollout_frrp", "variant": "v4", "world_size": 2,
                                                     "global_batch": 2, "environment": {"torch_threads": 1}}}
    (tmp_path / "train_config.json").write_text(json.dumps(config))
    (tmp_path / "train_log.jsonl").write_text("".join(json.dumps({"step": step, "time/step_s": 1.0}) + "\n"
                                                      for step in (1, 2, 3)))
    entry = find_entry(key, load_step_flops())
    assert training_cost(tmp_path)["flops"] == pytest.approx(entry["parts"]["item"] * 2 * 3)


@pytest.mark.slow
def test_kd_chunk_model_predicts_a_draw_it_was_not_built_from():
    """On the tiny Teacher (8 chunks, so chunks 5..7 all see the 20-frame memory window): the parts come from
    chunk {6}, chunks {6, 7} and every chunk; a rehearsal of chunks {5, 6, 7} costs fixed + 3 x one chunk."""
    tiny = sizes("--config", "tiny", "--text_tokens", "8", "--latent_grid", "2x3", "--source_blocks", "0,1")
    key = {"recipe": "kd", "train": "full", "student_steps": 1, "context_grad": False}
    entry = measure_step_flops.measure(key, tiny)
    args, extra = measure_step_flops.rehearsal_inputs(key, tiny)
    three = measure_step_flops.step_flops(args, extra, chunks=[5, 6, 7])["total"]
    one_chunk = entry["rehearsals"][1]["total"] - entry["rehearsals"][0]["total"]
    # within 1e-6: a few thousand FLOPs (of ~4e10) of small per-draw matmuls vary with which chunks are drawn; a
    # wrong model is off by a chunk's cost, ~1e10
    assert three == pytest.approx(entry["parts"]["fixed"] + 3 * one_chunk, rel=1e-6)
