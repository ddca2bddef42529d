"""Strict checkpoint loading with a readable report, and the upstream zero-initialisation bookkeeping."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor, nn

from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.io import load_safetensors
from predictor_training.runtime.state_dicts import StateDictMismatchError, listing, mismatch_report


# ---------------------------------------------------------------------------------------------------------------
# 1. Strict loading
# ---------------------------------------------------------------------------------------------------------------
def load_state_dict_strict(model: nn.Module, state_dict: Mapping[str, Tensor], source: str = "state dict") -> None:
    """Copy `state_dict` into `model` after checking that keys and shapes match exactly (raises otherwise).

    A model built on the meta device takes the checkpoint tensors as they are (assign=True, their dtype kept).
    """
    model_shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    checkpoint_shapes = {key: tuple(value.shape) for key, value in state_dict.items()}
    missing, unexpected, mismatched, report = mismatch_report(model_shapes, checkpoint_shapes, source)
    if report:
        raise StateDictMismatchError(source, missing, unexpected, mismatched, report)
    on_meta = any(parameter.is_meta for parameter in model.parameters())
    model.load_state_dict(state_dict, strict=True, assign=on_meta)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Tensor]:
    """Read a `.safetensors` file, or a sharded `*.safetensors.index.json` (its `weight_map` shards)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"checkpoint file not found: {path}")
    if path.name.endswith(".index.json"):
        with open(path) as handle:
            index = json.load(handle)
        if "weight_map" not in index:
            raise UserInputError(f"{path}: a sharded index needs a 'weight_map' field")
        state_dict: dict[str, Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            state_dict.update(load_safetensors(path.parent / shard))
        return state_dict
    if path.suffix != ".safetensors":
        raise UserInputError(f"{path}: expected a .safetensors file or a .safetensors.index.json index")
    return load_safetensors(path)


def load_checkpoint_strict(model: nn.Module, path: str | os.PathLike) -> None:
    load_state_dict_strict(model, read_checkpoint(path), source=str(path))


def raise_on_loading_info(info: Mapping[str, list], source: str) -> None:
    """Turn diffusers' `output_loading_info` into a StateDictMismatchError when anything did not match."""
    missing = sorted(info["missing_keys"])
    unexpected = sorted(info["unexpected_keys"])
    mismatched = sorted(str(item) for item in info["mismatched_keys"])
    errors = list(info["error_msgs"])
    if not (missing or unexpected or mismatched or errors):
        return
    lines = [f"checkpoint {source} does not match the model:"]
    lines += listing("missing keys", missing)
    lines += listing("unexpected keys", unexpected)
    lines += listing("shape mismatches", mismatched)
    lines += listing("errors", [str(error) for error in errors])
    raise StateDictMismatchError(source, missing, unexpected, mismatched, "\n".join(lines))


# ---------------------------------------------------------------------------------------------------------------
# 2. Zero-initialised layers
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ZeroInitialised:
    """One tensor (or slice) that upstream initialises to zero. fan_in is None for biases, 0 for embeddings."""

    name: str
    tensor: Tensor
    fan_in: int | None


def zero_initialised_entries(model) -> list[ZeroInitialised]:
    """Every tensor upstream zero-initialises: modulations, final layer, refiner gates, ProPE projections,
    `action_in.mlp.2`, `cond_type_embedding`, and the conditioning input channels (plus bias) of `img_in`."""
    entries: list[ZeroInitialised] = []

    def add_linear(name: str, linear: nn.Linear) -> None:
        entries.append(ZeroInitialised(f"{name}.weight", linear.weight, linear.in_features))
        if linear.bias is not None:
            entries.append(ZeroInitialised(f"{name}.bias", linear.bias, None))

    latent_channels = model.config.in_channels
    conv = model.img_in.proj
    entries.append(ZeroInitialised("img_in.proj.weight[:, C:]", conv.weight[:, latent_channels:], conv.in_channels))
    entries.append(ZeroInitialised("img_in.proj.bias", conv.bias, None))
    add_linear("action_in.mlp.2", model.action_in.mlp[2])
    entries.append(ZeroInitialised("cond_type_embedding.weight", model.cond_type_embedding.weight, 0))
    for index, block in enumerate(model.txt_in.individual_token_refiner.blocks):
        add_linear(f"txt_in.individual_token_refiner.blocks.{index}.adaLN_modulation.1", block.adaLN_modulation[1])
    for index, block in enumerate(model.double_blocks):
        add_linear(f"double_blocks.{index}.img_mod.linear", block.img_mod.linear)
        add_linear(f"double_blocks.{index}.txt_mod.linear", block.txt_mod.linear)
        add_linear(f"double_blocks.{index}.img_attn_prope_proj", block.img_attn_prope_proj)
    add_linear("final_layer.linear", model.final_layer.linear)
    add_linear("final_layer.adaLN_modulation.1", model.final_layer.adaLN_modulation[1])
    return entries


def zero_initialised_tensors(model) -> list[Tensor]:
    return [entry.tensor for entry in zero_initialised_entries(model)]


@torch.no_grad()
def randomize_zero_initialised_(model, generator: torch.Generator, scale: float = 0.5) -> list[str]:
    """Fill the upstream zero-initialised tensors with random values so every path affects the output.

    Weights: N(0, scale^2 / fan_in); biases: N(0, (0.1 scale)^2); `cond_type_embedding`: N(0, scale^2).
    Returns the names of the randomised tensors. Used by the demo assets and the tests.
    """
    names = []
    for entry in zero_initialised_entries(model):
        if entry.fan_in is None:
            std = 0.1 * scale
        elif entry.fan_in == 0:
            std = scale
        else:
            std = scale / entry.fan_in**0.5
        noise = torch.randn(entry.tensor.shape, generator=generator, dtype=torch.float32, device=generator.device)
        entry.tensor.copy_(noise * std)
        names.append(entry.name)
    return names
