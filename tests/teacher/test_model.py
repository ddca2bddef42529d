"""The WorldPlay-1.5 Teacher (predictor_training/teacher/model.py): the AR calls (text prefill, context prefill,
chunk step), building blocks, gradients, bf16 and its constructor arguments (the double-stream block:
tests/teacher/test_double_stream_block.py; the sizes it refuses: tests/teacher/test_config.py)."""

from __future__ import annotations

import pytest
import torch

from predictor_training.teacher import ContextKV, LayerContextKV, WorldPlayTransformer, preset_config
from tests.helpers.tiny_teacher import GRID, image_inputs, make_model, text_inputs


CHUNK_FRAMES = 4


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


def test_constructor_arguments_drop_bookkeeping_fill_defaults_and_refuse_unknown_fields():
    config = preset_config("tiny")
    del config["byt5_states_dim"]  # the released config.json has no byt5_*_dim
    config.update({"_class_name": "HunyuanVideo_1_5_DiffusionTransformer", "_diffusers_version": "0.35.0"})
    arguments = WorldPlayTransformer.constructor_arguments(config, source="cfg.json")
    assert "_class_name" not in arguments and arguments["byt5_states_dim"] == 1472
    assert WorldPlayTransformer(**arguments).config.hidden_size == config["hidden_size"]
    with pytest.raises(ValueError, match=r"cfg.json: unknown Teacher config field\(s\) \['hidden_sise'\]"):
        WorldPlayTransformer.constructor_arguments({**config, "hidden_sise": 64}, source="cfg.json")
