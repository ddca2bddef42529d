"""The WorldPlay-1.5 teacher transformer: our own implementation with the upstream state-dict key names.

Only the autoregressive (AR) paths of the upstream model are implemented: the text prefill, the context (memory)
prefill and the chunk step (predictor_training/conformance/golden/README.md, sections 4-7), plus batch-general
building blocks for the Predictor. Its double-stream block is teacher/double_stream_block.py; the config it supports
is checked in teacher/config.py.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.utils import logging as diffusers_logging
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from .cache import CameraProjection, ChunkOutput, ContextKV, LayerContextKV, RopeTable, TextKV
from .config import check_supported_config, preset_config
from .double_stream_block import DoubleStreamBlock
from .loading import load_checkpoint_strict, raise_on_loading_info, zero_initialised_tensors
from .layers import (
    ByT5Mapper,
    FinalLayer,
    PatchEmbed,
    SingleTokenRefiner,
    TimestepEmbedder,
    VisionProjection,
    build_camera_projection,
    build_rope_table,
    layer_norm_no_affine,
    modulate,
)

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import read_json_file

TEXT_TIMESTEP = 0.0  # the AR text stream is always modulated by time_in(0)
COND_TYPE_LLM, COND_TYPE_BYT5, COND_TYPE_SIGLIP = 0, 1, 2


def skipped_block_spans(depth: int, run_blocks: Sequence[int]) -> list[tuple[int, int]]:
    """The maximal runs (first, last) of the double blocks 0..depth-1 that are not in `run_blocks`, in order:
    skipped_block_spans(12, (0, 11)) = [(1, 10)]; skipped_block_spans(12, (1, 10)) = [(0, 0), (2, 9), (11, 11)].
    `run_blocks` must be distinct indices in [0, depth)."""
    run = sorted(int(index) for index in run_blocks)
    if len(set(run)) != len(run) or any(not 0 <= index < depth for index in run):
        raise ValueError(f"run_blocks must be distinct double-block indices in [0, {depth}), got {list(run_blocks)}")
    spans: list[tuple[int, int]] = []
    start = None
    for index in range(depth + 1):
        skipped = index < depth and index not in run
        if skipped and start is None:
            start = index
        elif not skipped and start is not None:
            spans.append((start, index - 1))
            start = None
    return spans


def _require_batch_one(name: str, tensor: Tensor) -> None:
    if tensor.shape[0] != 1:
        raise ValueError(
            f"{name}: the AR paths support batch size 1 only (tokens are dropped, not masked), got batch "
            f"{tensor.shape[0]} (shape {tuple(tensor.shape)})"
        )


# ---------------------------------------------------------------------------------------------------------------
# The transformer
# ---------------------------------------------------------------------------------------------------------------
class WorldPlayTransformer(ModelMixin, ConfigMixin):
    """WorldPlay-1.5 transformer (HunyuanVideo-1.5 dual-stream backbone + action embedder + ProPE branch).

    Constructor arguments carry the upstream names, so the released `transformer/480p_i2v/config.json` is read as
    is. Supported values are those of the WorldPlay AR model; anything else raises. Upstream arguments that do not
    change the AR computation (`attn_mode`, `attn_param`, `use_attention_mask`, `ideal_resolution`, `ideal_task`)
    are stored only. `byt5_states_dim` / `byt5_hidden_dim` are ours (fixed 1472 / 2048 upstream).
    """

    config_name = "config.json"
    _supports_gradient_checkpointing = True
    _no_split_modules = ["DoubleStreamBlock"]

    @register_to_config
    def __init__(
        self,
        patch_size: Sequence[int] = (1, 1, 1),
        in_channels: int = 32,
        concat_condition: bool = True,
        out_channels: int | None = None,
        hidden_size: int = 2048,
        heads_num: int = 16,
        mlp_width_ratio: float = 4.0,
        mlp_act_type: str = "gelu_tanh",
        mm_double_blocks_depth: int = 54,
        mm_single_blocks_depth: int = 0,
        rope_dim_list: Sequence[int] = (16, 56, 56),
        qkv_bias: bool = True,
        qk_norm: bool = True,
        qk_norm_type: str = "rms",
        guidance_embed: bool = False,
        use_meanflow: bool = False,
        text_projection: str = "single_refiner",
        use_attention_mask: bool = True,
        text_states_dim: int = 3584,
        text_states_dim_2: int | None = None,
        text_pool_type: str | None = None,
        rope_theta: float = 256,
        attn_mode: str = "flash",
        attn_param: dict | None = None,
        glyph_byT5_v2: bool = True,
        vision_projection: str = "linear",
        vision_states_dim: int = 1152,
        is_reshape_temporal_channels: bool = False,
        use_cond_type_embedding: bool = True,
        ideal_resolution: str | None = "480p",
        ideal_task: str | None = "i2v",
        byt5_states_dim: int = 1472,
        byt5_hidden_dim: int = 2048,
    ):
        super().__init__()
        check_supported_config(locals())
        self.out_channels = in_channels if out_channels is None else out_channels
        self.heads_num = heads_num
        self.head_dim = hidden_size // heads_num
        self.rope_dim_list = list(rope_dim_list)
        self.rope_theta = rope_theta

        self.img_in = PatchEmbed(2 * in_channels + 1, hidden_size)
        self.time_in = TimestepEmbedder(hidden_size)
        self.action_in = TimestepEmbedder(hidden_size)
        self.txt_in = SingleTokenRefiner(text_states_dim, hidden_size, heads_num, mlp_width_ratio, qkv_bias)
        self.byt5_in = ByT5Mapper(byt5_states_dim, byt5_hidden_dim, hidden_size)
        self.vision_in = VisionProjection(vision_states_dim, hidden_size)
        self.cond_type_embedding = nn.Embedding(3, hidden_size)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(hidden_size, heads_num, mlp_width_ratio, qkv_bias) for _ in range(mm_double_blocks_depth)
        )
        self.final_layer = FinalLayer(hidden_size, self.out_channels)
        self.reset_upstream_initialisation_()
        # Activation checkpointing of the double blocks in `chunk_step` (off by default; see
        # `set_gradient_checkpointing`). `checkpoint_context_fn` is torch's `context_fn`: adapters.py sets it so that
        # the recomputation runs with the LoRA adapter that was active in the forward.
        self.gradient_checkpointing = False
        self.checkpoint_context_fn = noop_context_fn

    # ---- construction helpers -----------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides) -> "WorldPlayTransformer":
        """Build a fresh model from a preset of `TEACHER_PRESETS` ("worldplay_480p_i2v", "tiny", "demo")."""
        return cls(**preset_config(name, **overrides))

    @classmethod
    def constructor_arguments(cls, config: Mapping, source: str) -> dict:
        """The full constructor arguments that a `config.json`-style mapping describes.

        Keys starting with `_` (`_class_name`, `_diffusers_version`) are diffusers bookkeeping and are dropped;
        arguments the mapping omits take the constructor defaults, as `from_pretrained` does (the released config has
        no `byt5_*_dim`); any other unknown field raises a ValueError naming `source`.
        """
        if not isinstance(config, Mapping):
            raise UserInputError(f"{source}: holds a {type(config).__name__}; expected a JSON object of Teacher "
                                 "config fields")
        stored = {key: value for key, value in config.items() if not key.startswith("_")}
        parameters = inspect.signature(cls.__init__).parameters
        unknown = sorted(set(stored) - set(parameters))
        if unknown:
            raise UserInputError(f"{source}: unknown Teacher config field(s) {unknown}")
        defaults = {name: parameter.default for name, parameter in parameters.items() if name != "self"}
        return {**defaults, **stored}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers `from_pretrained`, but strict: any missing, unexpected or mismatched key raises."""
        want_info = kwargs.pop("output_loading_info", False)
        config_path = Path(pretrained_model_name_or_path) / cls.config_name
        if config_path.is_file():  # a broken config.json as one line naming it (diffusers' error names no file)
            cls.constructor_arguments(read_json_file(config_path), source=str(config_path))
        verbosity = diffusers_logging.get_verbosity()
        diffusers_logging.set_verbosity_error()  # its warning about unused keys would precede our one-line error
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, output_loading_info=True, **kwargs)
        finally:
            diffusers_logging.set_verbosity(verbosity)
        raise_on_loading_info(info, source=str(pretrained_model_name_or_path))
        return (model, info) if want_info else model

    @classmethod
    def load_action_checkpoint(cls, path: str | os.PathLike, model: "WorldPlayTransformer") -> None:
        """Load a full WorldPlay state dict (e.g. the action model's safetensors) into `model`, strictly."""
        load_checkpoint_strict(model, path)

    def reset_upstream_initialisation_(self) -> None:
        """Upstream init of the layers it zero-initialises (and xavier on the latent channels of `img_in`)."""
        latent_channels = self.config.in_channels
        with torch.no_grad():
            nn.init.xavier_uniform_(self.img_in.proj.weight[:, :latent_channels])
            for tensor in zero_initialised_tensors(self):
                tensor.zero_()

    def set_gradient_checkpointing(self, enabled: bool = True) -> None:
        """Non-reentrant `torch.utils.checkpoint` around each double block of `chunk_step` and `context_prefill` while
        grad is enabled (a trainer that back-propagates through the context prefill pays only its block inputs).

        Forward outputs are bit-identical with it on or off; the blocks' activations are recomputed in backward.
        """
        self.gradient_checkpointing = bool(enabled)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        """diffusers' spelling of `set_gradient_checkpointing(True)`; only torch's non-reentrant checkpoint."""
        if gradient_checkpointing_func is not None:
            raise ValueError("WorldPlayTransformer checkpoints its blocks with torch's non-reentrant checkpoint only; "
                             "a custom gradient_checkpointing_func is not supported")
        self.set_gradient_checkpointing(True)

    def disable_gradient_checkpointing(self) -> None:
        self.set_gradient_checkpointing(False)

    # ---- building blocks (batch-general) --------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.double_blocks)

    def compute_dtype(self) -> torch.dtype:
        """The dtype activations are computed in: the autocast dtype when autocast is on, else the weights' dtype."""
        device_type = self.img_in.proj.weight.device.type
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return self.img_in.proj.weight.dtype

    def embed_image(self, hidden_states: Tensor) -> Tensor:
        """[B, 2C+1, T, H, W] -> [B, T*H*W, hidden] (`img_in`)."""
        if hidden_states.dim() != 5:
            raise ValueError(f"hidden_states must be [B, 2C+1, T, H, W], got shape {tuple(hidden_states.shape)}")
        return self.img_in(hidden_states)

    def frame_vec(self, timestep: Tensor, action: Tensor) -> Tensor:
        """timestep [B, T] or [T] (0..1000), action [B, T] (labels 0..80) -> per-frame vec [B, T, hidden]."""
        if action.dim() != 2:
            raise ValueError(f"action must be [B, T], got shape {tuple(action.shape)}")
        batch, frames = action.shape
        timestep = timestep.expand(batch, frames) if timestep.dim() == 1 else timestep
        if timestep.shape != (batch, frames):
            raise ValueError(
                f"timestep must be [T] or [B, T] matching action {tuple(action.shape)}, got {tuple(timestep.shape)}"
            )
        vec = self.time_in(timestep.reshape(-1)) + self.action_in(action.reshape(-1))
        return vec.view(batch, frames, vec.shape[-1])

    def modulated_input(self, hidden_states: Tensor, timestep: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """What the first double block's attention reads, without running the block: (embedded `img_in` tokens
        [1, T*HW, hidden], their timestep-modulated LayerNorm [1, T*HW, hidden], frame vec [1, T, hidden]).

        hidden_states [1, 2C+1, T, H, W]; timestep [T]; action [1, T]. The indicator of TeaCache-style skipping
        (predictor_training/eval/caches.py).
        """
        x = self.embed_image(hidden_states)
        vec = self.frame_vec(timestep, action)
        block = self.double_blocks[0]
        shift, scale = block._image_modulation(vec)[:2]
        frames = vec.shape[1]
        tokens_per_frame = x.shape[1] // frames
        modulated = modulate(layer_norm_no_affine(block._per_frame(x, frames, tokens_per_frame)), shift, scale)
        return x, modulated.flatten(1, 2), vec

    def rope_table(self, num_frames: int, height: int, width: int, start: int) -> RopeTable:
        """cos/sin [T*H*W, head_dim] float32 for temporal positions start..start+T-1."""
        return build_rope_table(
            num_frames, height, width, start, self.rope_dim_list, self.rope_theta, device=self.img_in.proj.weight.device
        )

    def camera_projection(self, viewmats: Tensor, Ks: Tensor) -> CameraProjection:
        """viewmats [B, T, 4, 4] (w2c), Ks [B, T, 3, 3] -> P, P_inv [B, T, 4, 4] in the compute dtype.

        The poses are cast to the compute dtype first (bf16 under bf16 autocast, as the upstream pipeline does).
        """
        dtype = self.compute_dtype()
        return build_camera_projection(viewmats.to(dtype), Ks.to(dtype))

    def final_projection(self, hidden: Tensor, frame_vec: Tensor, tokens_per_frame: int) -> Tensor:
        """`final_layer`: [B, T*HW, hidden] with frame_vec [B, T, hidden] -> [B, T*HW, C_out]."""
        return self.final_layer(hidden, frame_vec, tokens_per_frame)

    def unpatchify(self, tokens: Tensor, num_frames: int, height: int, width: int) -> Tensor:
        """[B, T*H*W, C] -> [B, C, T, H, W]."""
        batch, _, channels = tokens.shape
        return tokens.view(batch, num_frames, height, width, channels).permute(0, 4, 1, 2, 3)

    # ---- text prefill ---------------------------------------------------------------------------------------
    def text_tokens(
        self,
        text_states: Tensor,
        text_mask: Tensor,
        byt5_states: Tensor,
        byt5_mask: Tensor,
        vision_states: Tensor,
        mask_type: str = "i2v",
    ) -> tuple[Tensor, Tensor]:
        """The kept text tokens [1, L_txt, hidden] = [SigLIP | valid ByT5 | valid LLM] and vec_txt [1, hidden]."""
        named = {"text_states": text_states, "byt5_states": byt5_states, "vision_states": vision_states}
        for name, tensor in named.items():
            _require_batch_one(f"text_prefill {name}", tensor)
        if mask_type not in ("i2v", "t2v"):
            raise ValueError(f"mask_type must be 'i2v' or 't2v', got {mask_type!r}")
        device = text_states.device
        timestep_txt = torch.full((1,), TEXT_TIMESTEP, device=device)
        vec_txt = self.time_in(timestep_txt)
        cond = self.cond_type_embedding.weight
        llm = self.txt_in(text_states, timestep_txt, text_mask) + cond[COND_TYPE_LLM]
        byt5 = self.byt5_in(byt5_states) + cond[COND_TYPE_BYT5]
        vision = self.vision_in(vision_states) + cond[COND_TYPE_SIGLIP]
        drop_vision = mask_type == "t2v" and not bool((vision_states != 0).any())
        parts = [] if drop_vision else [vision[0]]
        parts += [byt5[0][byt5_mask[0].bool()], llm[0][text_mask[0].bool()]]
        return torch.cat(parts, dim=0).unsqueeze(0), vec_txt

    def text_prefill(
        self,
        text_states: Tensor,
        text_mask: Tensor,
        byt5_states: Tensor,
        byt5_mask: Tensor,
        vision_states: Tensor,
        mask_type: str = "i2v",
        trace: dict | None = None,
    ) -> TextKV:
        """Per-layer text K/V of the valid text tokens (B = 1).

        text_states [1, L, text_dim], text_mask [1, L]; byt5_states [1, Lb, byt5_dim], byt5_mask [1, Lb];
        vision_states [1, Nv, vision_dim]. Returns TextKV with k/v [1, heads, L_txt, d] per layer.
        `trace` (optional dict) receives "tokens", "vec_txt" and "layer{i}.txt_out" (debug aids).
        """
        x, vec_txt = self.text_tokens(text_states, text_mask, byt5_states, byt5_mask, vision_states, mask_type)
        if trace is not None:
            trace.update({"tokens": x, "vec_txt": vec_txt})
        keys, values = [], []
        last = self.num_layers - 1
        for index, block in enumerate(self.double_blocks):
            x_next, k, v = block.text_forward(x, vec_txt, kv_only=index == last)
            keys.append(k)
            values.append(v)
            if x_next is not None:
                x = x_next
                if trace is not None:
                    trace[f"layer{index}.txt_out"] = x
        return TextKV(keys, values)

    # ---- context prefill and chunk step ---------------------------------------------------------------------
    def _image_inputs(self, name, hidden_states, timestep, action, viewmats, Ks):
        """Shared input handling of the AR image calls (B = 1)."""
        named = {"hidden_states": hidden_states, "action": action, "viewmats": viewmats, "Ks": Ks}
        for arg_name, tensor in named.items():
            _require_batch_one(f"{name} {arg_name}", tensor)
        if hidden_states.dim() != 5:
            raise ValueError(f"{name}: hidden_states must be [1, 2C+1, T, H, W], got {tuple(hidden_states.shape)}")
        frames, height, width = hidden_states.shape[2:]
        for arg_name, tensor, shape in (
            ("timestep", timestep, (frames,)),
            ("action", action, (1, frames)),
            ("viewmats", viewmats, (1, frames, 4, 4)),
            ("Ks", Ks, (1, frames, 3, 3)),
        ):
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{name}: {arg_name} must have shape {shape}, got {tuple(tensor.shape)}")
        x = self.embed_image(hidden_states)
        vec = self.frame_vec(timestep, action)
        camera = self.camera_projection(viewmats, Ks)
        return x, vec, camera, (frames, height, width)

    def _check_text_kv(self, text_kv: TextKV) -> None:
        if text_kv.num_layers != self.num_layers:
            raise ValueError(f"text_kv has {text_kv.num_layers} layers, the model has {self.num_layers}")

    def _chunk_inputs(self, name, hidden_states, timestep, action, viewmats, Ks, text_kv: TextKV,
                      context_kv: ContextKV | None, rope_start: int | None):
        """The start of a chunk step (`chunk_step`, `chunk_step_blocks`): the text and context K/V checked against the
        model's depth, the inputs embedded, the RoPE table from `rope_start` (default: the context's frame count).
        Returns (x, vec, camera, (frames, height, width), tokens_per_frame, rope)."""
        self._check_text_kv(text_kv)
        if context_kv is not None and context_kv.num_layers != self.num_layers:
            raise ValueError(f"context_kv has {context_kv.num_layers} layers, the model has {self.num_layers}")
        if rope_start is None:
            rope_start = 0 if context_kv is None else context_kv.num_frames
        x, vec, camera, grid = self._image_inputs(name, hidden_states, timestep, action, viewmats, Ks)
        frames, height, width = grid
        return x, vec, camera, grid, height * width, self.rope_table(frames, height, width, start=rope_start)

    def _chunk_velocity(self, x: Tensor, vec: Tensor, grid: tuple[int, int, int]) -> Tensor:
        """The velocity [1, C, T, H, W] of a chunk step's final hidden x [1, T*H*W, hidden]."""
        frames, height, width = grid
        return self.unpatchify(self.final_projection(x, vec, height * width), frames, height, width)

    def context_prefill(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        action: Tensor,
        viewmats: Tensor,
        Ks: Tensor,
        text_kv: TextKV,
        prefeature_layers: Sequence[int] = (),
        trace: dict | None = None,
    ) -> tuple[ContextKV, dict[int, Tensor]]:
        """Encode n context frames into per-layer context K/V (temporal RoPE positions 0..n-1).

        hidden_states [1, 2C+1, n, H, W]; timestep [n]; action [1, n]; viewmats [1, n, 4, 4]; Ks [1, n, 3, 3].
        Returns (ContextKV, {layer: hidden state entering double block `layer`, [1, n*H*W, hidden]}).
        `trace` (optional) receives "img_tokens_in", "vec" [n, hidden] and "layer{i}.img_out" (i < depth-1).
        """
        self._check_text_kv(text_kv)
        wanted = sorted(set(int(layer) for layer in prefeature_layers))
        if wanted and not (0 <= wanted[0] and wanted[-1] < self.num_layers):
            raise ValueError(f"prefeature_layers must lie in [0, {self.num_layers}), got {wanted}")
        x, vec, camera, (frames, height, width) = self._image_inputs(
            "context_prefill", hidden_states, timestep, action, viewmats, Ks
        )
        tokens_per_frame = height * width
        rope = self.rope_table(frames, height, width, start=0)
        if trace is not None:
            trace.update({"img_tokens_in": x, "vec": vec[0]})
        prefeatures: dict[int, Tensor] = {}
        layers: list[LayerContextKV] = []
        last = self.num_layers - 1
        checkpointed = self.gradient_checkpointing and torch.is_grad_enabled()  # a trainer learning its context
        for index, block in enumerate(self.double_blocks):
            if index in wanted:
                prefeatures[index] = x
            if index == last:  # everything after the last block's K/V is unused
                layers.append(block.image_kv(x, vec, tokens_per_frame, rope, camera))
                break
            text_k, text_v = text_kv.layer(index)
            args = (x, vec, tokens_per_frame, rope, camera, text_k, text_v, text_kv.mask)
            if checkpointed:
                x, own = checkpoint(block.image_forward, *args, return_kv=True, use_reentrant=False,
                                    context_fn=self.checkpoint_context_fn)
            else:
                x, own = block.image_forward(*args, return_kv=True)
            layers.append(own)
            if trace is not None:
                trace[f"layer{index}.img_out"] = x
        return ContextKV(layers, frames), prefeatures

    def chunk_step(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        action: Tensor,
        viewmats: Tensor,
        Ks: Tensor,
        text_kv: TextKV,
        context_kv: ContextKV | None = None,
        rope_start: int | None = None,
        return_final_hidden: bool = False,
        trace: dict | None = None,
        return_raw_kv: bool = False,
    ):
        """One denoising call on a chunk: velocity [1, C, T, H, W] (or ChunkOutput with return_final_hidden; with
        return_raw_kv too, its `raw_kv` holds every block's raw (k, v) of the chunk's tokens, see `frame_kv_pass`).

        hidden_states [1, 2C+1, T, H, W]; timestep [T]; action [1, T]; viewmats [1, T, 4, 4]; Ks [1, T, 3, 3].
        Temporal RoPE positions are rope_start..rope_start+T-1, rope_start defaulting to the context's frame count.
        `trace` (optional) receives "img_tokens_in" and "layer{i}.img_out" (i < depth-1).
        """
        x, vec, camera, grid, tokens_per_frame, rope = self._chunk_inputs(
            "chunk_step", hidden_states, timestep, action, viewmats, Ks, text_kv, context_kv, rope_start)
        if trace is not None:
            trace["img_tokens_in"] = x
        if return_raw_kv and not return_final_hidden:
            raise ValueError("chunk_step: return_raw_kv needs return_final_hidden (the K/V come in the ChunkOutput)")
        checkpointed = self.gradient_checkpointing and torch.is_grad_enabled()
        raw_kv: list[tuple[Tensor, Tensor]] = []
        for index, block in enumerate(self.double_blocks):
            text_k, text_v = text_kv.layer(index)
            context = None if context_kv is None else context_kv.layer(index)
            args = (x, vec, tokens_per_frame, rope, camera, text_k, text_v, text_kv.mask, context)
            if return_raw_kv:
                x, kv = block.image_forward(*args, return_raw_kv=True)
                raw_kv.append(kv)
            elif checkpointed:
                x = checkpoint(block.image_forward, *args, use_reentrant=False, context_fn=self.checkpoint_context_fn)
            else:
                x = block.image_forward(*args)
            if trace is not None and index < self.num_layers - 1:
                trace[f"layer{index}.img_out"] = x
        velocity = self._chunk_velocity(x, vec, grid)
        if return_final_hidden:
            return ChunkOutput(velocity=velocity, final_hidden=x, vec=vec[0], raw_kv=raw_kv if return_raw_kv else None)
        return velocity

    def chunk_step_blocks(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        action: Tensor,
        viewmats: Tensor,
        Ks: Tensor,
        text_kv: TextKV,
        context_kv: ContextKV | None = None,
        rope_start: int | None = None,
        *,
        run_blocks: Sequence[int] | None = None,
        span_residuals: Mapping[int, Tensor] | None = None,
        keep_hidden: Sequence[int] = (),
    ) -> tuple[ChunkOutput, dict[int, Tensor]]:
        """A chunk step that runs only the double blocks `run_blocks` and stands in for each skipped span of blocks
        a..b (`skipped_block_spans`) with a residual: x_out(b) = x_in(a) + span_residuals[a] (the block-residual
        cache of predictor_training/eval/caches.py). Inputs, text K/V, context K/V and RoPE positions are
        `chunk_step`'s, so with run_blocks None (every block) this is the Full step.

        hidden_states [1, 2C+1, T, H, W]; timestep [T]; action [1, T]; viewmats [1, T, 4, 4]; Ks [1, T, 3, 3].
        span_residuals: {first block of a skipped span: [1, T*H*W, hidden]}, one per span. keep_hidden: block
        boundaries i in 0..depth whose hidden is returned, i < depth the hidden entering block i (0: the embedded
        input), depth the final hidden. Returns (ChunkOutput without raw K/V, {i: hidden}). No gradient
        checkpointing: an eval path.
        """
        depth = self.num_layers
        run = set(range(depth)) if run_blocks is None else {int(index) for index in run_blocks}
        spans = skipped_block_spans(depth, sorted(run))
        residuals = dict(span_residuals or {})
        if sorted(residuals) != [first for first, _ in spans]:
            raise ValueError(f"chunk_step_blocks: skipped spans {spans} need one residual each, keyed by the span's "
                             f"first block; got residuals for {sorted(residuals)}")
        keep = {int(index) for index in keep_hidden}
        if any(not 0 <= index <= depth for index in keep):
            raise ValueError(f"keep_hidden must lie in [0, {depth}], got {sorted(keep)}")
        x, vec, camera, grid, tokens_per_frame, rope = self._chunk_inputs(
            "chunk_step_blocks", hidden_states, timestep, action, viewmats, Ks, text_kv, context_kv, rope_start)
        hiddens: dict[int, Tensor] = {}
        for index, block in enumerate(self.double_blocks):
            if index in keep:
                hiddens[index] = x
            if index in run:
                text_k, text_v = text_kv.layer(index)
                context = None if context_kv is None else context_kv.layer(index)
                x = block.image_forward(x, vec, tokens_per_frame, rope, camera, text_k, text_v, text_kv.mask, context)
            elif index in residuals:  # the span's first block: the whole span at once
                x = x + residuals[index]
        if depth in keep:
            hiddens[depth] = x
        return ChunkOutput(velocity=self._chunk_velocity(x, vec, grid), final_hidden=x, vec=vec[0]), hiddens

    def frame_kv_pass(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        action: Tensor,
        viewmats: Tensor,
        Ks: Tensor,
        text_kv: TextKV,
        context_kv: ContextKV | None = None,
        rope_start: int | None = None,
    ) -> list[tuple[Tensor, Tensor]]:
        """The raw per-layer K/V of a chunk's frames, computed as `chunk_step` sees them (the incremental context
        mode caches them once a chunk is final): a chunk step whose velocity is not used.

        Same inputs as `chunk_step`. Returns, per double block, (k, v) [1, heads, T*H*W, d]: qk-normed K and V
        before RoPE and ProPE, so they can be placed at any context position and camera later
        (`assemble_context_kv`).
        """
        output = self.chunk_step(hidden_states, timestep, action, viewmats, Ks, text_kv, context_kv=context_kv,
                                 rope_start=rope_start, return_final_hidden=True, return_raw_kv=True)
        return output.raw_kv

    def assemble_context_kv(
        self, raw_kv: Sequence[tuple[Tensor, Tensor]], viewmats: Tensor, Ks: Tensor, height: int, width: int
    ) -> ContextKV:
        """Context K/V of n frames from their raw per-layer K/V: compacted RoPE positions 0..n-1 and each frame's
        own ProPE camera, exactly as a context prefill places the K/V it computes.

        raw_kv: per double block (k, v) [1, heads, n*H*W, d] (frames in context order); viewmats [1, n, 4, 4];
        Ks [1, n, 3, 3].
        """
        if len(raw_kv) != self.num_layers:
            raise ValueError(f"raw K/V of {len(raw_kv)} layers for a model of {self.num_layers}")
        frames = viewmats.shape[1]
        tokens_per_frame = height * width
        rope = self.rope_table(frames, height, width, start=0)
        camera = self.camera_projection(viewmats, Ks)
        layers = [DoubleStreamBlock._own_context_kv(k, v, tokens_per_frame, rope, camera) for k, v in raw_kv]
        return ContextKV(layers, frames)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(
            "WorldPlayTransformer has no generic forward; call text_prefill, context_prefill or chunk_step"
        )
