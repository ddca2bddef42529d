"""Make the CPU demo assets: a tiny random Teacher, tiny encoders, procedural images, sample tables, encoder outputs.

    python tools/make_demo_assets.py --out demo_data/D

Writes (a few MB, seconds on a CPU; the same arguments give byte-identical files):

    D/teacher/            WorldPlayTransformer.from_preset("demo"), upstream zero-initialised layers given small random
                          values (`randomize_zero_initialised_`) so every path affects the output; save_pretrained
    D/encoders/           tiny random diffusers-format HunyuanVideo-1.5 i2v encoders (predictor_training.demo)
    D/images/{case}.png   procedural source images (96 x 160)
    D/cases.jsonl         case_id, source_image (relative to D), caption
    D/samples/            poses/*.json, train.jsonl, holdout25.jsonl, holdout50.jsonl (4 standard actions per case;
                          source_image paths relative to D/samples, so the folder can be moved)
    D/encoded/{case}.pt   encoder outputs at 64 x 96 (latent grid 4 x 6), made by the encoder stage's own function
    D/demo_config.json    resolution, num_latents, latent grid, teacher preset, counts, seed

The folder is assembled next to --out and moved into place at the end; an existing --out is only replaced with
--overwrite.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import time
from pathlib import Path

import torch

from predictor_training.data.encoders import (
    CaseEncoder,
    check_or_write_encode_config,
    encode_cases_to_folder,
    encode_settings,
    jobs_from_cases,
    load_encoded_case,
    write_bytes_atomic,
)
from predictor_training.data.sample_table import (
    STANDARD_ACTIONS,
    Case,
    build_sample_rows,
    read_cases,
    read_sample_table,
    split_cases,
    write_sample_table,
    write_standard_pose_files,
)
from predictor_training.demo import (
    DEMO_HEIGHT,
    DEMO_NUM_LATENTS,
    DEMO_TEACHER_PRESET,
    DEMO_WIDTH,
    TinyEncoderSizes,
    make_demo_scenes,
    save_tiny_encoders,
)
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_

# Sub-seeds of --seed for each ingredient, so changing one never shifts another.
_TEACHER_SEED, _TEACHER_ZERO_INIT_SEED, _ENCODER_SEED = 1000, 2000, 3000


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="demo folder to create")
    parser.add_argument("--num_train", type=int, default=12, help="cases in samples/train.jsonl")
    parser.add_argument("--num_holdout25", type=int, default=3, help="cases in samples/holdout25.jsonl")
    parser.add_argument("--num_holdout50", type=int, default=3, help="cases in samples/holdout50.jsonl")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenes, the split, the Teacher and the encoders")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = parser.parse_args(argv)
    for flag in ("num_train", "num_holdout25", "num_holdout50"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.out.exists() and not args.overwrite:
        parser.error(f"--out {args.out} already exists; pass --overwrite to replace it")
    return args


# =============================================================================================================
# Steps (each writes into the staging folder `root`)
# =============================================================================================================
def write_images_and_cases(root: Path, num_cases: int, seed: int) -> list[Case]:
    """images/{case_id}.png and cases.jsonl (source_image relative to root). Returns the cases as written."""
    (root / "images").mkdir(parents=True)
    cases, lines = [], []
    for scene in make_demo_scenes(num_cases, seed):
        buffer = io.BytesIO()
        scene.image.save(buffer, format="PNG")
        write_bytes_atomic(root / "images" / f"{scene.case_id}.png", buffer.getvalue())
        case = Case(scene.case_id, f"images/{scene.case_id}.png", scene.caption)
        cases.append(case)
        lines.append(json.dumps({"case_id": case.case_id, "source_image": case.source_image, "caption": case.caption},
                                ensure_ascii=False))
    write_bytes_atomic(root / "cases.jsonl", ("\n".join(lines) + "\n").encode("utf-8"))
    return cases


def write_sample_tables(root: Path, cases: list[Case], sizes: dict[str, int], seed: int) -> dict[str, int]:
    """samples/: the same steps as tools/make_sample_table.py, with image paths kept relative (../images/...)."""
    samples = root / "samples"
    relative_cases = [Case(case.case_id, f"../{case.source_image}", case.caption) for case in cases]
    splits = split_cases(relative_cases, sizes, seed=seed)
    action_ids = tuple(sorted(STANDARD_ACTIONS))
    write_standard_pose_files(samples, action_ids)
    rows_per_split = {}
    for name, split in splits.items():
        rows = build_sample_rows(split, action_ids, seed_base=seed)
        write_sample_table(samples / f"{name}.jsonl", rows)
        rows_per_split[name] = len(read_sample_table(samples / f"{name}.jsonl"))
    return rows_per_split


def write_teacher(root: Path, seed: int) -> WorldPlayTransformer:
    """teacher/: the demo preset with every upstream zero-initialised tensor given small random values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + _TEACHER_SEED)
        teacher = WorldPlayTransformer.from_preset(DEMO_TEACHER_PRESET)
    generator = torch.Generator().manual_seed(seed + _TEACHER_ZERO_INIT_SEED)
    randomize_zero_initialised_(teacher, generator)
    teacher.save_pretrained(str(root / "teacher"))
    return teacher


