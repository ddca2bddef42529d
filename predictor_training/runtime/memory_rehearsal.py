"""Memory rehearsal: a recipe's own training step at real size on fake tensors, with the GPU's memory rules.

Nothing of real size is allocated: everything runs under `torch._subclasses.fake_tensor.FakeTensorMode` on the CPU,
where tensors carry only shape, dtype and device. `Rehearsal` (a context manager) stacks three things:

* `FakeTensorMode(allow_non_fake_inputs=True)`: every tensor made inside is fake; small real CPU tensors made
  before (poses, memory-selection points) may enter model ops and are converted;
* `CudaAutocastRules`: CUDA's autocast policies emulated at the `AutocastCPU` dispatch key (CPU autocast differs:
  CUDA runs layer_norm / pow / exp / rsqrt / softmax / sum / the losses in float32 and has no "promote" policy for
  `cat` / `stack` / `index_copy`). A dispatcher registration, not a TorchFunctionMode, so that the backward's
  checkpoint recompute follows the same rules. The op lists are copied from torch's `aten/src/ATen/autocast_mode.h`
  for the pinned torch version (`AUTOCAST_TORCH_VERSION`); tests/runtime/test_memory_rehearsal.py fails when
  torch's own registrations change;
* `MemoryTracker`: a TorchDispatchMode that sees every op output (forward, backward, checkpoint recompute, optimizer)
  and accounts storages (views share one) by category - parameters, gradients, optimizer state, DDP buckets,
  activations (activations and temporaries) - with the peak per phase (setup / forward / backward / optimizer; the
  backward is told apart by the autograd engine's graph task) and the tensors alive at the global peak (shape,
  dtype, the op that made them).

The device is the CPU here; tensors on the meta device stand for host memory (the data loader's pinned batch, which
the step copies to the device) and are not counted.

What is modelled, as the GPU has it:
* attention: on fake CPU tensors `scaled_dot_product_attention` dispatches to the CPU flash kernel (saves q, k, v,
  out, logsumexp; no attention matrix), as CUDA's flash / memory-efficient kernels (their workspaces not counted);
* DDP: `DDPBuckets` holds one bucket buffer of every trainable parameter (DDP allocates it when it wraps the model,
  `gradient_as_bucket_view=True`), and after the synchronised backward the gradients become views of it;
* AdamW's foreach path (CUDA's default; `use_foreach`);
* the caching allocator's 512-byte rounding (`peak_rounded`, what `max_memory_allocated` counts). Its
  reserved-but-free memory (fragmentation) is NOT in the figure: `MemoryReport.allocator_margin` states it as a
  separate margin.
Not modelled: kernel workspaces (cuBLAS, attention), NCCL buffers, the CUDA context, fragmentation beyond the margin.

Host reads of fake values (`float(t)`, `.item()`, `bool(t)`, `nonzero()`) cannot be answered; the tracker answers
them with placeholders (floats 1.0, ints 0, bools True; `nonzero` one row of zeros) so that metric conversions,
finite checks and the scheduler's first-step lookup run; indexing with a fake boolean mask selects every element
(the rehearsals' masks are all ones: every text token valid); code whose *memory* depends on values (the rollout's
memory selection) must run on real CPU inputs (`real_values`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import warnings
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

GIB = 2 ** 30
PHASES = ("setup", "forward", "backward", "optimizer")
CATEGORIES = ("parameters", "gradients", "optimizer_state", "ddp_buckets", "activations")
CUDA_ALLOCATION_ROUNDING = 512  # bytes: every caching-allocator block is a multiple of this
DEFAULT_ALLOCATOR_MARGIN = 0.05  # reserved-but-free share assumed on top of the peak (fragmentation), stated apart
CUDA_CONTEXT_GIB = 0.5  # CUDA context + NCCL, per process, for the "fits on a card" answers

# ---------------------------------------------------------------------------------------------------------------
# 1. CUDA autocast, emulated on the CPU
# ---------------------------------------------------------------------------------------------------------------
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
# changes either list fails tests/runtime/test_memory_rehearsal.py and this emulation is re-checked.
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


# ---------------------------------------------------------------------------------------------------------------
# 2. The tracker
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class StorageRecord:
    """One live storage: its size, the first tensor seen on it (shape, dtype), the op that made it, the phase."""

    nbytes: int
    shape: tuple
    dtype: torch.dtype
    op: str
    phase: str
    category: str = "activations"

    def describe(self) -> dict:
        return {"gib": self.nbytes / GIB, "bytes": self.nbytes, "shape": list(self.shape),
                "dtype": str(self.dtype).removeprefix("torch."), "op": self.op, "phase": self.phase,
                "category": self.category}


def _is_fake(tensor) -> bool:
    """A fake tensor, or a wrapper (DTensor) around fake ones."""
    if isinstance(tensor, FakeTensor):
        return True
    if isinstance(tensor, Tensor) and is_traceable_wrapper_subclass(tensor):
        return any(_is_fake(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0]
                   if isinstance(getattr(tensor, name), Tensor))
    return False


def _all_true_indices(indices) -> list:
    """A fake boolean mask's index, read as if every element were True (a mask's values are unknown; the rehearsal's
    synthetic inputs make every mask all ones, e.g. every text token valid): the equivalent long indices."""
    converted = []
    for index in indices:
        if isinstance(index, Tensor) and index.dtype == torch.bool and _is_fake(index):
            grids = torch.meshgrid(*[torch.arange(size, device=index.device) for size in index.shape], indexing="ij")
            converted.extend(grid.reshape(-1) for grid in grids)
        else:
            converted.append(index)
    return converted


def _placeholder(tensor: Tensor):
    if tensor.dtype == torch.bool:
        return True
    if tensor.is_floating_point():
        return 1.0
    return 0


class MemoryTracker(TorchDispatchMode):
    """Live bytes of every storage made by an op under this mode (views share their storage), by category; the
    global peak, the peak of each phase and the storages alive at the global peak.

    `phase` is set by the caller ("setup", "forward", "optimizer"); an op run by the autograd engine while the phase
    is "forward" counts as "backward". `label(tensors, category)` moves storages to another category (parameters,
    gradients, optimizer state, DDP buckets); storages made before the tracker are added by `label` as well.
    """

    def __init__(self, *, answer_host_reads: bool = True):
        super().__init__()
        self.phase = "setup"
        self.answer_host_reads = answer_host_reads
        self.live = 0
        self.live_rounded = 0
        self.peak = 0
        self.peak_rounded = 0
        self.peak_phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self.host_reads = 0
        self._records: dict[int, StorageRecord] = {}
        self._at_peak: list[StorageRecord] = []
        self._peak_dirty = False

    # ---- dispatch ---------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.answer_host_reads and func in (torch.ops.aten._local_scalar_dense.default,
                                               torch.ops.aten.nonzero.default):
            tensor = args[0]
            if _is_fake(tensor):
                self.host_reads += 1
                if func is torch.ops.aten.nonzero.default:
                    return torch.zeros((1, tensor.dim()), dtype=torch.long, device=tensor.device)
                return _placeholder(tensor)
        if func is torch.ops.aten.index.Tensor and any(
                isinstance(index, Tensor) and index.dtype == torch.bool and _is_fake(index) for index in args[1]):
            args = (args[0], _all_true_indices(args[1]), *args[2:])
        output = func(*args, **kwargs)
        phase = self.current_phase()
        for value in tree_flatten(output)[0]:
            if isinstance(value, Tensor):
                self._track(value, str(func.overloadpacket.__name__), phase)
        return output

    def current_phase(self) -> str:
        if self.phase == "forward" and torch._C._current_graph_task_id() != -1:
            return "backward"
        return self.phase

    def _track(self, tensor: Tensor, op: str, phase: str, category: str = "activations") -> StorageRecord | None:
        if is_traceable_wrapper_subclass(tensor):  # a DTensor (FSDP2's shards): its local tensor holds the memory
            inner = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]
            records = [self._track(value, op, phase, category) for value in inner if isinstance(value, Tensor)]
            return next((record for record in records if record is not None), None)
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return None  # meta tensors stand for host memory (a loop's pinned batch): not on the device
        storage = tensor.untyped_storage()
        key = storage._cdata
        record = self._records.get(key)
        if record is not None:
            return record
        size = storage.nbytes()
        record = StorageRecord(size, tuple(tensor.shape), tensor.dtype, op, phase, category)
        self._records[key] = record
        self.live += size
        self.live_rounded += _rounded(size)
        if self.live > self.peak:
            self.peak, self.peak_phase, self._peak_dirty = self.live, phase, True
        self.peak_rounded = max(self.peak_rounded, self.live_rounded)
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.live)
        weakref.finalize(storage, self._release, key)
        return record

    def resized(self, tensor: Tensor) -> None:
        """A storage resized in place (FSDP2 frees and re-allocates its unsharded parameters and all-gather
        buffers with `untyped_storage().resize_`): its record follows the new size."""
        record = self._track(tensor, "resize_", self.current_phase())
        if record is None:
            return
        size = tensor.untyped_storage().nbytes()
        if size == record.nbytes:
            return
        if size < record.nbytes and self._peak_dirty and self.live == self.peak:
            self._at_peak = list(self._records.values())
            self._peak_dirty = False
        self.live += size - record.nbytes
        self.live_rounded += _rounded(size) - _rounded(record.nbytes)
        record.nbytes = size
        phase = self.current_phase()
        if self.live > self.peak:
            self.peak, self.peak_phase, self._peak_dirty = self.live, phase, True
        self.peak_rounded = max(self.peak_rounded, self.live_rounded)
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.live)

    def _release(self, key: int) -> None:
        record = self._records.pop(key, None)
        if record is None:
            return
        if self._peak_dirty and self.live == self.peak:
            self._at_peak = list(self._records.values()) + [record]
            self._peak_dirty = False
        self.live -= record.nbytes
        self.live_rounded -= _rounded(record.nbytes)

    # ---- categories -------------------------------------------------------------------------------------------
    def label(self, tensors: Iterable[Tensor | None], category: str) -> None:
        """Count these tensors' storages as `category` from now on (and in the peak's breakdown)."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; expected one of {list(CATEGORIES)}")
        for tensor in tensors:
            if tensor is None:
                continue
            record = self._track(tensor, "external", self.current_phase(), category)
            if record is not None:
                record.category = category

    def live_by_category(self) -> dict[str, int]:
        return _by_category(self._records.values())

    def peak_records(self) -> list[StorageRecord]:
        """The storages alive at the global peak."""
        if self._peak_dirty:
            self._at_peak = list(self._records.values())
            self._peak_dirty = False
        return list(self._at_peak)


