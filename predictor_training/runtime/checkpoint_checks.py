"""The checks every checkpoint file gets, whichever its format (`runtime/checkpoint.py`: training states;
`runtime/inference_weights.py`: inference weights): nothing non-finite is written or loaded, meta and state dicts
must match the run, and each failure is one line naming the file (`UserInputError` subclasses for bad files)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from predictor_training.runtime.distributed import unwrap_model
from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.state_dicts import StateDictMismatchError, mismatch_report


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or weight is NaN/Inf; raised before anything is stepped or written."""


class NonFiniteWeightsError(UserInputError):
    """A checkpoint file holds NaN/Inf weights; the message names the file and the first tensors."""


class CheckpointMismatchError(UserInputError):
    """A checkpoint was saved for a different variant / source blocks / precision / world size than requested."""



def json_plain(obj, what: str):
    """`obj` normalised through JSON (tuples -> lists); raises if it is not JSON-representable."""
    try:
        return json.loads(json.dumps(obj, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be JSON-serialisable plain data: {error}") from error


def non_finite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding NaN/Inf; a DTensor is checked on this rank's shard only."""
    bad = []
    for name, tensor in tensors.items():
        if hasattr(tensor, "to_local"):  # DTensor (FSDP2 shard)
            tensor = tensor.to_local()
        if torch.is_floating_point(tensor) and not bool(torch.isfinite(tensor).all()):
            bad.append(name)
    return bad


def check_finite_tensors(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Raise NonFiniteError naming the first few non-finite floating tensors of `tensors`."""
    bad = non_finite_names(tensors)
    if bad:
        raise NonFiniteError(f"{what}: non-finite values in {len(bad)} tensors, e.g. {bad[:5]}; nothing was written")


def check_finite_file_weights(tensors: dict[str, torch.Tensor], path: str | os.PathLike, what: str = "") -> None:
    """Raise NonFiniteWeightsError naming `path` (and `what`, e.g. "role 'predictor'") when weights read from it hold
    NaN/Inf."""
    bad = non_finite_names(tensors)
    if bad:
        where = f" ({what})" if what else ""
        raise NonFiniteWeightsError(f"{path}{where}: NaN/Inf in {len(bad)} weight tensors, e.g. {bad[:3]}; expected "
                                    "finite weights (the file is damaged, or was not written by this toolkit)")


def compare_expect(saved_meta: dict, expect: dict, path: Path) -> None:
    problems = []
    for key, requested in json_plain(expect, "expect").items():
        if key not in saved_meta:
            problems.append(f"{key}: not recorded in the checkpoint, requested {requested!r}")
        elif saved_meta[key] != requested:
            problems.append(f"{key}: saved {saved_meta[key]!r}, requested {requested!r}")
    if problems:
        raise CheckpointMismatchError(f"{path} does not match this run: " + "; ".join(problems))


def require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise MissingFileError(f"{what}: {path} does not exist; refusing to start from scratch instead")


def check_state_matches(model: nn.Module, state: dict, path: str | os.PathLike, what: str = "") -> None:
    """Refuse (`StateDictMismatchError`, one line naming the file and the first offending keys) a state dict whose
    keys or shapes differ from `model`'s, before anything is loaded (torch's own error is a multi-line traceback)."""
    model_shapes = {key: tuple(value.shape) for key, value in unwrap_model(model).state_dict().items()}
    file_shapes = {key: tuple(value.shape) for key, value in state.items()}
    missing, unexpected, mismatched, report = mismatch_report(model_shapes, file_shapes, str(path))
    if not report:
        return
    found = [f"{len(keys)} {kind} (e.g. {', '.join(keys[:2])})" for kind, keys in (
        ("missing keys", missing), ("unexpected keys", unexpected),
        ("shape mismatches", [f"{key} {list(file_shapes[key])} vs {list(model_shapes[key])}" for key in mismatched]))
        if keys]
    raise StateDictMismatchError(str(path), missing, unexpected, mismatched,
                                 f"{path}{what}: its weights do not fit the model: {'; '.join(found)}; expected a "
                                 "checkpoint of this model (the same variant, Teacher size and source blocks)")
