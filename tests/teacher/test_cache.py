"""The Teacher's cache containers (predictor_training/teacher/cache.py): stacking, selecting and
moving K/V, and the recomputed context (released, rebuilt once, freed without the garbage collector)."""

from __future__ import annotations

import pytest
import torch

from predictor_training.teacher import ContextKV, LayerContextKV, RecomputedContextKV, TextKV


# ---------------------------------------------------------------------------------------------------------------
# Cache containers
# ---------------------------------------------------------------------------------------------------------------
def test_recomputed_context_releases_rebuilds_once_and_hands_layers_over():
    """RecomputedContextKV: the forward reads the original K/V; after release() the first read rebuilds (once for
    all layers, the same values) and each rebuilt layer is handed over at its read, so after every layer was read
    once (a backward's recomputes) it holds no K/V; a second read rebuilds again."""
    generator = torch.Generator().manual_seed(0)
    original = ContextKV([LayerContextKV(torch.randn(2, 2, 6, 8, generator=generator),
                                         torch.randn(2, 2, 6, 8, generator=generator)) for _ in range(3)], 2)
    rebuilds = []

    def rebuild():
        rebuilds.append(1)
        return ContextKV([LayerContextKV(layer.k.clone(), layer.v.clone()) for layer in original.layers], 2)

    context = RecomputedContextKV(original, rebuild)
    assert context.num_layers == 3 and context.num_frames == 2
    for index in range(3):  # the forward
        assert context.layer(index).stacked()[0] is original.layer(index).k
    context.release()
    assert context._store.kv is None and not rebuilds
    for index in reversed(range(3)):  # the backward's recomputes, last block first
        k, v = context.layer(index).stacked()
        assert torch.equal(k, original.layer(index).k) and torch.equal(v, original.layer(index).v)
    assert len(rebuilds) == 1 and context.rebuilds == 1
    assert all(layer is None for layer in context._store.kv)  # nothing kept after the backward
    assert torch.equal(context.layer(1).stacked()[1], original.layer(1).v) and context.rebuilds == 2


def test_a_dropped_recomputed_context_frees_its_kv_without_the_garbage_collector():
    """A RecomputedContextKV its last holder drops frees its K/V at once (no reference cycle between the object and
    its layer handles): at the real config a context is GiBs that would otherwise wait for a collection."""
    import gc
    import weakref

    k = torch.randn(2, 2, 6, 8)
    context = RecomputedContextKV(ContextKV([LayerContextKV(k, torch.randn(2, 2, 6, 8))], 1), rebuild=lambda: None)
    alive = weakref.ref(k)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del k, context
        assert alive() is None
    finally:
        if enabled:
            gc.enable()


def test_cache_containers_stack_select_and_move():
    generator = torch.Generator().manual_seed(0)
    k_vision, v_vision = torch.randn(2, 2, 6, 8, generator=generator), torch.randn(2, 2, 6, 8, generator=generator)
    layer = LayerContextKV.from_stacked(k_vision, v_vision)
    assert torch.equal(layer.rope_k, k_vision[:1]) and torch.equal(layer.prope_v, v_vision[1:])
    assert layer.stacked()[0] is k_vision  # no copy for a cache built in the stacked layout
    assert set(vars(layer)) == {"k", "v"}  # the branches are views, not fields (FSDP2 wraps every field)
    branches = LayerContextKV.from_branches(layer.rope_k, layer.rope_v, layer.prope_k, layer.prope_v)
    assert torch.equal(branches.k, k_vision) and torch.equal(branches.v, v_vision)
    moved = LayerContextKV.from_stacked(k_vision, v_vision).to(dtype=torch.float64)
    assert moved.rope_v.dtype == torch.float64 and torch.equal(moved.stacked()[1], v_vision.double())
    with pytest.raises(ValueError, match="even leading axis"):
        LayerContextKV.from_stacked(k_vision[:1], v_vision[:1])

    context = ContextKV([LayerContextKV.from_stacked(k_vision * i, v_vision) for i in range(3)], num_frames=2)
    selected = context.select([2, 0])
    assert selected.num_layers == 2 and selected.num_frames == 2
    assert torch.equal(selected.layer(0).rope_k, context.layer(2).rope_k)
    text = TextKV([torch.full((1, 2, 3, 8), float(i)) for i in range(3)], [torch.zeros(1, 2, 3, 8)] * 3)
    assert text.select([1]).layer(0)[0][0, 0, 0, 0] == 1.0
    assert text.to(dtype=torch.bfloat16).k[2].dtype == torch.bfloat16
