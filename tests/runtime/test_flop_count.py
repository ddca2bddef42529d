"""runtime/flop_count.py: FLOPs of a linear layer and an attention call worked out by hand, forward and backward;
fake tensors count as real ones; the total is torch's FlopCounterMode's once it is given the CPU attention kernel;
a matmul-like op without a formula is listed, not skipped."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from predictor_training.runtime.flop_count import CPU_ATTENTION_FORMULAS, FlopCounter

B, H, Q, K, D = 1, 2, 16, 32, 8  # batch, heads, queries, keys, head width


def attention_then_linear():
    """SDPA on q [1, 2, 16, 8] over k, v [1, 2, 32, 8], then Linear(8 -> 8) on its 32 output rows, then backward."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(B, H, Q, D, generator=generator, requires_grad=True)
    key, value = torch.randn(B, H, K, D, generator=generator), torch.randn(B, H, K, D, generator=generator)
    linear = torch.nn.Linear(D, D)
    out = linear(F.scaled_dot_product_attention(query, key, value))
    out.sum().backward()


def test_counts_by_hand():
    """Forward: QK^T and AV, 2 x (B*H x Q x K x D) multiply-adds each = 2 x 16384; the linear's addmm on 32 rows,
    2 x 32 x 8 x 8 = 4096. Backward: the CPU flash kernel's 5 matmuls of the same size (the scores again, dV, dP,
    dQ, dK) = 81920; the linear's input and weight gradients, 2 x 4096."""
    attention_matmul = 2 * B * H * Q * K * D
    linear = 2 * (B * H * Q) * D * D
    with FlopCounter() as flops:
        attention_then_linear()
    assert flops.forward == 2 * attention_matmul + linear == 36864
    assert flops.backward == 5 * attention_matmul + 2 * linear == 90112
    assert flops.total == flops.forward + flops.backward
    assert flops.by_op == {"_scaled_dot_product_flash_attention_for_cpu": 2 * attention_matmul,
                           "_scaled_dot_product_flash_attention_for_cpu_backward": 5 * attention_matmul,
                           "addmm": linear, "mm": 2 * linear}
    assert flops.uncounted == {}


def test_fake_tensors_count_as_real_ones():
    with FlopCounter() as real:
        attention_then_linear()
    with FakeTensorMode(), FlopCounter() as fake:
        attention_then_linear()
    assert (fake.forward, fake.backward) == (real.forward, real.backward)


def test_total_is_torch_flop_counter_modes_with_the_cpu_attention_formulas():
    """torch's own FlopCounterMode counts the CPU attention kernel as 0; given the same two formulas as
    `custom_mapping` it agrees with the counter, and without them it is short by exactly the attention FLOPs."""
    with FlopCounter() as ours:
        attention_then_linear()
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FORMULAS) as torchs:
        attention_then_linear()
    with FlopCounterMode(display=False) as plain:
        attention_then_linear()
    assert torchs.get_total_flops() == ours.total
    attention = ours.by_op["_scaled_dot_product_flash_attention_for_cpu"] + \
        ours.by_op["_scaled_dot_product_flash_attention_for_cpu_backward"]
    assert plain.get_total_flops() == ours.total - attention


def test_a_matmul_like_op_without_a_formula_is_listed():
    with FlopCounter() as flops:
        torch.mv(torch.ones(4, 3), torch.ones(3))
    assert flops.total == 0
    assert flops.uncounted == {"mv": 1}
