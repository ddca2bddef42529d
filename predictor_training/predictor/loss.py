"""Predictor supervision loss (docs/offline.md § What is trained, and the loss): FP32 MSE on the velocity and on
the final hidden. The weights are the recipes' --velocity_weight / --hidden_weight flags."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def predictor_loss(
    pred_hidden: Tensor,
    pred_velocity: Tensor,
    target_hidden: Tensor,
    target_velocity: Tensor,
    *,
    velocity_weight: float,
    hidden_weight: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = velocity_weight * mse(v_pred, v_teacher) + hidden_weight * mse(h_pred, h_teacher), MSE in FP32.

    pred_hidden / target_hidden [B, N, D]; pred_velocity / target_velocity [B, C, T, H, W] (any dtype; both are
    upcast to float32 before the difference). Targets are stop-gradient labels by construction (they come from the
    Teacher or from disk); this function does not detach them. Returns (loss, metrics) where loss is a float32
    scalar with gradient and metrics {"loss", "hidden_mse", "velocity_mse"} are detached float32 scalars (no
    host sync here; convert with `float()` when logging).
    """
    for name, pred, target in (("hidden", pred_hidden, target_hidden), ("velocity", pred_velocity, target_velocity)):
        if pred.shape != target.shape:
            raise ValueError(f"{name}: prediction shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    hidden_mse = F.mse_loss(pred_hidden.float(), target_hidden.float())
    velocity_mse = F.mse_loss(pred_velocity.float(), target_velocity.float())
    loss = velocity_weight * velocity_mse + hidden_weight * hidden_mse
    metrics = {"loss": loss.detach(), "hidden_mse": hidden_mse.detach(), "velocity_mse": velocity_mse.detach()}
    return loss, metrics
