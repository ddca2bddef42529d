"""Sharded (per-rank) checkpoints of FSDP2 roles with `torch.distributed.checkpoint` (DCP).

    entries = save_sharded_roles(state_path, fsdp_roles)   # collective: each rank writes its shards, no gather
    publish_sharded_folder(state_path, referenced_tokens(state_path))   # rank 0, before the .pt is replaced
    folder = sharded_folder_for(state_path, entry)          # the complete folder holding the .pt's token
    load_sharded_roles(folder, fsdp_roles, entries)         # collective: DCP reads (and reshards) into the shards
    read_sharded_state(folder, role)                        # one process, no process group: full tensors

Why. `fsdp.full_state_dicts` gathers the full model and AdamW state on rank 0: at 8.6B parameters about 100 GB of
host memory in one process and one file of that size per checkpoint. Here every rank writes only its shards of the
FP32 master weights and AdamW moments (`get_state_dict` with sharded options: DTensors, the optimizer keyed by
parameter name), and DCP's `.metadata` (written last by the coordinator, itself via a temp file + rename) describes
the global shapes, so the same folder loads on another world size (DCP reshards) and converts to one file
(`tools/convert_sharded_checkpoint.py`).

Layout next to `training_latest.pt` (checkpoint.py pairs them):

    training_latest.pt          everything else (replicated roles, schedules, run state, RNG, config, meta) and, per
                                FSDP role, `{"sharded": {"folder", "token", "optimizer_state_names", "world_size"}}`
    training_latest.dcp/        DCP files of every FSDP role: `<role>.model.<fqn>`, `<role>.optimizer.state.<fqn>.*`,
                                `.metadata`, and `checkpoint_token` (the token the .pt names)
    training_prev.dcp/          the previous one (paired with `training_prev.pt`)

Crash safety. A save writes `training_latest.dcp.writing/` (every rank), then rank 0 writes its token, links
`training_latest.pt` to `training_prev.pt` (checkpoint.keep_previous_state), moves the current `training_latest.dcp`
to `training_prev.dcp` if a state file names it (else it is the orphan of a save killed after publishing, and is
deleted), renames the new folder into place, and only then replaces `training_latest.pt` (atomically). A `.pt` names
its folder by token, and `sharded_folder_for` finds the complete folder (`.metadata` and token present) holding that
token among `training_latest.dcp` / `training_prev.dcp`: a kill -9 at any instant leaves `training_latest.pt` (and
`training_prev.pt`) loadable; a partial `*.writing` folder is never read and is replaced by the next save. The
folder must be on a file system every rank sees (one node: its disk; several nodes: shared storage).

Optimizer state. Parameters that never received a gradient have no AdamW state; `get_state_dict` would create it
for an optimizer without any state (a zero-gradient step), which would change a resumed run. So the saved names are
recorded, an optimizer without state saves none, and a load drops whatever DCP had to create for the others (as
`fsdp.load_full_state_dicts` does).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from predictor_training.runtime.distributed import barrier, current_rank
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import write_text_atomic

SHARDED_SUFFIX = ".dcp"
WRITING_SUFFIX = ".writing"
TOKEN_FILE = "checkpoint_token"
METADATA_FILE = ".metadata"


class MissingShardedStateError(UserInputError, FileNotFoundError):
    """A training state names a sharded folder (by token) that is not on disk or incomplete."""


def sharded_folder(state_path: str | os.PathLike) -> Path:
    """`training_latest.pt` -> `training_latest.dcp` (the folder a save of that file writes)."""
    return Path(state_path).with_suffix(SHARDED_SUFFIX)


def _parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(parameter): name for name, parameter in model.named_parameters()}


def optimizer_state_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Names of the parameters that hold optimizer state now (a local question: every rank holds all parameters'
    shards, so the answer is the same on every rank)."""
    names = _parameter_names(model)
    return sorted(names[id(parameter)] for parameter in optimizer.state if id(parameter) in names)


def _role_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, saved_names) -> dict:
    """{"model": sharded model state, "optimizer": name-keyed sharded optimizer state restricted to `saved_names`}
    (no optimizer entry when it has no state to save / load)."""
    if optimizer is None or not saved_names:
        model_state, _ = get_state_dict(model, [], options=StateDictOptions())
        return {"model": model_state}
    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions())
    state = {name: value for name, value in optimizer_state["state"].items() if name in set(saved_names)}
    return {"model": model_state, "optimizer": {"state": state}}


