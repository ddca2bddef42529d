"""Loading the Teacher (predictor_training/teacher/loading.py and the model's constructors):
upstream zero-init and its randomisation, save/load round trips (one file and sharded), strict action checkpoints
and from_pretrained refusing missing and unexpected keys."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from predictor_training.teacher import (
    StateDictMismatchError,
    WorldPlayTransformer,
    randomize_zero_initialised_,
    zero_initialised_entries,
)
from tests.helpers.tiny_teacher import image_inputs, make_model, text_inputs


CHUNK_FRAMES = 4


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
