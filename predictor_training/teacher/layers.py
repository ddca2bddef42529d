"""Building blocks of the WorldPlay-1.5 teacher (HunyuanVideo-1.5 backbone), with the upstream sub-module names.

Numerics follow the upstream model (see `predictor_training/conformance/golden/README.md`, sections 3-5):
* sinusoidal features, RMS qk-norm and RoPE are computed in float32 and cast back, as upstream does under bf16;
* LayerNorm eps is 1e-6 in the blocks, the refiner and the final layer, 1e-5 in `byt5_in` and `vision_in`;
* ProPE matrices are computed in the dtype the poses are given in (the model casts them to the compute dtype).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import CameraProjection, RopeTable

BLOCK_NORM_EPS = 1e-6
QK_NORM_EPS = 1e-6
SINUSOID_DIM = 256
SINUSOID_MAX_PERIOD = 10000.0
REFINER_DEPTH = 2


# ---------------------------------------------------------------------------------------------------------------
# 1. Small helpers
# ---------------------------------------------------------------------------------------------------------------
def layer_norm_no_affine(x: Tensor, eps: float = BLOCK_NORM_EPS) -> Tensor:
    """LayerNorm over the last axis without learnable parameters (the blocks' and final layer's norms)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def split_heads(x: Tensor, heads: int) -> Tensor:
    """[B, N, heads*d] -> [B, heads, N, d] (head i = channels [i*d, (i+1)*d))."""
    batch, tokens, width = x.shape
    return x.view(batch, tokens, heads, width // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """[B, heads, N, d] -> [B, N, heads*d]."""
    batch, heads, tokens, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


class RMSNorm(nn.Module):
    """Per-head RMS norm with a learnable weight `[d]`; normalised in float32, cast back, then scaled.

    The weight is cast to the input's dtype before the product, so the output keeps the input's dtype: with BF16
    activations and FP32 master weights (the Predictor's copied blocks under fp32master) q and k stay BF16 instead of
    being promoted to FP32 (and, with them, the whole key concatenation of the block's attention: 9.4 GiB at the v4
    offline peak). Where weight and input share a dtype (the Teacher, every fp32 run) nothing changes.
    """

    def __init__(self, dim: int, eps: float = QK_NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight.to(x.dtype)


class MLP(nn.Module):
    """fc1 -> activation -> fc2 (keys `fc1`, `fc2`)."""

    def __init__(self, width: int, hidden_width: int, activation: nn.Module, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden_width, bias=bias)
        self.act = activation
        self.fc2 = nn.Linear(hidden_width, width, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


# ---------------------------------------------------------------------------------------------------------------
# 2. Embedders
# ---------------------------------------------------------------------------------------------------------------
def timestep_sinusoid(values: Tensor, dim: int = SINUSOID_DIM, max_period: float = SINUSOID_MAX_PERIOD) -> Tensor:
    """[N] scalars -> [N, dim] float32 `[cos(v f_0..f_{dim/2-1}), sin(...)]`, f_k = exp(-ln(max_period) k / (dim/2))."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=values.device) / half
    )
    args = values.reshape(-1, 1).float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """Sinusoid(256) -> Linear -> SiLU -> Linear (keys `mlp.0`, `mlp.2`). Used for timesteps and action labels."""

    def __init__(self, hidden_size: int, frequency_dim: int = SINUSOID_DIM):
        super().__init__()
        self.frequency_dim = frequency_dim
        self.mlp = nn.Sequential(
            nn.Linear(frequency_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, values: Tensor) -> Tensor:
        """values [N] (float; timesteps in 0..1000 or integer action labels) -> [N, hidden]."""
        features = timestep_sinusoid(values, self.frequency_dim).to(self.mlp[0].weight.dtype)
        return self.mlp(features)


class PatchEmbed(nn.Module):
    """`img_in`: Conv3d with kernel = stride = patch [1, 1, 1], applied as a per-voxel linear map (key `proj`)."""

    def __init__(self, in_channels: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Conv3d(in_channels, hidden_size, kernel_size=1, stride=1)

    def forward(self, x: Tensor) -> Tensor:
        """[B, C_in, T, H, W] -> [B, T*H*W, hidden], tokens in (frame, row, column) order."""
        batch, channels, frames, height, width = x.shape
        if channels != self.proj.in_channels:
            raise ValueError(f"img_in expects {self.proj.in_channels} input channels, got {channels}")
        tokens = x.permute(0, 2, 3, 4, 1).reshape(batch, frames * height * width, channels)
        return F.linear(tokens, self.proj.weight.flatten(1), self.proj.bias)


class TextContextEmbedder(nn.Module):
    """`txt_in.c_embedder`: linear_1 -> SiLU -> linear_2 on the pooled text states."""

    def __init__(self, in_dim: int, hidden_size: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden_size)
        self.act_1 = nn.SiLU()
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(self.act_1(self.linear_1(x)))


class ByT5Mapper(nn.Module):
    """`byt5_in`: LayerNorm(eps 1e-5) -> fc1 -> GELU -> fc2 -> GELU -> fc3 (exact GELU)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.layernorm = nn.LayerNorm(in_dim)
        self.fc1 = nn.Linear(in_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, hidden_dim)
        self.fc3 = nn.Linear(hidden_dim, out_dim)
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        """[B, L, in_dim] -> [B, L, out_dim]."""
        return self.fc3(self.act(self.fc2(self.act(self.fc1(self.layernorm(x))))))


class VisionProjection(nn.Module):
    """`vision_in`: proj = LayerNorm -> Linear -> GELU -> Linear -> LayerNorm (indices 0, 1, 2, 3, 4)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Sequential(
            nn.LayerNorm(in_dim),
            nn.Linear(in_dim, in_dim),
            nn.GELU(),
            nn.Linear(in_dim, out_dim),
            nn.LayerNorm(out_dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


# ---------------------------------------------------------------------------------------------------------------
# 3. Token refiner (`txt_in`)
# ---------------------------------------------------------------------------------------------------------------
class RefinerBlock(nn.Module):
    """One `IndividualTokenRefinerBlock`: gated self-attention and gated SiLU MLP, conditioned on `c`."""

    def __init__(self, hidden_size: int, heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden_size, eps=BLOCK_NORM_EPS)
        self.self_attn_qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=qkv_bias)
        self.self_attn_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.norm2 = nn.LayerNorm(hidden_size, eps=BLOCK_NORM_EPS)
        self.mlp = MLP(hidden_size, int(hidden_size * mlp_ratio), nn.SiLU())
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, c: Tensor, key_mask: Tensor, query_valid: Tensor) -> Tensor:
        """x [B, L, h]; c [B, h]; key_mask [B, 1, 1, L] bool; query_valid [B, L, 1] (rows set to 0 after attention)."""
        gate_msa, gate_mlp = self.adaLN_modulation(c).unsqueeze(1).chunk(2, dim=-1)
        q, k, v = self.self_attn_qkv(self.norm1(x)).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(
            split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads), attn_mask=key_mask
        )
        # A padded query row is fully masked upstream and comes out as 0; we let it see the valid keys (so it can
        # never be NaN) and zero it afterwards, which gives the same values.
        attn = merge_heads(attn) * query_valid
        x = x + gate_msa * self.self_attn_proj(attn)
        return x + gate_mlp * self.mlp(self.norm2(x))


class IndividualTokenRefiner(nn.Module):
    def __init__(self, hidden_size: int, heads: int, mlp_ratio: float, qkv_bias: bool, depth: int = REFINER_DEPTH):
        super().__init__()
        self.blocks = nn.ModuleList([RefinerBlock(hidden_size, heads, mlp_ratio, qkv_bias) for _ in range(depth)])

    def forward(self, x: Tensor, c: Tensor, mask: Tensor) -> Tensor:
        """x [B, L, h]; c [B, h]; mask [B, L] bool with position 0 already forced valid."""
        key_mask = mask[:, None, None, :]
        query_valid = mask[:, :, None].to(x.dtype)
        for block in self.blocks:
            x = block(x, c, key_mask, query_valid)
        return x


class SingleTokenRefiner(nn.Module):
    """`txt_in`: refines the LLM text states, conditioned on the text timestep and the pooled text."""

    def __init__(self, in_dim: int, hidden_size: int, heads: int, mlp_ratio: float, qkv_bias: bool):
        super().__init__()
        self.input_embedder = nn.Linear(in_dim, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.c_embedder = TextContextEmbedder(in_dim, hidden_size)
        self.individual_token_refiner = IndividualTokenRefiner(hidden_size, heads, mlp_ratio, qkv_bias)

    def forward(self, text_states: Tensor, timestep: Tensor, mask: Tensor) -> Tensor:
        """text_states [B, L, D]; timestep [B]; mask [B, L] (1 = valid) -> [B, L, hidden] for every position."""
        mask = mask.bool()
        if not bool(mask.any(dim=1).all()):
            raise ValueError("txt_in: every sample needs at least one valid text token (the pooled text is a mean)")
        mask_float = mask.float().unsqueeze(-1)
        pooled = (text_states * mask_float).sum(dim=1) / mask_float.sum(dim=1)
        c = self.t_embedder(timestep) + self.c_embedder(pooled)
        x = self.input_embedder(text_states)
        attention_mask = mask.clone()
        attention_mask[:, 0] = True  # upstream forces token 0 valid inside the refiner attention
        return self.individual_token_refiner(x, c, attention_mask)


# ---------------------------------------------------------------------------------------------------------------
# 4. Final layer
# ---------------------------------------------------------------------------------------------------------------
class FinalLayer(nn.Module):
    """Non-affine LayerNorm modulated by (shift, scale) = adaLN_modulation(vec), then `linear` to the patch channels."""

    def __init__(self, hidden_size: int, out_channels: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: Tensor, frame_vec: Tensor, tokens_per_frame: int) -> Tensor:
        """x [B, T*HW, h]; frame_vec [B, T, h] -> [B, T*HW, out]."""
        batch, tokens, width = x.shape
        frames = frame_vec.shape[1]
        shift, scale = self.adaLN_modulation(frame_vec).unsqueeze(2).chunk(2, dim=-1)
        x = modulate(layer_norm_no_affine(x).view(batch, frames, tokens_per_frame, width), shift, scale)
        return self.linear(x.view(batch, tokens, width))


# ---------------------------------------------------------------------------------------------------------------
# 5. RoPE (3-D, adjacent channel pairs)
# ---------------------------------------------------------------------------------------------------------------
def build_rope_table(
    num_frames: int, height: int, width: int, start: int, rope_dim_list, theta: float, device=None
) -> RopeTable:
    """cos/sin `[T*H*W, sum(rope_dim_list)]` float32 for temporal positions start..start+T-1, rows y, columns x."""
    positions = (
        torch.arange(start, start + num_frames, dtype=torch.float32, device=device),
        torch.arange(height, dtype=torch.float32, device=device),
        torch.arange(width, dtype=torch.float32, device=device),
    )
    grid = torch.meshgrid(*positions, indexing="ij")
    cos_parts, sin_parts = [], []
    for axis_dim, axis_pos in zip(rope_dim_list, grid):
        freqs = 1.0 / (
            theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32, device=device)[: axis_dim // 2] / axis_dim)
        )
        angles = torch.outer(axis_pos.reshape(-1), freqs)
        cos_parts.append(angles.cos().repeat_interleave(2, dim=1))
        sin_parts.append(angles.sin().repeat_interleave(2, dim=1))
    return RopeTable(torch.cat(cos_parts, dim=1), torch.cat(sin_parts, dim=1), start)


def apply_rope(x: Tensor, rope: RopeTable) -> Tensor:
    """x [B, heads, N, d]: rotate each adjacent pair (a, b) -> (a cos - b sin, b cos + a sin), in float32."""
    x32 = x.float()
    pairs = x32.unflatten(-1, (-1, 2))
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return (x32 * rope.cos + rotated * rope.sin).type_as(x)


# ---------------------------------------------------------------------------------------------------------------
# 6. ProPE (projective camera encoding)
# ---------------------------------------------------------------------------------------------------------------
def build_camera_projection(viewmats: Tensor, Ks: Tensor) -> CameraProjection:
    """viewmats [B, T, 4, 4] (world-to-camera), Ks [B, T, 3, 3] (normalised) -> P, P_inv in the inputs' dtype.

    The principal point is dropped: P = diag(fx, fy, 1, 1) @ w2c, P_inv = SE3inv(w2c) @ diag(1/fx, 1/fy, 1, 1).
    """
    if viewmats.shape[-2:] != (4, 4) or Ks.shape[-2:] != (3, 3) or viewmats.shape[:-2] != Ks.shape[:-2]:
        raise ValueError(
            f"camera inputs must be viewmats [B, T, 4, 4] and Ks [B, T, 3, 3], got {tuple(viewmats.shape)} and "
            f"{tuple(Ks.shape)}"
        )
    Ks = Ks.to(viewmats.dtype)
    ones = torch.ones_like(Ks[..., 0, 0])
    focal = torch.stack([Ks[..., 0, 0], Ks[..., 1, 1], ones, ones], dim=-1)  # [B, T, 4]
    inv_focal = torch.stack([1.0 / Ks[..., 0, 0], 1.0 / Ks[..., 1, 1], ones, ones], dim=-1)
    P = focal.unsqueeze(-1) * viewmats
    rotation_t = viewmats[..., :3, :3].transpose(-1, -2)
    translation = -(rotation_t @ viewmats[..., :3, 3:4])
    bottom = torch.zeros_like(viewmats[..., 3:4, :])
    bottom[..., 3] = 1
    se3_inverse = torch.cat([torch.cat([rotation_t, translation], dim=-1), bottom], dim=-2)
    P_inv = se3_inverse * inv_focal.unsqueeze(-2)
    return CameraProjection(P, P_inv)


def apply_frame_matrix(x: Tensor, matrix: Tensor, tokens_per_frame: int) -> Tensor:
    """Multiply each 4-vector u of every head vector by the matrix of its token's frame: u -> matrix @ u.

    x [B, heads, T*HW, d]; matrix [B, T, 4, 4] -> [B, heads, T*HW, d].
    """
    batch, heads, tokens, head_dim = x.shape
    frames = matrix.shape[1]
    if frames * tokens_per_frame != tokens:
        raise ValueError(f"{tokens} tokens do not split into {frames} frames x {tokens_per_frame} tokens")
    blocks = x.reshape(batch, heads, frames, tokens_per_frame * head_dim // 4, 4)
    # Row-vector form: (M u)^T = u^T M^T.
    out = blocks @ matrix.transpose(-1, -2).unsqueeze(1).to(x.dtype)
    return out.reshape(batch, heads, tokens, head_dim)
