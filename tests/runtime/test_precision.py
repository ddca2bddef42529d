"""Precision modes (predictor_training/runtime/precision.py): the dtypes of "fp32master" and "fp32", what their
autocast does to a forward, and the refusal of an unknown mode."""

from __future__ import annotations

import pytest
import torch

from predictor_training.runtime.precision import PRECISIONS, autocast, precision_policy, synchronize

CPU = torch.device("cpu")


def test_fp32master_freezes_in_bf16_and_autocasts_the_forward():
    policy = precision_policy("fp32master", CPU)
    assert (policy.frozen_dtype, policy.autocast_dtype, policy.device) == (torch.bfloat16, torch.bfloat16, CPU)
    assert policy.describe() == "fp32master (frozen bfloat16, trainable float32, autocast bfloat16)"
    layer = torch.nn.Linear(4, 3)
    with policy.autocast():
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32


def test_fp32_runs_everything_in_float32():
    policy = precision_policy("fp32", CPU)
    assert (policy.frozen_dtype, policy.autocast_dtype) == (torch.float32, None)
    assert policy.describe() == "fp32 (frozen float32, trainable float32, no autocast)"
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with policy.autocast():
        out = layer(x)
    assert out.dtype == torch.float32 and torch.equal(out, layer(x))


def test_every_listed_mode_has_a_policy_and_others_are_refused():
    assert [precision_policy(name, CPU).name for name in PRECISIONS] == list(PRECISIONS)
    with pytest.raises(ValueError, match=r"--precision='bf16': expected one of \('fp32master', 'fp32'\)"):
        precision_policy("bf16", CPU)


def test_autocast_helper_is_a_null_context_for_float32_and_none():
    x, weight = torch.randn(2, 3), torch.randn(3, 3)
    for dtype in (None, torch.float32):
        with autocast(CPU, dtype):
            assert (x @ weight).dtype == torch.float32
    with autocast("cpu", torch.bfloat16):
        assert (x @ weight).dtype == torch.bfloat16
    synchronize(CPU)  # nothing to wait for on the CPU (and no CUDA call)
