"""The Teacher's layers (predictor_training/teacher/layers.py): RMSNorm keeps the input's dtype
and the former FP32 values."""

from __future__ import annotations

import torch


# ---- the memory cuts keep the values -------------------------------------------------------------------------------
def test_rms_norm_keeps_the_input_dtype_and_fp32_values():
    """RMSNorm's weight is cast to the input's dtype: a BF16 input with an FP32 (master) weight stays BF16 (no
    float32 promotion of q, k and the key concatenation); with one dtype the values are the former formula's, bit
    for bit."""
    from predictor_training.teacher.layers import RMSNorm

    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 8)
    x32 = x.float()
    former = (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + norm.eps)).type_as(x) * norm.weight
    assert torch.equal(norm(x), former)
    assert norm(x.bfloat16()).dtype == torch.bfloat16
