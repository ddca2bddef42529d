"""Named LoRA adapters (peft) on one frozen WorldPlay Teacher: student, real score, fake score, ...

    add_lora(teacher, "real_score", rank=64, alpha=64)       # B = 0: the Teacher's outputs are unchanged
    add_lora(teacher, "fake_score", rank=64, alpha=64)
    optimizer = torch.optim.AdamW(lora_parameters(teacher, "fake_score"), lr=1e-4)
    with adapter(teacher, "real_score"):                      # only this adapter runs inside the block
        v_real = teacher.chunk_step(...)
    with adapter(teacher, None):                              # the frozen Teacher, no adapter
        v_teacher = teacher.chunk_step(...)
    save_lora(teacher, "fake_score", "fake_score.safetensors")
    load_lora(other_teacher, "fake_score.safetensors")        # refuses a Teacher with another config hash

1. Targets. Every double block's image-stream linears (`LORA_TARGETS`): the attention projections
   `img_attn_q/k/v`, the RoPE-branch output projection `img_attn_proj`, the ProPE-branch output projection
   `img_attn_prope_proj` and the image MLP `img_mlp.fc1/fc2`. `img_attn_prope_proj` is a plain `nn.Linear(h, h)` of
   the image stream that sums with `img_attn_proj` into the attention update (the camera-conditioned branch), so it
   is targeted by default: without it an adapter could not change how the camera branch enters the residual.
   `targets=LORA_TARGETS_WITHOUT_PROPE` leaves it out. Text-stream linears (`txt_*`), modulations (`img_mod`,
   `txt_mod`), embedders and the final layer are never targeted.
2. peft and our diffusers `ModelMixin` Teacher. diffusers 0.42 gives `ModelMixin` no peft mixin, so adapters are
   injected with peft's functional API (`inject_adapter_in_model`), which wraps each targeted `nn.Linear` in a
   `peft.tuners.lora.Linear` in place. Consequences, all handled here:
   * the wrapped layers' keys become `<module>.base_layer.weight` plus `<module>.lora_A.<name>.weight`, so
     `teacher.state_dict()` no longer has the Teacher's own keys. `base_state_dict` returns exactly the keys and
     tensors of the un-adapted Teacher, and `load_base_state_dict` / `load_base_checkpoint` load a Teacher
     checkpoint (its own keys) strictly into an adapted Teacher. Do not `save_pretrained` an adapted Teacher.
   * peft freezes every non-LoRA parameter of the model on injection: after `add_lora` only adapter parameters
     require grad (the base is frozen, as a LoRA run wants).
   * peft's own switching (`set_adapter`, `enable_adapters`) also flips `requires_grad` (active = trainable). Here
     switching never changes `requires_grad`: each adapter keeps the trainability it was created with
     (`add_lora(trainable=...)`, `set_lora_trainable`), so a frozen real score stays frozen while it runs.
   * peft makes a newly injected adapter the active one; `add_lora` restores the previous selection, so adding an
     adapter never changes what the Teacher computes.
   * peft records each adapter's `LoraConfig` in `teacher.peft_config` (a dict by adapter name); it is the registry
     read by `adapter_names` and `adapter_spec`.
3. Switching. Exactly one adapter, or none, is active at a time, on every wrapped layer. `adapter(teacher, name)` is
   a context manager that restores the previous selection on exit; `set_active_adapter` switches for good. A fresh
   Teacher with adapters runs the base (`active_adapter(teacher) is None`) until one is selected. With activation
   checkpointing on, the recomputation in backward runs with the adapter that was active in the forward (the
   Teacher's `checkpoint_context_fn`), even when backward is called after the `with` block has exited.
4. Files. `save_lora` writes one adapter as safetensors (FP32 `lora_A` / `lora_B` per targeted module, keys
   `double_blocks.{i}.{target}.lora_{A,B}.weight`) with its config in the metadata (rank, alpha, dropout, targets,
   number of blocks, the Teacher config hash `teacher_config_sha256`, peft version). `load_lora` refuses a Teacher
   whose config hash differs, and any key or shape mismatch.
5. Counting. `count_lora_parameters` builds the Teacher on the meta device (nothing is allocated), injects the
   adapter and counts. Rank 64 on the 480p config: 141,557,760 parameters with `img_attn_prope_proj`
   (127,401,984 without).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import peft
import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.functional import delete_adapter
from peft.tuners.lora import LoraLayer
from torch import Tensor, nn

from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.io import atomic_write
from predictor_training.runtime.io import load_safetensors, open_safetensors, save_safetensors
from predictor_training.runtime.state_dicts import StateDictMismatchError, mismatch_report
from predictor_training.teacher.loading import read_checkpoint
from predictor_training.teacher.model import WorldPlayTransformer
from predictor_training.teacher.source import teacher_config_sha256

LORA_TARGETS = (
    "img_attn_q",
    "img_attn_k",
    "img_attn_v",
    "img_attn_proj",
    "img_attn_prope_proj",
    "img_mlp.fc1",
    "img_mlp.fc2",
)
LORA_TARGETS_WITHOUT_PROPE = tuple(target for target in LORA_TARGETS if target != "img_attn_prope_proj")
LORA_FILE_FORMAT = "predictor_training.teacher_lora"
LORA_FILE_VERSION = 1
_ADAPTER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BASE_LAYER = ".base_layer."
_LORA_KEY = re.compile(r"\.lora_[AB]\.")  # `<module>.lora_A.<adapter>.weight`: the only LoRA entries created here
_LORA_PREFIX = "lora_"
_LAYER_CACHE = "_predictor_training_lora_layers"
# peft warns when a second adapter is injected into a model that already has one; several are the point here.
_MULTIPLE_ADAPTERS_WARNING = "Already found a `peft_config` attribute in the model"


# ---------------------------------------------------------------------------------------------------------------
# 1. Specs and the registry of adapters
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraSpec:
    """One adapter: name, rank r, alpha (scaling = alpha / rank), dropout on the LoRA input, and the targets
    (module names inside each double block, a subset of `LORA_TARGETS`)."""

    name: str
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    def to_dict(self) -> dict:
        return {**asdict(self), "targets": list(self.targets)}


def _check_targets(targets: Sequence[str]) -> tuple[str, ...]:
    targets = tuple(targets)
    unknown = [target for target in targets if target not in LORA_TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        raise ValueError(f"LoRA targets must be distinct names from {list(LORA_TARGETS)}, got {list(targets)}")
    return tuple(target for target in LORA_TARGETS if target in targets)  # canonical order


def _target_regex(targets: Sequence[str]) -> str:
    """peft matches a string `target_modules` with re.fullmatch against each module name."""
    return r"double_blocks\.\d+\.(" + "|".join(re.escape(target) for target in targets) + ")"


def _registry(teacher: nn.Module) -> dict[str, LoraConfig]:
    return getattr(teacher, "peft_config", None) or {}


def adapter_names(teacher: nn.Module) -> list[str]:
    """Names of the adapters added to `teacher`, in the order they were added."""
    return list(_registry(teacher))


def _require_adapter(teacher: nn.Module, name: str) -> LoraConfig:
    registry = _registry(teacher)
    if name not in registry:
        raise KeyError(f"the Teacher has no LoRA adapter {name!r}; adapters: {list(registry)}")
    return registry[name]


def adapter_spec(teacher: nn.Module, name: str) -> LoraSpec:
    """The LoraSpec `name` was created with."""
    config = _require_adapter(teacher, name)
    wrapped = {module_name.split(".", 2)[2] for module_name, layer in _lora_layers(teacher) if name in layer.lora_A}
    targets = tuple(target for target in LORA_TARGETS if target in wrapped)
    return LoraSpec(name, int(config.r), float(config.lora_alpha), float(config.lora_dropout), targets)


def _lora_layers(teacher: nn.Module) -> list[tuple[str, LoraLayer]]:
    """(module name, peft LoRA layer) of every wrapped linear. Cached on the Teacher (walking the 480p Teacher's
    modules takes ~5 ms, and checkpointing asks once per block); `_refresh_lora_layers` after any injection."""
    cached = getattr(teacher, _LAYER_CACHE, None)
    return _refresh_lora_layers(teacher) if cached is None else cached


def _refresh_lora_layers(teacher: nn.Module) -> list[tuple[str, LoraLayer]]:
    layers = [(module_name, module) for module_name, module in teacher.named_modules()
              if isinstance(module, LoraLayer)]
    object.__setattr__(teacher, _LAYER_CACHE, layers)  # a plain attribute: not a registered sub-module list
    return layers


# ---------------------------------------------------------------------------------------------------------------
# 2. Adding, copying, deleting; parameters and trainability
# ---------------------------------------------------------------------------------------------------------------
def add_lora(
    teacher: WorldPlayTransformer,
    name: str,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    *,
    targets: Sequence[str] = LORA_TARGETS,
    trainable: bool = True,
    seed: int = 0,
) -> LoraSpec:
    """Add adapter `name` (lora_A: peft's Kaiming-uniform init drawn from `seed`, lora_B = 0, so the outputs do not
    change) on every double block's `targets`. The init comes from its own seeded generator, not from the caller's
    random state (which is per rank in training), so every rank of a run adds the same adapter and the global RNG is
    left as it was. Its parameters are FP32 whatever the Teacher's dtype, and require grad iff
    `trainable`; every base parameter of the Teacher is frozen. The new modules take the train/eval mode of the
    linear they wrap. The active adapter is left as it was.

    Shapes: lora_A [rank, in_features], lora_B [out_features, rank] per targeted linear.
    """
    if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
        raise ValueError(f"adapter name must be a python identifier, got {name!r}")
    if name in _registry(teacher):
        raise ValueError(f"the Teacher already has a LoRA adapter {name!r}; adapters: {adapter_names(teacher)}")
    if int(rank) != rank or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must lie in [0, 1), got {dropout!r}")
    targets = _check_targets(targets)
    # A rank past the narrowest targeted linear adds only parameters (the update is full-rank there already); a huge
    # one would exhaust the machine's memory before training starts.
    widths = [min(module.in_features, module.out_features) for module_name, module in teacher.named_modules()
              if isinstance(module, nn.Linear) and re.fullmatch(_target_regex(targets), module_name)]
    if widths and rank > min(widths):
        raise UserInputError(f"--lora_rank {rank}: larger than the narrowest adapted linear of the Teacher "
                             f"({min(widths)} features); expected 1..{min(widths)} (--train full for a full-rank "
                             "update)")
    previous = active_adapter(teacher)
    grad_flags = _lora_grad_flags(teacher)
    config = LoraConfig(
        r=int(rank), lora_alpha=alpha, lora_dropout=float(dropout), target_modules=_target_regex(targets),
        bias="none", init_lora_weights=True,
    )
    cuda_devices = sorted({param.device.index for param in teacher.parameters() if param.device.type == "cuda"})
    with warnings.catch_warnings(), torch.random.fork_rng(devices=cuda_devices):
        warnings.filterwarnings("ignore", message=re.escape(_MULTIPLE_ADAPTERS_WARNING))
        torch.random.default_generator.manual_seed(seed)
        for device in cuda_devices:
            torch.cuda.default_generators[device].manual_seed(seed)
        inject_adapter_in_model(config, teacher, adapter_name=name)
    for _, layer in _refresh_lora_layers(teacher):
        # New modules start in training mode: follow the wrapped linear's mode, so an eval-mode Teacher has no
        # active LoRA dropout.
        layer.train(layer.base_layer.training)
        if name in layer.lora_A:
            for module in (layer.lora_A[name], layer.lora_B[name]):
                if module.weight.dtype != torch.float32:  # (a no-op cast would still swap the parameter)
                    module.float()
    # peft made `name` the active (and trainable) adapter and may have flipped the others' requires_grad.
    _restore_grad_flags(grad_flags)
    set_active_adapter(teacher, previous)
    set_lora_trainable(teacher, name, trainable)
    if isinstance(teacher, WorldPlayTransformer):
        teacher.checkpoint_context_fn = _RecomputeWithForwardAdapter(teacher)
    return adapter_spec(teacher, name)


def named_lora_parameters(teacher: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """{"double_blocks.{i}.{target}.lora_A.weight" / "...lora_B.weight": parameter} of adapter `name`."""
    _require_adapter(teacher, name)
    named = {}
    for module_name, layer in _lora_layers(teacher):
        if name in layer.lora_A:
            named[f"{module_name}.lora_A.weight"] = layer.lora_A[name].weight
            named[f"{module_name}.lora_B.weight"] = layer.lora_B[name].weight
    return named


class AdapterWeights(nn.Module):
    """Adapter `name`'s parameters as a module of their own: the same Parameter objects (not copies), registered
    under their `named_lora_parameters` keys with "/" for "." (a module attribute cannot hold a dot). A training
    role holds this as its module, so checkpoints save, load and count exactly the adapter, never the frozen base.
    Not callable: the adapter runs inside the Teacher (`adapter(teacher, name)`)."""

    def __init__(self, teacher: nn.Module, name: str):
        super().__init__()
        self.adapter_name = name
        for key, parameter in named_lora_parameters(teacher, name).items():
            self.register_parameter(key.replace(".", "/"), parameter)

    def forward(self, *args, **kwargs):
        raise TypeError(f"AdapterWeights({self.adapter_name!r}) only holds the adapter's weights; run the Teacher "
                        f"with `adapter(teacher, {self.adapter_name!r})`")


def lora_parameters(teacher: nn.Module, name: str) -> list[nn.Parameter]:
    """Exactly adapter `name`'s parameters (lora_A, lora_B of each targeted linear), e.g. for its optimizer."""
    return list(named_lora_parameters(teacher, name).values())


