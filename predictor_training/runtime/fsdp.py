"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for full-parameter training of a WorldPlay Teacher-shaped model.

    env = init_distributed("auto")                  # torchrun: nccl on GPU, gloo on CPU
    model = shard_model(model.to(env.device), env)  # each double block, then the root, on a 1-D mesh
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)   # AFTER shard_model: it must hold the DTensors
    with gradient_sync(model, enabled=sync):        # DDP: no all-reduce on accumulation micro-batches
        loss = flow_matching_loss(model.chunk_step(...)); loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # DTensor grads: a global norm
    optimizer.step(); optimizer.zero_grad()
    model_state, optimizer_state = full_state_dicts(model, optimizer)    # collective; full CPU tensors on rank 0
    load_full_state_dicts(model, optimizer, model_state, optimizer_state) # collective; any world size
    weights = gather_full_model_state(model, torch.bfloat16)            # collective; the model alone, on rank 0
    # training checkpoints: sharded with DCP, runtime/sharded_checkpoint.py (via checkpoint.save_training_state)

1. Sharding. `shard_model` calls `fully_shard` on every `double_blocks[i]`, then on the root, on a 1-D device mesh
   over all ranks (`env.device.type`: "cuda" with nccl, "cpu" with gloo). FSDP2 hooks only `nn.Module.__call__`,
   and the Teacher is driven through methods (`chunk_step`, `text_prefill`, `context_prefill` on the root;
   `image_forward`, `image_kv`, `text_forward` on each block), so those are registered with
   `register_fsdp_forward_method`; without it a block's parameters would stay sharded inside `chunk_step`.
   Every module, the root included, reshards after each forward (`reshard_after_forward=True`): FSDP2's default
   keeps the root unsharded after a forward, and after a no-grad forward (a prefill) nothing reshards it, so
   `model.parameters()` would return the unsharded plain tensors and an optimizer built then would silently never
   update the root's parameters.
