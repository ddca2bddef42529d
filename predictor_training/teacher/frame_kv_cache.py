"""Per-frame context K/V kept across chunks: the `incremental` and `last_step` context modes of the AR loop.

In the `exact` mode (the reference) every chunk re-runs the whole Teacher over its selected context frames to
rebuild their K/V. The other modes compute each frame's K/V once and re-use it whenever the frame is selected again:

    incremental   after a chunk is final, one Teacher pass over its frames at the context timestep, attending to the
                  chunk's own context (the one it was generated with) - `WorldPlayTransformer.frame_kv_pass`
    last_step     the K/V of the chunk's last Full Teacher step (no extra pass; the frames are then still noisy, at
                  that step's timestep)

Both store K/V in a position- and camera-free form (qk-normed K and V before RoPE and ProPE), so a later chunk can
place a frame at its compacted context position with its own camera (`WorldPlayTransformer.assemble_context_kv`).
The approximation: a frame's K/V come from the attention context it had when it was cached, not from the frames it
is selected with later (an exact prefill lets every context frame attend to every other).

Memory: one frame holds, per double block, K and V of heads x H*W x head_dim values each
(`FrameKVCache.bytes_per_frame`). Frames that no later chunk can select are never stored (the last chunk's).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

CONTEXT_MODES = ("exact", "incremental", "last_step")


def check_context_mode(mode: str) -> str:
    if mode not in CONTEXT_MODES:
        raise ValueError(f"context mode must be one of {CONTEXT_MODES}, got {mode!r}")
    return mode


def cache_bytes_per_frame(depth: int, hidden_size: int, tokens_per_frame: int, bytes_per_value: int) -> int:
    """Bytes of one cached frame over all layers: K and V of `hidden_size` values per token and layer."""
    return 2 * depth * tokens_per_frame * hidden_size * bytes_per_value


class FrameKVCache:
    """Raw K/V per latent frame and layer: `put` a chunk's frames, `gather` any selection of cached frames.

    Stored per frame: k, v [depth, heads, H*W, d] (the dtype they were computed in).
    """

    def __init__(self, depth: int, tokens_per_frame: int):
        self.depth = depth
        self.tokens_per_frame = tokens_per_frame
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def __contains__(self, frame: int) -> bool:
        return frame in self.keys

    @property
    def frames(self) -> list[int]:
        return sorted(self.keys)

    def put(self, frames: Sequence[int], raw_kv: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Store `frames` (in token order) from per-layer (k, v) [1, heads, len(frames)*H*W, d]."""
        if len(raw_kv) != self.depth:
            raise ValueError(f"raw K/V of {len(raw_kv)} layers for a cache of {self.depth}")
        count, tokens = len(frames), self.tokens_per_frame
        for name, store, index in (("k", self.keys, 0), ("v", self.values, 1)):
            stacked = torch.stack([layer[index][0] for layer in raw_kv])  # [depth, heads, n*HW, d]
            if stacked.shape[2] != count * tokens:
                raise ValueError(f"{name} holds {stacked.shape[2]} tokens for {count} frames x {tokens} tokens")
            per_frame = stacked.unflatten(2, (count, tokens)).detach()
            for position, frame in enumerate(frames):
                store[int(frame)] = per_frame[:, :, position].clone()

    def gather(self, frames: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
        """Per layer (k, v) [1, heads, len(frames)*H*W, d] of cached `frames`, in the given order."""
        missing = [frame for frame in frames if frame not in self.keys]
        if missing:
            raise KeyError(f"frames {missing} are not in the K/V cache (cached: {self.frames})")
        keys = torch.stack([self.keys[frame] for frame in frames], dim=2).flatten(2, 3)  # [depth, heads, n*HW, d]
        values = torch.stack([self.values[frame] for frame in frames], dim=2).flatten(2, 3)
        return [(keys[layer][None], values[layer][None]) for layer in range(self.depth)]

    def bytes_per_frame(self) -> int:
        if not self.keys:
            return 0
        sample = next(iter(self.keys.values()))
        return 2 * sample.numel() * sample.element_size()

    def total_bytes(self) -> int:
        return self.bytes_per_frame() * len(self.keys)