def set_lora_trainable(teacher: nn.Module, name: str, trainable: bool) -> None:
    """requires_grad of adapter `name`'s parameters (e.g. freeze the real score while the fake score trains)."""
    for parameter in lora_parameters(teacher, name):
        parameter.requires_grad_(bool(trainable))


def copy_lora(teacher: WorldPlayTransformer, source: str, target: str, *, trainable: bool = True) -> LoraSpec:
    """New adapter `target` with `source`'s spec and a copy of its weights (e.g. a fake score initialised from the
    real score). The active adapter is left as it was."""
    spec = adapter_spec(teacher, source)
    add_lora(teacher, target, spec.rank, spec.alpha, spec.dropout, targets=spec.targets, trainable=trainable)
    source_parameters = named_lora_parameters(teacher, source)
    with torch.no_grad():
        for key, parameter in named_lora_parameters(teacher, target).items():
            parameter.copy_(source_parameters[key])
    return adapter_spec(teacher, target)


def delete_lora(teacher: nn.Module, name: str) -> None:
    """Remove adapter `name`; when it was the active one, the Teacher runs the base afterwards."""
    _require_adapter(teacher, name)
    previous = active_adapter(teacher)
    grad_flags = _lora_grad_flags(teacher)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
        delete_adapter(teacher, name, prefix=_LORA_PREFIX)
    del teacher.peft_config[name]
    _restore_grad_flags(grad_flags)  # (the deleted adapter's entries no longer matter)
    set_active_adapter(teacher, None if previous == name else previous)


