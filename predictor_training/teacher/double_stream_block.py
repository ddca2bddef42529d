"""One double-stream block of the WorldPlay-1.5 teacher transformer (`double_blocks.N`, upstream key names): the
text stream (text-only attention) and the image stream (RoPE + ProPE branches, per-frame modulation), batch-general
so the Predictor reuses it (the transformer that stacks them is teacher/model.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import CameraProjection, LayerContextKV, RopeTable
from .layers import (
    MLP,
    RMSNorm,
    apply_frame_matrix,
    apply_rope,
    layer_norm_no_affine,
    merge_heads,
    modulate,
    split_heads,
)


class _Modulation(nn.Module):
    """`{img,txt}_mod`: SiLU then `linear` to 6 * hidden."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 6 * hidden_size)

    def forward(self, vec: Tensor) -> Tensor:
        return self.linear(F.silu(vec))


# `DoubleStreamBlock.image_forward` releases its attention inputs (q, the key/value concatenations, this call's own
# K/V) right after the attention; False keeps them to the end of the call, as the code the user's GPU figures were
# measured with did (tests/tools/test_estimate_memory.py compares the memory rehearsal with those figures). Values
# are the same either way: only the tensors' lifetimes differ.
RELEASE_ATTENTION_INPUTS = True


class DoubleStreamBlock(nn.Module):
    """One `double_blocks.N`: a text stream (text-only attention) and an image stream (RoPE + ProPE branches).

    Modulation chunks: (shift1, scale1, gate1, shift2, scale2, gate2). Norms are non-affine LayerNorms (no keys).
    """

    def __init__(self, hidden_size: int, heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        self.heads = heads
        head_dim = hidden_size // heads
        mlp_width = int(hidden_size * mlp_ratio)

        def linear() -> nn.Linear:
            return nn.Linear(hidden_size, hidden_size, bias=qkv_bias)

        # image stream
        self.img_mod = _Modulation(hidden_size)
        self.img_attn_q, self.img_attn_k, self.img_attn_v = linear(), linear(), linear()
        self.img_attn_q_norm, self.img_attn_k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.img_attn_proj = linear()
        self.img_attn_prope_proj = nn.Linear(hidden_size, hidden_size)  # WorldPlay extra, always with bias
        self.img_mlp = MLP(hidden_size, mlp_width, nn.GELU(approximate="tanh"))
        # text stream
        self.txt_mod = _Modulation(hidden_size)
        self.txt_attn_q, self.txt_attn_k, self.txt_attn_v = linear(), linear(), linear()
        self.txt_attn_q_norm, self.txt_attn_k_norm = RMSNorm(head_dim), RMSNorm(head_dim)
        self.txt_attn_proj = linear()
        self.txt_mlp = MLP(hidden_size, mlp_width, nn.GELU(approximate="tanh"))

    # ---- text stream --------------------------------------------------------------------------------------
    def text_forward(
        self, x: Tensor, vec_txt: Tensor, text_mask: Tensor | None = None, kv_only: bool = False
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """Text-only mode. x [B, L, h]; vec_txt [B, h]; text_mask [B, L] bool (True = valid) or None.

        Returns (x' [B, L, h] or None when kv_only, k [B, heads, L, d] qk-normed, v [B, heads, L, d]).
        """
        shift1, scale1, gate1, shift2, scale2, gate2 = self.txt_mod(vec_txt).unsqueeze(1).chunk(6, dim=-1)
        x_mod = modulate(layer_norm_no_affine(x), shift1, scale1)
        k = self.txt_attn_k_norm(split_heads(self.txt_attn_k(x_mod), self.heads))
        v = split_heads(self.txt_attn_v(x_mod), self.heads)
        if kv_only:
            return None, k, v
        q = self.txt_attn_q_norm(split_heads(self.txt_attn_q(x_mod), self.heads))
        attn_mask = None if text_mask is None else text_mask[:, None, None, :]
        attn = merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask))
        x = x + gate1 * self.txt_attn_proj(attn)
        x = x + gate2 * self.txt_mlp(modulate(layer_norm_no_affine(x), shift2, scale2))
        return x, k, v

    # ---- image stream -------------------------------------------------------------------------------------
    def _image_modulation(self, frame_vec: Tensor) -> tuple[Tensor, ...]:
        """frame_vec [B, T, h] -> six [B, T, 1, h] tensors (broadcast over the tokens of each frame)."""
        return self.img_mod(frame_vec).unsqueeze(2).chunk(6, dim=-1)

    @staticmethod
    def _per_frame(x: Tensor, frames: int, tokens_per_frame: int) -> Tensor:
        """[B, T*HW, h] -> [B, T, HW, h]."""
        return x.view(x.shape[0], frames, tokens_per_frame, x.shape[-1])

    def _image_qkv(
        self, x: Tensor, shift1: Tensor, scale1: Tensor, tokens_per_frame: int, need_q: bool
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """Modulate, project and qk-norm. Returns q (or None), k, v, each [B, heads, N, d]."""
        frames = shift1.shape[1]
        normed = layer_norm_no_affine(self._per_frame(x, frames, tokens_per_frame))
        x_mod = modulate(normed, shift1, scale1).flatten(1, 2)
        k = self.img_attn_k_norm(split_heads(self.img_attn_k(x_mod), self.heads))
        v = split_heads(self.img_attn_v(x_mod), self.heads)
        q = self.img_attn_q_norm(split_heads(self.img_attn_q(x_mod), self.heads)) if need_q else None
        return q, k, v

    @staticmethod
    def _check_image_inputs(
        x: Tensor, frame_vec: Tensor, tokens_per_frame: int, rope: RopeTable, camera: CameraProjection
    ) -> None:
        batch, tokens = x.shape[:2]
        frames = frame_vec.shape[1]
        if frame_vec.shape[0] != batch or frames * tokens_per_frame != tokens:
            raise ValueError(
                f"x {tuple(x.shape)} must hold frame_vec's {frames} frames x {tokens_per_frame} tokens for batch "
                f"{frame_vec.shape[0]}"
            )
        if rope.cos.shape[0] != tokens:
            raise ValueError(f"the RoPE table has {rope.cos.shape[0]} rows for {tokens} image tokens")
        if tuple(camera.P.shape[:2]) != (batch, frames):
            raise ValueError(f"camera matrices {tuple(camera.P.shape)} do not match batch {batch} x {frames} frames")

    @staticmethod
    def _own_context_kv(
        k: Tensor, v: Tensor, tokens_per_frame: int, rope: RopeTable, camera: CameraProjection
    ) -> LayerContextKV:
        """Both branches' K/V of these tokens, built directly in the branch-stacked layout [2B, heads, N, d]."""
        keys = torch.cat([apply_rope(k, rope), apply_frame_matrix(k, camera.P_inv, tokens_per_frame)])
        values = torch.cat([v, apply_frame_matrix(v, camera.P_inv, tokens_per_frame)])
        return LayerContextKV.from_stacked(keys, values)

    def image_kv(
        self, x: Tensor, frame_vec: Tensor, tokens_per_frame: int, rope: RopeTable, camera: CameraProjection
    ) -> LayerContextKV:
        """Only the K/V path of `image_forward` (what a context prefill caches for this block).

        x [B, T*HW, h]; frame_vec [B, T, h] -> LayerContextKV with tensors [B, heads, T*HW, d].
        """
        self._check_image_inputs(x, frame_vec, tokens_per_frame, rope, camera)
        shift1, scale1 = self._image_modulation(frame_vec)[:2]
        _, k, v = self._image_qkv(x, shift1, scale1, tokens_per_frame, need_q=False)
        return self._own_context_kv(k, v, tokens_per_frame, rope, camera)

    def image_forward(
        self,
        x: Tensor,
        frame_vec: Tensor,
        tokens_per_frame: int,
        rope: RopeTable,
        camera: CameraProjection,
        text_k: Tensor,
        text_v: Tensor,
        text_mask: Tensor | None = None,
        context: LayerContextKV | None = None,
        return_kv: bool = False,
        return_raw_kv: bool = False,
    ):
        """Image stream of one block; queries attend to [text ; context ; own] in the RoPE and ProPE branches.

        x [B, N=T*HW, h]; frame_vec [B, T, h]; text_k/v [B, heads, L, d]; text_mask [B, L] bool (True = valid) or
        None; context [B, heads, S, d] tensors or None. Returns x' [B, N, h] (and this call's LayerContextKV with
        `return_kv`, or its raw (k, v) [B, heads, N, d] - qk-normed K and V before RoPE and ProPE - with
        `return_raw_kv`).
        """
        self._check_image_inputs(x, frame_vec, tokens_per_frame, rope, camera)
        batch = x.shape[0]
        shift1, scale1, gate1, shift2, scale2, gate2 = self._image_modulation(frame_vec)
        q, k, v = self._image_qkv(x, shift1, scale1, tokens_per_frame, need_q=True)
        own = self._own_context_kv(k, v, tokens_per_frame, rope, camera)
        # 1. Both branches in one attention call: the branch is stacked on the batch axis (RoPE rows first).
        queries = torch.cat([apply_rope(q, rope), apply_frame_matrix(q, camera.P.transpose(-1, -2), tokens_per_frame)])
        parts = [(text_k.repeat(2, 1, 1, 1), text_v.repeat(2, 1, 1, 1))]
        if context is not None:
            parts.append(context.stacked())
        parts.append(own.stacked())
        keys = torch.cat([key for key, _ in parts], dim=2)
        values = torch.cat([value for _, value in parts], dim=2)
        attn_mask = None
        if text_mask is not None:
            always_valid = torch.ones(batch, keys.shape[2] - text_k.shape[2], dtype=torch.bool, device=x.device)
            attn_mask = torch.cat([text_mask.bool(), always_valid], dim=1).repeat(2, 1)[:, None, None, :]
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attn_mask)
        if RELEASE_ATTENTION_INPUTS:
            # Drop the attention inputs now (references only: what SDPA saved for its backward stays), so that they
            # are not alive through the MLP half, in the forward and in a checkpoint's recompute.
            queries = keys = values = parts = attn_mask = q = None
            if not return_kv:
                own = None
            if not return_raw_kv:
                k = v = None
        attn_rope, attn_prope = attn[:batch], attn[batch:]
        attn_prope = apply_frame_matrix(attn_prope, camera.P, tokens_per_frame)
        # 2. Gated residuals with per-frame gates.
        update = self.img_attn_proj(merge_heads(attn_rope)) + self.img_attn_prope_proj(merge_heads(attn_prope))
        frames = frame_vec.shape[1]
        x = self._per_frame(x, frames, tokens_per_frame) + gate1 * self._per_frame(update, frames, tokens_per_frame)
        x = x + gate2 * self.img_mlp(modulate(layer_norm_no_affine(x), shift2, scale2))
        x = x.flatten(1, 2)
        if return_raw_kv:
            return x, (k, v)
        return (x, own) if return_kv else x
