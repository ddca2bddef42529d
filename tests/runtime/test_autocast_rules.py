"""CUDA's autocast rules emulated on the CPU (predictor_training/runtime/autocast_rules.py): the op lists (pinned to
torch's registrations) and the dtypes they give."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from predictor_training.runtime.autocast_rules import (
    AUTOCAST_TORCH_VERSION,
    PINNED_CPU_AUTOCAST_OPS,
    CudaAutocastRules,
    cuda_autocast_policies,
    emulated_ops,
    registered_autocast_ops,
)
from predictor_training.runtime.memory_tracker import MemoryTracker


def test_autocast_op_lists_are_torchs_own():
    """The emulation's CUDA policies cover exactly the ops torch registers at AutocastCUDA, and the CPU list is the
    pinned one: a torch upgrade that changes either fails here (re-check the lists against autocast_mode.h)."""
    assert torch.__version__.startswith(AUTOCAST_TORCH_VERSION)
    assert set(cuda_autocast_policies()) == registered_autocast_ops("AutocastCUDA")
    assert set(PINNED_CPU_AUTOCAST_OPS) == registered_autocast_ops("AutocastCPU")
    ops = emulated_ops()
    for name in ("layer_norm", "native_layer_norm", "pow.Tensor_Scalar", "exp", "rsqrt", "reciprocal"):
        assert ops[name] == "fp32", name
    for name in ("softmax.int", "sum", "sum.dim_IntList"):
        assert ops[name] == "fp32_set_opt_dtype", name
    for name in ("cat", "stack", "index_copy"):
        assert ops[name] == "none", name  # CPU "promotes", CUDA has no policy
    for name in ("linear", "mm", "bmm", "scaled_dot_product_attention", "mse_loss"):
        assert name not in ops, name  # the policies agree: CPU's native kernel (and its weight-cast cache) stays


def test_cuda_rules_change_dtypes_and_are_removed_on_exit():
    x = torch.randn(4, 8, dtype=torch.bfloat16)

    def dtypes():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (F.layer_norm(x, (8,)).dtype, x.pow(2).dtype, torch.softmax(x, -1).dtype, x.exp().dtype,
                    F.linear(x.float(), torch.randn(3, 8)).dtype)

    cpu_rules = dtypes()
    assert cpu_rules == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    with CudaAutocastRules():
        assert dtypes() == (torch.float32, torch.float32, torch.float32, torch.float32, torch.bfloat16)
    assert dtypes() == cpu_rules


def test_cat_has_no_promote_copy_under_cuda_rules():
    """CPU autocast casts every bf16 input of a mixed cat to float32 first (a full copy); CUDA does not."""
    a, b = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64)

    def copies(rules: bool) -> int:
        tracker = MemoryTracker()
        with (CudaAutocastRules() if rules else contextlib.nullcontext()), tracker, \
                torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.cat([a, b])
        assert out.dtype == torch.float32
        return tracker.peak

    assert copies(rules=False) == 64 * 64 * 4 + 2 * 64 * 64 * 4  # the fp32 copy of `a`, then the output
    assert copies(rules=True) == 2 * 64 * 64 * 4  # the output only