# ---------------------------------------------------------------------------------------------------------------
# 3. Switching
# ---------------------------------------------------------------------------------------------------------------
def _lora_grad_flags(teacher: nn.Module) -> dict[nn.Parameter, bool]:
    flags = {}
    for _, layer in _lora_layers(teacher):
        for module_dict in (layer.lora_A, layer.lora_B):
            for module in module_dict.values():
                for parameter in module.parameters():
                    flags[parameter] = parameter.requires_grad
    return flags


def _restore_grad_flags(flags: Mapping[nn.Parameter, bool]) -> None:
    for parameter, flag in flags.items():
        parameter.requires_grad_(flag)


def active_adapter(teacher: nn.Module) -> str | None:
    """The adapter every wrapped layer runs, or None when they run the base (also when there is no adapter)."""
    states = {(bool(layer.disable_adapters), tuple(layer.active_adapters)) for _, layer in _lora_layers(teacher)}
    if not states:
        return None
    if len(states) == 1:
        disabled, active = next(iter(states))
        if disabled:
            return None
        if len(active) == 1:
            return active[0]
    raise RuntimeError(
        f"the Teacher's LoRA layers disagree on the active adapter ({sorted(states)}); switch adapters only through "
        "predictor_training.teacher.adapters (adapter / set_active_adapter)"
    )