def _rounded(size: int) -> int:
    return -(-size // CUDA_ALLOCATION_ROUNDING) * CUDA_ALLOCATION_ROUNDING


def _by_category(records: Iterable[StorageRecord]) -> dict[str, int]:
    totals = {category: 0 for category in CATEGORIES}
    for record in records:
        totals[record.category] += record.nbytes
    return totals


# ---------------------------------------------------------------------------------------------------------------
# 3. DDP's buckets, AdamW's foreach path
# ---------------------------------------------------------------------------------------------------------------
class DDPBuckets:
    """DDP's gradient buckets (`gradient_as_bucket_view=True`): one buffer per dtype of the trainable parameters,
    made when DDP wraps the model and kept for the run; after the synchronised backward the gradients become views
    of it (`adopt_gradients`), as the reducer leaves them."""

    def __init__(self, parameters: Sequence[nn.Parameter], tracker: MemoryTracker):
        self.parameters = [param for param in parameters if param.requires_grad]
        self.buffers: dict[torch.dtype, Tensor] = {}
        for dtype in sorted({param.dtype for param in self.parameters}, key=str):
            numel = sum(param.numel() for param in self.parameters if param.dtype == dtype)
            self.buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.parameters[0].device)
        tracker.label(self.buffers.values(), "ddp_buckets")

    def adopt_gradients(self) -> None:
        offsets = {dtype: 0 for dtype in self.buffers}
        for param in self.parameters:
            start = offsets[param.dtype]
            offsets[param.dtype] = start + param.numel()
            if param.grad is not None:
                param.grad = self.buffers[param.dtype][start:start + param.numel()].view_as(param)


