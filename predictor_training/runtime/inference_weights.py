"""Inference weights (`predictor_step_XXXXX.safetensors`): weights only (BF16 by default) plus JSON metadata and
the run config, with the sha256 of the tensors (`tensors_sha256`), checked whenever the weights are loaded (files
written before it existed load unchecked); written atomically, never with NaN/Inf; `prune_checkpoints` keeps the
newest of the ones a run wrote. Training states (`training_latest.pt`) and loading either kind into a model:
`runtime/checkpoint.py`."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from predictor_training.runtime.checkpoint_checks import (
    check_finite_file_weights,
    check_finite_tensors,
    json_plain,
    require_file,
)
from predictor_training.runtime.distributed import unwrap_model
from predictor_training.runtime.errors import MissingFieldError, UserInputError
from predictor_training.runtime.io import atomic_write, load_safetensors, open_safetensors, save_safetensors
from predictor_training.runtime.io import redact_secrets
from predictor_training.runtime.provenance import portable_paths, with_provenance
from predictor_training.runtime.roles import module_is_fsdp

INFERENCE_FORMAT = "predictor_training.inference_weights"
TENSORS_SHA256_KEY = "tensors_sha256"  # inference metadata: `tensors_sha256` of the file's tensors


def inference_weights_name(step: int, role: str = "predictor") -> str:
    """`predictor_step_00300.safetensors` for step 300 of the role "predictor" (`<role>_step_XXXXX.safetensors`)."""
    return f"{role}_step_{step:05d}.safetensors"



def save_inference_weights(
    path: str | os.PathLike,
    model_state_or_module: nn.Module | dict[str, torch.Tensor],
    dtype: torch.dtype = torch.bfloat16,
    metadata: dict | None = None,
    config: dict | None = None,
) -> Path:
    """Write a safetensors file atomically: floating tensors cast to `dtype`, others unchanged.

    A module contributes its whole (unwrapped) `state_dict()`; pass a dict to choose a subset. An FSDP-sharded
    module is refused (its state dict holds this rank's shards): pass its full state (`fsdp.full_state_dicts`, or
    what `save_training_state` returns). `metadata` (e.g. meta + step) and `config` (the run config, secrets
    redacted, so eval can rebuild the model) are stored as JSON strings in the file header. Non-finite weights raise
    NonFiniteError and write nothing. Call on one rank only.

    Provenance (runtime/provenance.py): the run config's `derived.provenance` (the hashes of the run's Teacher,
    parent weights and dataset config) goes into the metadata as `provenance`, and every absolute path in the
    stored config is written relative to the file's folder (`$RUN_DIR/...`), so the file names no path of this
    machine.
    """
    if isinstance(model_state_or_module, nn.Module):
        if module_is_fsdp(unwrap_model(model_state_or_module)):
            raise ValueError(f"save_inference_weights({path}): the module is FSDP-sharded; pass its full state dict "
                             "(fsdp.full_state_dicts) instead")
        state = unwrap_model(model_state_or_module).state_dict()
    else:
        state = model_state_or_module
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        if torch.is_floating_point(tensor):
            tensor = tensor.to(dtype)
        # clone: safetensors refuses tensors that share storage
        tensors[name] = tensor.to("cpu").contiguous().clone()
    check_finite_tensors(tensors, f"save_inference_weights({path})")
    metadata = with_provenance(metadata, config)
    config = portable_paths(config or {}, Path(path).absolute().parent)
    file_metadata = {
        "format": INFERENCE_FORMAT,
        "dtype": str(dtype).removeprefix("torch."),
        TENSORS_SHA256_KEY: tensors_sha256(tensors),
        "meta": json.dumps(json_plain(metadata or {}, "inference metadata")),
        "config": json.dumps(json_plain(redact_secrets(config or {}), "inference config")),
    }
    return atomic_write(path, lambda tmp: save_safetensors(tensors, tmp, file_metadata))


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order: the inference file's checksum."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _read_inference_header(path: str | os.PathLike) -> dict:
    path = Path(path)
    require_file(path, "inference weights")
    with open_safetensors(path) as handle:
        file_metadata = handle.metadata() or {}
    if file_metadata.get("format") != INFERENCE_FORMAT:
        raise UserInputError(f"{path} is not a predictor inference file (metadata format "
                             f"{file_metadata.get('format')!r}; expected {INFERENCE_FORMAT!r})")
    return file_metadata


def read_inference_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of an inference file, checked: their sha256 against the metadata's (when the file has one) and
    finite. A damaged file raises a `UserInputError` naming it."""
    path = Path(path)
    expected = _read_inference_header(path).get(TENSORS_SHA256_KEY)
    tensors = load_safetensors(path)
    if expected is not None and tensors_sha256(tensors) != expected:
        raise UserInputError(f"{path}: the tensors' sha256 differs from the {TENSORS_SHA256_KEY!r} in its metadata; "
                             "expected the file as it was written (it was damaged or edited since)")
    check_finite_file_weights(tensors, path)
    return tensors


def _inference_header_field(path: str | os.PathLike, field: str) -> dict:
    """One JSON field of an inference file's header; a missing or broken one is a `UserInputError` naming the
    file and the field."""
    header = _read_inference_header(path)
    if field not in header:
        raise MissingFieldError(f"{path}: the header has no {field!r} field; expected an inference file written by "
                                "a training run (save_inference_weights)")
    try:
        value = json.loads(header[field])
    except json.JSONDecodeError as error:
        raise UserInputError(f"{path}: the header's {field!r} field is not valid JSON ({error}); expected the file "
                             "as a training run wrote it") from None
    if not isinstance(value, dict):
        raise UserInputError(f"{path}: the header's {field!r} field holds a {type(value).__name__}; expected a "
                             "JSON object")
    return value


def read_inference_metadata(path: str | os.PathLike) -> dict:
    """The `metadata` dict stored by `save_inference_weights` (meta + step for loop checkpoints)."""
    return _inference_header_field(path, "meta")


def read_inference_config(path: str | os.PathLike) -> dict:
    """The run config stored by `save_inference_weights` (for rebuilding the model at eval time)."""
    return _inference_header_field(path, "config")


def prune_checkpoints(run_dir: str | os.PathLike, keep: int, role: str, written: Sequence[str], *,
                      delete: bool = True) -> list[Path]:
    """Delete all but the newest `keep` `<role>_step_XXXXX.safetensors` among `written`, the names of the files this
    run wrote into `run_dir` (`RunState.checkpoints`); -1 keeps all. A file the run did not write is never touched,
    whatever its name. `delete=False` only names them (ranks other than 0 keep the same record without deleting).

    Returns the paths pruned (a recorded file already gone is counted, not an error).
    """
    if keep == -1:
        return []
    if keep < 1:
        raise ValueError(f"prune_checkpoints: keep={keep}; expected >= 1, or -1 to keep all")
    by_step = []
    for name in written:
        match = re.match(rf"^{re.escape(role)}_step_(\d{{5,}})\.safetensors$", name)
        if match:
            by_step.append((int(match.group(1)), Path(run_dir) / name))
    by_step.sort()
    doomed = [path for _, path in by_step[:-keep]]
    if delete:
        for path in doomed:
            path.unlink(missing_ok=True)
    return doomed
