"""Tests of the WorldPlay-1.5 teacher: construction, checkpoints, AR calls, building blocks, gradients, bf16."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from predictor_training.teacher import (
    TEACHER_PRESETS,
    ContextKV,
    LayerContextKV,
    RecomputedContextKV,
    StateDictMismatchError,
    TextKV,
    WorldPlayTransformer,
    preset_config,
    randomize_zero_initialised_,
    zero_initialised_entries,
)

KEYS_JSON = Path(__file__).parent / "data" / "conformance" / "worldplay_480p_i2v_keys.json"
GRID = (4, 3)  # H, W
CHUNK_FRAMES = 4


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
def make_model(preset: str = "tiny", seed: int = 0) -> WorldPlayTransformer:
    """A model whose upstream zero-initialised layers are random, so every path affects the output."""
    torch.manual_seed(seed)
    model = WorldPlayTransformer.from_preset(preset)
    randomize_zero_initialised_(model, torch.Generator().manual_seed(seed + 1), scale=0.5)
    return model.eval()


def text_inputs(model: WorldPlayTransformer, generator: torch.Generator, text_len=7, byt5_len=5, vision_len=3):
    config = model.config
    text_mask = torch.ones(1, text_len, dtype=torch.int64)
    text_mask[0, -2:] = 0
    byt5_mask = torch.zeros(1, byt5_len, dtype=torch.int64)
    byt5_mask[0, :2] = 1
    return dict(
        text_states=torch.randn(1, text_len, config.text_states_dim, generator=generator),
        text_mask=text_mask,
        byt5_states=torch.randn(1, byt5_len, config.byt5_states_dim, generator=generator),
        byt5_mask=byt5_mask,
        vision_states=torch.randn(1, vision_len, config.vision_states_dim, generator=generator),
    )


def camera_inputs(frames: int, generator: torch.Generator):
    """Random rotations + translations (w2c) and normalised Ks, float32."""
    rotation, _ = torch.linalg.qr(torch.randn(frames, 3, 3, generator=generator))
    viewmats = torch.eye(4).repeat(frames, 1, 1)
    viewmats[:, :3, :3] = rotation
    viewmats[:, :3, 3] = torch.randn(frames, 3, generator=generator)
    Ks = torch.eye(3).repeat(frames, 1, 1)
    Ks[:, 0, 0] = 0.5 + torch.rand(frames, generator=generator)
    Ks[:, 1, 1] = 0.5 + torch.rand(frames, generator=generator)
    Ks[:, :2, 2] = 0.5
    return viewmats[None], Ks[None]


def image_inputs(model: WorldPlayTransformer, frames: int, generator: torch.Generator, timestep: float):
    channels = 2 * model.config.in_channels + 1
    viewmats, Ks = camera_inputs(frames, generator)
    return dict(
        hidden_states=torch.randn(1, channels, frames, *GRID, generator=generator),
        timestep=torch.full((frames,), timestep),
        action=torch.randint(0, 81, (1, frames), generator=generator).float(),
        viewmats=viewmats,
        Ks=Ks,
    )


@pytest.fixture(scope="module")
def tiny():
    model = make_model("tiny")
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        text_kv = model.text_prefill(**text_inputs(model, generator))
    context = image_inputs(model, 5, generator, 14.0)
    chunk = image_inputs(model, CHUNK_FRAMES, generator, 833.3333)
    return model, text_kv, context, chunk


# ---------------------------------------------------------------------------------------------------------------
# Construction and configuration
# ---------------------------------------------------------------------------------------------------------------
def test_real_config_on_meta_device_matches_released_keys():
    reference = json.loads(KEYS_JSON.read_text())
    assert TEACHER_PRESETS["worldplay_480p_i2v"] == {
        **reference["config"], "byt5_states_dim": 1472, "byt5_hidden_dim": 2048
    }
    with torch.device("meta"):
        model = WorldPlayTransformer.from_preset("worldplay_480p_i2v")
    shapes = {key: list(value.shape) for key, value in model.state_dict().items()}
    assert shapes == reference["keys"]
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert num_parameters == reference["num_parameters"]
    assert num_parameters == 8_557_933_856
    assert list(model.buffers()) == []


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 65}, "divisible by heads_num"),
        ({"rope_dim_list": [8, 12, 10]}, "summing to head_dim"),
        ({"hidden_size": 36, "rope_dim_list": [6, 6, 6]}, "divisible by 4"),
        ({"mm_single_blocks_depth": 2}, "mm_single_blocks_depth"),
    ],
)
def test_constructor_rejects_bad_sizes(overrides, message):
    with pytest.raises(ValueError, match=message):
        WorldPlayTransformer.from_preset("tiny", **overrides)


def test_unknown_preset_and_override_raise():
    with pytest.raises(KeyError, match="unknown teacher preset"):
        WorldPlayTransformer.from_preset("huge")
    with pytest.raises(KeyError, match="hidden_dim"):
        WorldPlayTransformer.from_preset("tiny", hidden_dim=8)


def test_fresh_model_has_upstream_zero_init_and_randomize_fills_it():
    torch.manual_seed(0)
    model = WorldPlayTransformer.from_preset("demo")
    entries = zero_initialised_entries(model)
    names = {entry.name for entry in entries}
    assert {"action_in.mlp.2.weight", "double_blocks.3.img_attn_prope_proj.weight", "final_layer.linear.weight",
            "cond_type_embedding.weight", "img_in.proj.weight[:, C:]"} <= names
    assert all(bool((entry.tensor == 0).all()) for entry in entries)
    latent = model.img_in.proj.weight[:, : model.config.in_channels]
    assert bool((latent != 0).all())
    # The zero final layer makes a fresh model predict exactly zero velocity.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        text_kv = model.text_prefill(**text_inputs(model, generator))
        velocity = model.chunk_step(**image_inputs(model, CHUNK_FRAMES, generator, 1000.0), text_kv=text_kv)
    assert bool((velocity == 0).all())
    randomized = randomize_zero_initialised_(model, torch.Generator().manual_seed(1), scale=0.5)
    assert set(randomized) == names
    assert all(bool((entry.tensor != 0).all()) for entry in zero_initialised_entries(model))
    assert sum(parameter.numel() for parameter in model.parameters()) < 2_000_000  # "a few MB"


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------
def _assert_same_weights(model_a, model_b):
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert torch.equal(state_a[key], state_b[key]), key


def test_save_and_load_round_trip_with_upstream_config_keys(tmp_path):
    model = make_model("tiny")
    model.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config.update({"_class_name": "HunyuanVideo_1_5_DiffusionTransformer", "_diffusers_version": "0.35.0"})
    config_path.write_text(json.dumps(config))
    loaded = WorldPlayTransformer.from_pretrained(tmp_path)
    _assert_same_weights(model, loaded)
    assert loaded.config.hidden_size == model.config.hidden_size


def test_sharded_save_and_load(tmp_path):
    model = make_model("tiny")
    model.save_pretrained(tmp_path, max_shard_size="5MB")
    shards = sorted(tmp_path.glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) > 1
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    _assert_same_weights(model, WorldPlayTransformer.from_pretrained(tmp_path))
    # The same index also loads through the strict action-checkpoint path.
    other = WorldPlayTransformer.from_preset("tiny")
    WorldPlayTransformer.load_action_checkpoint(tmp_path / "diffusion_pytorch_model.safetensors.index.json", other)
    _assert_same_weights(model, other)


def test_action_checkpoint_loads_strictly_and_reports_bad_keys(tmp_path):
    model = make_model("demo")
    state = {key: value.clone() for key, value in model.state_dict().items()}
    good = tmp_path / "good.safetensors"
    save_file(state, good)
    target = WorldPlayTransformer.from_preset("demo")
    WorldPlayTransformer.load_action_checkpoint(good, target)
    _assert_same_weights(model, target)

    broken = dict(state)
    broken.pop("double_blocks.1.img_attn_prope_proj.weight")
    broken["single_blocks.0.linear1.weight"] = torch.zeros(2, 2)
    broken["img_in.proj.weight"] = torch.zeros(64, 5, 1, 1, 1)
    bad = tmp_path / "bad.safetensors"
    save_file(broken, bad)
    with pytest.raises(StateDictMismatchError) as caught:
        WorldPlayTransformer.load_action_checkpoint(bad, target)
    message = str(caught.value)
    assert "double_blocks.1.img_attn_prope_proj.weight" in message and "missing" in message
    assert "single_blocks.0.linear1.weight" in message and "unexpected" in message
    assert "img_in.proj.weight: checkpoint [64, 5, 1, 1, 1], model [64, 9, 1, 1, 1]" in message
    assert isinstance(caught.value, KeyError)
    assert caught.value.missing == ["double_blocks.1.img_attn_prope_proj.weight"]
    _assert_same_weights(model, target)  # a failed load leaves the model untouched


def test_from_pretrained_rejects_missing_and_unexpected_keys(tmp_path):
    model = make_model("demo")
    model.save_pretrained(tmp_path)
    state = {key: value.clone() for key, value in model.state_dict().items()}
    state.pop("final_layer.linear.bias")
    state["vector_in.weight"] = torch.zeros(3)
    save_file(state, tmp_path / "diffusion_pytorch_model.safetensors")
    with pytest.raises(StateDictMismatchError, match="final_layer.linear.bias") as caught:
        WorldPlayTransformer.from_pretrained(tmp_path)
    assert "vector_in.weight" in str(caught.value)


# ---------------------------------------------------------------------------------------------------------------
# AR interface
# ---------------------------------------------------------------------------------------------------------------
def test_text_prefill_orders_and_drops_tokens(tiny):
    model, _, _, _ = tiny
    generator = torch.Generator().manual_seed(5)
    inputs = text_inputs(model, generator)
    trace: dict = {}
    with torch.no_grad():
        text_kv = model.text_prefill(**inputs, trace=trace)
        expected_llm = model.txt_in(inputs["text_states"], torch.zeros(1), inputs["text_mask"])[0]
        expected_llm = expected_llm[inputs["text_mask"][0].bool()] + model.cond_type_embedding.weight[0]
        expected_vision = model.vision_in(inputs["vision_states"])[0] + model.cond_type_embedding.weight[2]
    num_vision, num_byt5 = 3, int(inputs["byt5_mask"].sum())
    tokens = trace["tokens"][0]
    assert tokens.shape[0] == num_vision + num_byt5 + int(inputs["text_mask"].sum())
    torch.testing.assert_close(tokens[:num_vision], expected_vision)
    torch.testing.assert_close(tokens[num_vision + num_byt5:], expected_llm)
    assert text_kv.num_layers == model.num_layers
    assert text_kv.k[0].shape == (1, model.heads_num, tokens.shape[0], model.head_dim)
    # t2v with all-zero SigLIP states drops the SigLIP tokens; i2v keeps them.
    zero_vision = dict(inputs, vision_states=torch.zeros_like(inputs["vision_states"]))
    with torch.no_grad():
        assert model.text_prefill(**zero_vision, mask_type="t2v").num_tokens == tokens.shape[0] - num_vision
        assert model.text_prefill(**zero_vision, mask_type="i2v").num_tokens == tokens.shape[0]


def test_refiner_padded_rows_stay_finite():
    model = make_model("demo")
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(2, 6, model.config.text_states_dim, generator=generator)
    mask = torch.tensor([[0, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])  # padded first token and holes
    with torch.no_grad():
        refined = model.txt_in(states, torch.zeros(2), mask)
    assert bool(torch.isfinite(refined).all())


def test_ar_methods_reject_batches(tiny):
    model, text_kv, context, _ = tiny
    batched = {key: torch.cat([value, value]) if key != "timestep" else value for key, value in context.items()}
    with pytest.raises(ValueError, match="batch size 1"):
        model.context_prefill(**batched, text_kv=text_kv)
    generator = torch.Generator().manual_seed(0)
    inputs = {key: torch.cat([value, value]) for key, value in text_inputs(model, generator).items()}
    with pytest.raises(ValueError, match="batch size 1"):
        model.text_prefill(**inputs)


def test_empty_context_equals_no_context(tiny):
    model, text_kv, _, chunk = tiny
    heads, head_dim = model.heads_num, model.head_dim
    empty = torch.zeros(1, heads, 0, head_dim)
    manual = ContextKV([LayerContextKV.from_branches(empty, empty, empty, empty) for _ in range(model.num_layers)],
                       num_frames=0)
    no_frames = dict(
        hidden_states=torch.zeros(1, 2 * model.config.in_channels + 1, 0, *GRID), timestep=torch.zeros(0),
        action=torch.zeros(1, 0), viewmats=torch.zeros(1, 0, 4, 4), Ks=torch.zeros(1, 0, 3, 3),
    )
    with torch.no_grad():
        prefilled, _ = model.context_prefill(**no_frames, text_kv=text_kv)
        reference = model.chunk_step(**chunk, text_kv=text_kv)
        for context in (manual, prefilled):
            assert context.num_frames == 0
            velocity = model.chunk_step(**chunk, text_kv=text_kv, context_kv=context)
            torch.testing.assert_close(velocity, reference, rtol=0, atol=0)


def test_context_changes_output_and_rope_start_defaults_to_context_length(tiny):
    model, text_kv, context_inputs, chunk = tiny
    with torch.no_grad():
        context_kv, _ = model.context_prefill(**context_inputs, text_kv=text_kv)
        default = model.chunk_step(**chunk, text_kv=text_kv, context_kv=context_kv)
        explicit = model.chunk_step(**chunk, text_kv=text_kv, context_kv=context_kv, rope_start=context_kv.num_frames)
        shifted = model.chunk_step(**chunk, text_kv=text_kv, context_kv=context_kv, rope_start=0)
        no_context = model.chunk_step(**chunk, text_kv=text_kv)
    assert context_kv.num_frames == 5
    assert torch.equal(default, explicit)
    assert (default - shifted).abs().max() > 1e-4
    assert (default - no_context).abs().max() > 1e-4


def test_prefeatures_reproduce_context_kv_through_image_kv(tiny):
    model, text_kv, context_inputs, _ = tiny
    frames = context_inputs["hidden_states"].shape[2]
    trace: dict = {}
    with torch.no_grad():
        context_kv, prefeatures = model.context_prefill(
            **context_inputs, text_kv=text_kv, prefeature_layers=range(model.num_layers), trace=trace
        )
        torch.testing.assert_close(prefeatures[0], model.embed_image(context_inputs["hidden_states"]), rtol=0, atol=0)
        torch.testing.assert_close(prefeatures[1], trace["layer0.img_out"], rtol=0, atol=0)
        vec = model.frame_vec(context_inputs["timestep"], context_inputs["action"])
        rope = model.rope_table(frames, *GRID, start=0)
        camera = model.camera_projection(context_inputs["viewmats"], context_inputs["Ks"])
        for layer, feature in prefeatures.items():
            rebuilt = model.double_blocks[layer].image_kv(feature, vec, GRID[0] * GRID[1], rope, camera)
            for name in ("rope_k", "rope_v", "prope_k", "prope_v"):
                expected = getattr(context_kv.layer(layer), name)
                torch.testing.assert_close(getattr(rebuilt, name), expected, rtol=0, atol=0)


def test_chunk_output_fields(tiny):
    model, text_kv, _, chunk = tiny
    with torch.no_grad():
        output = model.chunk_step(**chunk, text_kv=text_kv, return_final_hidden=True)
        vec = model.frame_vec(chunk["timestep"], chunk["action"])
        projected = model.final_projection(output.final_hidden, vec, GRID[0] * GRID[1])
        velocity = model.unpatchify(projected, CHUNK_FRAMES, *GRID)
    tokens = CHUNK_FRAMES * GRID[0] * GRID[1]
    assert output.velocity.shape == (1, model.config.out_channels, CHUNK_FRAMES, *GRID)
    assert output.final_hidden.shape == (1, tokens, model.config.hidden_size)
    torch.testing.assert_close(output.vec, vec[0], rtol=0, atol=0)
    torch.testing.assert_close(output.velocity, velocity, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Batch-general blocks (Predictor usage)
# ---------------------------------------------------------------------------------------------------------------
def test_image_forward_with_padded_text_mask_matches_unpadded_calls(tiny):
    """A batch of 2 with right-padded text K/V and a mask equals two B=1 calls on the valid text only."""
    model, _, _, _ = tiny
    block = model.double_blocks[0]
    generator = torch.Generator().manual_seed(9)
    heads, head_dim, hidden = model.heads_num, model.head_dim, model.config.hidden_size
    frames, tokens_per_frame = 2, GRID[0] * GRID[1]
    text_lengths = (7, 4)
    x = torch.randn(2, frames * tokens_per_frame, hidden, generator=generator)
    vec = torch.randn(2, frames, hidden, generator=generator)
    text_k = torch.randn(2, heads, max(text_lengths), head_dim, generator=generator)
    text_v = torch.randn(2, heads, max(text_lengths), head_dim, generator=generator)
    text_mask = torch.arange(max(text_lengths))[None] < torch.tensor(text_lengths)[:, None]
    context_shape = (2, heads, 2 * tokens_per_frame, head_dim)
    context = LayerContextKV.from_branches(*(torch.randn(context_shape, generator=generator) for _ in range(4)))
    viewmats, Ks = zip(*(camera_inputs(frames, generator) for _ in range(2)))
    camera = model.camera_projection(torch.cat(viewmats), torch.cat(Ks))
    rope = model.rope_table(frames, *GRID, start=2)
    with torch.no_grad():
        batched, own = block.image_forward(
            x, vec, tokens_per_frame, rope, camera, text_k, text_v, text_mask, context, return_kv=True
        )
        for index, length in enumerate(text_lengths):
            single_camera = type(camera)(camera.P[index : index + 1], camera.P_inv[index : index + 1])
            single_context = LayerContextKV.from_branches(
                *(t[index : index + 1] for t in (context.rope_k, context.rope_v, context.prope_k, context.prope_v))
            )
            single = block.image_forward(
                x[index : index + 1], vec[index : index + 1], tokens_per_frame, rope, single_camera,
                text_k[index : index + 1, :, :length], text_v[index : index + 1, :, :length], None, single_context,
            )
            torch.testing.assert_close(batched[index : index + 1], single, rtol=1e-5, atol=1e-6)
        kv_only = block.image_kv(x, vec, tokens_per_frame, rope, camera)
    torch.testing.assert_close(kv_only.prope_v, own.prope_v, rtol=0, atol=0)
    torch.testing.assert_close(kv_only.rope_k, own.rope_k, rtol=0, atol=0)


def test_frozen_embedder_and_final_layer_pass_gradients_to_inputs(tiny):
    model, text_kv, _, chunk = tiny
    model.requires_grad_(False)
    hidden_states = chunk["hidden_states"].clone().requires_grad_(True)
    tokens = model.embed_image(hidden_states)
    tokens.square().sum().backward()
    assert hidden_states.grad is not None and hidden_states.grad.abs().sum() > 0

    vec = model.frame_vec(chunk["timestep"], chunk["action"])
    hidden = torch.randn(1, CHUNK_FRAMES * GRID[0] * GRID[1], model.config.hidden_size, requires_grad=True)
    model.final_projection(hidden, vec, GRID[0] * GRID[1]).square().sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0

    chunk_input = chunk["hidden_states"].clone().requires_grad_(True)
    velocity = model.chunk_step(**dict(chunk, hidden_states=chunk_input), text_kv=text_kv)
    velocity.square().sum().backward()
    assert chunk_input.grad.abs().sum() > 0
    assert all(parameter.grad is None for parameter in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------------------------------
def test_bf16_autocast_close_to_float32_and_uses_bf16_poses(tiny):
    model32, text_kv, context_inputs, chunk = tiny
    model16 = make_model("tiny").to(torch.bfloat16)
    with torch.no_grad():
        context32, _ = model32.context_prefill(**context_inputs, text_kv=text_kv)
        reference = model32.chunk_step(**chunk, text_kv=text_kv, context_kv=context32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            text16 = text_kv.to(dtype=torch.bfloat16)
            context16, _ = model16.context_prefill(**context_inputs, text_kv=text16)
            velocity = model16.chunk_step(**chunk, text_kv=text16, context_kv=context16)
            camera = model16.camera_projection(chunk["viewmats"], chunk["Ks"])
    assert velocity.dtype == torch.bfloat16
    assert context16.layer(0).rope_k.dtype == torch.bfloat16
    relative = (velocity.float() - reference).norm() / reference.norm()
    assert relative < 0.05, relative
    # ProPE matrices come from the bf16-rounded poses and are bf16 themselves.
    bf16_poses = chunk["viewmats"].bfloat16().float()
    focal = chunk["Ks"].bfloat16().float()[..., 0, 0]
    assert camera.P.dtype == torch.bfloat16
    expected_row0 = (focal[..., None] * bf16_poses[..., 0, :]).bfloat16().float()
    torch.testing.assert_close(camera.P[..., 0, :].float(), expected_row0)


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


def test_constructor_arguments_drop_bookkeeping_fill_defaults_and_refuse_unknown_fields():
    config = preset_config("tiny")
    del config["byt5_states_dim"]  # the released config.json has no byt5_*_dim
    config.update({"_class_name": "HunyuanVideo_1_5_DiffusionTransformer", "_diffusers_version": "0.35.0"})
    arguments = WorldPlayTransformer.constructor_arguments(config, source="cfg.json")
    assert "_class_name" not in arguments and arguments["byt5_states_dim"] == 1472
    assert WorldPlayTransformer(**arguments).config.hidden_size == config["hidden_size"]
    with pytest.raises(ValueError, match=r"cfg.json: unknown Teacher config field\(s\) \['hidden_sise'\]"):
        WorldPlayTransformer.constructor_arguments({**config, "hidden_sise": 64}, source="cfg.json")