def write_encoders_and_encoded(root: Path, teacher_config, seed: int) -> tuple[int, int]:
    """encoders/ (tiny, sized to the Teacher) and encoded/ (the encoder stage run on cases.jsonl)."""
    save_tiny_encoders(root / "encoders", TinyEncoderSizes.for_teacher_config(teacher_config), seed + _ENCODER_SEED)
    encoder = CaseEncoder.from_pretrained(
        root / "encoders", "cpu", torch.float32, byt5_dtype=torch.float32, vae_dtype=torch.float32
    )
    jobs = jobs_from_cases(read_cases(root / "cases.jsonl"))
    check_or_write_encode_config(root / "encoded", encode_settings(encoder, DEMO_HEIGHT, DEMO_WIDTH), write=True)
    encode_cases_to_folder(encoder, jobs, root / "encoded", DEMO_HEIGHT, DEMO_WIDTH, show_progress=False)
    grid = encoder.latent_grid(DEMO_HEIGHT, DEMO_WIDTH)
    for job in jobs:  # the outputs must fit the demo Teacher
        load_encoded_case(root / "encoded" / f"{job.case_id}.pt", teacher_config, grid)
    return grid


def write_demo_config(root: Path, teacher_config, grid: tuple[int, int], rows: dict[str, int], seed: int) -> dict:
    config = {
        "resolution": {"height": DEMO_HEIGHT, "width": DEMO_WIDTH},
        "num_latents": DEMO_NUM_LATENTS,
        "latent_grid": {"channels": int(teacher_config["in_channels"]), "height": grid[0], "width": grid[1]},
        "teacher_preset": DEMO_TEACHER_PRESET,
        "teacher": "teacher",
        "encoders": "encoders",
        "cases": "cases.jsonl",
        "samples": {name: f"samples/{name}.jsonl" for name in rows},
        "sample_rows": rows,
        "encoded": "encoded",
        "seed": seed,
    }
    write_bytes_atomic(root / "demo_config.json", (json.dumps(config, indent=2) + "\n").encode("utf-8"))
    return config


def build_demo_assets(out: Path, num_train: int, num_holdout25: int, num_holdout50: int, seed: int,
                      overwrite: bool = False) -> dict:
    """Build every demo asset in a staging folder next to `out`, then move it to `out`. Returns demo_config."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    staging = out.parent / f".{out.name}.building"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)

    sizes = {"train": num_train, "holdout25": num_holdout25, "holdout50": num_holdout50}
    cases = write_images_and_cases(staging, sum(sizes.values()), seed)
    rows = write_sample_tables(staging, cases, sizes, seed)
    teacher = write_teacher(staging, seed)
    grid = write_encoders_and_encoded(staging, teacher.config, seed)
    config = write_demo_config(staging, teacher.config, grid, rows, seed)

    if out.exists():
        retired = out.parent / f".{out.name}.old"
        if retired.exists():
            shutil.rmtree(retired)
        out.rename(retired)
        staging.rename(out)
        shutil.rmtree(retired)
    else:
        staging.rename(out)
    return config


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.time()
    config = build_demo_assets(args.out, args.num_train, args.num_holdout25, args.num_holdout50, args.seed,
                               overwrite=args.overwrite)
    size = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(f"demo assets in {args.out}: {config['sample_rows']} sample rows, grid {config['latent_grid']}, "
          f"{size / 2**20:.1f} MiB, {time.time() - started:.1f} s")
    return config


if __name__ == "__main__":
    main()
