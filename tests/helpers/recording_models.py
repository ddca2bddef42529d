"""Stand-ins that a test passes wherever the package takes a Teacher or a Predictor: each calls the real model and
keeps what it was called with, so a test observes the calls without patching the model or a package class."""

from __future__ import annotations

import torch


class RecordingTeacher:
    """The real Teacher behind every attribute; the calls of the methods named in `record` (e.g. "chunk_step",
    "context_prefill") are kept in order in `calls[name]` as {"args", "kwargs", "output", "grad_enabled"}. Only the
    calls made through this object are seen: the Teacher's calls of its own methods are not."""

    def __init__(self, teacher, *record: str):
        self.teacher = teacher
        self.calls: dict[str, list[dict]] = {name: [] for name in record}

    def __getattr__(self, name: str):
        attribute = getattr(self.teacher, name)
        if name not in self.calls:
            return attribute

        def recorded(*args, **kwargs):
            output = attribute(*args, **kwargs)
            self.calls[name].append({"args": args, "kwargs": kwargs, "output": output,
                                     "grad_enabled": torch.is_grad_enabled()})
            return output

        return recorded


class RecordingPredictor(torch.nn.Module):
    """Calls the real Predictor and keeps every call's arguments and outputs (the objects themselves)."""

    def __init__(self, predictor):
        super().__init__()
        self.inner = predictor
        self.calls: list[dict] = []

    @property
    def variant(self):
        return self.inner.variant

    @property
    def source_blocks(self):
        return self.inner.source_blocks

    def forward(self, *args, **kwargs):
        outputs = self.inner(*args, **kwargs)
        self.calls.append({"args": args, "kwargs": kwargs, "outputs": outputs})
        return outputs


def frame_indices(model_input: torch.Tensor, history: torch.Tensor) -> list[int]:
    """The frames of `history` [1, C, T, H, W] that a model call's input [1, 2C+1, n, H, W] (latents | condition)
    holds, in order: each of its n frames is found by its latents (ValueError if one is in no frame)."""
    channels = history.shape[1]
    indices = []
    for frame in model_input[0, :channels].unbind(1):
        matches = [index for index in range(history.shape[2]) if torch.equal(frame, history[0, :, index].to(frame))]
        if len(matches) != 1:
            raise ValueError(f"a frame of the call's input matches {len(matches)} frames of the history")
        indices.append(matches[0])
    return indices
