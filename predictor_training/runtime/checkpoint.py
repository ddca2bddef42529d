"""Training checkpoints (`training_latest.pt`) and inference weights (`predictor_step_XXXXX.safetensors`).

* `training_latest.pt` holds everything a lossless resume needs: the FP32 model state of the unwrapped module,
  the optimizer, the LR schedule, the run state (global/micro step, epoch, data position), the RNG states of
  every rank (python, numpy, torch CPU, CUDA), the config and `meta` (variant, source_blocks, precision).
  It loads with `torch.load(weights_only=True)`: everything in it is tensors or plain python values.
* `predictor_step_XXXXX.safetensors` holds inference weights only (BF16 by default) plus JSON metadata, with the
  sha256 of its tensors (`tensors_sha256`), checked whenever the weights are loaded (files written before it
  existed load unchecked): `runtime/inference_weights.py`. `load_model_weights` loads either kind into a model.
* Weights are checked finite whenever they are loaded (a resume, --init_from, eval's --ckpt): NaN/Inf in a file is
  refused with one line naming it, as a damaged or mismatched checkpoint is (`UserInputError` subclasses;
  `runtime/checkpoint_checks.py`).
* Every write is atomic (temp file in the same folder, fsync, `os.replace`), and nothing non-finite is ever
  written, so the last good checkpoint survives a crash, a SIGKILL or a NaN.
* A role whose module is FSDP2-sharded (`predictor_training.runtime.fsdp`) is saved sharded: each rank writes its
  own shards of the model and optimizer with `torch.distributed.checkpoint` into `training_latest.dcp/` next to the
  file (`runtime/sharded_checkpoint.py`: staged folder, renamed into place before the `.pt` is replaced, paired by
  a token; the previous one is kept as `training_prev.dcp/`), and the `.pt` keeps the role's schedule, update
  count, parameter groups and the folder's token. Nothing is gathered on one rank except the model alone, one
  tensor at a time in BF16, for the role's inference weights. `sharded=False` writes the old full-state format
  (`full_state_dicts`), which still loads (`load_full_state_dicts`).
"""

from __future__ import annotations

import os
import pickle
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from predictor_training.runtime.checkpoint_checks import (
    CheckpointMismatchError,
    NonFiniteError,
    check_finite_file_weights,
    check_finite_tensors,
    check_state_matches,
    compare_expect,
    json_plain,
    non_finite_names,
    require_file,
)
from predictor_training.runtime.distributed import all_gather_objects, barrier, current_rank, unwrap_model
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.inference_weights import read_inference_metadata, read_inference_weights
from predictor_training.runtime.io import atomic_write, redact_secrets
from predictor_training.runtime.roles import module_is_fsdp
from predictor_training.runtime.sharded_checkpoint import (
    load_sharded_roles,
    publish_sharded_folder,
    read_sharded_state,
    referenced_tokens,
    save_sharded_roles,
    sharded_folder_for,
)

TRAINING_STATE_NAME = "training_latest.pt"
# The state before the latest one, kept as the fallback when the latest is damaged (e.g. a truncated copy).
PREVIOUS_TRAINING_STATE_NAME = "training_prev.pt"
CHECKPOINTS_KEY = "written_checkpoints"  # the training state's record of the step files its run wrote
TRAINING_STATE_FORMAT = "predictor_training.training_state"
TRAINING_STATE_VERSION = 2  # 2: one entry per role; 1 (single Predictor, top-level model/optimizer) still loads
REQUIRED_META_KEYS = ("precision",)  # a Predictor recipe adds variant and source_blocks (`checkpoint_meta`)


class DamagedTrainingStateError(UserInputError):
    """A training state that cannot be read (truncated, corrupted); the message names the file and the fallback."""


def checkpoint_meta(variant: str, source_blocks, precision: str, **extra) -> dict:
    """What identifies a run's checkpoints; saved as `meta` and required back on resume (the `expect` dict): a
    checkpoint of another variant, other source blocks or another precision mode is refused. `extra`: more keys a
    recipe requires (e.g. recipe="rollout_fppp")."""
    return {"variant": variant, "source_blocks": [int(block) for block in source_blocks], "precision": precision,
            **extra}