def use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """AdamW takes its foreach path on CUDA by default, the per-tensor loop for CPU tensors: use CUDA's."""
    optimizer.defaults["foreach"] = True
    for group in optimizer.param_groups:
        group["foreach"] = True


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A process group of `world_size` ranks in which this process is rank 0 and every collective returns at once
    (torch's "fake" backend, as torchtitan's memory estimator uses): FSDP2 shards, all-gathers and reduce-scatters
    with the real per-rank sizes, nothing is communicated. Destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def patched(*patches):
    """(object, attribute, value) patches, undone on exit."""
    saved = [(target, name, getattr(target, name)) for target, name, _ in patches]
    for target, name, value in patches:
        setattr(target, name, value)
    try:
        yield
    finally:
        for target, name, value in reversed(saved):
            setattr(target, name, value)


@contextlib.contextmanager
def fsdp_storage_accounting(tracker: MemoryTracker):
    """FSDP2 (torch 2.14) frees an unsharded parameter and its all-gather buffer after each forward / backward by
    resizing the storage to 0 bytes and re-allocates it by resizing it back (`_fsdp_param.alloc_storage` /
    `free_storage`), which no op shows: the tracker is told of each resize, so it counts what FSDP2 holds."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    original_alloc, original_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor):
        original_alloc(tensor)
        tracker.resized(tensor)

    def free_storage(tensor):
        original_free(tensor)
        tracker.resized(tensor)

    with patched((_fsdp_param, "alloc_storage", alloc_storage), (_fsdp_param, "free_storage", free_storage),
                 (_fsdp_param_group, "alloc_storage", alloc_storage)):
        yield


# ---------------------------------------------------------------------------------------------------------------
# 4. One rehearsal
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MemoryReport:
    """The figures of one rehearsal (bytes unless named *_gib)."""

    name: str
    peak: int
    peak_rounded: int
    peak_phase: str
    phase_peaks: dict[str, int]
    by_category: dict[str, int]
    largest: list[dict]
    allocator_margin: float = DEFAULT_ALLOCATOR_MARGIN
    host_reads: int = 0
    notes: dict = dataclasses.field(default_factory=dict)

    @property
    def peak_gib(self) -> float:
        return self.peak / GIB

    def with_margin_gib(self) -> float:
        """Peak (rounded as the allocator counts it) plus the stated allocator margin: what to plan a card for."""
        return self.peak_rounded * (1 + self.allocator_margin) / GIB

    def to_json(self) -> dict:
        return {
            "name": self.name, "peak_gib": self.peak / GIB, "peak_rounded_gib": self.peak_rounded / GIB,
            "peak_phase": self.peak_phase,
            "phase_peaks_gib": {phase: value / GIB for phase, value in self.phase_peaks.items()},
            "by_category_gib": {category: value / GIB for category, value in self.by_category.items()},
            "allocator_margin": self.allocator_margin, "with_margin_gib": self.with_margin_gib(),
            "largest": self.largest, "host_reads_answered": self.host_reads, **self.notes,
        }

    def format(self) -> str:
        lines = [(f"{self.name}: peak {self.peak / GIB:.2f} GiB in the {self.peak_phase} "
                  f"(allocator-rounded {self.peak_rounded / GIB:.2f}; + {self.allocator_margin:.0%} allocator margin "
                  f"= {self.with_margin_gib():.2f} GiB)")]
        lines.append("  per phase: " + ", ".join(f"{phase} {value / GIB:.2f}"
                                                 for phase, value in self.phase_peaks.items()))
        lines.append("  at the peak: " + ", ".join(f"{category} {value / GIB:.2f}"
                                                   for category, value in self.by_category.items()))
        lines.append(f"  {len(self.largest)} largest live tensors at the peak:")
        for item in self.largest:
            lines.append(f"    {item['gib']:7.2f} GiB  {item['dtype']:>8} {item['shape']!s:<28} "
                         f"{item['op']} ({item['phase']}, {item['category']})")
        for key, value in self.notes.items():
            lines.append(f"  {key}: {value}")
        return "\n".join(lines)


class Rehearsal:
    """Fake tensors + CUDA autocast rules + the tracker, entered together:

        with Rehearsal("v4") as rehearsal:
            model = build(...)                       # phase "setup"
            rehearsal.label_parameters([model])
            rehearsal.watch_gradients(trainable)
            with rehearsal.phase("forward"):         # forward and backward (told apart by autograd)
                step(batch)
            with rehearsal.phase("optimizer"):
                optimizer.step(); rehearsal.label_optimizer(optimizer)
        report = rehearsal.report()
    """

    def __init__(self, name: str, *, cuda_autocast: bool = True, allocator_margin: float = DEFAULT_ALLOCATOR_MARGIN,
                 fake: bool = True):
        self.name = name
        self.cuda_autocast = cuda_autocast
        self.fake = fake  # False: the same accounting on real tensors (tiny sizes; checks the fake run)
        self.allocator_margin = allocator_margin
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.tracker = MemoryTracker()
        self.notes: dict = {}
        self._stack = contextlib.ExitStack()
        self._hooks: list = []

    def __enter__(self) -> Rehearsal:
        if self.cuda_autocast:
            self._stack.enter_context(CudaAutocastRules())
        if self.fake:
            self._stack.enter_context(self.fake_mode)
        self._stack.enter_context(self.tracker)
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._stack.close()

    @contextlib.contextmanager
    def phase(self, name: str):
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {list(PHASES)}")
        previous, self.tracker.phase = self.tracker.phase, name
        try:
            yield
        finally:
            self.tracker.phase = previous

    def label_parameters(self, modules: Iterable[nn.Module]) -> None:
        for module in modules:
            self.tracker.label(list(module.parameters()) + list(module.buffers()), "parameters")

    def watch_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Count each trainable parameter's .grad as "gradients" once autograd has accumulated it."""
        for param in parameters:
            if param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(
                    lambda p: self.tracker.label([p.grad], "gradients")))

    def label_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        states = [value for state in optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]
        self.tracker.label(states, "optimizer_state")

    def report(self, top: int = 10) -> MemoryReport:
        records = self.tracker.peak_records()
        largest = sorted(records, key=lambda record: record.nbytes, reverse=True)[:top]
        return MemoryReport(
            name=self.name, peak=self.tracker.peak, peak_rounded=self.tracker.peak_rounded,
            peak_phase=self.tracker.peak_phase, phase_peaks=dict(self.tracker.phase_peaks),
            by_category=_by_category(records), largest=[record.describe() for record in largest],
            allocator_margin=self.allocator_margin, host_reads=self.tracker.host_reads, notes=dict(self.notes),
        )


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


