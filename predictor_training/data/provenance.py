"""What a training run records of its inputs, by hash (`runtime/provenance.py` holds the record, its reading and the
portable paths): its Teacher, the weights it started from and its training data's config.

A recipe computes it once, after its run directory and process group exist, and passes it to `run_config` as
`provenance=...`; it then lives in train_config.json and the training state (`derived.provenance`), and
`save_inference_weights` / the methods' exports copy it into every weights file:

    provenance = run_provenance(start, env, teacher=teacher_source.folder, action_ckpt=teacher_source.action_ckpt,
                                parent=args.init_from, data_root=args.dataset_root)

A resumed or continued run keeps the provenance its training state recorded (the --init_from file may have changed
since the run started; its hash at the start is what counts). Rank 0 hashes, the other ranks receive its record.
"""

from __future__ import annotations

import os
from pathlib import Path

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
from predictor_training.data.ode_cache import CACHE_CONFIG_NAME
from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_DATASET_CONFIG_NAME
from predictor_training.runtime.checkpoint import read_training_summary
from predictor_training.runtime.distributed import DistEnv, all_gather_objects
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.io import read_json_file, sha256_json
from predictor_training.runtime.provenance import (
    config_provenance,
    file_sha256,
    make_provenance,
    path_name,
    weight_files,
    weights_sha256,
)
from predictor_training.runtime.run_directory import RunStart
from predictor_training.teacher.model import WorldPlayTransformer

DATA_CONFIG_NAMES = (DATASET_CONFIG_NAME, CACHE_CONFIG_NAME, VIDEO_DATASET_CONFIG_NAME)  # a data folder's config


def data_config_file(data_root: str | os.PathLike) -> Path:
    """The config JSON of a training data folder (a Predictor dataset, an ODE cache or a video-latent dataset: the
    first of `DATA_CONFIG_NAMES` it holds); a file is its own config (e.g. a sample table)."""
    data_root = Path(data_root)
    if data_root.is_file():
        return data_root
    for name in DATA_CONFIG_NAMES:
        if (data_root / name).is_file():
            return data_root / name
    raise MissingFileError(f"{data_root}: none of {list(DATA_CONFIG_NAMES)}; expected a training data folder")


def teacher_folder_config_sha256(folder: str | os.PathLike) -> str:
    """The Teacher config hash (`teacher.source.teacher_config_sha256`) from a Teacher folder's config.json alone,
    without loading its weights."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise MissingFileError(f"{config_path}: no such file; expected a Teacher folder with config.json")
    return sha256_json(WorldPlayTransformer.constructor_arguments(read_json_file(config_path), source=str(config_path)))


def _teacher_name(teacher: str | os.PathLike) -> Path:
    """What `teacher_sha256` is the hash of: the Teacher's one weights file, or its folder when it has several."""
    files = weight_files(teacher)
    return files[0] if len(files) == 1 else Path(teacher)


def input_provenance(*, teacher: str | os.PathLike | None, action_ckpt: str | os.PathLike | None = None,
                     parent: str | os.PathLike | None = None, data_root: str | os.PathLike | None = None,
                     unknown: dict | None = None) -> dict:
    """The provenance record of these inputs (None: no such input), every file hashed now. `teacher`: a Teacher
    folder (config.json + weights) or a weights file; `parent`: the weights file the run starts from; `data_root`:
    the training data folder (or file, `data_config_file`); `unknown`: {key: why} for inputs nobody recorded."""
    teacher_config = None
    if teacher is not None and Path(teacher).is_dir():
        teacher_config = teacher_folder_config_sha256(teacher)
    dataset_config = None if data_root is None else data_config_file(data_root)
    return make_provenance(
        teacher_sha256=None if teacher is None else weights_sha256(teacher),
        teacher_config_sha256=teacher_config,
        teacher_action_ckpt_sha256=None if action_ckpt is None else file_sha256(action_ckpt),
        parent_sha256=None if parent is None else file_sha256(parent),
        dataset_config_sha256=None if dataset_config is None else file_sha256(dataset_config),
        names={"teacher": None if teacher is None else path_name(_teacher_name(teacher)), "parent": path_name(parent),
               "dataset_config": path_name(dataset_config)},
        unknown=unknown,
    )


def run_provenance(start: RunStart, env: DistEnv, *, teacher: str | os.PathLike | None,
                   action_ckpt: str | os.PathLike | None, parent: str | os.PathLike | None,
                   data_root: str | os.PathLike | None) -> dict:
    """The provenance this run records (`input_provenance` of its inputs), the same on every rank: a resumed or
    continued run's from its training state when that records one; else hashed on rank 0 now. A collective."""
    saved = None
    if start.resume_path is not None:
        saved = config_provenance(read_training_summary(start.resume_path)["config"])
    if saved is not None:
        return saved
    record = None
    if env.is_main:
        unknown = None
        if start.resume_path is not None and parent is None:  # a state saved before provenance existed
            unknown = {"parent_sha256": f"resumed from {path_name(start.resume_path)}, whose run recorded no "
                                        "provenance"}
        record = input_provenance(teacher=teacher, action_ckpt=action_ckpt, parent=parent, data_root=data_root,
                                  unknown=unknown)
    return all_gather_objects(record)[0]