2. CPU / gloo. FSDP2 runs on CPU with gloo in torch 2.14.1 (all-gather, reduce-scatter, DTensor AdamW,
   `clip_grad_norm_` on DTensor grads, activation checkpointing recompute), which is what the tests use. Each
   forward warns once per module class that an FSDP module "returned a view tensor" (`image_forward` ends with
   `flatten`, `chunk_step` with `unpatchify`'s permute); harmless as long as no caller modifies a returned tensor
   in place. The nccl/GPU path is the same code but has not been run yet; LoRA adapters on a sharded Teacher are
   not covered (LoRA runs use DDP).
3. State dicts. `full_state_dicts` / `load_full_state_dicts` go through `torch.distributed.checkpoint.state_dict`
   (`get_state_dict` / `set_model_state_dict` / `set_optimizer_state_dict` with `full_state_dict=True`,
   `cpu_offload=True`). Supported:
   * the model state is the plain module's `state_dict()` (same keys and full shapes, CPU), so it loads into an
     unsharded model with `load_state_dict`, and a plain model's state dict loads into a sharded one;
   * the optimizer state is keyed by parameter name (DCP's format: `state[fqn]`, `param_groups[i]["params"]` =
     fqns), independent of the world size: a `training_latest.pt` written by rank 0 resumes on the same or another
     world size. A plain torch optimizer state dict (integer ids, `optimizer.state_dict()` of an unsharded run with
     the same parameter groups) is accepted too and mapped to names by the optimizer's parameter order;
   * parameters that have no optimizer state yet (never received a gradient, e.g. text-stream weights under a
     chunk-step-only loss) stay without state after loading, as in an uninterrupted run;
   * `broadcast_from_rank0=True`: only rank 0 passes the state dicts (others pass None) and rank 0 broadcasts;
     this keeps one full copy in CPU memory instead of one per rank (8.6 B parameters: ~34 GB weights + ~69 GB
     AdamW moments in FP32). The model may then be materialised from the meta device: build on meta,
     `shard_model`, `model.to_empty(device=env.device)`, then load.
   Not supported: FSDP1, and changing the parameter groups between save and load (refused with the differing
   names). Training checkpoints of FSDP roles no longer go through these helpers: they are sharded, each rank
   writing its own shards with `torch.distributed.checkpoint` (`runtime/sharded_checkpoint.py`); these helpers
   remain for full-state files (a whole-model export, old `training_latest.pt` files that hold the full state).
   `gather_full_model_state` gathers the model alone, one tensor at a time, cast to the dtype it is written in
   (the role's BF16 inference weights, the FP32 Teacher-folder export), without the optimizer state.
4. `is_fsdp(module)` tells the loop that a module is FSDP2-sharded (no DDP wrapper, no `unwrap_model`, state
   through these helpers); `gradient_sync` is the FSDP2 / DDP / plain `no_sync`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from predictor_training.runtime.distributed import DistEnv, maybe_no_sync
from predictor_training.runtime.state_dicts import StateDictMismatchError, mismatch_report

ROOT_FORWARD_METHODS = ("chunk_step", "context_prefill", "text_prefill")
BLOCK_FORWARD_METHODS = ("image_forward", "image_kv", "text_forward")


# ---------------------------------------------------------------------------------------------------------------
# 1. Sharding
# ---------------------------------------------------------------------------------------------------------------
def is_fsdp(module: nn.Module) -> bool:
    """True when `module` was passed to FSDP2's `fully_shard` (its parameters are DTensor shards)."""
    return isinstance(module, FSDPModule)


def device_mesh(env: DistEnv) -> DeviceMesh:
    """The 1-D mesh over all ranks of the job, on `env.device`'s type (needs a process group)."""
    if not env.distributed:
        raise RuntimeError(
            "FSDP needs a process group: launch with torchrun (`--nproc_per_node 1` for a single process)"
        )
    return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("fsdp",))


def shard_model(
    model: nn.Module,
    env: DistEnv,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    block_attribute: str = "double_blocks",
) -> nn.Module:
    """Shard `model` in place with FSDP2 and return it: `fully_shard` on each `model.<block_attribute>[i]`, then on
    the root, all on `device_mesh(env)`, resharding after every forward. The forward methods the Teacher is driven
    by (`ROOT_FORWARD_METHODS`, `BLOCK_FORWARD_METHODS`, those that exist) are registered with FSDP.

    The model must be on `env.device` or on the meta device (then `model.to_empty(device=env.device)` and
    `load_full_state_dicts`). Build the optimizer afterwards from `model.parameters()`. `mp_policy`: e.g.
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)` on GPU (sharded FP32 masters).
    """
    if is_fsdp(model):
        raise ValueError(f"{type(model).__name__} is already sharded with FSDP")
    blocks = getattr(model, block_attribute, None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(f"shard_model: {type(model).__name__}.{block_attribute} must be a non-empty nn.ModuleList")
    devices = {parameter.device.type for parameter in model.parameters()} - {"meta"}
    if devices - {env.device.type}:
        raise ValueError(f"shard_model: the model has parameters on {sorted(devices)}; move it to {env.device} "
                         "(or build it on the meta device) first")
    mesh = device_mesh(env)
    kwargs = {"mesh": mesh, "reshard_after_forward": True}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for block in blocks:
        fully_shard(block, **kwargs)
        for method in BLOCK_FORWARD_METHODS:
            if hasattr(block, method):
                register_fsdp_forward_method(block, method)
    fully_shard(model, **kwargs)
    for method in ROOT_FORWARD_METHODS:
        if hasattr(model, method):
            register_fsdp_forward_method(model, method)
    return model


def gradient_sync(module: nn.Module, enabled: bool):
    """Context of a backward that reduces gradients across ranks (enabled: the step's last micro-batch or chunk) or
    may leave them to a later backward (an accumulation micro-batch): DDP `no_sync` when not enabled, nothing for a
    plain module, and nothing for FSDP2 either: an FSDP2 module reduce-scatters after every backward. Skipping that
    (`set_requires_gradient_sync(False)`) would keep every block's unsharded FP32 gradient, the full model's size
    (32 GiB at the real config), on each rank until the step's last backward; the sharded gradients accumulate
    instead, for one reduce-scatter per block and backward (same sum, other rounding)."""
    if is_fsdp(module):
        return contextlib.nullcontext()
    return maybe_no_sync(module, enabled=not enabled)


# ---------------------------------------------------------------------------------------------------------------
# 2. Full state dicts
# ---------------------------------------------------------------------------------------------------------------
def _parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(parameter): name for name, parameter in model.named_parameters()}


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The names of the optimizer's parameters, group by group; raises if it holds a tensor the model does not
    (an optimizer built before `shard_model`)."""
    names = _parameter_names(model)
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        unknown = sum(id(parameter) not in names for parameter in group["params"])
        if unknown:
            raise ValueError(
                f"optimizer group {index} holds {unknown} tensors that are not parameters of "
                f"{type(model).__name__}; build the optimizer after shard_model, from model.parameters()"
            )
        groups.append([names[id(parameter)] for parameter in group["params"]])
    return groups


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def named_param_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's parameter groups with parameter names in `params` (DCP's name-keyed format)."""
    return [{**{key: value for key, value in group.items() if key != "params"}, "params": names}
            for group, names in zip(optimizer.param_groups, _optimizer_names(model, optimizer))]


def gather_full_model_state(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's full state dict on rank 0 as CPU tensors (floating ones cast to `dtype` when given), `{}` on the
    other ranks. A collective. Gathers one tensor at a time (`DTensor.full_tensor`) and casts it before the next, so
    rank 0's peak is the model in `dtype` plus one full tensor: no optimizer state, no second FP32 copy."""
    rank = _rank()
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()  # collective, the same order on every rank
        if rank == 0:
            if dtype is not None and torch.is_floating_point(tensor):
                tensor = tensor.to(dtype)
            state[name] = tensor.to("cpu", copy=True) if tensor.device.type != "cpu" else tensor.clone()
    return state


def full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, torch.Tensor], dict | None]:
    """(model state, optimizer state) as full, unsharded CPU tensors on rank 0; `{}` (and `{}`) on the other ranks
    of a process group.

    A collective: call it on every rank. Works for plain (unsharded) modules too. Where no gather is needed (world
    size 1, plain modules) the tensors share memory with the live parameters and optimizer state, as
    `state_dict()` does: write them out before the next optimizer step.
    The optimizer state is keyed by parameter name; None when `optimizer` is None. An optimizer without state yet
    gives `{"state": {}, "param_groups": [...]}` (DCP would otherwise take a zero-gradient step to create state).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        model_state, _ = get_state_dict(model, [], options=options)
        return model_state, None
    group_names = _optimizer_names(model, optimizer)
    if optimizer.state:
        return get_state_dict(model, optimizer, options=options)
    model_state, _ = get_state_dict(model, [], options=options)
    if _rank() == 0:
        groups = [{**{key: value for key, value in group.items() if key != "params"}, "params": names}
                  for group, names in zip(optimizer.param_groups, group_names)]
        return model_state, {"state": {}, "param_groups": groups}
    return model_state, {}


def _named_optimizer_state(optimizer_state: Mapping, group_names: list[list[str]]) -> dict:
    """A plain torch optimizer state dict (integer ids in parameter order) -> the name-keyed format."""
    flat_names = [name for names in group_names for name in names]
    saved_ids = [pid for group in optimizer_state["param_groups"] for pid in group["params"]]
    if saved_ids != list(range(len(flat_names))) or [len(g["params"]) for g in optimizer_state["param_groups"]] != [
        len(names) for names in group_names
    ]:
        raise ValueError(
            f"the optimizer state's parameter groups ({[len(g['params']) for g in optimizer_state['param_groups']]} "
            f"ids) do not match this optimizer's ({[len(names) for names in group_names]} parameters)"
        )
    return {
        "state": {flat_names[pid]: value for pid, value in optimizer_state["state"].items()},
        "param_groups": [{**group, "params": names}
                         for group, names in zip(optimizer_state["param_groups"], group_names)],
    }


def _check_model_state(model: nn.Module, model_state: Mapping[str, torch.Tensor]) -> str:
    model_shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    found = {key: tuple(value.shape) for key, value in model_state.items()}
    return mismatch_report(model_shapes, found, "model state")[3]


def _check_optimizer_groups(optimizer_state: Mapping, group_names: list[list[str]]) -> str:
    saved = [list(group["params"]) for group in optimizer_state["param_groups"]]
    if saved == group_names:
        return ""
    if len(saved) != len(group_names):
        return f"optimizer state has {len(saved)} parameter groups, this optimizer {len(group_names)}"
    problems = []
    for index, (saved_names, names) in enumerate(zip(saved, group_names)):
        missing, extra = sorted(set(names) - set(saved_names)), sorted(set(saved_names) - set(names))
        if missing or extra:
            problems.append(f"group {index}: {len(missing)} not saved {missing[:5]}, {len(extra)} not in this "
                            f"optimizer {extra[:5]}")
        elif saved_names != names:
            problems.append(f"group {index}: same parameters in another order")
    return "optimizer state does not match this optimizer's parameter groups: " + "; ".join(problems)


def _raise_together(message: str, broadcast_from_rank0: bool) -> None:
    """Raise `message` (if any) on every rank; with broadcast_from_rank0 only rank 0 could check."""
    if dist.is_available() and dist.is_initialized():
        messages = [message]
        if broadcast_from_rank0:
            dist.broadcast_object_list(messages, src=0)
        else:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, message)
            messages = [next((text for text in gathered if text), "")]
        message = messages[0]
    if message:
        raise StateDictMismatchError("state dict", [], [], [], message)


def load_full_state_dicts(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state: Mapping[str, torch.Tensor] | None,
    optimizer_state: Mapping | None = None,
    *,
    broadcast_from_rank0: bool = False,
) -> None:
    """Load full (unsharded) state dicts into a sharded (or plain) model and its optimizer. A collective.

    model_state: the (not DDP-wrapped) model's `state_dict()` keys, full shapes, any device; optimizer_state:
    `full_state_dicts`'s name-keyed format or a plain torch optimizer state dict (integer ids), None to leave the
    optimizer alone.
    Every rank passes the dicts, or with `broadcast_from_rank0` only rank 0 (the others pass None). Keys, shapes
    and parameter groups are checked first (StateDictMismatchError on every rank). Parameters without saved
    optimizer state are left without state. The optimizer's hyper-parameters (lr, betas, ...) are the saved ones.
    """
    rank = _rank()
    broadcast_from_rank0 = broadcast_from_rank0 and dist.is_available() and dist.is_initialized()
    has_data = rank == 0 or not broadcast_from_rank0
    group_names = None if optimizer is None else _optimizer_names(model, optimizer)
    # 1. Checks (on the ranks that hold the dicts), raised on every rank together.
    problem = ""
    if has_data:
        if model_state is None:
            problem = f"rank {rank}: no model state passed"
        else:
            problem = _check_model_state(model, model_state)
        if not problem and optimizer is not None:
            if optimizer_state is None:
                problem = f"rank {rank}: no optimizer state passed"
            else:
                if all(isinstance(key, int) for key in optimizer_state["state"]) and all(
                    isinstance(pid, int) for group in optimizer_state["param_groups"] for pid in group["params"]
                ):
                    try:
                        optimizer_state = _named_optimizer_state(optimizer_state, group_names)
                    except ValueError as error:
                        problem = str(error)
                problem = problem or _check_optimizer_groups(optimizer_state, group_names)
    _raise_together(problem, broadcast_from_rank0)
    # 2. Model.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=True)
    set_model_state_dict(model, dict(model_state) if has_data else {}, options=options)
    if optimizer is None:
        return
    # 3. Optimizer. strict=False admits parameters without state; DCP first creates state for every parameter
    # (a zero-gradient step at lr 0, weights unchanged), so the entries that were not saved are dropped after.
    saved_names = set(optimizer_state["state"]) if has_data else None
    if broadcast_from_rank0:
        shared = [saved_names]
        dist.broadcast_object_list(shared, src=0)
        saved_names = shared[0]
    tuple_keys = [{key for key, value in group.items() if isinstance(value, tuple)} for group in optimizer.param_groups]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast_from_rank0, strict=False)
    set_optimizer_state_dict(model, optimizer, dict(optimizer_state) if has_data else {}, options=options)
    names = _parameter_names(model)
    for group, keys in zip(optimizer.param_groups, tuple_keys):
        for parameter in group["params"]:
            if names[id(parameter)] not in saved_names:
                optimizer.state.pop(parameter, None)
        for key in keys:  # DCP's broadcast turns tuples (AdamW betas) into lists
            if isinstance(group.get(key), list):
                group[key] = tuple(group[key])
