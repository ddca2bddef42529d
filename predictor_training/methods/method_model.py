"""The model a generic method (fvtools/) trains: a LoRA on the Teacher, or all parameters of a Teacher-shaped model.

    --train lora   the Teacher (frozen, in the precision's frozen dtype) + one LoRA adapter on its image-stream
                   linears (`adapters.py`, FP32); the role holds only the adapter (`AdapterWeights`), whose
                   gradients are averaged over ranks after backward (the frozen base is not DDP-wrapped).
    --train full   every parameter, FP32 master weights (autocast per --precision); under a process group the
                   model is sharded with FSDP2 (`fsdp.shard_model`), since the real 8.6B Teacher with AdamW does not
                   fit in a DDP replica. --init_weights teacher starts from the Teacher's weights, scratch from a
                   fresh initialisation of the same config (seeded, identical on every rank).

Either way the method calls `model.text_prefill / context_prefill / chunk_step` exactly as the AR loop does, and
the trained result is exported next to the checkpoints by `export_method_model`: a LoRA file (`save_lora`, loadable
with `load_lora`) or a Teacher folder (config.json + safetensors, loadable as `--teacher`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import safetensors.torch
import torch

from predictor_training.runtime.errors import MissingFileError
from predictor_training.teacher.adapters import (
    AdapterWeights,
    adapter_spec,
    add_lora,
    count_lora_parameters,
    lora_parameters,
    save_lora,
    set_active_adapter,
)
from predictor_training.runtime.distributed import DistEnv, barrier
from predictor_training.runtime.fsdp import gather_full_model_state, is_fsdp, shard_model
from predictor_training.runtime.io import read_json_file
from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.predictor.model import build_predictor
from predictor_training.runtime.roles import Role
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.model import WorldPlayTransformer
from predictor_training.teacher.source import TeacherSource, load_teacher

TRAIN_MODES = ("lora", "full")
INIT_WEIGHTS = ("teacher", "scratch")
MODEL_FOLDER = "model"  # full-parameter export: <run_dir>/model/{config.json, diffusion_pytorch_model.safetensors}
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


@dataclass
class MethodModel:
    """model: what the method calls (the adapter active, or the possibly sharded model); role: the trained role;
    mode: "lora" | "full"; adapter: the adapter's name in lora mode."""

    model: WorldPlayTransformer
    role: Role
    mode: str
    adapter: str | None = None

    @property
    def trains_text_stream(self) -> bool:
        """Whether the text-stream weights train (then the text K/V must be the model's own, under grad)."""
        return self.mode == "full"

    def trainable_parameter_count(self) -> int:
        """Trained parameters (a sharded parameter counts its global size)."""
        return sum(param.numel() for param in self.role.parameters)

    def describe(self) -> str:
        """One line: the role, what trains and how many parameters."""
        count = self.trainable_parameter_count()
        if self.mode == "lora":
            spec = adapter_spec(self.model, self.adapter)
            return (f"{self.role.name}: LoRA rank {spec.rank}, alpha {spec.alpha:g} on {len(spec.targets)} image-stream "
                    f"linears per block of the frozen Teacher: {count:,} parameters")
        sharded = " (FSDP2-sharded)" if is_fsdp(self.model) else ""
        return f"{self.role.name}: every parameter{sharded}: {count:,}"


@dataclass(frozen=True)
class MethodSettings:
    """What `build_method_model` builds from, named as the method flags (recipes/flags.py add_method_model_args,
    add_method_optimization_args, add_run_args; `flags.settings_from_flags(MethodSettings, args)`).

    train: "lora" | "full"; init_weights: "teacher" | "scratch" (full only); lora_rank, lora_alpha: the adapter
    (lora only); gradient_checkpointing: of the model's blocks; lr, warmup_steps, max_steps: the peak LR and the
    warmup + cosine in loop steps; adam_beta1, adam_beta2, weight_decay: AdamW; grad_clip: the role's clip (-1 =
    measure only); seed: the adapter's or the fresh model's initialisation (the same on every rank)."""

    train: str
    init_weights: str
    lora_rank: int
    lora_alpha: float
    gradient_checkpointing: bool
    lr: float
    warmup_steps: int
    max_steps: int
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    grad_clip: float
    seed: int