def read_token(folder: Path) -> str | None:
    """The token of a complete sharded folder (its `.metadata` and token file exist), else None."""
    token_path = Path(folder) / TOKEN_FILE
    if not (Path(folder) / METADATA_FILE).is_file() or not token_path.is_file():
        return None
    return token_path.read_text(encoding="utf-8").strip()


def save_sharded_roles(state_path: str | os.PathLike, roles: Sequence) -> dict:
    """Write every FSDP role's model + optimizer shards next to `state_path` (a collective; each rank writes its
    own shards). Returns {role name: {"folder", "token", "optimizer_state_names", "world_size"}} for the `.pt` (the
    same on every rank). Call `publish_sharded_folder` on rank 0 after this and before the `.pt` is replaced."""
    final = sharded_folder(state_path)
    staging = final.with_name(final.name + WRITING_SUFFIX)
    # 1. One token for this save (rank 0's, shared), a clean staging folder.
    shared = [uuid.uuid4().hex if current_rank() == 0 else None]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    token = shared[0]
    if current_rank() == 0:
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
    barrier()
    # 2. Every rank writes its shards; the coordinator writes `.metadata` last.
    state, entries = {}, {}
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    for role in roles:
        names = [] if role.optimizer is None else optimizer_state_names(role.raw_module, role.optimizer)
        state[role.name] = _role_state(role.raw_module, role.optimizer, names)
        entries[role.name] = {"folder": final.name, "token": token, "optimizer_state_names": names,
                              "world_size": world_size}
    dcp.save(state, checkpoint_id=staging, no_dist=not (dist.is_available() and dist.is_initialized()))
    barrier()
    if current_rank() == 0:
        write_text_atomic(staging / TOKEN_FILE, token + "\n")
    return entries


def previous_sharded_folder(state_path: str | os.PathLike) -> Path:
    """Where the folder being replaced goes: `training_latest.pt` -> `training_prev.dcp` (paired with
    `training_prev.pt`); another name `x.pt` -> `x.prev.dcp` (kept only through the next save)."""
    state_path = Path(state_path)
    if state_path.stem == "training_latest":
        return state_path.with_name("training_prev" + SHARDED_SUFFIX)
    return state_path.with_name(state_path.stem + ".prev" + SHARDED_SUFFIX)


def referenced_tokens(state_path: str | os.PathLike) -> set[str]:
    """Tokens of the sharded folders that `state_path` and its previous state (training_prev.pt) name; a missing or
    unreadable file names none. Memory-mapped: the weights in the file are not read."""
    state_path = Path(state_path)
    tokens = set()
    for path in (state_path, state_path.with_name("training_prev.pt")):
        if not path.is_file():
            continue
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            tokens |= {entry["sharded"]["token"] for entry in payload.get("roles", {}).values()
                       if isinstance(entry, dict) and "sharded" in entry}
        except Exception:  # noqa: BLE001 - a damaged file names no folder; the loader reports it when read
            continue
    return tokens


def publish_sharded_folder(state_path: str | os.PathLike, keep_tokens: set[str]) -> None:
    """Rank 0, after `save_sharded_roles` and before the `.pt` is replaced: the folder holding one of `keep_tokens`
    (those the state files on disk name, `referenced_tokens`) becomes the previous one
    (`previous_sharded_folder`), a current folder that no file names (left by a save killed after this step) is
    deleted, then the staged folder is renamed into place. After each of these steps every `.pt` on disk still finds
    a complete folder holding its token (see the module docstring)."""
    final = sharded_folder(state_path)
    previous = previous_sharded_folder(state_path)
    staging = final.with_name(final.name + WRITING_SUFFIX)
    if final.exists():
        if read_token(final) in keep_tokens:
            if previous.exists():
                shutil.rmtree(previous)
            os.replace(final, previous)
        else:
            shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_directory(final.parent)


def _fsync_directory(directory: Path) -> None:
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def sharded_folder_for(state_path: str | os.PathLike, entry: dict) -> Path:
    """The complete folder holding `entry["token"]`, looked up next to `state_path` (its own name first, then the
    latest / previous one, which a save interrupted between its renames leaves). Raises MissingShardedStateError."""
    state_path = Path(state_path)
    candidates = [state_path.parent / entry["folder"], sharded_folder(state_path),
                  previous_sharded_folder(state_path.parent / entry["folder"]), previous_sharded_folder(state_path)]
    for name in ("training_latest", "training_prev"):
        candidates.append(state_path.parent / (name + SHARDED_SUFFIX))
    seen = []
    for folder in candidates:
        if folder in seen:
            continue
        seen.append(folder)
        if read_token(folder) == entry["token"]:
            return folder
    raise MissingShardedStateError(
        f"{state_path}: its sharded model/optimizer state (token {entry['token']}) is in none of "
        f"{[str(folder) for folder in seen]} (missing or incomplete); it cannot be resumed. Use the run's previous "
        "training state (training_prev.pt) if it has one"
    )


