"""CUDA's autocast rules, emulated on the CPU (part of the memory rehearsal, runtime/memory_rehearsal.py).

`CudaAutocastRules` emulates CUDA's autocast policies at the `AutocastCPU` dispatch key (CPU autocast differs: CUDA
runs layer_norm / pow / exp / rsqrt / softmax / sum / the losses in float32 and has no "promote" policy for `cat` /
`stack` / `index_copy`). A dispatcher registration, not a TorchFunctionMode, so that the backward's checkpoint
recompute follows the same rules. The op lists are copied from torch's `aten/src/ATen/autocast_mode.h` for the pinned
torch version (`AUTOCAST_TORCH_VERSION`); tests/runtime/test_autocast_rules.py fails when torch's own registrations
change.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

AUTOCAST_TORCH_VERSION = "2.14"
# CUDA's policies (aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
# AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE and the redispatch specials), op names as the dispatcher lists them.
CUDA_LOWER_PRECISION = (
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
    "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
    "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention", "_cudnn_rnn",
)
CUDA_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh",
    "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "rms_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss", "multilabel_margin_loss",
    "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy_with_logits", "dist",
    "pdist", "cdist", "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d",
    "upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa", "linalg_matrix_sqrth", "binary_cross_entropy",
)
CUDA_FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "norm.Scalar",
    "norm.ScalarOpt_dim",
)
CUDA_PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put", "tensordot",
    "scatter_add",
)
# The ops torch 2.14 registers at AutocastCPU (aten/src/ATen/autocast_mode.cpp): pinned so that a torch upgrade that
# changes either list fails tests/runtime/test_autocast_rules.py and this emulation is re-checked.
PINNED_CPU_AUTOCAST_OPS = (
    '_addmm_activation', '_convolution.deprecated', '_grid_sampler_2d_cpu_fallback', '_lu_with_info',
    '_native_multi_head_attention', 'adaptive_avg_pool3d', 'adaptive_max_pool3d', 'addbmm', 'addmm', 'avg_pool3d',
    'baddbmm', 'binary_cross_entropy', 'binary_cross_entropy_with_logits', 'bmm', 'cat', 'cdist',
    'cholesky_inverse', 'cholesky_solve', 'conv1d', 'conv1d.padding', 'conv2d', 'conv2d.padding', 'conv3d',
    'conv3d.padding', 'conv_tbc', 'conv_transpose1d', 'conv_transpose2d.input', 'conv_transpose3d.input',
    'cosine_embedding_loss', 'cross_entropy_loss', 'ctc_loss.IntList', 'ctc_loss.Tensor',
    'fake_quantize_per_tensor_affine', 'fft_fft', 'fft_fft2', 'fft_fftn', 'fft_hfft', 'fft_ifft', 'fft_ifft2',
    'fft_ifftn', 'fft_ihfft', 'fft_irfft', 'fft_irfft2', 'fft_irfftn', 'fft_rfft', 'fft_rfft2', 'fft_rfftn',
    'fractional_max_pool2d', 'fractional_max_pool3d', 'geqrf', 'grid_sampler', 'grid_sampler_2d', 'grid_sampler_3d',
    'hinge_embedding_loss', 'huber_loss', 'index_copy', 'inverse', 'kl_div', 'l1_loss', 'linalg_cholesky',
    'linalg_cholesky_ex', 'linalg_cond', 'linalg_cond.p_str', 'linalg_eig', 'linalg_eigh', 'linalg_eigvals',
    'linalg_eigvalsh', 'linalg_householder_product', 'linalg_inv', 'linalg_inv_ex', 'linalg_lstsq',
    'linalg_matrix_rank', 'linalg_matrix_rank.atol_rtol_float', 'linalg_matrix_rank.atol_rtol_tensor',
    'linalg_matrix_rank.tol_tensor', 'linalg_matrix_sqrth', 'linalg_qr', 'linalg_solve', 'linalg_svd',
    'linalg_svdvals', 'linalg_tensorinv', 'linalg_tensorsolve', 'linalg_vecdot', 'linear', 'lu_solve',
    'margin_ranking_loss', 'matmul', 'max_pool3d', 'max_unpool2d', 'max_unpool3d', 'mkldnn_rnn_layer', 'mm',
    'mse_loss', 'multi_margin_loss', 'multilabel_margin_loss', 'multilabel_margin_loss_forward', 'nanquantile',
    'nanquantile.scalar', 'nll_loss', 'nll_loss2d', 'orgqr', 'ormqr', 'pinverse', 'poisson_nll_loss', 'polar',
    'prelu', 'prod', 'prod.dim_int', 'quantile', 'quantile.scalar', 'reflection_pad1d', 'reflection_pad2d',
    'replication_pad1d', 'replication_pad2d', 'replication_pad3d', 'scaled_dot_product_attention', 'smooth_l1_loss',
    'soft_margin_loss', 'stack', 'stft', 'stft.center', 'svd', 'trace', 'triangular_solve', 'triplet_margin_loss',
    'view_as_complex',
)
# CPU autocast's policies that differ from CUDA's for ops both lists hold (the rest agree: matmul-like ops in the
# lower precision, the losses in float32).
CPU_DIFFERS_FROM_CUDA = ("prod", "prod.dim_int", "grid_sampler")
# binary_cross_entropy is an error under CUDA autocast; emulated as fp32 (the CPU's policy).


def cuda_autocast_policies() -> dict[str, str]:
    """{op name: CUDA policy} with policies "lower_precision_fp" | "fp32" | "fp32_set_opt_dtype" | "promote"."""
    policies = {}
    for names, policy in ((CUDA_LOWER_PRECISION, "lower_precision_fp"), (CUDA_FP32, "fp32"),
                          (CUDA_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"), (CUDA_PROMOTE, "promote")):
        for name in names:
            policies[name] = policy
    return policies


def registered_autocast_ops(key: str) -> set[str]:
    """The aten ops torch registers at an autocast dispatch key ("AutocastCPU", "AutocastCUDA"), without "aten::"
    (other libraries' ops, e.g. torchvision's once it is imported, are not torch's policies)."""
    return {name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key(key)
            if name.startswith("aten::")}


def emulated_ops() -> dict[str, str]:
    """{op: policy} this emulation registers at AutocastCPU: CUDA's policy where the CPU's differs or is missing,
    "none" (no cast at all) for the CPU-only ops (cat, stack, index_copy ... have no CUDA policy)."""
    cpu, cuda = registered_autocast_ops("AutocastCPU"), cuda_autocast_policies()
    ops = {name: policy for name, policy in cuda.items() if name not in cpu or name in CPU_DIFFERS_FROM_CUDA}
    ops.update({name: "none" for name in cpu if name not in cuda})
    return ops


_AUTOCAST_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _eligible(value) -> bool:
    """CUDA autocast's is_eligible: a floating tensor of the autocast device, not float64."""
    return isinstance(value, Tensor) and value.is_floating_point() and value.device.type == "cpu" \
        and value.dtype != torch.float64


def _autocast_kernel(op, policy: str):
    dtype_index = next((i for i, arg in enumerate(op._schema.arguments) if arg.name == "dtype"), None)

    def kernel(keyset, *args, **kwargs):
        if policy == "none":
            # No autocast kernel on CUDA: the next key runs, and a decomposition's own ops still see autocast.
            return op.redispatch(keyset.remove(torch._C.DispatchKey.AutocastCPU), *args, **kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU_KEYS):
            if policy == "fp32":
                cast = lambda value: value.to(torch.float32) if _eligible(value) else value
                args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
            elif policy == "lower_precision_fp":
                low = torch.get_autocast_dtype("cpu")
                cast = lambda value: value.to(low) if _eligible(value) else value
                args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
            elif policy == "promote":
                floats = [value.dtype for value in tree_flatten((args, kwargs))[0] if _eligible(value)]
                if floats:
                    widest = torch.float32 if torch.float32 in floats else floats[0]
                    cast = lambda value: value.to(widest) if _eligible(value) else value
                    args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
            elif policy == "fp32_set_opt_dtype":
                first = next((value for value in tree_flatten(args)[0] if isinstance(value, Tensor)), None)
                if first is not None and _eligible(first) and dtype_index is not None:
                    if len(args) > dtype_index:
                        if args[dtype_index] is None:
                            args = (*args[:dtype_index], torch.float32, *args[dtype_index + 1:])
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


class CudaAutocastRules:
    """Context manager: while active, CPU autocast follows CUDA's policies (`emulated_ops`). Registrations are
    global to the process (the autograd engine's backward sees them too) and removed on exit."""

    def __init__(self):
        self._library = None

    def __enter__(self) -> CudaAutocastRules:
        self._library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, policy in sorted(emulated_ops().items()):
                packet_name, _, overload = name.partition(".")
                packet = getattr(torch.ops.aten, packet_name, None)
                if packet is None:
                    continue
                op = getattr(packet, overload or "default", None)
                if op is None:
                    continue
                self._library.impl(name, _autocast_kernel(op, policy), "AutocastCPU", with_keyset=True)
        return self

    def __exit__(self, *exc) -> None:
        self._library._destroy()
        self._library = None

