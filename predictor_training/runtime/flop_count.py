"""FLOPs of the ops a block of code runs, read from shapes alone, so fake tensors count as real ones (the memory
rehearsal's loop step at real size: recipes/rehearsal.py; the training cost's per-step figures: eval/
training_cost.py).

    with FlopCounter() as flops:
        step_fn(batch, sync=True, due=...)       # forward and backward
    flops.forward, flops.backward, flops.total   # FLOPs; flops.uncounted: matmul-like ops without a formula

The formulas are torch's own (`torch.utils.flop_counter`, the registry `FlopCounterMode` reads: mm, addmm, bmm,
baddbmm, convolutions and their backward, the CUDA attention kernels): 2 FLOPs per multiply-add; element-wise ops,
norms, softmax and the optimizer are not counted. Two formulas are added: on CPU tensors (fake or real)
`scaled_dot_product_attention` dispatches to `_scaled_dot_product_flash_attention_for_cpu`, for which torch has no
formula (FlopCounterMode counts it as 0); it is counted as torch counts the CUDA flash kernel: QK^T and AV forward
(2 matmuls), the backward 5 matmuls (the scores computed again, dV, dP, dQ, dK).

Why not `FlopCounterMode` itself: it attributes FLOPs to modules through hooks on every module, and decomposes an op
without a formula (which would change the ops the memory tracker beside it sees); the rehearsal needs neither, but
does need the forward / backward split. An op run by the autograd engine (the backward, and a checkpointed block's
recompute inside it) counts as backward.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

_aten = torch.ops.aten
# matmul-like op names: an op among these without a formula is listed in `uncounted`, never silently skipped
_MATMUL_LIKE = re.compile(r"mm|^mv$|addmv|matmul|conv|attention|einsum|linear|dot|^addr$")


def _cpu_flash_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# In torch's convention for `FlopCounterMode(custom_mapping=...)`: functions of the arguments' shapes.
CPU_ATTENTION_FORMULAS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def formulas() -> dict:
    """{op packet: formula(*args, out_val=..., **kwargs) -> FLOPs}: torch's registry plus the CPU attention
    kernels (wrapped as torch wraps its own: tensors read as their shapes)."""
    return {**flop_registry, **{op: shape_wrapper(formula) for op, formula in CPU_ATTENTION_FORMULAS.items()}}


class FlopCounter(TorchDispatchMode):
    """Counts the FLOPs of every op dispatched while active (see the module docstring): `forward`, `backward`
    (ops the autograd engine runs), `total`, `by_op` ({op name: FLOPs}) and `uncounted` ({op name: calls} of
    matmul-like ops without a formula)."""

    def __init__(self):
        super().__init__()
        self.forward = 0
        self.backward = 0
        self.by_op: Counter = Counter()
        self.uncounted: Counter = Counter()
        self._formulas = formulas()

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        packet = func.overloadpacket
        formula = self._formulas.get(packet)
        if formula is None:
            if _MATMUL_LIKE.search(packet.__name__):
                self.uncounted[packet.__name__] += 1
            return output
        count = int(formula(*args, **kwargs, out_val=output))
        if torch._C._current_graph_task_id() != -1:
            self.backward += count
        else:
            self.forward += count
        self.by_op[packet.__name__] += count
        return output

    def summary(self) -> dict:
        """{"forward", "backward", "total", "by_op", "uncounted"} as plain JSON data."""
        return {"forward": self.forward, "backward": self.backward, "total": self.total,
                "by_op": dict(self.by_op.most_common()), "uncounted": dict(self.uncounted)}
