"""The memory rehearsal's accounting (runtime/memory_rehearsal.py): the tracker, DDP's buckets, AdamW's foreach
path, a fake process group and FSDP2's storage resizes.

`MemoryTracker`: a TorchDispatchMode that sees every op output (forward, backward, checkpoint recompute, optimizer)
and accounts storages (views share one) by category - parameters, gradients, optimizer state, DDP buckets,
activations (activations and temporaries) - with the peak per phase (setup / forward / backward / optimizer; the
backward is told apart by the autograd engine's graph task) and the tensors alive at the global peak (shape, dtype,
the op that made them). Tensors on the meta device stand for host memory and are not counted; the caching
allocator's 512-byte rounding is counted apart (`peak_rounded`).

Host reads of fake values (`float(t)`, `.item()`, `bool(t)`, `nonzero()`) cannot be answered; the tracker answers
them with placeholders (floats 1.0, ints 0, bools True; `nonzero` one row of zeros), and indexing with a fake boolean
mask selects every element.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

GIB = 2 ** 30
PHASES = ("setup", "forward", "backward", "optimizer")
CATEGORIES = ("parameters", "gradients", "optimizer_state", "ddp_buckets", "activations")
CUDA_ALLOCATION_ROUNDING = 512  # bytes: every caching-allocator block is a multiple of this


# ---------------------------------------------------------------------------------------------------------------
# 1. The tracker
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
        return by_category(self._records.values())

    def peak_records(self) -> list[StorageRecord]:
        """The storages alive at the global peak."""
        if self._peak_dirty:
            self._at_peak = list(self._records.values())
            self._peak_dirty = False
        return list(self._at_peak)


def _rounded(size: int) -> int:
    return -(-size // CUDA_ALLOCATION_ROUNDING) * CUDA_ALLOCATION_ROUNDING


def by_category(records: Iterable[StorageRecord]) -> dict[str, int]:
    totals = {category: 0 for category in CATEGORIES}
    for record in records:
        totals[record.category] += record.nbytes
    return totals


# ---------------------------------------------------------------------------------------------------------------
# 2. DDP's buckets, AdamW's foreach path, the fake process group, FSDP2's resizes
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

