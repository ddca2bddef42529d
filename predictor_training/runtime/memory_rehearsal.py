"""Memory rehearsal: a recipe's own training step at real size on fake tensors, with the GPU's memory rules.

Nothing of real size is allocated: everything runs under `torch._subclasses.fake_tensor.FakeTensorMode` on the CPU,
where tensors carry only shape, dtype and device. `Rehearsal` (a context manager) stacks three things:

* `FakeTensorMode(allow_non_fake_inputs=True)`: every tensor made inside is fake; small real CPU tensors made
  before (poses, memory-selection points) may enter model ops and are converted;
* `CudaAutocastRules` (runtime/autocast_rules.py): CUDA's autocast policies emulated at the `AutocastCPU` dispatch
  key (CPU autocast differs: CUDA runs layer_norm / pow / exp / rsqrt / softmax / sum / the losses in float32 and
  has no "promote" policy for `cat` / `stack` / `index_copy`). A dispatcher registration, not a TorchFunctionMode,
  so that the backward's checkpoint recompute follows the same rules. The op lists are copied from torch's
  `aten/src/ATen/autocast_mode.h` for the pinned torch version (`AUTOCAST_TORCH_VERSION`);
  tests/runtime/test_autocast_rules.py fails when torch's own registrations change;
* `MemoryTracker` (runtime/memory_tracker.py, with `DDPBuckets`, `use_foreach`, `fake_process_group`): a
  TorchDispatchMode that sees every op output (forward, backward, checkpoint recompute, optimizer)
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
memory selection) must run on real CPU inputs (`real_values`, runtime/fake_tensors.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from predictor_training.runtime.autocast_rules import CudaAutocastRules
from predictor_training.runtime.memory_tracker import GIB, PHASES, MemoryTracker, by_category

DEFAULT_ALLOCATOR_MARGIN = 0.05  # reserved-but-free share assumed on top of the peak (fragmentation), stated apart
CUDA_CONTEXT_GIB = 0.5  # CUDA context + NCCL, per process, for the "fits on a card" answers


# ---------------------------------------------------------------------------------------------------------------
# 1. One rehearsal
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
            by_category=by_category(records), largest=[record.describe() for record in largest],
            allocator_margin=self.allocator_margin, host_reads=self.tracker.host_reads, notes=dict(self.notes),
        )



def relative_error(estimate: float, measured: float) -> float:
    return (estimate - measured) / measured if measured else math.inf


# ---------------------------------------------------------------------------------------------------------------
# 2. Reading a rehearsal: where the peak was, what was alive there, the largest batch that fits
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
