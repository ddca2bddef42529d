"""Make the CPU demo assets: a Teacher, encoders, source images, sample tables, encoder outputs (and ground truth).

    python tools/make_demo_assets.py --out demo_data/D                  # the demo world (default)
    python tools/make_demo_assets.py --out demo_data/D --kind random    # a tiny random Teacher (what tests use)
    python tools/make_demo_assets.py --out demo_data/D_kd --teacher W/kd/model   # the world with another Teacher

--kind world (default; about 75 s of CPU time, ~65 MB): the shipped demo world
(`predictor_training/world/weights/`, docs/demo_world.md): its trained 4-step Teacher and VAE, its rendered scenes
and camera paths. A case is a scene, an action one of its camera paths (see predictor_training/world/shipped.py for
which scenes go to which split):

    D/teacher/            the world Teacher (copied from the weights folder)
    D/encoders/           tiny text / glyph / vision encoders (seeded, as the Teacher was trained with) + the world VAE
    D/images/{scene}.png  the scene's first frame (32 x 48), the image condition
    D/samples/            poses/{clip}.json (the path's exact cameras), train.jsonl, holdout25.jsonl, holdout50.jsonl,
                          final.jsonl
    D/ground_truth/{scene}__a{path}/   the clip's 125 rendered frames (PNG), what the eval compares against
    D/clips/              train.jsonl, holdout.jsonl (holdout25 + holdout50): clip tables of the same clips for
                          tools/build_video_latent_dataset.py --clips (the fvtools demos' video latents); final.jsonl
                          lists the final clips the same way, for reading (no dataset builder takes it)
    D/encoded, D/cases.jsonl, D/demo_config.json   as below (demo_config also names ground_truth and clips, and
                          records how the final scenes were made)

final (--num_final, default 12 scenes x 4 paths = 48 videos; 0 = none) is the split nothing is chosen on: new scenes,
not in the world at all, made as the world makes its held-out scenes from seeds of their own (cases f000, ...;
predictor_training/world/shipped.py: final_clips). Choose presets, weights and hyperparameters on holdout25 /
holdout50 only, and quote final in headlines (docs/eval.md). Adding it changes no file of the other splits: with
--num_final 0 the folder is byte for byte the one made before the split existed, and otherwise only cases.jsonl
(the final cases appended), demo_config.json and the final split's own files differ.

--kind random (seconds, a few MB; what the tests use):

    D/teacher/            WorldPlayTransformer.from_preset("demo"), upstream zero-initialised layers given small random
                          values (`randomize_zero_initialised_`) so every path affects the output; save_pretrained
    D/encoders/           tiny random diffusers-format HunyuanVideo-1.5 i2v encoders (predictor_training.world.demo_assets)
    D/images/{case}.png   procedural source images (96 x 160)
    D/cases.jsonl         case_id, source_image (relative to D), caption
    D/samples/            poses/*.json, train.jsonl, holdout25.jsonl, holdout50.jsonl (4 standard actions per case;
                          source_image paths relative to D/samples, so the folder can be moved)
    D/encoded/{case}.pt   encoder outputs at 64 x 96 (latent grid 4 x 6), made by the encoder stage's own function
    D/demo_config.json    kind, resolution, num_latents, latent grid, teacher preset, counts, seed

The same arguments give byte-identical files.

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
from PIL import Image

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
    FINAL_SPLIT,
    STANDARD_ACTIONS,
    Case,
    SampleRow,
    build_sample_rows,
    read_cases,
    read_sample_table,
    sample_seed,
    split_cases,
    write_sample_table,
    write_standard_pose_files,
)
from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import SEED, add_check_only_arg, add_threads_arg, report_check_only
from predictor_training.runtime.io import check_output_folder_kind
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.video.ground_truth import video_key
from predictor_training.video.io import write_video
from predictor_training.world.assets import WORLD_WEIGHTS, write_world_encoders
from predictor_training.world.clips import FPS, render_clip
from predictor_training.world.demo_assets import (
    DEMO_HEIGHT,
    DEMO_NUM_LATENTS,
    DEMO_TEACHER_PRESET,
    DEMO_WIDTH,
    TinyEncoderSizes,
    make_demo_scenes,
    save_tiny_encoders,
)
from predictor_training.world.shipped import (
    ShippedWorld,
    demo_split_clips,
    final_clips,
    load_shipped_world,
    scene_case_id,
)

# Sub-seeds of --seed for each ingredient, so changing one never shifts another.
_TEACHER_SEED, _TEACHER_ZERO_INIT_SEED, _ENCODER_SEED = 1000, 2000, 3000
DEFAULT_NUM_FINAL = 12  # --kind world: final scenes (x 4 paths = 48 videos)
# The clip table (D/clips/<name>.jsonl) of each sample-table split of --kind world.
CLIP_TABLE_OF_SPLIT = {"train": "train", "holdout25": "holdout", "holdout50": "holdout", FINAL_SPLIT: FINAL_SPLIT}


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="demo folder to create")
    parser.add_argument("--kind", choices=("world", "random"), default="world", help="world: the shipped demo world "
                        "(trained Teacher and VAE, rendered scenes with ground truth); random: a tiny random Teacher "
                        "on procedural images (default %(default)s)")
    parser.add_argument("--world_weights", type=Path, default=WORLD_WEIGHTS, help="--kind world: the world weights "
                        "folder (vae/, teacher/, world_config.json; default: the shipped one)")
    parser.add_argument("--teacher", type=Path, default=None, help="--kind world: another Teacher folder of the same "
                        "world (config.json + weights, e.g. a distilled student's kd/model/) in place of "
                        "--world_weights' teacher/ (default: that one); demo_config.json records it")
    parser.add_argument("--num_train", type=int, default=12, help="cases in samples/train.jsonl (world: scenes, each "
                        "with its 4 train paths; random: images, each with the 4 standard actions)")
    parser.add_argument("--num_holdout25", type=int, default=8, help="cases in samples/holdout25.jsonl (world: "
                        "held-out scenes x their 4 paths; 8 x 4 = 32 videos, half of them revisit paths)")
    parser.add_argument("--num_holdout50", type=int, default=8, help="cases in samples/holdout50.jsonl (world: train "
                        "scenes outside the demo's train split, each with its new path)")
    parser.add_argument("--num_final", type=int, default=None, help="world: new scenes in samples/final.jsonl, each "
                        "with its 4 paths, made like holdout25's from other seeds: the split nothing is chosen on "
                        "(default 12, i.e. 48 videos; 0 = none); random: 0 (the default there; it has no final split)")
    parser.add_argument("--seed", type=SEED, default=0, help="random: seed of the scenes, the split, the Teacher and "
                        "the encoders; world: seed of the rows' noise (the encoders keep the world's seed)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    add_check_only_arg(parser, what="the folder it would make and its splits")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    for flag in ("num_train", "num_holdout25", "num_holdout50"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.num_final is None:
        args.num_final = DEFAULT_NUM_FINAL if args.kind == "world" else 0
    if args.num_final < 0:
        parser.error(f"--num_final must be >= 0 (0 = no final split), got {args.num_final}")
    if args.kind == "random" and args.num_final:
        parser.error(f"--num_final {args.num_final}: the final split is made of new world scenes; --kind random has "
                     "none (leave the flag out or pass 0)")
    if args.out.exists() and not args.overwrite:
        parser.error(f"--out {args.out} already exists; pass --overwrite to replace it")
    # --overwrite replaces demo assets only: never a dataset, a run or anything else that lives in --out
    check_output_folder_kind(args.out, flag="--out", marker="demo_config.json")
    if args.teacher is not None:
        if args.kind != "world":
            parser.error("--teacher is for --kind world (the random kind makes its own Teacher)")
        if not (args.teacher / "config.json").is_file():
            parser.error(f"--teacher={str(args.teacher)!r}: no config.json in that folder")
    if args.kind == "world":
        world = load_shipped_world(args.world_weights)  # checked before the staging folder is made
        try:
            final_clips(world, args.num_final)  # a final caption with a word the tokenizer does not know is refused
        except ValueError as error:
            parser.error(str(error))
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


def write_encoded(root: Path, teacher_config, height: int, width: int) -> tuple[int, int]:
    """encoded/: the encoder stage run on cases.jsonl with D/encoders at height x width; checked to fit the Teacher."""
    encoder = CaseEncoder.from_pretrained(
        root / "encoders", "cpu", torch.float32, byt5_dtype=torch.float32, vae_dtype=torch.float32
    )
    jobs = jobs_from_cases(read_cases(root / "cases.jsonl"))
    check_or_write_encode_config(root / "encoded", encode_settings(encoder, height, width), write=True)
    encode_cases_to_folder(encoder, jobs, root / "encoded", height, width, show_progress=False)
    grid = encoder.latent_grid(height, width)
    for job in jobs:  # the outputs must fit the Teacher
        load_encoded_case(root / "encoded" / f"{job.case_id}.pt", teacher_config, grid)
    return grid


def write_random_encoders(root: Path, teacher_config, seed: int) -> None:
    """encoders/: tiny random encoders sized to the Teacher."""
    save_tiny_encoders(root / "encoders", TinyEncoderSizes.for_teacher_config(teacher_config), seed + _ENCODER_SEED)


def write_world_cases(root: Path, world: ShippedWorld, splits: dict[str, list], seed: int) -> dict[str, int]:
    """images/, cases.jsonl, samples/ (poses + tables), ground_truth/ and clips/ of the chosen world clips.

    clips/train.jsonl holds the train split's clips, clips/holdout.jsonl those of holdout25 and holdout50, and
    clips/final.jsonl those of final, when there is one (`CLIP_TABLE_OF_SPLIT`; the clip tables of
    tools/build_video_latent_dataset.py, whose splits are their file names).

    Every clip is rendered once: its frames are the ground truth, its first frame the scene's image (all paths of a
    scene start from the same camera). Returns the rows per split.
    """
    for folder in ("images", "samples/poses", "ground_truth", "clips"):
        (root / folder).mkdir(parents=True)
    cases: dict[str, Case] = {}
    rows_per_split = {}
    clip_lines = {CLIP_TABLE_OF_SPLIT[name]: [] for name in splits}
    for name, clips in splits.items():
        rows = []
        for clip in clips:
            case_id, key = scene_case_id(clip), video_key(scene_case_id(clip), clip.path_index)
            frames = render_clip(clip, world.settings)
            write_video(root / "ground_truth" / key, frames, fps=FPS, lossless=True)
            if case_id not in cases:
                buffer = io.BytesIO()
                Image.fromarray(frames[0]).save(buffer, format="PNG")
                write_bytes_atomic(root / "images" / f"{case_id}.png", buffer.getvalue())
                cases[case_id] = Case(case_id, f"images/{case_id}.png", clip.caption)
            pose = f"poses/{clip.clip_id}.json"
            pose_json = json.dumps(pose_string_to_json(clip.pose_string), indent=1) + "\n"
            write_bytes_atomic(root / "samples" / pose, pose_json.encode("utf-8"))
            rows.append(SampleRow(case_id=case_id, source_image=f"../images/{case_id}.png", caption=clip.caption,
                                  action_id=clip.path_index, pose=pose,
                                  seed=sample_seed(case_id, clip.path_index, seed)))
            clip_lines[CLIP_TABLE_OF_SPLIT[name]].append(json.dumps(
                {"clip_id": key, "video": f"../ground_truth/{key}", "pose": f"../samples/{pose}",
                 "caption": clip.caption}) + "\n")
        write_sample_table(root / "samples" / f"{name}.jsonl", rows)
        rows_per_split[name] = len(read_sample_table(root / "samples" / f"{name}.jsonl"))
    for name, lines in clip_lines.items():
        write_bytes_atomic(root / "clips" / f"{name}.jsonl", "".join(lines).encode("utf-8"))
    lines = [json.dumps({"case_id": case.case_id, "source_image": case.source_image, "caption": case.caption},
                        ensure_ascii=False) for case in cases.values()]
    write_bytes_atomic(root / "cases.jsonl", ("\n".join(lines) + "\n").encode("utf-8"))
    return rows_per_split


def write_demo_config(root: Path, kind: str, teacher_config, resolution: tuple[int, int], num_latents: int,
                      grid: tuple[int, int], rows: dict[str, int], seed: int, extra: dict | None = None) -> dict:
    config = {
        "kind": kind,
        "resolution": {"height": resolution[0], "width": resolution[1]},
        "num_latents": num_latents,
        "latent_grid": {"channels": int(teacher_config["in_channels"]), "height": grid[0], "width": grid[1]},
        "teacher_preset": DEMO_TEACHER_PRESET if kind == "random" else "world",
        "teacher": "teacher",
        "encoders": "encoders",
        "cases": "cases.jsonl",
        "samples": {name: f"samples/{name}.jsonl" for name in rows},
        "sample_rows": rows,
        "encoded": "encoded",
        "seed": seed,
        **(extra or {}),
    }
    write_bytes_atomic(root / "demo_config.json", (json.dumps(config, indent=2) + "\n").encode("utf-8"))
    return config


def assemble_random(root: Path, sizes: dict[str, int], seed: int) -> dict:
    """--kind random into `root`; returns demo_config."""
    cases = write_images_and_cases(root, sum(sizes.values()), seed)
    rows = write_sample_tables(root, cases, sizes, seed)
    teacher = write_teacher(root, seed)
    write_random_encoders(root, teacher.config, seed)
    grid = write_encoded(root, teacher.config, DEMO_HEIGHT, DEMO_WIDTH)
    return write_demo_config(root, "random", teacher.config, (DEMO_HEIGHT, DEMO_WIDTH), DEMO_NUM_LATENTS, grid, rows,
                             seed)


def assemble_world(root: Path, sizes: dict[str, int], seed: int, weights: Path, teacher: Path | None = None) -> dict:
    """--kind world into `root`; returns demo_config. `teacher`: a Teacher folder in place of the weights' own.
    sizes["final"] (0 or absent: none) new scenes make the final split, after the others."""
    world = load_shipped_world(weights)
    splits = demo_split_clips(world, sizes["train"], sizes["holdout25"], sizes["holdout50"])
    if sizes.get(FINAL_SPLIT):
        splits[FINAL_SPLIT] = final_clips(world, sizes[FINAL_SPLIT])
    rows = write_world_cases(root, world, splits, seed)
    shutil.copytree(world.teacher if teacher is None else teacher, root / "teacher")
    teacher_config = WorldPlayTransformer.load_config(str(root / "teacher"))
    write_world_encoders(root / "encoders", world.vae, world.captions, world.settings.seed)
    resolution = (world.settings.height, world.settings.width)
    grid = write_encoded(root, teacher_config, *resolution)
    clip_tables = dict.fromkeys(CLIP_TABLE_OF_SPLIT[name] for name in splits)
    extra = {"ground_truth": "ground_truth", "clips": {name: f"clips/{name}.jsonl" for name in clip_tables},
             "world": {"settings": world.settings.recorded(),
                       "splits": {name: [clip.clip_id for clip in clips] for name, clips in splits.items()}}}
    if FINAL_SPLIT in splits:  # how its scenes were made (predictor_training/world/shipped.py: final_clips)
        extra["final"] = {
            "rule": "new scenes made as the world makes held-out scenes; scene i = make_scene(derive_seed(world seed, "
                    "'final_scene', i)), path p = the first clear attempt of derive_seed(world seed, 'final_path', i, "
                    "p, attempt); chosen on: nothing (choose on holdout25 / holdout50, quote final)",
            "clips": [clip.record() for clip in splits[FINAL_SPLIT]],
        }
    if teacher is not None:
        extra["teacher_source"] = str(Path(teacher).resolve())
    return write_demo_config(root, "world", teacher_config, resolution, world.settings.num_latents, grid, rows, seed,
                             extra)


def build_demo_assets(out: Path, num_train: int, num_holdout25: int, num_holdout50: int, seed: int,
                      overwrite: bool = False, kind: str = "world", world_weights: Path = WORLD_WEIGHTS,
                      teacher: Path | None = None, num_final: int = 0) -> dict:
    """Build every demo asset in a staging folder next to `out`, then move it to `out`. Returns demo_config.
    `num_final`: final scenes (--kind world only; 0 = no final split)."""
    if num_final and kind != "world":
        raise ValueError(f"num_final={num_final}: only --kind world has a final split")
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass overwrite=True (--overwrite) to replace it")
    staging = out.parent / f".{out.name}.building"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)

    sizes = {"train": num_train, "holdout25": num_holdout25, "holdout50": num_holdout50}
    if kind == "world":
        sizes[FINAL_SPLIT] = num_final
        config = assemble_world(staging, sizes, seed, Path(world_weights), teacher)
    elif kind == "random":
        config = assemble_random(staging, sizes, seed)
    else:
        raise ValueError(f"kind must be 'world' or 'random', got {kind!r}")

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


@command
def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.check_only:
        if args.kind == "world":  # the world has these many scenes per split
            demo_split_clips(load_shipped_world(args.world_weights), args.num_train, args.num_holdout25,
                             args.num_holdout50)
        report_check_only(f"demo assets ({args.kind}) -> {args.out} ({'replaced' if args.out.exists() else 'new'}): "
                          f"{args.num_train} train, {args.num_holdout25} holdout25, {args.num_holdout50} holdout50 "
                          "cases")
        return {}
    set_cpu_threads(args.threads, tool="make_demo_assets", load_aware=False)
    started = time.time()
    config = build_demo_assets(args.out, args.num_train, args.num_holdout25, args.num_holdout50, args.seed,
                               overwrite=args.overwrite, kind=args.kind, world_weights=args.world_weights,
                               teacher=args.teacher, num_final=args.num_final)
    size = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(f"demo assets ({config['kind']}) in {args.out}: {config['sample_rows']} sample rows, grid "
          f"{config['latent_grid']}, {size / 2**20:.1f} MiB, {time.time() - started:.1f} s")
    return config


if __name__ == "__main__":
    main()
