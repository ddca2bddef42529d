"""The Predictor (docs/offline.md § What is trained, and the loss): two trainable copies of Teacher double blocks
that stand in for a Teacher denoising step.

One Predictor call replaces one Full-DiT step `k` of a chunk. It sees the current noisy input `x_k`
(`[B, 2C+1, T, H, W]`: latent | image condition | mask), the anchor hidden `h_{k-1}` (the hidden entering the
Teacher's final layer at the previous step of the same chunk) and, for `v4`, the previous chunk's hidden of the same
step. It returns `(pred_hidden [B, N, D], pred_velocity [B, C, T, H, W])`, N = T*H*W:

    img      = img_in(x_k)                                   frozen Teacher `img_in` (gradient still flows to x_k)
    x        = img + fusion([img ; h_{k-1} ; h_prev_chunk])  group "fusion", output projection zero-initialised
    x        = block_2(block_1(x))                           group "blocks": copies of teacher.double_blocks[a], [b]
    pred_h   = h_{k-1} + head(x)                             group "fusion", last Linear zero-initialised
    pred_v   = final_layer(pred_h, vec_k)                    frozen Teacher `final_layer`, vec_k = time_in + action_in

Inside the blocks the image queries attend to [text K/V of the block's source layer ; context K/V of the source
layer (v4) ; own tokens] in the RoPE and ProPE branches, exactly like the Teacher's AR chunk step
(`DoubleStreamBlock.image_forward`), with the chunk at temporal RoPE positions `rope_start..rope_start+T-1`.

Variants (docs/offline.md § The variants):
* `v4`: context K/V of the source layers (offline: `context_from_prefeatures`, the frozen ORIGINAL source block's
  K/V path applied to the stored pre-features; online: the Teacher prefill's exact K/V,
  `context_kv.select(source_blocks)`), and the previous-chunk hidden as a third fusion stream.
* `disca`: text K/V only; no context and no previous-chunk hidden (passing either raises).

Precision: the trainable copies are FP32 master weights even when the Teacher is BF16; the frozen Teacher parts
keep their dtype. Activations run in the autocast dtype under autocast (else in the trainable weights' dtype);
`pred_hidden` is returned in FP32.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from predictor_training.runtime.optim import BLOCKS_GROUP, FUSION_GROUP
from predictor_training.teacher import (
    CameraProjection,
    ContextKV,
    DoubleStreamBlock,
    LayerContextKV,
    RopeTable,
    TextKV,
    WorldPlayTransformer,
)
from predictor_training.teacher.layers import build_camera_projection, build_rope_table

VARIANTS = ("v4", "disca")
PREDICTOR_ARCH_VERSION = 1
FUSION_NORM_EPS = 1e-6
# Stream order of the fusion input; a checkpoint records it so that a rebuild cannot silently reorder the weights.
FUSION_STREAMS = {"v4": ("image", "anchor", "prev_chunk"), "disca": ("image", "anchor")}
HEAD_LAYOUT = "layernorm-linear-gelu_tanh-linear(zero)"


def _autocast_or(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The autocast dtype when autocast is on for `device`, else `dtype`."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


def _check_shape(name: str, tensor: Tensor, expected: tuple, layout: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must be {layout} = {tuple(expected)}, got {tuple(tensor.shape)}")


# ---------------------------------------------------------------------------------------------------------------
# 1. Frozen Teacher parts
# ---------------------------------------------------------------------------------------------------------------
class FrozenTeacherParts:
    """The Teacher sub-modules the Predictor runs but never trains: `img_in`, `time_in`, `action_in`,
    `final_layer`, and (v4) the ORIGINAL source blocks used as the context projector.

    They are the Teacher's own module objects (shared, not copied: no memory cost, and always identical to the
    Teacher), with `requires_grad=False`. This is a plain object, not an `nn.Module`, so the Predictor does not
    register them: they are not in its `state_dict`, its `parameters()` or DDP's buckets, and `Predictor.to()`
    leaves them (and the Teacher) where they are. Their forwards are NOT under `no_grad` (except the context
    projector), so gradients reach the Predictor's inputs. The methods mirror the Teacher's batch-general building
    blocks (`WorldPlayTransformer.embed_image`, `frame_vec`, `camera_projection`, `rope_table`,
    `final_projection`, `unpatchify`).
    """

    def __init__(self, teacher: WorldPlayTransformer, context_source_blocks: Sequence[int] | None):
        self.img_in = teacher.img_in
        self.time_in = teacher.time_in
        self.action_in = teacher.action_in
        self.final_layer = teacher.final_layer
        self.context_blocks = (
            None if context_source_blocks is None else [teacher.double_blocks[index] for index in context_source_blocks]
        )
        self.rope_dim_list = list(teacher.rope_dim_list)
        self.rope_theta = float(teacher.rope_theta)
        for module in (self.img_in, self.time_in, self.action_in, self.final_layer, *(self.context_blocks or [])):
            module.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.img_in.proj.weight.device

    def compute_dtype(self) -> torch.dtype:
        """Autocast dtype under autocast, else the frozen weights' dtype (as the Teacher's `compute_dtype`)."""
        return _autocast_or(self.img_in.proj.weight.dtype, self.device)

    def embed_image(self, noisy_input: Tensor) -> Tensor:
        """[B, 2C+1, T, H, W] -> [B, T*H*W, D]."""
        return self.img_in(noisy_input.to(self.compute_dtype()))

    def frame_vec(self, timestep: Tensor, action: Tensor) -> Tensor:
        """timestep [B, T] (0..1000), action [B, T] (labels 0..80) -> vec = time_in(t) + action_in(a), [B, T, D]."""
        batch, frames = action.shape
        vec = self.time_in(timestep.reshape(-1)) + self.action_in(action.reshape(-1))
        return vec.unflatten(0, (batch, frames))  # not view(batch, frames, -1): frames may be 0 (no context)

    def rope_table(self, num_frames: int, height: int, width: int, start: int) -> RopeTable:
        """cos/sin [T*H*W, head_dim] float32 for temporal positions start..start+T-1."""
        return build_rope_table(num_frames, height, width, start, self.rope_dim_list, self.rope_theta, self.device)

    def final_projection(self, hidden: Tensor, frame_vec: Tensor, tokens_per_frame: int) -> Tensor:
        """[B, T*HW, D] with frame_vec [B, T, D] -> [B, T*HW, C]."""
        return self.final_layer(hidden.to(self.compute_dtype()), frame_vec, tokens_per_frame)

    @staticmethod
    def unpatchify(tokens: Tensor, num_frames: int, height: int, width: int) -> Tensor:
        """[B, T*H*W, C] -> [B, C, T, H, W]."""
        batch, _, channels = tokens.shape
        return tokens.view(batch, num_frames, height, width, channels).permute(0, 4, 1, 2, 3)


# ---------------------------------------------------------------------------------------------------------------
# 2. Trainable parts
# ---------------------------------------------------------------------------------------------------------------
class ImageFusion(nn.Module):
    """Merges the image tokens with the anchor hidden (and, v4, the previous-chunk hidden) into the block input.

    block_input = img + proj(concat_s LayerNorm_s(stream_s)),  streams `stream_names` in that order, each [B, N, D].

    Why this shape: the three streams live on very different scales (img_in tokens vs. final-layer hiddens), so
    each gets its own affine LayerNorm before a single Linear(S*D -> D) mixes them. `proj` is zero-initialised, so
    an untrained Predictor feeds its first block exactly `img_in(x_k)`, the input of the Teacher's block 0, and the
    copied blocks start from the computation they were trained for; the anchor/previous-chunk information is then
    learned into the residual path (gradients reach `proj` from the first step, as its input is not zero).

    Config: hidden_size D, stream_names.
    """

    def __init__(self, hidden_size: int, stream_names: Sequence[str]):
        super().__init__()
        self.stream_names = tuple(stream_names)
        self.norms = nn.ModuleDict({name: nn.LayerNorm(hidden_size, eps=FUSION_NORM_EPS) for name in self.stream_names})
        self.proj = nn.Linear(len(self.stream_names) * hidden_size, hidden_size)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, streams: dict[str, Tensor]) -> Tensor:
        """streams: {name: [B, N, D]} with exactly `stream_names` (all in one dtype) -> block input [B, N, D]."""
        if set(streams) != set(self.stream_names):
            raise ValueError(f"fusion expects streams {list(self.stream_names)}, got {sorted(streams)}")
        normed = [self.norms[name](streams[name]) for name in self.stream_names]
        fused = self.proj(torch.cat(normed, dim=-1))
        return streams["image"] + fused.to(streams["image"].dtype)


class ResidualHead(nn.Module):
    """head(x) = fc2(GELU_tanh(fc1(LayerNorm(x)))), fc2 zero-initialised: an untrained Predictor returns the anchor.

    Config: hidden_size D (fc1, fc2: D -> D).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden_size, eps=FUSION_NORM_EPS)
        self.fc1 = nn.Linear(hidden_size, hidden_size)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: Tensor) -> Tensor:
        """[B, N, D] -> [B, N, D]."""
        return self.fc2(self.act(self.fc1(self.norm(x))))


