"""predictor_loss (predictor_training/predictor/loss.py): the weighted FP32 MSE of the
velocity and hidden terms."""

from __future__ import annotations

import pytest
import torch

from predictor_training.predictor.loss import predictor_loss


WEIGHTS = {"velocity_weight": 1.0, "hidden_weight": 0.1}  # the recipes' defaults


def test_predictor_loss_matches_weighted_fp32_mse():
    gen = torch.Generator().manual_seed(20)
    pred_h, target_h = torch.randn(2, 6, 8, generator=gen), torch.randn(2, 6, 8, generator=gen)
    pred_v, target_v = torch.randn(2, 4, 4, 2, 3, generator=gen), torch.randn(2, 4, 4, 2, 3, generator=gen)
    pred_h.requires_grad_(True)
    loss, metrics = predictor_loss(pred_h, pred_v, target_h, target_v, **WEIGHTS)
    hidden_mse = ((pred_h.detach() - target_h) ** 2).mean()
    velocity_mse = ((pred_v - target_v) ** 2).mean()
    torch.testing.assert_close(metrics["hidden_mse"], hidden_mse)
    torch.testing.assert_close(metrics["velocity_mse"], velocity_mse)
    torch.testing.assert_close(loss.detach(), velocity_mse + 0.1 * hidden_mse)
    torch.testing.assert_close(metrics["loss"], loss.detach())
    assert all(not value.requires_grad for value in metrics.values())
    loss.backward()
    torch.testing.assert_close(pred_h.grad, 0.1 * 2 * (pred_h.detach() - target_h) / pred_h.numel())
    # custom weights; BF16 inputs give an FP32 loss computed from the upcast values
    loss2, _ = predictor_loss(
        pred_h.bfloat16(), pred_v.bfloat16(), target_h, target_v, hidden_weight=0.5, velocity_weight=2.0
    )
    expected = 2.0 * ((pred_v.bfloat16().float() - target_v) ** 2).mean() + 0.5 * (
        (pred_h.detach().bfloat16().float() - target_h) ** 2
    ).mean()
    assert loss2.dtype == torch.float32
    torch.testing.assert_close(loss2.detach(), expected)
    with pytest.raises(ValueError, match="velocity"):
        predictor_loss(pred_h, pred_v[:, :2], target_h, target_v, **WEIGHTS)
