"""The fake-tensor helpers (predictor_training/runtime/fake_tensors.py) that production code runs under a memory
rehearsal."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from predictor_training.runtime.fake_tensors import default_dtype, real_values


def test_real_values_makes_real_tensors_inside_a_fake_mode():
    with FakeTensorMode():
        assert isinstance(torch.zeros(2), FakeTensor)
        with real_values():
            real = torch.arange(3)
        assert isinstance(torch.zeros(2), FakeTensor)
    assert not isinstance(real, FakeTensor)
    assert real.tolist() == [0, 1, 2]


def test_default_dtype_builds_in_the_dtype_and_restores_the_previous_one():
    before = torch.get_default_dtype()
    with default_dtype(torch.bfloat16):
        assert torch.nn.Linear(2, 2).weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == before