@dataclass
class RunState:
    """Loop position saved in every checkpoint.

    global_step: optimizer updates done. micro_step: micro-batches consumed (global_step * grad_accum on an
    uninterrupted run). epoch: current data epoch. data: `ResumableBatches.state_dict()` (epoch + position).
    checkpoints: the names of the inference files this run wrote into its run directory and has not pruned; the
    only files `--keep_last` may delete (`prune_checkpoints`). A record of the directory, not of the loop's
    position: it is saved beside `run_state` in the training state (`CHECKPOINTS_KEY`) and left out of comparisons.
    """

    global_step: int = 0
    micro_step: int = 0
    epoch: int = 0
    data: dict = field(default_factory=dict)
    checkpoints: list = field(default_factory=list, compare=False)

    def to_dict(self) -> dict:
        """The loop position (what `run_state` holds in a training state)."""
        return {key: value for key, value in asdict(self).items() if key != "checkpoints"}

    @classmethod
    def from_dict(cls, state: dict) -> "RunState":
        return cls(
            global_step=int(state["global_step"]),
            micro_step=int(state["micro_step"]),
            epoch=int(state["epoch"]),
            data=dict(state["data"]),
        )


# ------------------------------------------------------------------------------------------------ RNG
def capture_rng_state() -> dict:
    """This process's RNG states as plain values and CPU byte tensors (weights_only-loadable)."""
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    cuda_state = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda_state = torch.cuda.get_rng_state(torch.cuda.current_device())
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_name,
            "keys": np_keys.tolist(),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": cuda_state,
    }


