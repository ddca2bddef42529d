"""Conformance set A (predictor_training/conformance/golden/worldplay_tiny_A) through
predictor_training.conformance.calls (the logic of tools/check_conformance.py), strict tier: every case passes, a
perturbed model fails the chunk cases, and the comparison uses atol + rtol."""

from __future__ import annotations

import pytest
import torch

from predictor_training.conformance import SET_A
from predictor_training.conformance.calls import build_model, compare_close, load_conformance_set, run_conformance


@pytest.fixture(scope="module")
def set_a_results():
    return run_conformance(SET_A, tier="strict")


def test_set_a_passes_strict_tier(set_a_results):
    failures = [result.line() for result in set_a_results if not result.passed]
    assert not failures, "\n".join(failures)
    names = {result.name for result in set_a_results}
    cset = load_conformance_set(SET_A)
    depth = cset.config["mm_double_blocks_depth"]
    expected = {
        *(
            f"{group}.layer{i}.{kind}"
            for group in ("txt", "txt_holes", "txt_small", "txt_t2v")
            for i in range(depth)
            for kind in ("k_txt", "v_txt")
        ),
        *(f"ctx.layer{i}.{kind}" for i in range(depth) for kind in ("k_vision", "v_vision")),
        *(
            f"{group}.{kind}"
            for group in ("chunk", "chunk_noctx", "chunk_first", "chunk_small")
            for kind in ("velocity", "final_hidden", "vec")
        ),
        "txt.tokens", "txt.vec_txt", "ctx.vec", "sched.sigmas", "sched.timesteps", "sched.step3.prev_sample",
        "pose.viewmats", "pose.Ks", "pose.action", "pose_str.viewmats", "pose_str.action",
        "retr.selected.cur24", "retr.selected.cur28", "retr.candidates.cur28.distances",
    }
    assert expected <= names, sorted(expected - names)


def test_perturbed_model_fails_the_chunk_cases():
    """A 1e-3 change of one ProPE projection bias (a weak path) must be caught."""
    cset = load_conformance_set(SET_A)
    model = build_model(cset)
    with torch.no_grad():
        model.double_blocks[-1].img_attn_prope_proj.bias.add_(1e-3)
    results = run_conformance(SET_A, tier="portable", cases=["chunk", "context"], model=model)
    failed = {result.name for result in results if not result.passed}
    assert "chunk.velocity" in failed and "chunk_first.velocity" in failed
    assert not any(name.startswith("ctx.") for name in failed)  # the last block's context K/V do not use it


def test_compare_close_uses_atol_plus_rtol():
    reference = torch.tensor([0.0, 10.0])
    inside = compare_close("x", reference + torch.tensor([0.9e-5, 1.0e-4]), reference, 1e-5, 1e-5)
    outside = compare_close("x", reference + torch.tensor([0.0, 1.2e-4]), reference, 1e-5, 1e-6)
    assert inside.passed and inside.worst_ratio < 1
    assert not outside.passed and outside.worst_ratio > 1
    assert not compare_close("x", torch.tensor([float("nan"), 10.0]), reference, 1e-5, 1e-5).passed
    assert not compare_close("x", torch.zeros(3), reference, 1e-5, 1e-5).passed