def set_active_adapter(teacher: nn.Module, name: str | None) -> None:
    """Make `name` the one adapter that runs (None: the base Teacher), on every wrapped layer. requires_grad of the
    adapters is left as it is (peft's own switching would change it)."""
    if name is not None:
        _require_adapter(teacher, name)
    layers = _lora_layers(teacher)
    if not layers:
        return
    try:
        if active_adapter(teacher) == name:
            return
    except RuntimeError:
        pass  # inconsistent: set every layer below
    grad_flags = _lora_grad_flags(teacher)
    for _, layer in layers:
        if name is None:
            layer.enable_adapters(False)
        else:
            layer.set_adapter(name)
            layer.enable_adapters(True)
    _restore_grad_flags(grad_flags)


@contextlib.contextmanager
def adapter(teacher: nn.Module, name: str | None) -> Iterator[nn.Module]:
    """`with adapter(teacher, "real_score"): ...` runs the Teacher with that adapter only; `None` runs the frozen
    base. The previous selection is restored on exit (also on an exception); contexts nest."""
    previous = active_adapter(teacher)
    set_active_adapter(teacher, name)
    try:
        yield teacher
    finally:
        set_active_adapter(teacher, previous)


class _RecomputeWithForwardAdapter:
    """`context_fn` of the Teacher's block checkpoints: called at forward time, it returns (no-op context for the
    forward, a context that re-selects the adapter active NOW for the recomputation in backward)."""

    def __init__(self, teacher: nn.Module):
        self.teacher = teacher

    def __call__(self):
        return contextlib.nullcontext(), adapter(self.teacher, active_adapter(self.teacher))