def copy_image_stream(block: DoubleStreamBlock) -> DoubleStreamBlock:
    """A trainable FP32 deep copy of `block` without its text stream.

    The Predictor's text K/V come precomputed from the source layer, so the `txt_*` weights never take part in
    `image_forward`; keeping them would leave unused trainable parameters (DDP with find_unused_parameters=False
    fails on those) and dead weight in the checkpoints.
    """
    hidden_size, mlp_width = block.img_attn_q.in_features, block.img_mlp.fc1.out_features
    rebuildable = type(block) is DoubleStreamBlock and int(hidden_size * (mlp_width / hidden_size)) == mlp_width
    if not rebuildable:  # a wrapped or modified block: copy it as it is
        copied = copy.deepcopy(block)
        for name in [name for name, _ in copied.named_children() if name.startswith("txt_")]:
            delattr(copied, name)
        return _float32(copied).requires_grad_(True)
    # Built on the meta device (no random initialisation, so the caller's RNG stream is untouched) and given FP32
    # copies of the source weights: the same values as deepcopy + .float(), and it also works on fake tensors,
    # which can be neither deep-copied nor converted in place (tools/estimate_memory.py).
    with torch.device("meta"):
        copied = DoubleStreamBlock(hidden_size, block.heads, mlp_width / hidden_size,
                                   block.img_attn_q.bias is not None)
    for name in [name for name, _ in copied.named_children() if name.startswith("txt_")]:
        delattr(copied, name)
    source = block.state_dict()
    state = {name: source[name].detach().to(torch.float32, copy=True) for name in copied.state_dict()}
    copied.load_state_dict(state, strict=True, assign=True)
    return copied.train(block.training).requires_grad_(True)


