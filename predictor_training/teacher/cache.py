"""Small containers passed between the teacher's AR calls and its building blocks.

Layouts follow the upstream AR KV cache: `[B, heads, tokens, head_dim]`. The upstream cache keeps the two attention
branches stacked along the batch axis (`[2, heads, S, d]`, entry 0 = RoPE, entry 1 = ProPE), and so does
`LayerContextKV` (its `rope_k` / `prope_k` / `rope_v` / `prope_v` are views of the stacked pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor


def _move(tensor: Tensor, device, dtype) -> Tensor:
    return tensor.to(device=device, dtype=dtype)


@dataclass
class TextKV:
    """Per-layer text keys/values of the text prefill.

    `k[i]`, `v[i]`: `[B, heads, L_txt, head_dim]` for double block i (K after qk-norm, no RoPE; V raw).
    `mask`: optional `[B, L_txt]` bool (True = valid token); None means every token is valid (the AR case).
    """

    k: list[Tensor]
    v: list[Tensor]
    mask: Tensor | None = None

    def __post_init__(self):
        if len(self.k) != len(self.v):
            raise ValueError(f"TextKV: {len(self.k)} key tensors but {len(self.v)} value tensors")

    @classmethod
    def from_layer_stack(cls, text_k: Tensor, text_v: Tensor, device=None, dtype=None) -> "TextKV":
        """Stored text K/V of every layer, `[depth, heads, L_txt, head_dim]` each (a case file's `text_k` /
        `text_v`, padding already removed) -> a TextKV with `[1, heads, L_txt, head_dim]` per layer."""
        for name, tensor in (("text_k", text_k), ("text_v", text_v)):
            if tensor.dim() != 4:
                raise ValueError(f"{name} must be [depth, heads, L_txt, head_dim], got {tuple(tensor.shape)}")
        return cls([_move(layer[None], device, dtype) for layer in text_k],
                   [_move(layer[None], device, dtype) for layer in text_v])

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_tokens(self) -> int:
        return self.k[0].shape[2]

    def layer(self, index: int) -> tuple[Tensor, Tensor]:
        return self.k[index], self.v[index]

    def to(self, device=None, dtype=None) -> "TextKV":
        mask = None if self.mask is None else self.mask.to(device=device)
        return TextKV([_move(t, device, dtype) for t in self.k], [_move(t, device, dtype) for t in self.v], mask)

    def select(self, layers: Sequence[int]) -> "TextKV":
        """Keep only `layers`, in that order: entry j of the result is layer `layers[j]`."""
        return TextKV([self.k[i] for i in layers], [self.v[i] for i in layers], self.mask)


@dataclass
class LayerContextKV:
    """Context (memory) K/V of one double block in the branch-stacked layout: k, v `[2B, heads, S, head_dim]`, the
    first B rows the RoPE branch, the last B the ProPE branch (the upstream AR cache's layout).

    rope_k: qk-normed K with RoPE at the context positions; rope_v: raw V; prope_k / prope_v: qk-normed K / raw V
    multiplied by P^-1 of their frame (no RoPE): views `[B, heads, S, head_dim]` of k and v, nothing copied (clone
    them before saving them as separate safetensors entries).

    Only the two stacked tensors are fields: FSDP2 wraps every tensor of its forwards' (dataclass) arguments in one
    autograd node and fills the gradient of each wrapped tensor the forward does not read with zeros, so four views
    next to the stacked pair cost two more context-sized copies per layer (zeros and a re-stacking) in a
    full-parameter run.
    """

    k: Tensor
    v: Tensor

    def __post_init__(self):
        if self.k.shape[0] % 2 or self.v.shape != self.k.shape:
            raise ValueError(
                f"stacked context K/V must have an even leading axis and equal shapes, got {tuple(self.k.shape)} "
                f"and {tuple(self.v.shape)}"
            )

    @property
    def num_tokens(self) -> int:
        return self.k.shape[2]

    @property
    def rope_k(self) -> Tensor:
        return self.k[: self.k.shape[0] // 2]

    @property
    def prope_k(self) -> Tensor:
        return self.k[self.k.shape[0] // 2 :]

    @property
    def rope_v(self) -> Tensor:
        return self.v[: self.v.shape[0] // 2]

    @property
    def prope_v(self) -> Tensor:
        return self.v[self.v.shape[0] // 2 :]

    @classmethod
    def from_stacked(cls, k_vision: Tensor, v_vision: Tensor) -> "LayerContextKV":
        """From the upstream layout `[2B, heads, S, d]` (first B rows = RoPE branch, last B rows = ProPE branch)."""
        return cls(k_vision, v_vision)

    @classmethod
    def from_branches(cls, rope_k: Tensor, rope_v: Tensor, prope_k: Tensor, prope_v: Tensor) -> "LayerContextKV":
        """From the four branch tensors `[B, heads, S, d]` (stacked here: one copy)."""
        return cls(torch.cat([rope_k, prope_k], dim=0), torch.cat([rope_v, prope_v], dim=0))

    def stacked(self) -> tuple[Tensor, Tensor]:
        """Upstream layout: (k, v) each `[2B, heads, S, d]`, RoPE branch first."""
        return self.k, self.v

    def to(self, device=None, dtype=None) -> "LayerContextKV":
        return LayerContextKV(_move(self.k, device, dtype), _move(self.v, device, dtype))


@dataclass
class ContextKV:
    """Context K/V of every double block plus the number of context frames it encodes."""

    layers: list[LayerContextKV]
    num_frames: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, index: int) -> LayerContextKV:
        return self.layers[index]

    def to(self, device=None, dtype=None) -> "ContextKV":
        return ContextKV([layer.to(device, dtype) for layer in self.layers], self.num_frames)

    def select(self, layers: Sequence[int]) -> "ContextKV":
        """Keep only `layers`, in that order: entry j of the result is layer `layers[j]`."""
        return ContextKV([self.layers[i] for i in layers], self.num_frames)


class RecomputedContextKV(ContextKV):
    """A context read without a graph whose K/V can be dropped after the forward that read them and rebuilt, with
    the same values, when the backward recomputes a block checkpoint that reads them.

    A block checkpoint keeps its inputs, the layer's context K/V among them, until its backward; at the real config
    a 20-frame context of 54 layers is 25.7 GiB held from a chunk's forward to its backward. Here each layer is a
    handle (`stacked()` as `LayerContextKV`'s) that reads the K/V from this object, so `release()` frees them all
    and the first recompute that reads a layer calls `rebuild()` (the same no-grad context prefill) once for all.
    A rebuilt layer is handed over at its read (each block's recompute reads its layer once), so nothing of the
    rebuild outlives the backward: the graph that keeps this object after the backward keeps no K/V (a second read
    of a handed-over layer rebuilds again).
    """

    def __init__(self, context: ContextKV, rebuild: Callable[[], ContextKV]):
        store = _RecomputedStore(list(context.layers), context.num_frames, rebuild)
        # The handles hold the store, not this object: no reference cycle, so a context dropped by its last holder
        # frees its K/V at once instead of at the next garbage collection.
        super().__init__([_RecomputedLayer(store, index) for index in range(context.num_layers)], context.num_frames)
        self._store = store

    @property
    def rebuilds(self) -> int:
        return self._store.rebuilds

    def release(self) -> None:
        """Drop the K/V (references held elsewhere, e.g. by a graph, stay alive)."""
        self._store.kv = None

    def layer_kv(self, index: int) -> LayerContextKV:
        return self._store.layer_kv(index)

    def to(self, device=None, dtype=None) -> ContextKV:
        return ContextKV([self.layer_kv(i).to(device, dtype) for i in range(self.num_layers)], self.num_frames)

    def select(self, layers: Sequence[int]) -> ContextKV:
        return ContextKV([self.layer_kv(i) for i in layers], self.num_frames)


class _RecomputedStore:
    """The K/V of a `RecomputedContextKV` and how to rebuild them (see there)."""

    def __init__(self, kv: list[LayerContextKV], num_frames: int, rebuild: Callable[[], ContextKV]):
        self.kv: list[LayerContextKV | None] | None = kv
        self.num_layers, self.num_frames = len(kv), num_frames
        self.rebuild = rebuild
        self.rebuilt = False
        self.rebuilds = 0

    def layer_kv(self, index: int) -> LayerContextKV:
        if self.kv is None or self.kv[index] is None:
            rebuilt = self.rebuild()
            if rebuilt.num_layers != self.num_layers or rebuilt.num_frames != self.num_frames:
                raise RuntimeError(f"the rebuilt context has {rebuilt.num_layers} layers of {rebuilt.num_frames} "
                                   f"frames, the released one {self.num_layers} of {self.num_frames}")
            self.kv, self.rebuilt = list(rebuilt.layers), True
            self.rebuilds += 1
        layer = self.kv[index]
        if self.rebuilt:
            self.kv[index] = None
        return layer


class _RecomputedLayer:
    """One layer of a `RecomputedContextKV`: holds no tensor, so a checkpoint that keeps it keeps no K/V."""

    def __init__(self, store: _RecomputedStore, index: int):
        self.store, self.index = store, index

    def stacked(self) -> tuple[Tensor, Tensor]:
        return self.store.layer_kv(self.index).stacked()


@dataclass
class RopeTable:
    """3-D RoPE table for `num_frames x height x width` tokens in (frame, row, column) order.

    cos, sin: `[T*H*W, head_dim]` float32, each value repeated for the two channels of its adjacent pair.
    """

    cos: Tensor
    sin: Tensor
    start: int = 0

    def to(self, device=None) -> "RopeTable":
        return RopeTable(self.cos.to(device=device), self.sin.to(device=device), self.start)


@dataclass
class CameraProjection:
    """Per-frame ProPE matrices, `[B, T, 4, 4]` each.

    P = lift(K with the principal point dropped) @ w2c; P_inv = SE3inv(w2c) @ lift(K^-1).
    """

    P: Tensor
    P_inv: Tensor

    @property
    def num_frames(self) -> int:
        return self.P.shape[1]


@dataclass
class ChunkOutput:
    """Output of `WorldPlayTransformer.chunk_step(..., return_final_hidden=True)`.

    velocity `[1, C, T, H, W]`; final_hidden `[1, T*H*W, hidden]` (input of the final layer); vec `[T, hidden]`;
    raw_kv (with `return_raw_kv`): per double block the chunk tokens' (k, v) `[1, heads, T*H*W, d]` before RoPE/ProPE.
    """

    velocity: Tensor
    final_hidden: Tensor
    vec: Tensor
    raw_kv: list[tuple[Tensor, Tensor]] | None = None