# ---------------------------------------------------------------------------------------------------------------
# 4. The Teacher's own keys
# ---------------------------------------------------------------------------------------------------------------
def base_key(key: str) -> str | None:
    """The un-adapted Teacher's key for a state-dict key of an adapted Teacher (None for LoRA entries)."""
    if _LORA_KEY.search(key):
        return None
    return key.replace(_BASE_LAYER, ".")


def base_state_dict(teacher: nn.Module) -> dict[str, Tensor]:
    """The Teacher's state dict under its own keys (exactly those of the Teacher without adapters), LoRA entries
    left out. Tensors are the model's own (no copy)."""
    state = {}
    for key, tensor in teacher.state_dict().items():
        mapped = base_key(key)
        if mapped is not None:
            state[mapped] = tensor
    return state


def load_base_state_dict(teacher: nn.Module, state_dict: Mapping[str, Tensor], source: str = "state dict") -> None:
    """Load a Teacher state dict (the Teacher's own keys) strictly into `teacher`, adapted or not; adapter weights
    are left as they are. Raises StateDictMismatchError listing missing, unexpected and mismatched keys."""
    model_state = teacher.state_dict()
    own_key = {base_key(key): key for key in model_state if base_key(key) is not None}
    model_shapes = {key: tuple(model_state[full].shape) for key, full in own_key.items()}
    checkpoint_shapes = {key: tuple(value.shape) for key, value in state_dict.items()}
    missing, unexpected, mismatched, report = mismatch_report(model_shapes, checkpoint_shapes, source)
    if report:
        raise StateDictMismatchError(source, missing, unexpected, mismatched, report)
    renamed = {own_key[key]: value for key, value in state_dict.items()}
    result = teacher.load_state_dict(renamed, strict=False)
    not_loaded = [key for key in result.missing_keys if base_key(key) is not None]
    if not_loaded or result.unexpected_keys:
        raise RuntimeError(f"{source}: internal key mapping error ({not_loaded[:5]}, {result.unexpected_keys[:5]})")


def load_base_checkpoint(teacher: nn.Module, path: str | os.PathLike) -> None:
    """`load_base_state_dict` from a `.safetensors` file or sharded index (e.g. the WorldPlay action checkpoint)."""
    load_base_state_dict(teacher, read_checkpoint(path), source=str(path))


# ---------------------------------------------------------------------------------------------------------------
# 5. Adapter files
# ---------------------------------------------------------------------------------------------------------------
def lora_state_dict(teacher: nn.Module, name: str) -> dict[str, Tensor]:
    """Adapter `name`'s weights, detached FP32 CPU tensors keyed `double_blocks.{i}.{target}.lora_{A,B}.weight`."""
    return {key: parameter.detach().to("cpu", torch.float32).contiguous()
            for key, parameter in named_lora_parameters(teacher, name).items()}


def _expected_lora_shapes(teacher: WorldPlayTransformer, rank: int, targets: Sequence[str]) -> dict[str, tuple]:
    """The keys and shapes an adapter of this rank and targets has on `teacher` (computed, nothing added)."""
    shapes = {}
    for index, block in enumerate(teacher.double_blocks):
        for target in targets:
            linear = block.get_submodule(target)
            prefix = f"double_blocks.{index}.{target}"
            shapes[f"{prefix}.lora_A.weight"] = (rank, linear.in_features)
            shapes[f"{prefix}.lora_B.weight"] = (linear.out_features, rank)
    return shapes


