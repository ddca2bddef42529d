"""Precision modes of a run (`--precision`) and the two small device helpers every forward pass uses.

* "fp32master" (the real recipe): frozen Teacher weights in BF16, trainable Predictor weights and the AdamW moments
  in FP32, forwards under BF16 autocast, losses in FP32.
* "fp32": everything in FP32, no autocast (the CPU demo and the exact tests).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32master", "fp32")


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """`torch.autocast` on `device`'s type with `dtype`; a null context when `dtype` is None or FP32."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def synchronize(device: torch.device | str) -> None:
    """Wait for queued CUDA work on `device` (so a timer measures it); nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class PrecisionPolicy:
    """name: "fp32master" | "fp32"; frozen_dtype: dtype of the frozen Teacher weights; autocast_dtype: the forward's
    autocast dtype (None = no autocast). Trainable weights are always FP32 (`build_optimizer` checks)."""

    name: str
    frozen_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    device: torch.device

    def autocast(self):
        """Context for the forward passes (a null context in "fp32")."""
        return autocast(self.device, self.autocast_dtype)

    def describe(self) -> str:
        """e.g. "fp32master (frozen bfloat16, trainable float32, autocast bfloat16)"."""
        def name(dtype: torch.dtype) -> str:
            return str(dtype).removeprefix("torch.")

        mixed = "no autocast" if self.autocast_dtype is None else f"autocast {name(self.autocast_dtype)}"
        return f"{self.name} (frozen {name(self.frozen_dtype)}, trainable float32, {mixed})"


def precision_policy(name: str, device: torch.device) -> PrecisionPolicy:
    """The dtypes of a `--precision` mode on `device` (BF16 autocast also runs on the CPU, slowly)."""
    if name == "fp32master":
        return PrecisionPolicy(name, torch.bfloat16, torch.bfloat16, device)
    if name == "fp32":
        return PrecisionPolicy(name, torch.float32, None, device)
    raise ValueError(f"--precision={name!r}: expected one of {PRECISIONS}")
