"""Build the sample tables (train / holdout25 / holdout50) from a list of image-caption cases.

    python tools/make_sample_table.py --cases cases.jsonl --out data/sample_table

``cases.jsonl`` has one object per line: ``{"case_id": ..., "source_image": ..., "caption": ...}`` (a relative
``source_image`` is relative to the cases file). Writes into ``--out``:

    poses/action{0..3}_*.json     the 4 standard camera actions (32 latents each)
    train.jsonl                   --train-size cases x 4 actions
    holdout25.jsonl               --holdout25-size cases x 4 actions
    holdout50.jsonl               --holdout50-size cases x 4 actions

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
    build_sample_rows,
    check_disjoint_splits,
    format_sample_table,
    read_cases,
    read_sample_table,
    split_cases,
    write_sample_table,
    write_standard_pose_files,
)
from predictor_training.runtime.errors import CommandParser, UserInputError, command


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
    parser.add_argument("--split-seed", type=int, default=0, help="seed of the shuffle that assigns cases to splits")
    parser.add_argument("--seed-base", type=int, default=0,
                        help="mixed into every row's seed (seed = hash(seed_base, case_id, action_id))")
    parser.add_argument("--actions", type=str, default=",".join(str(a) for a in STANDARD_ACTIONS),
                        help=f"comma-separated standard action ids to include, from {sorted(STANDARD_ACTIONS)}")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing tables whose content differs (default: refuse)")
    args = parser.parse_args(argv)
    for flag in ("train_size", "holdout25_size", "holdout50_size"):
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    try:
        args.action_ids = tuple(int(part) for part in args.actions.split(","))
    except ValueError:
        parser.error(f"--actions must be comma-separated integers, got {args.actions!r}")
    unknown = [a for a in args.action_ids if a not in STANDARD_ACTIONS]
    if unknown or len(set(args.action_ids)) != len(args.action_ids):
        parser.error(f"--actions {args.actions!r}: expected distinct ids from {sorted(STANDARD_ACTIONS)}")
    return args


@command
def main(argv=None) -> dict[str, Path]:
    args = parse_args(argv)
    sizes = {"train": args.train_size, "holdout25": args.holdout25_size, "holdout50": args.holdout50_size}

    # 1. validate and split the cases (nothing is written before this succeeds)
    cases = read_cases(args.cases)
    splits = split_cases(cases, sizes, seed=args.split_seed)
    tables = {name: build_sample_rows(split, args.action_ids, args.seed_base) for name, split in splits.items()}
    check_disjoint_splits(tables)
    texts = {name: format_sample_table(rows) for name, rows in tables.items()}

    # 2. refuse to silently change an existing split
    paths = {name: args.out / f"{name}.jsonl" for name in tables}
    changed = [str(path) for name, path in paths.items() if path.exists() and path.read_text("utf-8") != texts[name]]
    if changed and not args.overwrite:
        raise UserInputError(f"{', '.join(changed)} already exist with different content; pass --overwrite to "
                             "replace them")

    # 3. write poses, then the tables, then read them back as the trainers will
    write_standard_pose_files(args.out, args.action_ids)
    for name, rows in tables.items():
        write_sample_table(paths[name], rows)
    for name, path in paths.items():
        read_sample_table(path)
        num_cases, num_rows = len(splits[name]), len(tables[name])
        print(f"{name}: {num_cases} cases x {len(args.action_ids)} actions = {num_rows} rows -> {path}")
    unused = len(cases) - sum(sizes.values())
    if unused:
        print(f"{unused} of {len(cases)} cases are in no split")
    return paths


if __name__ == "__main__":
    main()
