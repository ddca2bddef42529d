"""Build the sample tables (train / holdout25 / holdout50) from a list of image-caption cases (docs/dataset.md).

    python tools/make_sample_table.py --cases cases.jsonl --out data/sample_table
    python tools/make_sample_table.py --cases cases.jsonl --poses camera_paths.jsonl --out data/sample_table

``cases.jsonl`` has one object per line: ``{"case_id": ..., "source_image": ..., "caption": ...}`` (a relative
``source_image`` is relative to the cases file). Writes into ``--out``:

    poses/action{0..3}_*.json     the 4 standard camera actions (32 latents each)
    poses/action<id>_<name>.json  with --poses: your own camera paths (poses/<case_id>/... for one case's own)
    train.jsonl                   --train-size cases x their camera paths
    holdout25.jsonl               --holdout25-size cases x their camera paths
    holdout50.jsonl               --holdout50-size cases x their camera paths

``--poses`` takes a JSONL file of camera paths, one per line: ``{"action_id": 4, "pose": "cams/orbit.json"}`` (a
pose JSON in the inference or the upstream training format, relative to the file) or ``{"action_id": 5,
"pose_string": "w-10, left-21"}``; optional ``"name"`` (the pose file's name) and ``"case_id"`` (that case only).
With --poses the standard actions are left out unless --actions names them. Every path must have --num_latents
latents. A row's seed is sha256(seed_base/case_id/action_id), so it depends on nothing else in the table.

The split is a seeded shuffle (``--split-seed``); the same inputs always give the same files. Existing tables with
different content are only replaced with ``--overwrite`` (changing a holdout after it was used would leak it).
Everything is validated before anything is written; each file is written atomically.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from predictor_training.data.sample_table import (
    DEFAULT_SPLIT_SIZES,
    STANDARD_ACTIONS,
    STANDARD_NUM_LATENTS,
    build_sample_rows,
    check_disjoint_splits,
    format_sample_table,
    read_camera_paths,
    read_cases,
    read_sample_table,
    split_cases,
    write_camera_pose_files,
    write_sample_table,
    write_standard_pose_files,
)
from predictor_training.runtime.errors import CommandParser, UserInputError, command
from predictor_training.runtime.flags import SEED, add_check_only_arg, report_check_only
from predictor_training.runtime.io import check_output_folder_kind


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, required=True,
                        help="JSONL of image-caption cases with fields case_id, source_image, caption")
    parser.add_argument("--out", type=Path, required=True,
                        help="output folder for poses/, train.jsonl, holdout25.jsonl, holdout50.jsonl")
    parser.add_argument("--train-size", type=int, default=DEFAULT_SPLIT_SIZES["train"],
                        help="number of cases in train.jsonl (each gives one row per action)")
    parser.add_argument("--holdout25-size", type=int, default=DEFAULT_SPLIT_SIZES["holdout25"],
                        help="number of cases in holdout25.jsonl")
    parser.add_argument("--holdout50-size", type=int, default=DEFAULT_SPLIT_SIZES["holdout50"],
                        help="number of cases in holdout50.jsonl")
    parser.add_argument("--split-seed", type=SEED, default=0, help="seed of the shuffle that assigns cases to splits")
    parser.add_argument("--seed-base", type=int, default=0,
                        help="mixed into every row's seed (seed = hash(seed_base, case_id, action_id))")
    parser.add_argument("--actions", type=str, default=None,
                        help=f"comma-separated standard action ids to include, from {sorted(STANDARD_ACTIONS)} "
                             "(default: all four without --poses, none with it)")
    parser.add_argument("--poses", type=Path, default=None,
                        help="JSONL of your own camera paths (action_id + pose file or pose_string, optional name "
                             "and case_id); each case gets one row per path")
    parser.add_argument("--num_latents", type=int, default=STANDARD_NUM_LATENTS,
                        help="latents every camera path must have (default %(default)s = 125 frames)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing tables whose content differs (default: refuse)")
    add_check_only_arg(parser, what="the tables and their case and row counts")
    args = parser.parse_args(argv)
    for flag in ("train_size", "holdout25_size", "holdout50_size"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.num_latents < 1:
        parser.error(f"--num_latents must be >= 1, got {args.num_latents}")
    if args.actions is None:
        args.actions = "" if args.poses is not None else ",".join(str(a) for a in STANDARD_ACTIONS)
    try:
        args.action_ids = tuple(int(part) for part in args.actions.split(",")) if args.actions else ()
    except ValueError:
        parser.error(f"--actions must be comma-separated integers, got {args.actions!r}")
    if not args.action_ids and args.poses is None:
        parser.error("--actions '': no camera path left; name standard actions or give --poses")
    unknown = [a for a in args.action_ids if a not in STANDARD_ACTIONS]
    if unknown or len(set(args.action_ids)) != len(args.action_ids):
        parser.error(f"--actions {args.actions!r}: expected distinct ids from {sorted(STANDARD_ACTIONS)}")
    return args


@command
def main(argv=None) -> dict[str, Path]:
    args = parse_args(argv)
    sizes = {"train": args.train_size, "holdout25": args.holdout25_size, "holdout50": args.holdout50_size}

    # 1. validate and split the cases (nothing is written before this succeeds); --out holds no other kind of folder
    check_output_folder_kind(args.out, flag="--out", marker=None)
    cases = read_cases(args.cases)
    camera_paths = [] if args.poses is None else read_camera_paths(
        args.poses, num_latents=args.num_latents, standard_ids=args.action_ids, case_ids=[c.case_id for c in cases])
    if args.action_ids and args.num_latents != STANDARD_NUM_LATENTS:
        raise UserInputError(f"--actions {args.actions}: the standard actions have {STANDARD_NUM_LATENTS} latents, "
                             f"not --num_latents {args.num_latents}; leave them out (--actions '') or use 32")
    splits = split_cases(cases, sizes, seed=args.split_seed)
    tables = {name: build_sample_rows(split, args.action_ids, args.seed_base, camera_paths)
              for name, split in splits.items()}
    check_disjoint_splits(tables)
    texts = {name: format_sample_table(rows) for name, rows in tables.items()}

    # 2. refuse to silently change an existing split
    paths = {name: args.out / f"{name}.jsonl" for name in tables}
    changed = [str(path) for name, path in paths.items() if path.exists() and path.read_text("utf-8") != texts[name]]
    if changed and not args.overwrite:
        raise UserInputError(f"{', '.join(changed)} already exist with different content; pass --overwrite to "
                             "replace them")

    if args.check_only:
        report_check_only(*(f"{name}: {len(splits[name])} cases, {len(tables[name])} rows -> {paths[name]}"
                            for name in tables))
        return paths

    # 3. write poses, then the tables, then read them back as the trainers will
    write_standard_pose_files(args.out, args.action_ids)
    write_camera_pose_files(args.out, camera_paths)
    for name, rows in tables.items():
        write_sample_table(paths[name], rows)
    for name, path in paths.items():
        read_sample_table(path)
        num_cases, num_rows = len(splits[name]), len(tables[name])
        print(f"{name}: {num_cases} cases, {num_rows} rows (case x camera path) -> {path}")
    unused = len(cases) - sum(sizes.values())
    if unused:
        print(f"{unused} of {len(cases)} cases are in no split")
    return paths


if __name__ == "__main__":
    main()
