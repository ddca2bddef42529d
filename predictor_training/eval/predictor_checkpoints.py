"""The Predictor checkpoints an evaluation scores (`--ckpt`): a checkpoint's metadata and saved run config read
without its weights, unique labels, and its Predictor rebuilt on the Teacher with the weights loaded."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from predictor_training.eval.methods import PredictorCheckpoint
from predictor_training.predictor.model import Predictor, build_predictor_from_config
from predictor_training.runtime.checkpoint import load_model_weights, read_inference_metadata, read_training_state
from predictor_training.runtime.inference_weights import read_inference_config
from predictor_training.runtime.errors import MissingFieldError, UserInputError
from predictor_training.runtime.provenance import expand_run_dir, with_provenance
from predictor_training.teacher import WorldPlayTransformer

_STEP_NAME = re.compile(r"^predictor_step_(\d+)\.safetensors$")


def read_predictor_checkpoint(path: str | Path) -> PredictorCheckpoint:
    """Read a checkpoint's metadata and saved run config (no weights). Errors name the file and the field. The
    config's `$RUN_DIR/...` paths (runtime/provenance.py) are made paths under the file's folder; a training
    state's provenance (`derived.provenance`) joins its meta, as an inference file's is there."""
    path = Path(path).resolve()
    if path.suffix == ".safetensors":
        meta = read_inference_metadata(path)
        config = expand_run_dir(read_inference_config(path), path.parent)
        if "step" not in meta:
            raise MissingFieldError(f"{path}: inference metadata has no 'step' (keys {sorted(meta)})")
        step = int(meta["step"])
        name_match = _STEP_NAME.match(path.name)
        if name_match and int(name_match.group(1)) != step:
            raise UserInputError(f"{path}: the file name says step {int(name_match.group(1))}, its metadata step {step}")
    elif path.suffix == ".pt":
        payload = read_training_state(path)
        meta, config = with_provenance(payload["meta"], payload["config"]), payload["config"]
        step = int(payload["run_state"]["global_step"])
    else:
        raise UserInputError(f"--ckpt {path}: expected predictor_step_XXXXX.safetensors or training_latest.pt")
    for key in ("derived", "flags"):
        if key not in config:
            raise MissingFieldError(f"{path}: the saved run config has no '{key}' section (expected train_config.json layout)")
    if "predictor" not in config["derived"]:
        raise MissingFieldError(f"{path}: the saved run config has no 'derived.predictor' (the Predictor's architecture)")
    predictor_config = dict(config["derived"]["predictor"])
    for key in ("variant", "source_blocks"):
        if key not in meta or key not in predictor_config:
            raise MissingFieldError(f"{path}: '{key}' is missing from the checkpoint meta or from derived.predictor")
        if predictor_config[key] != meta[key]:
            raise UserInputError(f"{path}: meta {key}={meta[key]!r} but derived.predictor {key}={predictor_config[key]!r}")
    return PredictorCheckpoint(path, path.parent.name, step, dict(meta), predictor_config, dict(config["flags"]))


def label_checkpoints(checkpoints: Sequence[PredictorCheckpoint]) -> list[PredictorCheckpoint]:
    """Give each checkpoint a unique label: `ckptstep<N>` when all come from one run, else `<run>_ckptstep<N>`."""
    single_run = len({ckpt.run_name for ckpt in checkpoints}) <= 1
    labelled = [
        replace(ckpt, label=f"ckptstep{ckpt.step}" if single_run else f"{ckpt.run_name}_ckptstep{ckpt.step}",
                panel=f"ckptstep{ckpt.step}" if single_run else f"#{position} ckptstep{ckpt.step}")
        for position, ckpt in enumerate(checkpoints, start=1)
    ]
    labels = [ckpt.label for ckpt in labelled]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise UserInputError(f"--ckpt: checkpoints {duplicates} are given twice (same run and step)")
    return labelled


def load_predictor(teacher: WorldPlayTransformer, ckpt: PredictorCheckpoint) -> Predictor:
    """Rebuild the checkpoint's Predictor on `teacher` from its saved config and load its weights (strict). A
    training state of several roles (adversarial: predictor + discriminator) gives its "predictor" role."""
    predictor = build_predictor_from_config(teacher, ckpt.predictor_config)
    load_model_weights(ckpt.path, predictor, expect={"variant": ckpt.meta["variant"],
                                                      "source_blocks": ckpt.meta["source_blocks"]},
                       role="predictor" if ckpt.path.suffix == ".pt" else None)
    return predictor.eval().requires_grad_(False)