def load_sharded_roles(folder: Path, roles: Sequence, entries: dict[str, dict]) -> None:
    """Load every FSDP role's model and optimizer shards from `folder` (a collective). Works on any world size:
    DCP reads the parts of each saved shard this rank's shards need. entries: {role name: {"optimizer_state_names":
    [...], "param_groups": the saved name-keyed groups}}. Parameters without saved optimizer state are left without
    state; the groups' hyper-parameters (lr, betas, ...) become the saved ones, as `optimizer.load_state_dict` does."""
    templates = {}
    for role in roles:
        names = entries[role.name]["optimizer_state_names"]
        # With names: creates state for every parameter if there is none yet (a zero-gradient step at lr 0), so
        # that the template holds DTensors of the right shapes to read into.
        templates[role.name] = _role_state(role.raw_module, role.optimizer if names else None, names)
    dcp.load(templates, checkpoint_id=folder, no_dist=not (dist.is_available() and dist.is_initialized()))
    for role in roles:
        entry, template = entries[role.name], templates[role.name]
        set_model_state_dict(role.raw_module, template["model"], options=StateDictOptions(strict=True))
        if role.optimizer is None:
            continue
        for group, saved in zip(role.optimizer.param_groups, entry["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        names = set(entry["optimizer_state_names"])
        parameter_names = _parameter_names(role.raw_module)
        if names:
            tuple_keys = [{key for key, value in group.items() if isinstance(value, tuple)}
                          for group in role.optimizer.param_groups]
            named_groups = [{**{key: value for key, value in group.items() if key != "params"},
                             "params": [parameter_names[id(p)] for p in group["params"]]}
                            for group in role.optimizer.param_groups]
            set_optimizer_state_dict(role.raw_module, role.optimizer,
                                     {"state": template["optimizer"]["state"], "param_groups": named_groups},
                                     options=StateDictOptions(strict=False))
            for group, keys in zip(role.optimizer.param_groups, tuple_keys):
                for key in keys:  # DCP turns tuples (AdamW betas) into lists
                    if isinstance(group.get(key), list):
                        group[key] = tuple(group[key])
        for group in role.optimizer.param_groups:
            for parameter in group["params"]:
                if parameter_names[id(parameter)] not in names:
                    role.optimizer.state.pop(parameter, None)


def read_sharded_state(folder: str | os.PathLike, role: str | None = None, *, optimizer: bool = True) -> dict:
    """Full (unsharded) CPU tensors of a sharded folder, in one process without a process group: {role: {"model":
    {fqn: tensor}, "optimizer": {"state": {fqn: {...}}}}} (`role` given: that role's dict only; `optimizer=False`
    reads the model only). Needs the memory of what it reads (the model alone at 8.6B: 34 GB in FP32)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(folder)
    if not (folder / METADATA_FILE).is_file():
        raise MissingShardedStateError(f"{folder} is not a complete sharded checkpoint (no {METADATA_FILE})")
    keys = None
    if role is not None:
        keys = {f"{role}.model"} | ({f"{role}.optimizer"} if optimizer else set())
    elif not optimizer:
        raise ValueError("read_sharded_state: optimizer=False needs a role")
    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(folder)),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    if role is None:
        return state
    if role not in state:
        raise KeyError(f"{folder} holds no role {role!r}; it holds {sorted(state)}")
    return state[role]


def saved_roles(folder: str | os.PathLike) -> list[str]:
    """Role names stored in a sharded folder (read from its metadata, no tensors); a folder that is not one raises
    MissingShardedStateError naming it."""
    if not (Path(folder) / METADATA_FILE).is_file():
        raise MissingShardedStateError(f"{folder} is not a complete sharded checkpoint (no {METADATA_FILE})")
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as error:  # the unpickler's many errors on a damaged file: name the file instead
        raise UserInputError(f"{Path(folder) / METADATA_FILE}: damaged ({type(error).__name__}: {error}); expected "
                             "the metadata a sharded save writes") from None
    return sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata})
