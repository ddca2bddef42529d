"""Write the provenance of an existing inference weights file into its metadata, without touching its tensors
(docs/runs.md § Provenance).

    python tools/fix_provenance.py FILE --show       # what FILE records ("no provenance recorded" for an old file)
    python tools/fix_provenance.py predictor_training/world/weights/predictor_frrp/predictor_step_00480.safetensors \\
        --teacher predictor_training/world/weights/teacher \\
        --parent_unknown "not recorded when it was trained" --dataset_config_unknown "not on this machine"

A weights file written before provenance existed (or fixed by hand) gets what a recipe now records
(predictor_training/runtime/provenance.py): the sha256 of the Teacher it was trained on (--teacher, --action_ckpt),
of the weights it started from (--parent FILE, --no_parent, or --parent_unknown WHY) and of its training data's
config (--dataset_config FILE|FOLDER, or --dataset_config_unknown WHY: an unknown value is null with the reason,
never a guessed hash), and every absolute path in its run config is made relative to its run directory
(`$RUN_DIR/...`; --run_dir, default: the config's own --output_dir).

Checked before anything is written: the Teacher's config hash equals the one the file records (its provenance, or
its training dataset's record when that is readable here), and a Predictor's recorded architecture fits the Teacher
(its tensors' names and shapes are a Predictor's built on it). Only the header's JSON changes: the tensor bytes are
copied, and their sha256 (and the toolkit's `tensors_sha256`) are printed before and after and must agree.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from predictor_training.data.dataset_config import dataset_teacher_record
from predictor_training.data.provenance import input_provenance, teacher_folder_config_sha256
from predictor_training.predictor.model import build_predictor_from_config
from predictor_training.runtime.inference_weights import INFERENCE_FORMAT, read_inference_weights, tensors_sha256
from predictor_training.runtime.errors import CommandParser, UserInputError, command
from predictor_training.runtime.flags import add_check_only_arg, report_check_only
from predictor_training.runtime.provenance import (
    PROVENANCE_KEY,
    absolute_paths_in,
    describe_provenance,
    expand_run_dir,
    is_absolute_path,
    portable_paths,
    read_safetensors_header,
    recorded_provenance,
    rewrite_safetensors_metadata,
    tensor_bytes_sha256,
)
from predictor_training.teacher.model import WorldPlayTransformer


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path, help="an inference weights file (predictor_step_XXXXX.safetensors)")
    parser.add_argument("--show", action="store_true", help="print what the file records and write nothing")
    parser.add_argument("--teacher", type=Path, default=None,
                        help="the Teacher it was trained on: a Teacher folder (config.json + weights) or a weights "
                             "file; required to write")
    parser.add_argument("--action_ckpt", type=Path, default=None,
                        help="the action checkpoint loaded on that Teacher in training (default: none)")
    parent = parser.add_mutually_exclusive_group()
    parent.add_argument("--parent", type=Path, default=None, help="the weights file its training started from")
    parent.add_argument("--no_parent", action="store_true",
                        help="its training started from no weights file (from the Teacher, or from scratch)")
    parent.add_argument("--parent_unknown", default=None, metavar="WHY",
                        help="its parent is not known: recorded as null with this reason")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--dataset_config", type=Path, default=None,
                      help="its training data: a data folder (its dataset_config.json, ode_cache_config.json or "
                           "video_dataset_config.json is hashed) or that config file")
    data.add_argument("--dataset_config_unknown", default=None, metavar="WHY",
                      help="its training data's config is not at hand: recorded as null with this reason")
    parser.add_argument("--run_dir", type=Path, default=None,
                        help="the folder the file was written in, absolute paths are made relative to (default: "
                             "its run config's --output_dir)")
    add_check_only_arg(parser, what="the new metadata (after the Teacher checks)")
    args = parser.parse_args(argv)
    if not args.path.is_file():
        parser.error(f"{args.path}: no such file")
    if args.show:
        return args
    if args.teacher is None or not args.teacher.exists():
        parser.error(f"--teacher {args.teacher}: expected the Teacher folder (or weights file) it was trained on")
    if args.parent is None and not args.no_parent and args.parent_unknown is None:
        parser.error("say where its training started: --parent FILE, --no_parent or --parent_unknown WHY")
    if args.dataset_config is None and args.dataset_config_unknown is None:
        parser.error("say what it was trained on: --dataset_config FILE|FOLDER or --dataset_config_unknown WHY")
    for flag in ("action_ckpt", "parent", "dataset_config"):
        value = getattr(args, flag)
        if value is not None and not value.exists():
            parser.error(f"--{flag} {value}: no such file or folder")
    return args


def read_header(path: Path) -> tuple[dict, dict, dict]:
    """(the header's metadata strings, meta, run config) of an inference weights file."""
    header, _ = read_safetensors_header(path)
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != INFERENCE_FORMAT:
        raise UserInputError(f"{path}: metadata format {metadata.get('format')!r}; expected an inference weights file "
                             f"({INFERENCE_FORMAT!r})")
    return metadata, json.loads(metadata["meta"]), json.loads(metadata["config"])


def recorded_teacher_config(path: Path, meta: dict, config: dict) -> tuple[str | None, str]:
    """(the Teacher config hash the file records, where from): its provenance's, else its training dataset's record
    when that is readable here; (None, why) when neither is."""
    provenance = recorded_provenance(meta)
    if provenance is not None and provenance["teacher_config_sha256"] is not None:
        return provenance["teacher_config_sha256"], "its provenance"
    dataset_root = expand_run_dir(config.get("flags", {}), path.resolve().parent).get("dataset_root")
    if dataset_root is None:
        return None, "its run records no dataset"
    try:
        return dataset_teacher_record(dataset_root)["config_sha256"], f"the dataset {dataset_root}"
    except (FileNotFoundError, KeyError) as error:
        return None, f"its dataset's record cannot be read here ({error})"


def check_predictor_fits(path: Path, config: dict, teacher: Path) -> str:
    """A Predictor file's tensors (names, shapes) against a Predictor of its recorded architecture built on the
    Teacher's config (on the meta device: no weights read); returns what was checked."""
    predictor_config = config.get("derived", {}).get("predictor")
    if predictor_config is None:
        return "not a Predictor file: no architecture to check"
    with torch.device("meta"):
        teacher_model = WorldPlayTransformer.from_config(WorldPlayTransformer.load_config(str(teacher)))
        try:
            predictor = build_predictor_from_config(teacher_model, predictor_config)
        except ValueError as error:
            raise UserInputError(f"{path}: its Predictor does not fit the Teacher {teacher}: {error}") from None
    header, _ = read_safetensors_header(path)
    saved = {name: list(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    built = {name: list(tensor.shape) for name, tensor in predictor.state_dict().items()}
    if saved != built:
        differing = sorted(name for name in saved.keys() | built.keys() if saved.get(name) != built.get(name))
        raise UserInputError(f"{path}: its tensors are not those of its Predictor built on the Teacher {teacher} "
                             f"({len(differing)} differ, e.g. {differing[:3]})")
    return f"its {len(saved)} tensors are a Predictor's on this Teacher"


def new_metadata(args, metadata: dict, meta: dict, config: dict) -> dict:
    """The header metadata with the provenance in meta and the run config's absolute paths made portable."""
    unknown = {}
    if args.parent_unknown is not None:
        unknown["parent_sha256"] = args.parent_unknown
    if args.dataset_config_unknown is not None:
        unknown["dataset_config_sha256"] = args.dataset_config_unknown
    provenance = input_provenance(teacher=args.teacher, action_ckpt=args.action_ckpt, parent=args.parent,
                                  data_root=args.dataset_config, unknown=unknown)
    run_dir = args.run_dir
    if run_dir is None and absolute_paths_in(config):
        output_dir = config.get("flags", {}).get("output_dir")
        if output_dir is None or not is_absolute_path(output_dir):
            raise UserInputError(f"{args.path}: its run config holds absolute paths and records no absolute "
                                 "--output_dir; pass --run_dir (the folder it was written in)")
        run_dir = Path(output_dir)
    portable = config if run_dir is None else portable_paths(config, run_dir)
    left = absolute_paths_in(portable)
    if left:
        raise UserInputError(f"{args.path}: absolute paths left in its run config {left[:3]}; expected none")
    return {**metadata, "meta": json.dumps({**meta, PROVENANCE_KEY: provenance}),
            "config": json.dumps(portable)}


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    metadata, meta, config = read_header(args.path)
    if args.show:
        if args.check_only:
            return report_check_only(f"what {args.path} records (--show writes nothing in any case)")
        print(describe_provenance(recorded_provenance(meta)))
        print(json.dumps(recorded_provenance(meta), indent=2))
        return 0
    # 1. The Teacher: its config hash against the recorded one, a Predictor's architecture against it.
    if args.teacher.is_dir():
        actual = teacher_folder_config_sha256(args.teacher)
        recorded, source = recorded_teacher_config(args.path, meta, config)
        if recorded is not None and recorded != actual:
            raise UserInputError(f"--teacher {args.teacher}: config sha256 {actual}, but {source} records {recorded} "
                                 "for the Teacher this file was trained on; pass that Teacher")
        print(f"Teacher config sha256 {actual}: " + (f"matches {source}" if recorded is not None else
                                                     f"nothing to compare with ({source})"))
        print(f"architecture: {check_predictor_fits(args.path, config, args.teacher)}")
    # 2. The new header; the tensors before.
    updated = new_metadata(args, metadata, meta, config)
    if args.check_only:
        return report_check_only(json.dumps({key: json.loads(value) if key in ("meta", "config") else value
                          for key, value in updated.items()}, indent=2))
    # (read as the eval reads it: the tensors against their recorded tensors_sha256, finite)
    before = tensor_bytes_sha256(args.path), tensors_sha256(read_inference_weights(args.path))
    # 3. Write the header only; the tensors after.
    rewrite_safetensors_metadata(args.path, updated)
    after = tensor_bytes_sha256(args.path), tensors_sha256(read_inference_weights(args.path))
    print(f"tensor bytes sha256: before {before[0]}, after {after[0]}")
    print(f"tensors_sha256:      before {before[1]}, after {after[1]}")
    if before != after:
        raise RuntimeError(f"{args.path}: the tensors changed ({before} -> {after}); this tool must not touch them")
    print(f"{args.path}: {describe_provenance(recorded_provenance(read_header(args.path)[1]))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