def relative_error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured if measured else math.inf


# ---------------------------------------------------------------------------------------------------------------
# 5. Reading a rehearsal: where the peak was, what was alive there, the largest batch that fits
# ---------------------------------------------------------------------------------------------------------------
class PeakSegments:
    """Names the part of a step in which the tracker's global peak was reached. `mark(name)` starts a part (a
    recipe's step calls it through its `mark` seam); a rise of the peak seen at the next mark belongs to the part
    that was current, so a backward run after a marked call counts to that call's part unless a mark renames it."""

    def __init__(self, tracker: MemoryTracker):
        self.tracker = tracker
        self.current = "setup"
        self.seen = tracker.peak
        self.at_peak = "setup"

    def mark(self, name: str) -> None:
        if self.tracker.peak > self.seen:
            self.at_peak, self.seen = self.current, self.tracker.peak
        self.current = name


def peak_groups(tracker: MemoryTracker, top: int = 8) -> list[str]:
    """The storages alive at the peak grouped by (op, shape, dtype, phase, category), largest totals first: many
    same-shaped tensors (a context K/V per layer) that no single one of the 10 largest shows."""
    groups: dict[tuple, list[int]] = {}
    for record in tracker.peak_records():
        key = (record.op, record.shape, str(record.dtype).removeprefix("torch."), record.phase, record.category)
        entry = groups.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += record.nbytes
    ranked = sorted(groups.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return [f"{count} x {list(shape)} {dtype} {op} ({phase}, {category}): {total / GIB:.2f} GiB"
            for (op, shape, dtype, phase, category), (count, total) in ranked]


_MODULE_TO = nn.Module.to


def module_to_unless_unchanged(self, *args, **kwargs):
    """For `patched((nn.Module, "to", ...))` inside a rehearsal: Module.to() swaps every fake parameter, which fake
    tensors refuse; a move that changes nothing (PEFT moves each wrapped linear to its own device, the recipes move a
    model built on its device there) is skipped, anything else still goes to Module.to."""
    device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    tensors = list(self.parameters()) + list(self.buffers())
    if all((device is None or tensor.device == torch.device(device))
           and (dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype) for tensor in tensors):
        return self
    return _MODULE_TO(self, *args, **kwargs)


def card_gib(gigabytes: float) -> float:
    return gigabytes * 1e9 / GIB


def needed_gib(report: MemoryReport) -> float:
    """What a card must hold: the peak as the allocator counts it, the stated allocator margin, the CUDA context."""
    return report.with_margin_gib() + CUDA_CONTEXT_GIB


def largest_batches(run, cards_gb=(80, 141)) -> dict[float, tuple[int, MemoryReport]]:
    """{card GB: (the largest per-GPU batch whose need fits, its rehearsal)} for `run(batch) -> MemoryReport`: a line
    through the step's peaks at batches 4 and 8 (affine in the batch), then rehearsals around each predicted batch
    until batch fits and batch + 1 does not."""
    def step_need(report: MemoryReport) -> float:  # the step's own peak (not the Teacher load before it)
        step = max(value for phase, value in report.phase_peaks.items() if phase != "setup")
        return needed_gib(report) * step / max(report.peak, 1)

    low, high = run(4), run(8)
    per_item = (step_need(high) - step_need(low)) / 4
    if per_item <= 0:
        raise RuntimeError(f"the step's peak does not grow with the batch ({step_need(low):.2f} GiB at 4 and "
                           f"{step_need(high):.2f} GiB at 8); cannot extrapolate")
    found = {}
    for card in cards_gb:
        batch = max(1, int((card_gib(card) - step_need(low)) / per_item) + 4)
        report = run(batch)
        while batch > 1 and needed_gib(report) > card_gib(card):
            batch -= 1
            report = run(batch)
        while needed_gib(report) <= card_gib(card):  # the line may have been low: try one more
            bigger = run(batch + 1)
            if needed_gib(bigger) > card_gib(card):
                break
            batch, report = batch + 1, bigger
        found[card] = (batch, report)
    return found


def read_estimates(path: Path | None, recipes: Sequence[str], flag: str = "--memory_estimates") -> dict:
    """{recipe: {"gib", "name", "batch_size"}} from `tools/estimate_memory.py --json` output (`MemoryReport.to_json`
    objects): JSON lines, a list or one object of them (`name` starting with one of `recipes`; `peak_rounded_gib`,
    else `peak_gib`; the batch read from the name's "batch N"), or a plain {recipe: GiB} object. The first report of a
    recipe counts; {} without a path. A bad file is a ValueError naming `flag` and the path."""
    if path is None:
        return {}
    text = path.read_text(encoding="utf-8").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(f"{flag} {path}: neither JSON nor JSON lines ({error})") from None
    if isinstance(data, dict) and all(key in recipes for key in data):
        reports = [{"name": recipe, "peak_gib": value} if isinstance(value, (int, float)) else {"name": recipe, **value}
                   for recipe, value in data.items()]
    else:
        reports = data if isinstance(data, list) else [data]
    estimates = {}
    for report in reports:
        if not isinstance(report, dict) or "name" not in report:
            raise ValueError(f"{flag} {path}: expected report objects with a 'name', got {report!r:.200}")
        recipe = next((name for name in recipes if str(report["name"]).startswith(name)), None)
        gib = report.get("peak_rounded_gib", report.get("peak_gib"))
        if recipe is None or gib is None:
            raise ValueError(f"{flag} {path}: report {report['name']!r} names no recipe of {tuple(recipes)} or has no "
                             "peak_rounded_gib / peak_gib")
        batch = None
        if "batch" in str(report["name"]):
            after = str(report["name"]).split("batch", 1)[1].strip().split(",")[0]
            batch = int(after) if after.isdigit() else None
        estimates.setdefault(recipe, {"gib": float(gib), "name": report["name"], "batch_size": batch})
    return estimates


def estimate_columns(estimate: dict | None, measured_gib: float | None, batch_size: int | None = None) -> dict:
    """A measured peak next to its `read_estimates` entry (or None): estimate_gib, estimate_name,
    estimate_batch_matches (None unless both batches are known) and estimate_error, (estimate - measured) / measured
    (None unless both figures are known)."""
    if estimate is None or measured_gib is None:
        gib, name = (None, None) if estimate is None else (estimate["gib"], estimate["name"])
        return {"estimate_gib": gib, "estimate_name": name, "estimate_batch_matches": None, "estimate_error": None}
    batches = (batch_size, estimate.get("batch_size"))
    return {"estimate_gib": estimate["gib"], "estimate_name": estimate["name"],
            "estimate_batch_matches": None if None in batches else batches[0] == batches[1],
            "estimate_error": (estimate["gib"] - measured_gib) / measured_gib}
