"""Build the ODE-state cache of causal KD: a many-step teacher's AR rollouts, chunk by chunk (docs/ode_cache.md).

Conditions from a video-latent dataset (its clips' first frames, cameras, captions), or from sample tables with the
encoder stage's outputs:

    torchrun --nproc_per_node 8 tools/build_ode_cache.py --teacher RUN/model --video_latents /data/video_latents \
        --splits train,holdout --steps 32 --shift 5 --store_grid 4 --dtype bfloat16 --out /data/ode_cache
    torchrun --nproc_per_node 8 tools/build_ode_cache.py --teacher RUN/model --samples train.jsonl,holdout.jsonl \
        --encoded encoded/ --num_latents 32 --out /data/ode_cache

`--max_clips 400,8` caches at most 400 train and 8 holdout clips of the video-latent dataset, evenly spaced over each
split (a CPU-sized subset; the cache records it, so a rerun must give the same counts). Sample i is built by rank
i % world size; rerunning the same command resumes (finished samples are verified and
kept); COMPLETE is written last. The builder is ``predictor_training.data.ode_cache``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from predictor_training.data.builder import taken_back_on_refusal
from predictor_training.data.ode_cache import (
    CACHE_CONFIG_NAME,
    CACHE_LAYOUT,
    STORAGE_DTYPES,
    CacheJob,
    CacheSettings,
    build_cache,
    evenly_spaced,
    video_clip_seed,
)
from predictor_training.data.sample_table import FINAL_SPLIT
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.distributed import (
    cleanup_distributed,
    init_distributed,
    log0,
)
from predictor_training.runtime.errors import CommandParser, MissingFileError, UserInputError, command
from predictor_training.runtime.flags import SEED, add_check_only_arg, add_threads_arg, check_cuda_flag, report_check_only
from predictor_training.runtime.io import check_output_folder_kind, sha256_file
from predictor_training.teacher.config import DISTILLED_SHIFT
from predictor_training.teacher.source import (
    TeacherSource,
    describe_teacher,
    load_teacher,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, required=True, help="the many-step teacher's transformer folder")
    parser.add_argument("--action_ckpt", type=Path, default=None, help="action checkpoint loaded on top (optional)")
    source = parser.add_argument_group("conditions (either --video_latents, or --samples with --encoded)")
    source.add_argument("--video_latents", type=Path, default=None, help="a video-latent dataset root")
    source.add_argument("--splits", type=str, default="train",
                        help="--video_latents: comma-separated splits to cache (default %(default)s)")
    source.add_argument("--max_clips", type=str, default=None,
                        help="--video_latents: cache at most this many clips of each split, evenly spaced over the "
                             "split's clips in order; one number for every split or one per --splits entry "
                             "(e.g. 400,8; default: every clip)")
    source.add_argument("--samples", type=str, default=None,
                        help="comma-separated sample tables (JSONL); a row's split is its table's file stem")
    source.add_argument("--encoded", type=Path, default=None, help="--samples: folder of encoder outputs {case}.pt")
    source.add_argument("--num_latents", type=int, default=32, help="--samples: latents per video (default 32)")
    ode = parser.add_argument_group("the teacher's ODE")
    ode.add_argument("--steps", type=int, default=32, help="teacher denoising steps per chunk (default %(default)s)")
    ode.add_argument("--shift", type=float, default=DISTILLED_SHIFT, help="schedule shift (default %(default)g)")
    ode.add_argument("--store_grid", type=int, default=4,
                     help="keep the states on this many-step grid of the same shift, which must divide --steps "
                          "(default %(default)s: the 4-step student's noise levels; --store_grid = --steps keeps all)")
    ode.add_argument("--dtype", choices=sorted(STORAGE_DTYPES), default="bfloat16",
                     help="teacher weights and autocast dtype (default %(default)s; float32 on the CPU demo)")
    ode.add_argument("--storage_dtype", choices=sorted(STORAGE_DTYPES), default="bfloat16",
                     help="dtype of the stored states and final latents (default %(default)s)")
    ode.add_argument("--seed", type=SEED, default=0,
                     help="--video_latents: seed of the clips' noise (a clip's seed is stream_seed(seed, crc32(clip "
                          "id))); sample tables carry their own (default %(default)s)")
    parser.add_argument("--out", type=Path, required=True, help="cache folder to create or resume")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="process-group backend under torchrun (auto: nccl with CUDA, else gloo)")
    parser.add_argument("--stop_after", type=int, default=None,
                        help="debug: each rank stops after this many samples (no manifest; rerun to resume)")
    add_check_only_arg(parser, what="the samples it would cache and whether --out is new or resumed")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    check_cuda_flag(parser, "--backend", args.backend)
    if (args.video_latents is None) == (args.samples is None):
        parser.error("give exactly one condition source: --video_latents ROOT, or --samples TABLES --encoded DIR")
    if args.samples is not None and args.encoded is None:
        parser.error("--samples needs --encoded DIR (the encoder stage's outputs)")
    if args.samples is not None and FINAL_SPLIT in [Path(path).stem for path in args.samples.split(",") if path]:
        parser.error(f"--samples: split '{FINAL_SPLIT}' is the split nothing is chosen on; it never goes into a "
                     "training cache (docs/eval.md)")
    if args.steps < 1 or args.store_grid < 1 or args.steps % args.store_grid:
        parser.error(f"--store_grid={args.store_grid} must be >= 1 and divide --steps={args.steps}")
    if not args.shift > 0:
        parser.error(f"--shift={args.shift}: expected > 0")
    if not (args.teacher / "config.json").is_file():
        parser.error(f"--teacher={str(args.teacher)!r}: no config.json in that folder")
    if args.max_clips is not None:
        if args.video_latents is None:
            parser.error("--max_clips needs --video_latents (a sample table is its own subset)")
        splits = [item for item in args.splits.split(",") if item]
        try:
            counts = [int(item) for item in args.max_clips.split(",")]
        except ValueError:
            parser.error(f"--max_clips={args.max_clips!r}: comma-separated integers expected")
        if len(counts) not in (1, len(splits)) or min(counts) < 1:
            parser.error(f"--max_clips={args.max_clips!r}: one count >= 1, or one per split of --splits {splits}")
        args.max_clips = dict(zip(splits, counts * len(splits) if len(counts) == 1 else counts))
    return args


def plan_jobs(args) -> tuple[list[CacheJob], object, dict]:
    """(jobs, load_condition(job), the inputs record of the cache config)."""
    jobs = []
    if args.video_latents is not None:
        datasets = {split: VideoLatentDataset(args.video_latents, split)
                    for split in [item for item in args.splits.split(",") if item]}
        limits = args.max_clips or {}
        for split, dataset in datasets.items():
            for index in evenly_spaced(len(dataset.clips), limits.get(split)):
                entry = dataset.clips[index]
                jobs.append(CacheJob(len(jobs), entry.clip_id, split, video_clip_seed(args.seed, entry.clip_id),
                                     (split, index)))

        def load_condition(job: CacheJob) -> dict:
            split, index = job.condition
            return datasets[split][index]

        inputs = {"video_latents": str(args.video_latents.resolve()), "splits": sorted(datasets), "seed": args.seed}
        if limits:
            inputs["max_clips"] = {split: limits[split] for split in sorted(limits)}
        return jobs, load_condition, inputs
    tables = {Path(path).stem: TrajectoryTableDataset(path, encoded_dir=args.encoded, num_latents=args.num_latents)
              for path in args.samples.split(",") if path}
    for split, table in tables.items():
        for index, (case_id, action_id) in enumerate(table.keys()):
            jobs.append(CacheJob(len(jobs), f"{case_id}__a{action_id}", split, int(table.rows[index].seed),
                                 (split, index)))

    def load_condition(job: CacheJob) -> dict:
        split, index = job.condition
        item = tables[split][index]
        return {**tables[split].load_case(item["case_id"]), "viewmats": item["viewmats"].float(),
                "Ks": item["Ks"].float(), "action": item["action"]}

    inputs = {"samples": sorted(str(Path(path).resolve()) for path in args.samples.split(",") if path),
              "encoded": str(args.encoded.resolve()), "num_latents": args.num_latents}
    return jobs, load_condition, inputs


def weights_sha256(teacher: Path, action_ckpt: Path | None) -> dict[str, str]:
    """sha256 of every weight file of the teacher (and its action checkpoint): a cache is only resumed or reused with
    the weights that made it."""
    files = sorted(teacher.glob("*.safetensors")) + ([action_ckpt] if action_ckpt is not None else [])
    return {path.name: sha256_file(path) for path in files}


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    check_output_folder_kind(args.out, flag="--out", marker=CACHE_CONFIG_NAME, layout=CACHE_LAYOUT)
    if args.check_only:
        jobs, _, _ = plan_jobs(args)  # the conditions: a video-latent dataset's splits, or tables and encoder outputs
        if args.action_ckpt is not None and not args.action_ckpt.is_file():
            raise MissingFileError(f"--action_ckpt {args.action_ckpt}: no such file")
        if args.out.exists() and not args.out.is_dir():
            raise UserInputError(f"--out {args.out}: a file; expected a cache folder to create or resume")
        state = "resume: its settings are compared when it starts" if any(args.out.glob("*.json")) else "new"
        return report_check_only(f"{len(jobs)} samples, {args.steps} steps at shift {args.shift:g} -> {args.out} "
                                 f"({state})")
    set_cpu_threads(args.threads, tool="build_ode_cache", load_aware=False)
    env = init_distributed(args.backend)
    try:
        jobs, load_condition, inputs = plan_jobs(args)
        inputs["teacher_weights_sha256"] = weights_sha256(args.teacher, args.action_ckpt)
        source = TeacherSource(args.teacher, args.action_ckpt, "--teacher", None)
        teacher = load_teacher(source, env.device, STORAGE_DTYPES[args.dtype])
        log0(describe_teacher(source, teacher))
        log0(f"{len(jobs)} samples, {args.steps} steps at shift {args.shift:g}, states kept on the "
             f"{args.store_grid}-step grid, world size {env.world_size}")
        settings = CacheSettings(steps=args.steps, shift=args.shift, store_grid=args.store_grid,
                                 compute_dtype=args.dtype, storage_dtype=args.storage_dtype)
        with taken_back_on_refusal(args.out, env):
            build_cache(teacher, jobs, load_condition, settings, args.out, env=env, inputs=inputs,
                        stop_after=args.stop_after)
        return 0
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