def _float32(module: nn.Module) -> nn.Module:
    """`module.float()`, skipped when every floating parameter and buffer already is FP32 (so that a module of
    fake tensors, which cannot be converted in place, passes)."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(tensor.dtype == torch.float32 for tensor in tensors if tensor.is_floating_point()):
        return module
    return module.float()


@dataclass
class ChunkConditioning:
    """What both blocks need besides the image tokens, built once per call.

    frame_vec [B, T, D] (activation dtype); rope: cos/sin [T*H*W, head_dim]; camera: P, P_inv [B, T, 4, 4];
    text_k/text_v: one [B, heads, L, d] per Predictor block (source layers a, b); text_mask [B, L] bool or None;
    context: one LayerContextKV ([B, heads, S, d] each) per Predictor block, or None.
    """

    frame_vec: Tensor
    tokens_per_frame: int
    rope: RopeTable
    camera: CameraProjection
    text_k: list[Tensor]
    text_v: list[Tensor]
    text_mask: Tensor | None
    context: list[LayerContextKV] | None


# ---------------------------------------------------------------------------------------------------------------
# 3. The Predictor
# ---------------------------------------------------------------------------------------------------------------
class Predictor(nn.Module):
    """Two copied Teacher blocks between an image fusion and a residual head (module docstring has the math).

    Config (`predictor_config()`): variant ("v4" | "disca"), source_blocks (a, b), hidden_size, heads_num,
    latent_channels, teacher_num_layers, fusion_streams, head. Build with `build_predictor` or
    `build_predictor_from_config`.

    Sub-modules: `fusion` (ImageFusion) and `residual_head` (group "fusion"), `blocks` (group "blocks"), and
    `teacher_frozen` (FrozenTeacherParts: shared Teacher modules, frozen). `state_dict()` / `load_state_dict()`
    cover the trainable parts only (the frozen Teacher parts are rebuilt from the Teacher), and DDP is told to
    ignore the frozen parameters. `gradient_checkpointing` (attribute) wraps each block in a non-reentrant
    checkpoint.
    """

    def __init__(
        self,
        teacher: WorldPlayTransformer,
        variant: str,
        source_blocks: Sequence[int],
        gradient_checkpointing: bool = False,
    ):
        super().__init__()
        # 1. Validate against the Teacher.
        if variant not in VARIANTS:
            raise ValueError(f"unknown Predictor variant {variant!r}; expected one of {list(VARIANTS)}")
        source_blocks = tuple(int(index) for index in source_blocks)
        if len(source_blocks) != 2 or not all(0 <= index < teacher.num_layers for index in source_blocks):
            raise ValueError(
                f"source_blocks must be two double-block indices in [0, {teacher.num_layers}), "
                f"got {list(source_blocks)}"
            )
        self.variant = variant
        self.source_blocks = source_blocks
        self.hidden_size = int(teacher.config.hidden_size)
        self.heads_num = int(teacher.heads_num)
        self.latent_channels = int(teacher.out_channels)
        self.teacher_num_layers = int(teacher.num_layers)
        self.gradient_checkpointing = gradient_checkpointing
        # 2. Trainable parts (FP32 master weights).
        self.fusion = _float32(ImageFusion(self.hidden_size, FUSION_STREAMS[variant]))
        self.blocks = nn.ModuleList([copy_image_stream(teacher.double_blocks[index]) for index in source_blocks])
        self.residual_head = _float32(ResidualHead(self.hidden_size))
        # 3. Frozen parts, shared with the Teacher and not registered: out of state_dict, parameters() and DDP.
        self.teacher_frozen = FrozenTeacherParts(teacher, source_blocks if variant == "v4" else None)

    # ---- parameters, weights, config ------------------------------------------------------------------------
    def trainable_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """{"fusion": fusion + residual head parameters, "blocks": the two copied blocks' parameters}."""
        return {
            FUSION_GROUP: list(self.fusion.parameters()) + list(self.residual_head.parameters()),
            BLOCKS_GROUP: list(self.blocks.parameters()),
        }

    def predictor_config(self) -> dict:
        """Plain-data description that, with the Teacher, rebuilds this architecture."""
        return {
            "arch_version": PREDICTOR_ARCH_VERSION,
            "variant": self.variant,
            "source_blocks": list(self.source_blocks),
            "hidden_size": self.hidden_size,
            "heads_num": self.heads_num,
            "latent_channels": self.latent_channels,
            "teacher_num_layers": self.teacher_num_layers,
            "fusion_streams": list(self.fusion.stream_names),
            "head": HEAD_LAYOUT,
        }

    def activation_dtype(self) -> torch.dtype:
        """The trainable parts' compute dtype: the autocast dtype under autocast, else their weights' dtype."""
        weight = self.fusion.proj.weight
        return _autocast_or(weight.dtype, weight.device)

    # ---- v4 context projector ---------------------------------------------------------------------------------
    @torch.no_grad()
    def context_from_prefeatures(
        self,
        prefeatures: dict[int, Tensor],
        ctx_timestep: Tensor,
        ctx_action: Tensor,
        ctx_viewmats: Tensor,
        ctx_Ks: Tensor,
        *,
        height: int,
        width: int,
    ) -> ContextKV:
        """Context K/V of the source layers from stored pre-features (v4, offline), without gradients.

        prefeatures {layer: hidden entering double block `layer` during the context prefill, [B, n*H*W, D]} for
        both source layers; ctx_timestep [B, n] (14 each); ctx_action [B, n]; ctx_viewmats [B, n, 4, 4] (w2c);
        ctx_Ks [B, n, 3, 3]. Runs the ORIGINAL (frozen Teacher) source block's K/V path with RoPE positions
        0..n-1, i.e. exactly what `WorldPlayTransformer.context_prefill` caches for that layer. Returns a
        ContextKV with one layer per source block (entry j = source block j), `num_frames` = n.
        """
        if self.variant != "v4":
            raise ValueError(f"the {self.variant!r} Predictor has no context projector (v4 only)")
        missing = [layer for layer in self.source_blocks if layer not in prefeatures]
        if missing:
            raise KeyError(f"prefeatures lack source layer(s) {missing}; got layers {sorted(prefeatures)}")
        batch, frames = ctx_action.shape
        tokens = frames * height * width
        _check_shape("ctx_timestep", ctx_timestep, (batch, frames), "[B, n]")
        _check_shape("ctx_viewmats", ctx_viewmats, (batch, frames, 4, 4), "[B, n, 4, 4]")
        _check_shape("ctx_Ks", ctx_Ks, (batch, frames, 3, 3), "[B, n, 3, 3]")
        frozen = self.teacher_frozen
        dtype = frozen.compute_dtype()
        vec = frozen.frame_vec(ctx_timestep, ctx_action)
        rope = frozen.rope_table(frames, height, width, start=0)
        camera = build_camera_projection(ctx_viewmats.to(dtype), ctx_Ks.to(dtype))
        layers = []
        for layer, block in zip(self.source_blocks, frozen.context_blocks):
            features = prefeatures[layer]
            _check_shape(f"prefeatures[{layer}]", features, (batch, tokens, self.hidden_size), "[B, n*H*W, D]")
            layers.append(block.image_kv(features.to(dtype), vec, height * width, rope, camera))
        return ContextKV(layers, frames)

    # ---- forward pieces ---------------------------------------------------------------------------------------
    def chunk_conditioning(
        self,
        frame_vec: Tensor,
        height: int,
        width: int,
        viewmats: Tensor,
        Ks: Tensor,
        text_kv: TextKV,
        context: ContextKV | None,
        rope_start: int,
    ) -> ChunkConditioning:
        """Per-call inputs of the blocks, cast to the activation dtype.

        frame_vec [B, T, D]; viewmats [B, T, 4, 4]; Ks [B, T, 3, 3]; text_kv / context hold the source layers only
        (entry j = source block j).
        """
        dtype = self.activation_dtype()
        batch, frames = frame_vec.shape[:2]
        # 1. Text K/V of the source layers (padded batches carry a mask).
        if text_kv.num_layers != 2:
            raise ValueError(
                f"text_kv must hold the 2 source layers {list(self.source_blocks)} "
                f"(use text_kv.select(source_blocks)), got {text_kv.num_layers} layers"
            )
        text_len = text_kv.num_tokens
        for j in range(2):
            for name, tensor in (("k", text_kv.k[j]), ("v", text_kv.v[j])):
                expected = (batch, self.heads_num, text_len, tensor.shape[-1])
                _check_shape(f"text_kv.{name}[{j}]", tensor, expected, "[B, heads, L, d]")
        text_mask = None if text_kv.mask is None else text_kv.mask.bool()
        if text_mask is not None:
            _check_shape("text_kv.mask", text_mask, (batch, text_len), "[B, L]")
        # 2. Context K/V of the source layers (v4).
        layers = None
        if context is not None:
            if context.num_layers != 2:
                raise ValueError(
                    f"context must hold the 2 source layers {list(self.source_blocks)} (use "
                    f"context_kv.select(source_blocks) or context_from_prefeatures), got {context.num_layers} layers"
                )
            tokens = context.num_frames * height * width
            for j, layer in enumerate(context.layers):
                _check_shape(
                    f"context.layers[{j}].rope_k",
                    layer.rope_k,
                    (batch, self.heads_num, tokens, layer.rope_k.shape[-1]),
                    "[B, heads, n_ctx*H*W, d]",
                )
            layers = [layer.to(dtype=dtype) for layer in context.layers]
        return ChunkConditioning(
            frame_vec=frame_vec.to(dtype),
            tokens_per_frame=height * width,
            rope=self.teacher_frozen.rope_table(frames, height, width, start=rope_start),
            camera=build_camera_projection(viewmats.to(dtype), Ks.to(dtype)),
            text_k=[tensor.to(dtype) for tensor in text_kv.k],
            text_v=[tensor.to(dtype) for tensor in text_kv.v],
            text_mask=text_mask,
            context=layers,
        )

    def fuse_inputs(self, img_tokens: Tensor, anchor_hidden: Tensor, prev_chunk_hidden: Tensor | None) -> Tensor:
        """Block input [B, N, D] from img_in tokens, the anchor and (v4) the previous-chunk hidden, each [B, N, D]."""
        dtype = self.activation_dtype()
        streams = {"image": img_tokens.to(dtype), "anchor": anchor_hidden.to(dtype)}
        if prev_chunk_hidden is not None:
            streams["prev_chunk"] = prev_chunk_hidden.to(dtype)
        return self.fusion(streams)

    def run_blocks(self, block_input: Tensor, conditioning: ChunkConditioning) -> Tensor:
        """Block 1 then block 2 (`image_forward`), each with its source layer's text/context K/V. [B, N, D]."""
        x = block_input
        for j, block in enumerate(self.blocks):
            args = (
                x,
                conditioning.frame_vec,
                conditioning.tokens_per_frame,
                conditioning.rope,
                conditioning.camera,
                conditioning.text_k[j],
                conditioning.text_v[j],
                conditioning.text_mask,
                None if conditioning.context is None else conditioning.context[j],
            )
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block.image_forward, *args, use_reentrant=False)
            else:
                x = block.image_forward(*args)
        return x

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(
        self,
        noisy_input: Tensor,
        anchor_hidden: Tensor,
        timestep: Tensor,
        action: Tensor,
        viewmats: Tensor,
        Ks: Tensor,
        text_kv: TextKV,
        context: ContextKV | None = None,
        prev_chunk_hidden: Tensor | None = None,
        rope_start: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """One Predictor step.

        noisy_input [B, 2C+1, T, H, W] (x_k | image condition | mask); anchor_hidden [B, N, D] (h_{k-1}, N = T*H*W);
        timestep [B, T] (step k's timestep, 0..1000, per frame); action [B, T]; viewmats [B, T, 4, 4] (w2c);
        Ks [B, T, 3, 3]; text_kv: TextKV of the 2 source layers, k/v [B, heads, L, d], mask [B, L] or None.
        v4 only (required): context = ContextKV of the 2 source layers ([B, heads, n_ctx*H*W, d]) and
        prev_chunk_hidden [B, N, D] (the previous chunk's hidden of the same step).
        rope_start: temporal RoPE position of the chunk's first frame; default n_ctx (v4) or 0 (disca).
        Returns (pred_hidden [B, N, D] float32, pred_velocity [B, C, T, H, W]).
        """
        # 1. Inputs.
        self._check_variant_inputs(context, prev_chunk_hidden)
        if noisy_input.dim() != 5 or noisy_input.shape[1] != 2 * self.latent_channels + 1:
            raise ValueError(
                f"noisy_input must be [B, 2C+1={2 * self.latent_channels + 1}, T, H, W], got {tuple(noisy_input.shape)}"
            )
        batch, _, frames, height, width = noisy_input.shape
        tokens = frames * height * width
        _check_shape("anchor_hidden", anchor_hidden, (batch, tokens, self.hidden_size), "[B, T*H*W, D]")
        if prev_chunk_hidden is not None:
            _check_shape("prev_chunk_hidden", prev_chunk_hidden, (batch, tokens, self.hidden_size), "[B, T*H*W, D]")
        _check_shape("timestep", timestep, (batch, frames), "[B, T]")
        _check_shape("action", action, (batch, frames), "[B, T]")
        _check_shape("viewmats", viewmats, (batch, frames, 4, 4), "[B, T, 4, 4]")
        _check_shape("Ks", Ks, (batch, frames, 3, 3), "[B, T, 3, 3]")
        if rope_start is None:
            rope_start = 0 if context is None else context.num_frames
        # 2. Frozen Teacher embeddings (with gradient to noisy_input).
        frozen = self.teacher_frozen
        img_tokens = frozen.embed_image(noisy_input)
        vec = frozen.frame_vec(timestep, action)
        # 3. Fusion, the two blocks, the residual head.
        conditioning = self.chunk_conditioning(vec, height, width, viewmats, Ks, text_kv, context, rope_start)
        block_output = self.run_blocks(self.fuse_inputs(img_tokens, anchor_hidden, prev_chunk_hidden), conditioning)
        pred_hidden = anchor_hidden.float() + self.residual_head(block_output).float()
        # 4. Frozen final layer (with gradient to pred_hidden).
        velocity_tokens = frozen.final_projection(pred_hidden, vec, height * width)
        return pred_hidden, frozen.unpatchify(velocity_tokens, frames, height, width)

    def _check_variant_inputs(self, context: ContextKV | None, prev_chunk_hidden: Tensor | None) -> None:
        inputs = (("context", context), ("prev_chunk_hidden", prev_chunk_hidden))
        if self.variant == "disca":
            given = [name for name, value in inputs if value is not None]
            if given:
                raise ValueError(f"the disca Predictor takes no context and no previous-chunk hidden; got {given}")
        else:
            missing = [name for name, value in inputs if value is None]
            if missing:
                raise ValueError(f"the v4 Predictor needs {missing} (context K/V and previous-chunk hidden)")


# ---------------------------------------------------------------------------------------------------------------
# 4. Builders
# ---------------------------------------------------------------------------------------------------------------
def build_predictor(
    teacher: WorldPlayTransformer,
    variant: str,
    source_blocks: Sequence[int],
    gradient_checkpointing: bool = False,
) -> Predictor:
    """A fresh Predictor: copies of `teacher.double_blocks[a]`, `[b]` (FP32), zero-initialised fusion output and
    head output (so it starts as hidden reuse), frozen Teacher parts shared with `teacher`.

    Sets `requires_grad=False` on the shared Teacher modules (img_in, time_in, action_in, final_layer, and for v4
    the source blocks). The Predictor is created on the Teacher's device.
    """
    predictor = Predictor(teacher, variant, source_blocks, gradient_checkpointing)
    device = teacher.img_in.proj.weight.device
    if any(tensor.device != device for tensor in list(predictor.parameters()) + list(predictor.buffers())):
        predictor = predictor.to(device)
    return predictor


@torch.no_grad()
def as_trained_(predictor: Predictor, std: float = 0.02) -> Predictor:
    """The zero-initialised fusion output and head output filled with N(0, std^2) draws, as after (offline) training
    (a fresh Predictor returns its anchor unchanged)."""
    for module in (predictor.fusion.proj, predictor.residual_head.fc2):
        for param in module.parameters():
            param.normal_(0.0, std)
    return predictor


def build_predictor_from_config(
    teacher: WorldPlayTransformer, config: dict, gradient_checkpointing: bool = False
) -> Predictor:
    """Rebuild the architecture recorded by `Predictor.predictor_config()` on `teacher` (then load the weights).

    Raises ValueError when the config is of another version/layout or was made for a Teacher of other sizes.
    """
    expected_keys = {
        "arch_version", "variant", "source_blocks", "hidden_size", "heads_num", "latent_channels",
        "teacher_num_layers", "fusion_streams", "head",
    }
    if set(config) != expected_keys:
        raise ValueError(
            f"predictor config keys {sorted(config)} differ from the expected {sorted(expected_keys)}"
        )
    if config["arch_version"] != PREDICTOR_ARCH_VERSION:
        raise ValueError(
            f"predictor config arch_version {config['arch_version']}, this code builds {PREDICTOR_ARCH_VERSION}"
        )
    predictor = build_predictor(teacher, config["variant"], config["source_blocks"], gradient_checkpointing)
    rebuilt = predictor.predictor_config()
    problems = [
        f"{key}: saved {config[key]!r}, teacher gives {rebuilt[key]!r}"
        for key in sorted(config)
        if config[key] != rebuilt[key]
    ]
    if problems:
        raise ValueError("predictor config does not match this teacher/code: " + "; ".join(problems))
    return predictor


def text_kv_from_stacked(text_k: Tensor, text_v: Tensor, text_mask: Tensor | None = None) -> TextKV:
    """Batched source-layer text K/V as produced by `collate_pairs` -> TextKV for `Predictor.forward`.

    text_k, text_v [B, 2, heads, L, d] (layer axis = source blocks a, b); text_mask [B, L] bool or None.
    """
    if text_k.dim() != 5 or text_k.shape[1] != 2 or text_v.shape != text_k.shape:
        raise ValueError(
            f"text_k/text_v must both be [B, 2, heads, L, d], got {tuple(text_k.shape)} and {tuple(text_v.shape)}"
        )
    return TextKV([text_k[:, 0], text_k[:, 1]], [text_v[:, 0], text_v[:, 1]], text_mask)
