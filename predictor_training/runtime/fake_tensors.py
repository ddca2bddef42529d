"""Fake-tensor helpers that production code uses so that a memory rehearsal (runtime/memory_rehearsal.py) can run it
on fake tensors: host work on real values, modules built in a chosen dtype."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


@contextlib.contextmanager
def real_values():
    """Run a block on real CPU tensors inside a rehearsal (the fake mode and the tracker are set aside): for small
    value-dependent host work whose result decides shapes (e.g. the rollout's memory selection)."""
    with unset_fake_temporarily():
        yield


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Modules built inside get parameters of `dtype` (a fake module cannot be converted afterwards)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)