def method_meta(method: str, *, train: str, precision: str, lora_rank: int) -> dict:
    """The checkpoint meta of a method run; a resume must match it (`load_training_state(expect=...)`)."""
    return {"method": method, "train": train, "precision": precision,
            "lora_rank": lora_rank if train == "lora" else None}


def build_fresh_model(source: TeacherSource, seed: int) -> WorldPlayTransformer:
    """A model of the Teacher folder's config, freshly initialised from `seed` (same weights on every rank; the
    global RNG is left as it was)."""
    config_path = Path(source.folder) / "config.json"
    config = read_json_file(config_path)
    arguments = WorldPlayTransformer.constructor_arguments(config, source=str(config_path))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return WorldPlayTransformer(**arguments)


def build_method_model(source: TeacherSource, settings: MethodSettings, env: DistEnv, policy: PrecisionPolicy, *,
                       role_name: str, base_model: WorldPlayTransformer | None = None, every: int = 1,
                       shard: bool = True, load_teacher=load_teacher) -> MethodModel:
    """The trained model and its role from `settings` (train, init_weights, lora_rank, lora_alpha,
    gradient_checkpointing, lr, warmup_steps, max_steps, adam_beta1/2, weight_decay, grad_clip, seed). The optimizer
    is AdamW over one group named `role_name`, with the warmup + cosine schedule over the role's own updates
    (max_steps // every, warmup_steps // every).

    base_model: for a LoRA, the already loaded Teacher to put the adapter on (shared with other roles; the adapter
    is then not made the active one: each call selects its own) instead of loading a second one. every: the role's
    cadence in loop steps. shard: FSDP2-shard a full model over the ranks (else it is replicated, its gradients
    all-reduced). load_teacher: `(source, device, dtype) -> model`, the Teacher folder's loader (a memory rehearsal
    builds the model from its config instead)."""
    if settings.train == "lora":
        model = base_model if base_model is not None else load_teacher(source, env.device, policy.frozen_dtype)
        add_lora(model, role_name, settings.lora_rank, settings.lora_alpha, seed=settings.seed)  # alike on every rank
        if base_model is None:
            set_active_adapter(model, role_name)
        raw_module, grad_sync, adapter_name = AdapterWeights(model, role_name), "all_reduce", role_name
        parameters = lora_parameters(model, role_name)
    else:
        if settings.init_weights == "teacher":
            model = load_teacher(source, env.device, torch.float32)
        else:
            model = build_fresh_model(source, settings.seed).to(env.device)
        model.requires_grad_(True).train()
        if shard and env.distributed:
            model = shard_model(model, env)  # build the optimizer afterwards: it must hold the shards
        raw_module, grad_sync, adapter_name = model, ("none" if shard else "all_reduce"), None
        parameters = [param for param in model.parameters() if param.requires_grad]
    model.set_gradient_checkpointing(settings.gradient_checkpointing)
    optimizer = build_optimizer({role_name: parameters}, {role_name: settings.lr},
                                betas=(settings.adam_beta1, settings.adam_beta2), weight_decay=settings.weight_decay)
    schedule = WarmupCosineSchedule(optimizer, warmup_steps=settings.warmup_steps // every,
                                    max_steps=settings.max_steps // every)
    role = Role(role_name, raw_module, optimizer, schedule, every=every, grad_clip=settings.grad_clip,
                grad_sync=grad_sync)
    return MethodModel(model, role, settings.train, adapter_name)


def export_method_model(method_model: MethodModel, run_dir: Path, metadata: dict, env: DistEnv) -> Path:
    """Write the trained result for inference (a collective: call on every rank; rank 0 writes).

    lora: `<run_dir>/lora_<adapter>.safetensors` (`save_lora`: FP32, its config in the header). full:
    `<run_dir>/model/` with config.json and the full FP32 state, written to a staging folder and renamed into
    place, so a reader never sees a half-written model. Returns the path. A sharded model is gathered for this
    export only (the training checkpoints are sharded, runtime/sharded_checkpoint.py): the model alone, one tensor
    at a time onto rank 0's CPU (`fsdp.gather_full_model_state`; 34 GB at 8.6B parameters, no optimizer state);
    `tools/convert_sharded_checkpoint.py` makes the same weights from a checkpoint without any process group."""
    run_dir = Path(run_dir)
    if method_model.mode == "lora":
        path = run_dir / f"lora_{method_model.adapter}.safetensors"
        if env.is_main:
            save_lora(method_model.model, method_model.adapter, path, metadata)
        barrier()
        return path
    state = gather_full_model_state(method_model.model, torch.float32)
    folder = run_dir / MODEL_FOLDER
    if env.is_main:
        staging = run_dir / f".{MODEL_FOLDER}.writing"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        method_model.model.save_config(str(staging))
        # save_config records the folder the model was loaded from (an absolute path of this machine); drop it.
        config_path = staging / "config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if config.pop("_name_or_path", None) is not None:
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        tensors = {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in state.items()}
        safetensors.torch.save_file(tensors, str(staging / WEIGHTS_NAME),
                                    metadata={"metadata": json.dumps(metadata, sort_keys=True)})
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    barrier()
    return folder



def _config_arguments(config: str) -> dict:
    """Constructor arguments of a preset name or a config.json path."""
    path = Path(config)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise MissingFileError(f"Teacher config not found: {path}")
        return WorldPlayTransformer.constructor_arguments(read_json_file(path), str(path))
    return preset_config(config)


def dry_run_report(config: str, roles: dict[str, str], *, lora_rank: int, world_size: int = 8,
                   predictor_blocks: Sequence[int] | None = None) -> str:
    """Parameter counts of a method's roles at the size of `config` (a Teacher preset such as worldplay_480p_i2v,
    or a config.json), the model built on the meta device (nothing allocated).

    roles: {role name: "lora" | "full" | "frozen" | "predictor"} ("predictor": a v4 Predictor on the Teacher's
    `predictor_blocks`, replicated under DDP). Memory figures: bf16 frozen weights (2 bytes each); a trained
    parameter holds FP32 weight, gradient and two AdamW moments (16 bytes), divided over `world_size` ranks when
    FSDP2 shards it."""
    arguments = _config_arguments(config)
    with torch.device("meta"):
        teacher = WorldPlayTransformer(**arguments)
        total = sum(param.numel() for param in teacher.parameters())
        predictor = 0
        if predictor_blocks is not None:
            predictor = sum(param.numel() for param in build_predictor(teacher, "v4", tuple(predictor_blocks)).parameters()
                            if param.requires_grad)
    lora = count_lora_parameters(arguments, rank=lora_rank)
    lines = [f"Teacher config {config}: {arguments['mm_double_blocks_depth']} double blocks, hidden "
             f"{arguments['hidden_size']}: {total:,} parameters ({2 * total / 1e9:.1f} GB in bf16)",
             f"one LoRA adapter, rank {lora_rank}, on the image-stream linears: {lora:,} parameters "
             f"({16 * lora / 1e9:.2f} GB trained: FP32 weights, gradients, AdamW moments)"]
    for name, mode in roles.items():
        if mode == "lora":
            lines.append(f"role {name}: LoRA rank {lora_rank}: {lora:,} trained parameters on the shared frozen base")
        elif mode == "predictor":
            lines.append(f"role {name}: v4 Predictor on Teacher blocks {list(predictor_blocks)}: {predictor:,} trained "
                         f"parameters ({16 * predictor / 1e9:.1f} GB in FP32 with AdamW, on every rank under DDP)")
        elif mode == "full":
            lines.append(f"role {name}: every parameter: {total:,} trained ({16 * total / 1e9:.0f} GB in FP32 with "
                         f"AdamW: {16 * total / 1e9 / world_size:.1f} GB per rank under FSDP2 on {world_size} ranks)")
        else:
            lines.append(f"role {name}: frozen: {total:,} parameters (shares the base)")
    return "\n".join(lines)