def restore_rng_state(state: dict) -> None:
    """Inverse of `capture_rng_state`; a saved CUDA state on a machine without CUDA is an error."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            np.asarray(numpy_state["keys"], dtype=np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    if state["torch_cuda"] is not None:
        if not torch.cuda.is_available():
            raise RuntimeError("checkpoint holds a CUDA RNG state but CUDA is not available in this run")
        torch.cuda.set_rng_state(state["torch_cuda"], torch.cuda.current_device())


# ------------------------------------------------------------------------------------------------ checks
def _check_meta(meta: dict) -> dict:
    missing = [key for key in REQUIRED_META_KEYS if key not in meta]
    if missing:
        raise ValueError(f"checkpoint meta is missing {missing}; expected keys {REQUIRED_META_KEYS} (got {sorted(meta)})")
    return json_plain(meta, "checkpoint meta")


def _check_fp32_master(model: nn.Module, meta: dict) -> None:
    """Trainable parameters must be FP32 (an FSDP2 shard's dtype is its DTensor's: the sharded master weights)."""
    if meta["precision"] != "fp32master":
        return
    wrong = [f"{name} ({p.dtype})" for name, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]
    if wrong:
        raise ValueError(f"precision 'fp32master' but trainable parameters are not float32: {wrong[:5]}")


_OPTIMIZER_GROUP_KEYS = ("name", "initial_lr", "betas", "weight_decay")


def _compare_optimizer_groups(saved_state: dict, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """`optimizer.load_state_dict` (and `load_full_state_dicts`) would silently replace this run's LRs/betas with the
    saved ones: refuse. Only the groups' hyper-parameters are compared, so integer-id and name-keyed (FSDP) states
    alike."""
    saved_groups, current_groups = saved_state["param_groups"], optimizer.param_groups
    if len(saved_groups) != len(current_groups):
        raise CheckpointMismatchError(
            f"{path}: optimizer has {len(saved_groups)} param groups saved, this run builds {len(current_groups)}"
        )
    problems = []
    for index, (saved, current) in enumerate(zip(saved_groups, current_groups)):
        for key in _OPTIMIZER_GROUP_KEYS:
            saved_value, current_value = saved.get(key), current.get(key)
            if isinstance(saved_value, (list, tuple)):
                saved_value, current_value = list(saved_value), list(current_value)
            if saved_value != current_value:
                problems.append(f"group {index} {key}: saved {saved.get(key)!r}, requested {current.get(key)!r}")
    if problems:
        raise CheckpointMismatchError(f"{path} does not match this run's optimizer: " + "; ".join(problems))


def _name_keyed(optimizer_state: dict) -> bool:
    """Whether an optimizer state dict names its parameters (`fsdp.full_state_dicts`) instead of numbering them."""
    return any(isinstance(param, str) for group in optimizer_state["param_groups"] for param in group["params"])


# ------------------------------------------------------------------------------------------------ training state
def save_training_state(
    path: str | os.PathLike,
    *,
    roles: Sequence,
    run_state: RunState,
    config: dict,
    meta: dict,
    sharded: bool = True,
    inference_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, dict[str, torch.Tensor]]:
    """Write `training_latest.pt` atomically from rank 0: every role's model (its unwrapped module), optimizer, LR
    schedule, update count and EMA, plus the run state, every rank's RNG, config and meta. A collective: call it on
    EVERY rank (it gathers each rank's RNG state and the full state of FSDP-sharded roles, and ends with a barrier).

    roles: `predictor_training.runtime.roles.Role` objects. meta: {"variant": ..., "source_blocks": [...], "precision":
    ...}; `config` is stored with secrets redacted. Raises NonFiniteError (writing nothing) if a model holds NaN/Inf,
    on every rank together (an FSDP role's shards are checked on each rank, and the verdict is shared).

    An FSDP-sharded role (`Role.is_fsdp`) is stored sharded (`sharded=True`, the default): every rank writes its
    model and optimizer shards with DCP into `<path stem>.dcp/` (see the module docstring), nothing is gathered for
    the checkpoint. Returns {role name: the full model state in `inference_dtype`} on rank 0 (the role's inference
    weights; gathered one tensor at a time, no optimizer state); {} on the other ranks and for a run without FSDP
    roles. `sharded=False`: the old format, the full FP32 model and optimizer gathered to rank 0 into the `.pt`
    (the returned model state is then that FP32 state).
    """
    # 1. Validate on every rank so that all ranks raise together.
    meta = _check_meta(meta)
    model_states = {}
    sharded_problems = []
    for role in roles:
        raw_model = unwrap_model(role.raw_module)
        _check_fp32_master(raw_model, meta)
        if module_is_fsdp(raw_model):
            # Each rank holds other shards: collect, then decide together below (a raise on one rank only would
            # leave the others waiting in the gather).
            bad = non_finite_names(raw_model.state_dict())
            if bad:
                sharded_problems.append(f"role {role.name!r} rank {current_rank()}: {len(bad)} tensors, e.g. {bad[:5]}")
            continue
        model_states[role.name] = raw_model.state_dict()
        check_finite_tensors(model_states[role.name], f"save_training_state({path}) role {role.name!r}")
    fsdp_roles = [role for role in roles if module_is_fsdp(unwrap_model(role.raw_module))]
    optimizer_states, sharded_entries = {}, {}
    if fsdp_roles:
        sharded_problems = [problem for problems in all_gather_objects(sharded_problems) for problem in problems]
        if sharded_problems:
            raise NonFiniteError(f"save_training_state({path}): non-finite values in FSDP shards: "
                                 f"{'; '.join(sharded_problems)}; nothing was written")
        from predictor_training.runtime.fsdp import full_state_dicts, gather_full_model_state, named_param_groups

        if sharded:  # every rank writes its shards into a staging folder (published by rank 0 below)
            sharded_entries = save_sharded_roles(path, fsdp_roles)
        for role in fsdp_roles:  # collectives, in the roles' order on every rank
            if sharded:
                model_states[role.name] = gather_full_model_state(role.raw_module, inference_dtype)
                optimizer_states[role.name] = {"state": {},
                                               "param_groups": named_param_groups(role.raw_module, role.optimizer)}
            else:
                model_states[role.name], optimizer_states[role.name] = full_state_dicts(role.raw_module,
                                                                                        role.optimizer)
    # 2. Every rank's RNG, so each rank resumes its own noise stream.
    rng_by_rank = all_gather_objects(capture_rng_state())
    # 3. Rank 0 writes.
    full_states = {}
    if current_rank() == 0:
        full_states = {role.name: model_states[role.name] for role in fsdp_roles}
        payload = {
            "format": TRAINING_STATE_FORMAT,
            "format_version": TRAINING_STATE_VERSION,
            "roles": {
                role.name: {
                    "model": ({} if role.name in sharded_entries else
                              {name: tensor.detach().cpu() for name, tensor in model_states[role.name].items()}),
                    "optimizer": (optimizer_states[role.name] if role.name in optimizer_states
                                  else role.optimizer.state_dict()),
                    "lr_schedule": role.lr_schedule.state_dict(),
                    "updates": role.updates,
                    "ema": None if role.ema is None else role.ema.state_dict(),
                    **({"sharded": sharded_entries[role.name]} if role.name in sharded_entries else {}),
                }
                for role in roles
            },
            "run_state": json_plain(run_state.to_dict(), "run_state"),
            CHECKPOINTS_KEY: [str(name) for name in run_state.checkpoints],
            "rng_by_rank": rng_by_rank,
            "world_size": len(rng_by_rank),
            "config": json_plain(redact_secrets(config), "config"),
            "meta": meta,
        }

        def write(tmp_path: Path) -> None:
            with open(tmp_path, "wb") as handle:
                torch.save(payload, handle)
                handle.flush()

        keep_previous_state(Path(path))
        if sharded_entries:  # the new shards into place (the current ones become the previous) before the .pt
            publish_sharded_folder(path, referenced_tokens(path))
        atomic_write(path, write)
    barrier()
    return full_states


def keep_previous_state(path: Path) -> None:
    """Before `training_latest.pt` is replaced, the state it holds becomes `training_prev.pt` (a hard link swapped in
    atomically: at every instant both names hold a complete state, once the run has written two)."""
    if path.name != TRAINING_STATE_NAME or not path.is_file():
        return
    previous = path.with_name(PREVIOUS_TRAINING_STATE_NAME)
    staged = path.with_name(PREVIOUS_TRAINING_STATE_NAME + ".tmp")
    staged.unlink(missing_ok=True)
    os.link(path, staged)
    os.replace(staged, previous)


def load_state_file(path: Path, **load_options) -> dict:
    """`torch.load` of a training state, with a damaged file reported by name (and the run's previous state, when
    it has one, offered as the `--resume` to use instead) rather than as the zip reader's traceback."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, **load_options)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, ValueError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if detail.startswith("Weights only load failed"):  # torch's advice to unpickle it anyway: not for us
            detail = "not a file written by torch.save"
        message = f"{path} is damaged and cannot be read ({detail})"
        previous = path.with_name(PREVIOUS_TRAINING_STATE_NAME)
        if path.name == TRAINING_STATE_NAME and previous.is_file():
            message += f"; the run's previous training state is {previous}: continue from it with --resume {previous}"
        raise DamagedTrainingStateError(message) from None
    if not isinstance(payload, dict) or payload.get("format") != TRAINING_STATE_FORMAT:
        raise UserInputError(f"{path} is not a predictor training state (expected format {TRAINING_STATE_FORMAT!r})")
    return payload


def read_training_state(path: str | os.PathLike) -> dict:
    """The checkpoint dict (CPU tensors) in the current layout, after checking that the file exists and has our
    format. A version-1 state (one Predictor: top-level model / optimizer / lr_schedule) comes back as one role
    named "predictor" whose update count is the global step."""
    path = Path(path)
    require_file(path, "training state")
    payload = load_state_file(path)
    version = payload["format_version"]
    if version == 1:
        payload["roles"] = {"predictor": {
            "model": payload.pop("model"), "optimizer": payload.pop("optimizer"),
            "lr_schedule": payload.pop("lr_schedule"), "updates": int(payload["run_state"]["global_step"]),
            "ema": None,
        }}
        payload["format_version"] = TRAINING_STATE_VERSION
    elif version != TRAINING_STATE_VERSION:
        raise UserInputError(f"{path}: format_version {version}; expected 1 or {TRAINING_STATE_VERSION}")
    return payload


def role_state(payload: dict, role: str | None, path: str | os.PathLike) -> dict:
    """One role's entry of a training state; `role=None` takes the only role (an error if there are several). A
    sharded role's model is read (full, FP32, one process) from its DCP folder into the entry's "model"."""
    names = sorted(payload["roles"])
    if role is None:
        if len(names) != 1:
            raise CheckpointMismatchError(f"{path} holds roles {names}; name the one to read")
        role = names[0]
    if role not in payload["roles"]:
        raise CheckpointMismatchError(f"{path} has no role {role!r}; it holds {names}")
    entry = payload["roles"][role]
    if "sharded" in entry and not entry["model"]:
        folder = sharded_folder_for(path, entry["sharded"])
        entry["model"] = read_sharded_state(folder, role, optimizer=False)["model"]
    return entry


def read_training_summary(path: str | os.PathLike, expect: dict | None = None) -> dict:
    """{"step", "config", "meta"} of a training state, memory-mapped so the weights are not held in memory. With
    `expect` (the meta a run requires, as for `load_training_state`), a mismatch raises CheckpointMismatchError and
    weights holding NaN/Inf raise NonFiniteWeightsError (the models are read through the mapping once), so a
    launch can refuse the checkpoint before it creates anything."""
    path = Path(path)
    require_file(path, "training state")
    payload = load_state_file(path, mmap=True)
    if expect is not None:
        compare_expect(payload["meta"], expect, path)
        for role, entry in payload.get("roles", {"predictor": {"model": payload.get("model", {})}}).items():
            check_finite_file_weights(entry["model"], path, f"role {role!r}")
    return {"step": int(payload["run_state"]["global_step"]), "config": payload["config"], "meta": payload["meta"]}


def check_fp32_training_state(payload: dict, path: Path) -> None:
    """AdamW moments are FP32 in every precision mode (trainable weights are FP32, "fp32master" included), and
    `optimizer.load_state_dict` would silently cast other moments to the parameters' dtype: refuse a state (e.g.
    an old BF16 one) that holds anything else."""
    problems = []
    for role, entry in payload["roles"].items():
        for index, state in entry["optimizer"]["state"].items():
            for name, value in state.items():
                is_moment = torch.is_tensor(value) and value.is_floating_point() and value.numel() > 1
                if is_moment and value.dtype != torch.float32:
                    problems.append(f"role {role} optimizer state {index}.{name} is {value.dtype}")
    if problems:
        raise CheckpointMismatchError(f"{path}: not an FP32-master training state ({len(problems)} problems, e.g. "
                                      f"{problems[:3]}); refusing to resume it")


def load_training_state(path: str | os.PathLike, *, roles: Sequence, expect: dict) -> RunState:
    """Restore every role (model strict, optimizer, LR schedule, update count, EMA) and this rank's RNG from
    `path`; returns the RunState.

    roles: this run's `Role`s; the checkpoint must hold exactly these names (a version-1 single-Predictor state
    loads into a run with one role). expect: meta values this run requires, e.g. {"variant": "v4", "source_blocks":
    [1, 52], "precision": "fp32master"}; any difference raises CheckpointMismatchError showing saved and requested
    values. A missing file raises FileNotFoundError. Call it last before `train_loop` so nothing draws random
    numbers in between.

    A collective where a role is FSDP-sharded: every rank reads the file; a sharded role (the default format) is
    read from the DCP folder holding the file's token (`sharded_checkpoint.sharded_folder_for`: training_latest.dcp,
    or training_prev.dcp after a save interrupted between its renames) straight into the shards
    (`load_sharded_roles`); a role saved in the old full format gets `fsdp.load_full_state_dicts` (a name-keyed or
    a plain integer-id optimizer state). A missing or incomplete folder raises DamagedTrainingStateError on every
    rank. A name-keyed state (saved from an FSDP role) does not load into an unsharded role.
    """
    path = Path(path)
    payload = read_training_state(path)
    # 1. Refuse a checkpoint made for something else, or damaged.
    compare_expect(payload["meta"], expect, path)
    check_fp32_training_state(payload, path)
    for name, entry in payload["roles"].items():
        check_finite_file_weights(entry["model"], path, f"role {name!r}")
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if payload["world_size"] != world_size:
        raise CheckpointMismatchError(
            f"{path} does not match this run: world_size: saved {payload['world_size']}, requested {world_size} "
            "(the data position and per-rank RNG streams depend on it). The weights alone load at any world size "
            "(load_model_weights; a sharded role's folder also with sharded_checkpoint.load_sharded_roles, which "
            "reshards the model and optimizer, or tools/convert_sharded_checkpoint.py)"
        )
    saved_names = sorted(payload["roles"])
    if len(roles) == 1 and saved_names == ["predictor"] and roles[0].name != "predictor":
        payload["roles"] = {roles[0].name: payload["roles"]["predictor"]}  # a version-1 state into one role
    elif saved_names != sorted(role.name for role in roles):
        raise CheckpointMismatchError(f"{path} holds roles {saved_names}, this run trains "
                                      f"{sorted(role.name for role in roles)}")
    for role in roles:
        _compare_optimizer_groups(payload["roles"][role.name]["optimizer"], role.optimizer, path)
        if (payload["roles"][role.name]["ema"] is None) != (role.ema is None):
            raise CheckpointMismatchError(f"{path}: role {role.name!r} was saved {'without' if role.ema else 'with'} "
                                          "an EMA; this run has the opposite")
        if _name_keyed(payload["roles"][role.name]["optimizer"]) and not module_is_fsdp(
                unwrap_model(role.raw_module)):
            raise CheckpointMismatchError(f"{path}: role {role.name!r} was saved FSDP-sharded (optimizer state keyed "
                                          "by parameter name); shard this role with fsdp.shard_model to resume it")
    for role in roles:  # keys and shapes of every plain (not FSDP) model before any role is touched
        if "sharded" not in payload["roles"][role.name] and not module_is_fsdp(unwrap_model(role.raw_module)):
            check_state_matches(role.raw_module, payload["roles"][role.name]["model"], path, f" (role {role.name!r})")
    # 2. Sharded roles first: one DCP load for all of them (a collective), the folder found by the .pt's token.
    sharded_roles = [role for role in roles if "sharded" in payload["roles"][role.name]]
    if sharded_roles:
        entry = payload["roles"][sharded_roles[0].name]["sharded"]
        try:
            folder, problem = sharded_folder_for(path, entry), ""
        except FileNotFoundError as error:
            folder, problem = None, str(error)
        problems = [text for text in all_gather_objects(problem) if text]
        if problems:  # on every rank together (a rank that went on would wait in DCP's collectives)
            raise DamagedTrainingStateError(problems[0])
        load_sharded_roles(folder, sharded_roles, {
            role.name: {**payload["roles"][role.name]["sharded"],
                        "param_groups": payload["roles"][role.name]["optimizer"]["param_groups"]}
            for role in sharded_roles})
    # 3. Models, optimizers, schedules, EMAs (FSDP roles: collectives, in the roles' order on every rank).
    for role in roles:
        entry = payload["roles"][role.name]
        raw_model = unwrap_model(role.raw_module)
        if "sharded" in entry:
            pass  # loaded above
        elif module_is_fsdp(raw_model):
            from predictor_training.runtime.fsdp import load_full_state_dicts  # imports the Teacher: only where a role is sharded

            load_full_state_dicts(raw_model, role.optimizer, entry["model"], entry["optimizer"],
                                  broadcast_from_rank0=False)
        else:
            raw_model.load_state_dict(entry["model"], strict=True)
            role.optimizer.load_state_dict(entry["optimizer"])
        role.lr_schedule.load_state_dict(entry["lr_schedule"])
        if role.ema is not None:
            role.ema.load_state_dict(entry["ema"])
    # 4. RNG last.
    restore_rng_state(payload["rng_by_rank"][current_rank()])
    run_state = RunState.from_dict(payload["run_state"])
    # a state saved before the record existed: its run's earlier files are kept, never pruned
    run_state.checkpoints = [str(name) for name in payload.get(CHECKPOINTS_KEY, [])]
    return run_state


def check_weights_file(path: str | os.PathLike, expect: dict | None = None) -> dict:
    """The checks `load_model_weights` makes on a file, without a model to load it into (a launch makes them before
    it creates anything): readable, its meta matching `expect`, finite weights, an inference file's checksum.
    Returns the file's meta. A training state is read memory-mapped."""
    path = Path(path)
    if path.suffix == ".safetensors":
        meta = read_inference_metadata(path)
        read_inference_weights(path)
        if expect:
            compare_expect(meta, expect, path)
        return meta
    if path.suffix == ".pt":
        return read_training_summary(path, expect=expect or {})["meta"]
    raise UserInputError(f"{path}: expected a .pt training state or a .safetensors inference file")


def load_model_weights(
    path: str | os.PathLike, model: nn.Module, expect: dict | None = None, role: str | None = None
) -> dict:
    """Initialise `model` (strict) from a `training_latest.pt` (one role's model only; `role=None` = its only role)
    or an inference `.safetensors`.

    Values are cast to the model's own dtypes (BF16 file -> FP32 master params). Returns the file's meta; with
    `expect`, a mismatch (e.g. source_blocks) raises CheckpointMismatchError. Optimizer/schedule are not touched.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        meta = read_inference_metadata(path)
        state = read_inference_weights(path)
    elif path.suffix == ".pt":
        payload = read_training_state(path)
        meta, state = payload["meta"], role_state(payload, role, path)["model"]
        check_finite_file_weights(state, path)
    else:
        raise UserInputError(f"{path}: expected a .pt training state or a .safetensors inference file")
    if expect:
        compare_expect(meta, expect, path)
    check_state_matches(model, state, path)
    unwrap_model(model).load_state_dict(state, strict=True)
    return meta
