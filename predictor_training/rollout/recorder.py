"""What a recorded rollout keeps: every chunk's context, every step's latents, velocity and hidden state
(`TrajectoryRecorder`, handed to `ARRollout` as its `recorder`; `ar_rollout.record_rollout` runs a recorded F-F-F-F
rollout for the dataset builder and the trajectory conformance check)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from predictor_training.rollout.policy import ChunkContext


@dataclass
class StepRecord:
    """latent_in / velocity / latent_out [1, C, 4, H, W]; timestep [4]; final_hidden [1, 4*H*W, hidden] or None."""

    latent_in: Tensor
    timestep: Tensor
    velocity: Tensor
    final_hidden: Tensor | None
    latent_out: Tensor


@dataclass
class ChunkRecord:
    """Everything recorded for one chunk (see ``TrajectoryRecorder``)."""

    chunk_index: int
    frame_start: int
    ctx_indices: list[int]
    ctx_input: Tensor | None
    ctx_vec: Tensor | None
    prefeatures: dict[int, Tensor]
    steps: list[StepRecord] = field(default_factory=list)
    final_latent: Tensor | None = None


class TrajectoryRecorder:
    """Keeps every chunk's record, moved to ``device`` and (for floating tensors) cast to ``dtype`` if given.

    ``chunks[c]``: ChunkRecord with ctx_indices, ctx_input [1, 2C+1, n, H, W], ctx_vec [n, hidden],
    prefeatures {layer: [1, n*H*W, hidden]}, steps[k] (StepRecord) and final_latent [1, C, 4, H, W].
    """

    def __init__(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self.chunks: list[ChunkRecord] = []

    def _keep(self, tensor: Tensor | None) -> Tensor | None:
        if tensor is None:
            return None
        dtype = self.dtype if (self.dtype is not None and tensor.is_floating_point()) else tensor.dtype
        return tensor.detach().to(device=self.device, dtype=dtype, copy=True)

    def on_context(self, chunk_index: int, frame_start: int, context: ChunkContext) -> None:
        if len(self.chunks) != chunk_index:
            raise RuntimeError(f"recorder got chunk {chunk_index} after {len(self.chunks)} chunks")
        self.chunks.append(
            ChunkRecord(
                chunk_index=chunk_index,
                frame_start=frame_start,
                ctx_indices=list(context.indices),
                ctx_input=self._keep(context.model_input),
                ctx_vec=self._keep(context.vec),
                prefeatures={layer: self._keep(value) for layer, value in sorted(context.prefeatures.items())},
            )
        )

    def on_step(self, chunk_index: int, step_index: int, step: StepRecord) -> None:
        record = self.chunks[chunk_index]
        if len(record.steps) != step_index:
            raise RuntimeError(f"recorder got step {step_index} of chunk {chunk_index} out of order")
        record.steps.append(StepRecord(*(self._keep(getattr(step, name)) for name in StepRecord.__dataclass_fields__)))

    def on_chunk_end(self, chunk_index: int, final_latent: Tensor) -> None:
        self.chunks[chunk_index].final_latent = self._keep(final_latent)
