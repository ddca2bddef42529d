#!/usr/bin/env python
"""Is a Predictor worth training? One table: every schedule, the fewer-step samplers, training-free caches and every
Predictor given, on the same videos and seeds, at matched cost, with paired bootstrap intervals (docs/leaderboard.md).

Rows (predictor_training/eval/leaderboard.py): the reference F-F-F-F; the k-step Euler samplers (--samplers: every
choice of steps that keeps step 0; velocity reuse at a schedule is exactly such a sampler); the training-free
caches (--caches: hidden reuse, a TaylorSeer first-order forecast, previous-chunk reuse and the block-residual cache
at the same plans, and TeaCache adaptive skipping calibrated on --calibration_split to --teacache_full_steps);
per-chunk mixtures (--plans); each --ckpt at each plan of --predictor_plans (and every P plan of --plans, e.g.
F-R-R-P), each such plan also with hidden reuse and the block-residual cache for P (--counterparts: F-R-R-H, F-R-R-B,
the training-free rows at the Predictor's exact schedule); each --student (the Teacher distilled to fewer steps per
chunk) at its own steps. The rows run through the
eval's own per-video loop (tools/eval_predictor.py's outputs are written too), then:

    leaderboard.md / .csv / .json   per row: Full steps per chunk, speedups (FLOP bound on the config that ran and at
                                    the real 8.6B config, measured DiT - median of --timing_repeats interleaved
                                    rollouts, with the interquartile range over the videos - and end-to-end), PSNR vs
                                    F-F-F-F with its 95 %
                                    interval, the paired difference from --baseline, SSIM, LPIPS, last chunk,
                                    temporal-delta error, ground truth (chunks 1..) and revisit figures; for each
                                    Predictor its margin over the baselines' front on three cost axes
    pareto_<axis>.png               quality vs speedup with interval bars and the front (mixtures in MSE)
    front/side_by_side/*.mp4        ground truth | reference | the front's rows | the Predictors, first videos

Demo (CPU; the main job's two Predictors):

    python tools/leaderboard.py --demo demo_data/assets --split holdout25 --lpips_random_backbone \\
        --ckpt checkpoints/<offline run>/training_latest.pt --ckpt checkpoints/<rollout run>/training_latest.pt

Real model, 8 GPUs (run it first on your own checkpoint: it says whether fewer Teacher steps already do the job):

    torchrun --nproc_per_node 8 tools/leaderboard.py --split holdout25 --samples_dir /data/samples \\
        --encoded /data/encoded --vae /models/HunyuanVideo-1.5-i2v/vae --teacher /models/worldplay/transformer \\
        --ckpt RUN/predictor_step_02000.safetensors --lpips_alexnet ~/weights/alexnet-owt-7be5be79.pth

A rerun with the same flags skips finished videos (the eval's resume); another row set needs another --run_name.
Choose presets, weights and hyperparameters on holdout25 / holdout50 only; a headline quotes --split final (the
demo's new scenes, which nothing is chosen on; docs/leaderboard.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from predictor_training.data.sample_table import FINAL_SPLIT
import torch

from predictor_training.eval import DTYPES, resolve_eval_settings
from predictor_training.eval.front import BOOTSTRAP_UNITS, Estimate
from predictor_training.eval.inputs import INPUT_FLAGS, resolve_inputs, sample_table_path
from predictor_training.recipes.flags import add_input_args
from predictor_training.eval.caches import spread_rows
from predictor_training.eval.adaptive_calibration import calibrate_adaptive
from predictor_training.eval.leaderboard import (
    CACHES,
    COUNTERPART_LETTERS,
    DEFAULT_BASELINE,
    DEFAULT_RESIDUAL_BLOCKS,
    LeaderboardRows,
    build_rows,
    front_keys,
    choose_baseline,
    with_short_labels,
    write_front_side_by_side,
)
from predictor_training.eval.leaderboard_analysis import analyse
from predictor_training.eval.leaderboard_report import headline_lines, write_leaderboard
from predictor_training.eval.students import read_student, student_labels
from predictor_training.eval.training_cost import training_costs
from predictor_training.eval.methods import parse_context_modes
from predictor_training.eval.predictor_checkpoints import label_checkpoints, read_predictor_checkpoint
from predictor_training.eval.run import build_runtime, check_evaluation, open_dataset, run_evaluation
from predictor_training.eval.settings import EVAL_FLAGS
from predictor_training.eval.reports import SIDE_BY_SIDE_MIN_HEIGHT
from predictor_training.eval.timing import TIMING_STATISTICS
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, StepPlan
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.distributed import all_gather_objects, cleanup_distributed, init_distributed, print0
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import SEED, add_check_only_arg, add_threads_arg, report_check_only
from predictor_training.runtime.io import sha256_json, write_json_atomic
from predictor_training.teacher.config import DISTILLED_SHIFT, DISTILLED_STEPS
from predictor_training.teacher.source import load_teacher

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAINED = "trained"  # --predictor_plans entry: the schedule the checkpoint's run trained (its --replace_steps)
DEFAULT_PLANS = "F-R-R-R|F-R-R-F,F-R-R-R|F-R-R-R|F-R-R-R|F-R-R-F"


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_input_args(parser)
    rows = parser.add_argument_group("rows")
    rows.add_argument("--ckpt", type=Path, action="append", default=[], help="Predictor checkpoint "
                      "(predictor_step_XXXXX.safetensors or training_latest.pt); repeat for several")
    rows.add_argument("--student", type=Path, action="append", default=[], help="a trained few-step student of the "
                      "Teacher (fvtools/train_kd.py or train_dmd2.py --generator student): its model folder (RUN/model, "
                      "RUN/ema/model) or LoRA file (RUN/lora_student.safetensors); a baseline row at its own steps on "
                      "the Teacher's sigma grid, every chunk on the student; repeat for several")
    rows.add_argument("--shared_model", type=Path, action="append", default=[], help="a model every row shares "
                      "whose training no row's training cost counts, besides the Teacher (e.g. the demo's "
                      "flow-matching Teacher, the dmd2 students' real score; docs/leaderboard.md § Training cost); "
                      "repeat for several")
    rows.add_argument("--predictor_plans", default=f"{TRAINED},F-P-P-P,F-P-P-F,F-P-F-P", help="comma list of the "
                      f"plans every --ckpt runs at; '{TRAINED}' = the schedule its run trained (its --replace_steps, "
                      "F-P-P-P when the run has none); duplicates are run once (default: %(default)s)")
    rows.add_argument("--samplers", default="1,2,3", help="k of the k-step samplers, every subset of steps that keeps "
                      "step 0 ('' = none; default: %(default)s)")
    rows.add_argument("--caches", default=",".join(CACHES), help="comma list of the training-free caches: "
                      "reuse_hidden, taylor, prev_chunk, block_residual (each at every sampler plan), teacache (one "
                      "row per --teacache_full_steps); '' = none (default: %(default)s)")
    rows.add_argument("--counterparts", default=",".join(COUNTERPART_LETTERS), help="letters that stand in for P in "
                      "every Predictor plan as baseline rows at its exact schedule: H hidden reuse (F-R-R-H, what an "
                      "untrained F-R-R-P Predictor computes), B the block-residual cache (F-R-R-B); a plan another "
                      "row already runs is not repeated; '' = none (default: %(default)s)")
    rows.add_argument("--block_residual_blocks", default=",".join(map(str, DEFAULT_RESIDUAL_BLOCKS)),
                      help="the Teacher double blocks a block-residual (B) step runs, as many as a Predictor step "
                      "runs (2); negative counts from the last: 0,-1 the first and the last (one skipped span), 1,-2 "
                      "a Predictor's default source blocks (default: %(default)s)")
    rows.add_argument("--teacache_full_steps", default="1.1,1.2,1.3,2", help="target Full steps per chunk of the "
                      "TeaCache rows; a target between whole numbers is reached only through the chunks' spread, "
                      "the table says what each ran (default: %(default)s)")
    rows.add_argument("--calibration_split", default="train", help="sample table whose --calibration_videos rows, "
                      "spread over its scenes, calibrate TeaCache's threshold and rescaling (default: %(default)s; "
                      "must not be the evaluated --split, nor final)")
    rows.add_argument("--calibration_videos", type=int, default=8, help="rows of --calibration_split, one per "
                      "scene at evenly spaced scenes first (default: %(default)s)")
    rows.add_argument("--plans", default=DEFAULT_PLANS, help="comma list of extra plans, letters F R H P T C B per "
                      "step and '|' between the patterns of a per-chunk mixture (chunks 1, 2, ... take them in turn): "
                      "plans without P are baselines, plans with P run once per --ckpt (e.g. F-R-R-P). '' = none "
                      "(default: %(default)s)")
    rows.add_argument("--context_modes", default="exact", help="comma list: the reference and every Predictor row "
                      "also run under each mode other than exact (default: %(default)s)")
    stats = parser.add_argument_group("statistics")
    stats.add_argument("--seeds", type=int, default=1, help="run every video under N noise seeds (seed j = table "
                       "seed + j * 100003); intervals resample videos, a video's seeds together (default: %(default)s)")
    stats.add_argument("--baseline", default=None, help="row key every row's paired difference is taken from "
                       f"(default: {DEFAULT_BASELINE}, the 1-step sampler, when it is a row; else the first sampler "
                       "or cache row)")
    stats.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default: %(default)s)")
    stats.add_argument("--bootstrap_seed", type=SEED, default=0, help="(default: %(default)s)")
    stats.add_argument("--bootstrap_unit", choices=BOOTSTRAP_UNITS, default="scene",
                       help="what a bootstrap resample draws: scene (a case with all its videos and seeds: a scene's "
                            "paths share its first frame) or video (its seeds together) (default: %(default)s)")
    run = parser.add_argument_group("run and outputs")
    run.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto", help="as "
                     "tools/eval_predictor.py --dtype (default: auto)")
    run.add_argument("--vae_dtype", choices=("auto", *DTYPES), default="auto", help="VAE weights; auto = --dtype")
    run.add_argument("--vae_tiling", action="store_true", help="decode in spatial tiles (less GPU memory)")
    run.add_argument("--output_root", type=Path, default=REPO_ROOT / "eval", help="parent of the run directory "
                     "(default: eval/ in the repository)")
    run.add_argument("--run_name", default=None, help="default: leaderboard_<split>_<sha8 of the rows and "
                     "checkpoints>")
    run.add_argument("--num_side_by_side", type=int, default=2, help="side-by-side mp4 of the front's rows and the "
                     "Predictors for the first N videos (default: %(default)s)")
    run.add_argument("--side_by_side_scale", type=int, default=0, metavar="N", help="integer upscaling of every "
                     f"panel; 0 = auto (at least {SIDE_BY_SIDE_MIN_HEIGHT} pixels high)")
    run.add_argument("--fps", type=float, default=24.0, help="frame rate of the side-by-side mp4")
    run.add_argument("--lpips_alexnet", type=Path, default=None, help="torchvision AlexNet state dict for LPIPS")
    run.add_argument("--lpips_random_backbone", action="store_true", help="no real AlexNet: a random one, reported "
                     "as lpips_random_backbone_NOT_LPIPS (demo / tests only)")
    run.add_argument("--warmup_chunks", type=int, default=2, help="chunks of every row run untimed first")
    run.add_argument("--timing_repeats", type=int, default=3, help="rollouts timed per row and video: the scored "
                     "one, then K-1 interleaved rounds of every row in rotated order; the measured columns take "
                     "--timing_statistic of the K (1 = the scored rollout alone; default: %(default)s)")
    run.add_argument("--timing_statistic", choices=TIMING_STATISTICS, default="median", help="of the "
                     "--timing_repeats rollout times of a row on a video (default: %(default)s)")
    run.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto", help="process-group backend")
    run.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_check_only_arg(run, what="the run name and directory, the rows and the videos it would run")
    add_threads_arg(parser)
    return parser


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in str(text).split(",") if part.strip()]


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    inputs = resolve_inputs(parser, **{flag: getattr(args, flag) for flag in INPUT_FLAGS})
    vars(args).update(inputs._asdict())  # the inputs --demo stands for, and the split's sample table
    if args.lpips_alexnet is not None and args.lpips_random_backbone:
        parser.error("--lpips_alexnet and --lpips_random_backbone exclude each other")
    for flag, minimum in (("seeds", 1), ("resamples", 100), ("calibration_videos", 1), ("num_side_by_side", 0),
                          ("side_by_side_scale", 0), ("warmup_chunks", 0), ("timing_repeats", 1)):
        if getattr(args, flag) < minimum:
            parser.error(f"--{flag} must be >= {minimum}, got {getattr(args, flag)}")
    try:
        args.samplers = [int(part) for part in comma_list(args.samplers)]
        args.teacache_full_steps = [float(part) for part in comma_list(args.teacache_full_steps)]
    except ValueError as error:
        parser.error(f"--samplers / --teacache_full_steps: expected comma-separated numbers ({error})")
    args.caches = comma_list(args.caches)
    args.counterparts = [letter.upper() for letter in comma_list(args.counterparts)]
    try:
        args.block_residual_blocks = [int(part) for part in comma_list(args.block_residual_blocks)]
    except ValueError as error:
        parser.error(f"--block_residual_blocks {args.block_residual_blocks!r}: expected comma-separated block "
                     f"indices like 0,-1 ({error})")
    if not args.block_residual_blocks or len(set(args.block_residual_blocks)) != len(args.block_residual_blocks):
        parser.error(f"--block_residual_blocks {','.join(map(str, args.block_residual_blocks))}: expected distinct "
                     "block indices like 0,-1")
    for model in args.shared_model:
        if not model.exists():
            parser.error(f"--shared_model {model}: no such file or folder; expected a model folder or weights file "
                         "every row shares")
    args.plans = comma_list(args.plans)
    try:
        for plan in args.plans:
            StepPlan.parse(plan)
        for plan in comma_list(args.predictor_plans):
            if plan != TRAINED:
                StepPlan.parse(plan)
        args.context_modes = parse_context_modes(args.context_modes)
    except ValueError as error:
        parser.error(str(error))
    if "teacache" in args.caches:
        if args.calibration_split == args.split:
            parser.error(f"--calibration_split {args.calibration_split} is the evaluated --split: calibrate on "
                         "another split")
        if args.calibration_split == FINAL_SPLIT:
            parser.error(f"--calibration_split {FINAL_SPLIT}: nothing is chosen on the final split; calibrate on "
                         "train, holdout25 or holdout50")
        args.calibration_table = sample_table_path(parser, args.samples_dir, args.calibration_split,
                                                   "--calibration_split")
    args.plan = StepPlan.from_steps(DEFAULT_REPLACE_STEPS)  # unused by the rows (each has its own); the eval needs one
    return args


def predictor_plans(args: argparse.Namespace, checkpoints) -> dict[str, list[str]]:
    """{checkpoint label: its plans, in order, each once}."""
    wanted = comma_list(args.predictor_plans) + [plan for plan in args.plans if "P" in StepPlan.parse(plan).letters_used]
    plans = {}
    for ckpt in checkpoints:
        texts = [StepPlan.from_flags(ckpt.run_flags).text if plan == TRAINED else StepPlan.parse(plan).text
                 for plan in wanted]
        plans[ckpt.label] = list(dict.fromkeys(texts))
    return plans


def calibrated_rows(args, settings, specs, env) -> list:
    """The adaptive rows with their thresholds: computed once on rank 0 (kept in calibration.json of the run
    directory, reused by a rerun with the same rows) and shared with every rank."""
    if not any(spec.adaptive is not None for spec in specs):
        return specs
    out_dir = Path(settings.output_root) / settings.run_name
    path = out_dir / "calibration.json"
    key = sha256_json({"rows": [dataclasses.asdict(spec) for spec in specs], "table": str(args.calibration_table),
                       "videos": args.calibration_videos, "selection": "spread_rows",
                       "teacher": str(settings.teacher_source.folder),
                       "dtype": str(settings.dtype)})
    calibrated = None
    if env.is_main:
        if path.is_file():
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved.get("key") == key:
                calibrated = saved["rows"]
        if calibrated is None:
            teacher = load_teacher(settings.teacher_source, env.device, settings.dtype)
            dataset = open_dataset(settings, args.calibration_table)
            runtime = build_runtime(settings, teacher, [], dataset, env.device, decoder=False)
            items = [dataset[index] for index in spread_rows(dataset.keys(), args.calibration_videos)]
            calibrated = [dataclasses.asdict(spec) for spec in calibrate_adaptive(specs, runtime, items, log=print0)]
            out_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"key": key, "rows": calibrated})
    calibrated = next(rows for rows in all_gather_objects(calibrated) if rows is not None)
    return [type(specs[0])(**row) for row in calibrated]


def plan_rows(args: argparse.Namespace, argv: list[str], device) -> tuple[list, list, list, object]:
    """(the checkpoints, short-labelled; the students, labelled; the rows; the eval's settings with the run name
    leaderboard_<split>_<sha8 of the rows, checkpoints, students and seeds> unless --run_name) from the flags. Sets
    args.baseline. A problem with what the user gave is a UserInputError (one line, exit 2); any other error is a
    bug and keeps its traceback."""
    checkpoints = with_short_labels(label_checkpoints([read_predictor_checkpoint(path) for path in args.ckpt]))
    students = student_labels([read_student(path) for path in args.student])
    specs = build_rows(num_steps=DISTILLED_STEPS, shift=DISTILLED_SHIFT, samplers=args.samplers,
                       caches=args.caches, teacache_full_steps=args.teacache_full_steps, mixtures=args.plans,
                       predictor_plans=predictor_plans(args, checkpoints), context_modes=args.context_modes,
                       counterparts=args.counterparts, residual_blocks=args.block_residual_blocks, students=students)
    args.baseline = choose_baseline(specs, args.baseline)
    eval_flags = {**{flag: getattr(args, flag) for flag in EVAL_FLAGS}, "context_modes": "exact",
                  "run_name": None, "num_side_by_side": 0}
    settings = resolve_eval_settings(**eval_flags, argv=argv, device=device)
    run_name = args.run_name or f"leaderboard_{args.split}_" + sha256_json(
        {"rows": [spec.key for spec in specs], "ckpt": [str(path.resolve()) for path in args.ckpt],
         "seeds": args.seeds, **({"student": [str(path.resolve()) for path in args.student]}
                                 if args.student else {})})[:8]
    settings = dataclasses.replace(settings, run_name=run_name, seeds=args.seeds, revisit_sheets=False,
                                   num_side_by_side=0, timing_repeats=args.timing_repeats,
                                   timing_statistic=args.timing_statistic)
    return checkpoints, students, specs, settings


def trained_row_costs(args, checkpoints, students, settings) -> dict[str, dict]:
    """The training cost of every --ckpt and --student (eval/training_cost.py), read before the eval runs so a
    problem with one is found before hours of rollouts; the Teacher and --shared_model counted by none."""
    return training_costs({**{ckpt.label: ckpt.path for ckpt in checkpoints},
                           **{student.label: student.path for student in students}},
                          shared=[settings.teacher_source.folder, *args.shared_model])


@command
def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(parser, argv)
    if args.check_only:
        checkpoints, students, specs, settings = plan_rows(args, argv, torch.device("cpu"))
        lines = check_evaluation(settings, LeaderboardRows(specs, students, settings.teacher_source))
        costs = trained_row_costs(args, checkpoints, students, settings)
        return report_check_only(*lines, f"{len(specs)} rows (the baseline {args.baseline}); the training cost of "
                                 f"{len(costs)} trained sources read")
    set_cpu_threads(args.threads, tool="leaderboard", load_aware=True)
    env = init_distributed(args.backend)
    try:
        # 1. Checkpoints, rows, the eval's settings (a problem with what the user gave is a UserInputError: one
        #    line, exit 2; any other error is a bug and keeps its traceback).
        checkpoints, students, specs, settings = plan_rows(args, argv, env.device)
        costs = trained_row_costs(args, checkpoints, students, settings)
        run_name = settings.run_name
        # 2. TeaCache thresholds, then every row on every video (the eval's loop; resumable).
        specs = calibrated_rows(args, settings, specs, env)
        report = run_evaluation(settings, env, LeaderboardRows(specs, students, settings.teacher_source))
        # 3. Statistics, the front, reports, side-by-side videos of the front (rank 0).
        if env.is_main:
            configs = {ckpt.label: ckpt.predictor_config for ckpt in checkpoints}
            analysis = analyse(report["results"], specs, configs, baseline=args.baseline, resamples=args.resamples,
                               seed=args.bootstrap_seed, unit=args.bootstrap_unit)
            analysis["training_costs"] = costs
            header = {"split": args.split, "run_name": run_name, "device": str(env.device),
                      "world_size": env.world_size, "dtype": str(settings.dtype).removeprefix("torch."),
                      "seeds": args.seeds, "lpips": analysis["lpips_key"],
                      "bootstrap": f"{analysis['num_clusters']} {args.bootstrap_unit}s resampled",
                      "measured timing": f"{args.timing_statistic} of {args.timing_repeats} interleaved rollouts per "
                                         "row and video; bracket: interquartile range of the per-video speedups",
                      "checkpoints": {ckpt.label: str(ckpt.path) for ckpt in checkpoints},
                      "students": {student.label: str(student.path) for student in students},
                      "command": " ".join(["tools/leaderboard.py", *argv])}
            written = write_leaderboard(report["out_dir"], analysis, header)
            if args.num_side_by_side:
                written += write_front_side_by_side(report["out_dir"], settings, front_keys(analysis), specs,
                                                    checkpoints, env.device, args.num_side_by_side, students)
            print0((Path(report["out_dir"]) / "leaderboard.md").read_text(encoding="utf-8"))
            for line in headline_lines(analysis):
                print0(f"[leaderboard] {line.removeprefix('- ')}")
            for row in analysis["rows"]:
                if not row.spec.baseline:
                    margin: Estimate = row.margins["flops_run"][0]
                    real: Estimate = row.margins["flops_real"][0]
                    print0(f"[leaderboard] {row.spec.display}: {margin.format()} dB over the baselines' front "
                           f"on the FLOP axis of the config that ran ({real.format()} on the real-config "
                           "projection)")
            print0(f"[leaderboard] {len(report['computed'])} units computed, {report['skipped']} already finished; "
                   f"outputs in {report['out_dir']}: {', '.join(written)}")
    finally:
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