def save_lora(
    teacher: WorldPlayTransformer, name: str, path: str | os.PathLike, metadata: Mapping | None = None
) -> Path:
    """Write adapter `name` as FP32 safetensors (atomically). Header metadata: "format", "lora_config" (JSON: the
    spec, num_layers, teacher_config_sha256, peft_version) and "metadata" (JSON of `metadata`, e.g. the step)."""
    spec = adapter_spec(teacher, name)
    config = {
        **spec.to_dict(),
        "format_version": LORA_FILE_VERSION,
        "num_layers": int(teacher.num_layers),
        "teacher_config_sha256": teacher_config_sha256(teacher),
        "peft_version": peft.__version__,
    }
    header = {
        "format": LORA_FILE_FORMAT,
        "lora_config": json.dumps(config, sort_keys=True),
        "metadata": json.dumps(dict(metadata or {}), sort_keys=True, allow_nan=False),
    }
    tensors = lora_state_dict(teacher, name)
    return atomic_write(path, lambda tmp: save_safetensors(tensors, tmp, header))


def read_lora_header(path: str | os.PathLike) -> dict:
    """{"lora_config": {...}, "metadata": {...}} of an adapter file written by `save_lora`."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"LoRA adapter file not found: {path}")
    with open_safetensors(path) as handle:
        header = handle.metadata() or {}
    if header.get("format") != LORA_FILE_FORMAT:
        raise UserInputError(f"{path} is not a Teacher LoRA adapter file (format {header.get('format')!r}, expected "
                             f"{LORA_FILE_FORMAT!r})")
    fields = {}
    for field in ("lora_config", "metadata"):
        try:
            fields[field] = json.loads(header[field])
        except (KeyError, json.JSONDecodeError) as error:
            raise UserInputError(f"{path}: the header's {field!r} field is missing or not valid JSON ({error!r}); "
                                 "expected an adapter file as save_lora wrote it") from None
    config = fields["lora_config"]
    if not isinstance(config, dict) or config.get("format_version") != LORA_FILE_VERSION:
        version = config.get("format_version") if isinstance(config, dict) else None
        raise UserInputError(f"{path}: LoRA file version {version}, this code reads {LORA_FILE_VERSION}")
    return fields


def load_lora(
    teacher: WorldPlayTransformer, path: str | os.PathLike, name: str | None = None, *, trainable: bool = False
) -> LoraSpec:
    """Add the adapter stored in `path` to `teacher` as `name` (default: the saved name), frozen unless `trainable`.

    Refuses (ValueError, nothing added) a Teacher whose config hash differs from the one the adapter was trained
    on, a file whose keys or shapes do not fit, and a name the Teacher already has. The active adapter is left as
    it was: select it with `adapter(teacher, name)`.
    """
    path = Path(path)
    header = read_lora_header(path)
    config = header["lora_config"]
    name = config["name"] if name is None else name
    actual_sha = teacher_config_sha256(teacher)
    if config["teacher_config_sha256"] != actual_sha:
        raise ValueError(
            f"{path}: LoRA adapter {config['name']!r} was trained on a Teacher with config sha256 "
            f"{config['teacher_config_sha256'][:12]}..., this Teacher has {actual_sha[:12]}...; refusing to load it"
        )
    targets = _check_targets(config["targets"])
    tensors = load_safetensors(path)
    expected = _expected_lora_shapes(teacher, int(config["rank"]), targets)
    found = {key: tuple(value.shape) for key, value in tensors.items()}
    missing, unexpected, mismatched, report = mismatch_report(expected, found, f"{path} (LoRA adapter {name!r})")
    if report:
        raise StateDictMismatchError(str(path), missing, unexpected, mismatched, report)
    add_lora(teacher, name, int(config["rank"]), float(config["alpha"]), float(config["dropout"]), targets=targets,
             trainable=trainable)
    with torch.no_grad():
        for key, parameter in named_lora_parameters(teacher, name).items():
            parameter.copy_(tensors[key])
    return adapter_spec(teacher, name)


# ---------------------------------------------------------------------------------------------------------------
# 6. Parameter count without allocating
# ---------------------------------------------------------------------------------------------------------------
def count_lora_parameters(
    config: str | Mapping = "worldplay_480p_i2v", rank: int = 64, targets: Sequence[str] = LORA_TARGETS
) -> int:
    """Parameters of one rank-`rank` adapter on a Teacher of `config` (a preset name or config.json-style
    constructor arguments), counted on the meta device: nothing is allocated. Each targeted linear adds
    rank * (in_features + out_features)."""
    with torch.device("meta"):
        if isinstance(config, str):
            teacher = WorldPlayTransformer.from_preset(config)
        else:
            arguments = WorldPlayTransformer.constructor_arguments(config, source="count_lora_parameters")
            teacher = WorldPlayTransformer(**arguments)
        add_lora(teacher, "count", rank, alpha=float(rank), targets=targets)
    return sum(parameter.numel() for parameter in lora_parameters(teacher, "count"))
