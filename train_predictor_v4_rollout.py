"""On-policy recursive self-rollout fine-tuning of the v4 Predictor, F-P-P-P by default (docs/rollout.md).

Stage 2 after offline teacher forcing: the Predictor starts from an offline v4 checkpoint (`--init_from`, model
weights only; the optimizer and LR schedule start fresh) and learns on the states it visits itself. Per optimizer
step every rank rolls out ONE whole trajectory (case, action) of the sample table: chunk 0 F-F-F-F without
gradients, chunks 1..7 under the schedule it will run in (`--replace_steps`, as the eval's: 1,2,3 = F-P-P-P,
1,2 = F-P-P-F, 1,3 = F-P-F-P) with a per-chunk backward of chunk_loss / 7 (`predictor_training/predictor/self_rollout.py`).
`--context_mode incremental` builds every chunk's context from cached per-frame K/V instead of an exact prefill
(predictor_training/teacher/frame_kv_cache.py), as the eval's `--context_modes` runs it.
The Teacher labels are computed online on the student's own latents; no stored Teacher trajectory is read, only
the offline dataset's case files (image condition + exact text K/V of every layer).

DDP: each rank holds the frozen Teacher, the DDP Predictor and its own trajectory; chunks 1..6 run under
`no_sync()` (forwards and backward), chunk 7's backward all-reduces once; then clip, AdamW, schedule.

Tiny CPU run (demo data and the offline demo checkpoint come from `bash tools/launch_predictor_v4_training.sh`):

    python train_predictor_v4_rollout.py --preset demo --dataset_root demo_data/dataset \
        --init_from checkpoints/<offline demo run>/training_latest.pt

Launchers (8 GPUs; with no GPU and no DATASET_ROOT the first runs the whole CPU demo):

    INIT_FROM=RUN/training_latest.pt DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_rollout_training.sh
    bash tools/launch_predictor_v4_rollout_training.sh RUN_DIR RUN_DIR/training_latest.pt       # resume
    INIT_FROM=... DATASET_ROOT=... bash tools/launch_predictor_v4_rollout_overfit8_training.sh  # --preset overfit8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, resolve_teacher_source
from predictor_training.data.provenance import run_provenance
from predictor_training.data.trajectory_dataset import (
    TrajectoryTableDataset,
    open_trajectory_table,
    trajectory_batches,
)
from predictor_training.eval.leaderboard_command import leaderboard_command
from predictor_training.recipes.flags import add_plan_args, check_plan
from predictor_training.recipes.rollout import VARIANT, RolloutSettings, build_rollout
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.checkpoint import check_weights_file, checkpoint_meta
from predictor_training.runtime.distributed import DistEnv, log0
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import (
    SEED,
    add_data_args,
    add_loss_args,
    add_optimization_args,
    add_predictor_args,
    add_run_args,
    add_teacher_args,
    add_tracker_args,
    add_validation_args,
    check_args,
    parse_recipe_args,
    parse_subset_cases,
    settings_from_flags,
)
from predictor_training.runtime.launch import distributed_run, early_exit, resume_roles, run_training
from predictor_training.runtime.logger import log_summary, recipe_summary_rows
from predictor_training.runtime.precision import PrecisionPolicy, precision_policy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.run_directory import (
    environment_summary,
    plan_run,
    recorded_init_meta,
    run_config,
    subset_tag,
    write_train_config,
)
from predictor_training.teacher.frame_kv_cache import CONTEXT_MODES
from predictor_training.teacher.source import TeacherSource, check_source_blocks, load_teacher

RECIPE_PREFIX = "rollout_"  # + the schedule's letters: the checkpoints' recipe, e.g. rollout_fppp

# The demo trains at 5x the recipe's learning rates and on the velocity loss alone: with the recipe's hidden term
# (0.1) held-out F-P-P-P fell below the offline start on new paths at either rate
# (benchmarks/results/2026-12-02-main-job-demo-world.md).
_DEMO = ["--source_blocks", "1,10", "--precision", "fp32", "--fusion_lr", "5e-4", "--blocks_lr", "5e-5",
         "--hidden_weight", "0", "--max_steps", "96", "--scheduler_warmup_steps", "2",
         "--block_warmup_steps", "2", "--ckpt_every", "16", "--tracker", "none", "--num_workers", "0",
         "--val_every", "16", "--val_videos", "1"]
_OVERFIT8 = ["--subset_cases", "8", "--subset_seed", "20260721", "--scheduler_warmup_steps", "8",
             "--block_warmup_steps", "8"]
_FPPF = ["--replace_steps", "1,2", "--max_steps", "300"]
PRESETS = {
    # The CPU demo on the demo world: blocks 1,10 of its 12-block Teacher (as 1,52 of the real 54); fp32, no tracker.
    "demo": ["--experiment", "predictor_v4_rollout_{schedule}_demo", *_DEMO],
    # overfit8 (docs/rollout.md § overfit8): 8 fixed cases x their actions, warmup and block freeze of 8 steps.
    "overfit8": _OVERFIT8,
    "overfit8_demo": ["--experiment", "predictor_v4_rollout_{schedule}_demo", *_DEMO, *_OVERFIT8,
                      "--max_steps", "16", "--ckpt_every", "8"],
    # overfit8 FPPF (the notes' run): the same 8 cases, F-P-P-F, a 300-step schedule.
    "overfit8_fppf": [*_OVERFIT8, *_FPPF],
    "overfit8_fppf_demo": ["--experiment", "predictor_v4_rollout_{schedule}_demo", *_DEMO, *_OVERFIT8, *_FPPF,
                           "--max_steps", "16", "--ckpt_every", "8"],
    # F-R-R-P: velocity reuse at the two small steps, the Predictor trained for the last one (σ 0.625 -> 0, which
    # carries almost all of F-R-R-R's error on the demo world). frrp_demo: the demo recipe of the shipped Predictor,
    # 1920 steps (benchmarks/results/2026-12-06-leaderboard.md); whether the real distilled Teacher shares that step
    # structure is unknown: run tools/leaderboard.py on it first (docs/leaderboard.md).
    "frrp": ["--reuse_steps", "1,2", "--replace_steps", "3"],
    "frrp_demo": ["--experiment", "predictor_v4_rollout_{schedule}_demo", *_DEMO, "--reuse_steps", "1,2",
                  "--replace_steps", "3", "--max_steps", "1920", "--ckpt_every", "192", "--val_every", "192"],
    # frrp_revisit_demo: the shipped Predictor's last link, 480 steps from a trained F-R-R-P Predictor with the return
    # term (--revisit_weight 0.5): it lifted the revisit figures above the 1-step sampler's (same page).
    "frrp_revisit_demo": ["--experiment", "predictor_v4_rollout_{schedule}_revisit_demo", *_DEMO, "--reuse_steps",
                          "1,2", "--replace_steps", "3", "--revisit_weight", "0.5", "--max_steps", "480",
                          "--ckpt_every", "96", "--val_every", "96"],
    # The recipe at the size the memory rehearsal plans for (tools/estimate_memory.py): its defaults.
    "real_size": ["--source_blocks", "1,52", "--precision", "fp32master", "--gradient_checkpointing"],
}


def build_parser() -> argparse.ArgumentParser:
    """The rollout recipe's flags: every default below is the recipe (docs/rollout.md)."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(parser, pairs=None, num_workers=2)
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--sample_table", type=Path, default=None,
                         help="sample table (JSONL) of the trajectories to roll out; default: the table of --split "
                              "recorded in the dataset's dataset_config.json (sample_tables)")
    rollout.add_argument("--subset_cases", type=parse_subset_cases, default=None,
                         help="train on a subset of cases (all their actions): a count N (seeded choice, "
                              "--subset_seed) or comma-separated case ids; default: every case (overfit8: 8)")
    rollout.add_argument("--subset_seed", type=SEED, default=20260721,
                         help="seed of the --subset_cases choice (default %(default)s, the overfit8 run's)")
    add_plan_args(parser, group=rollout, reuse=True,
                  note=", where gradients stop; as the eval's --replace_steps. The run name and "
                  "checkpoints record the plan")
    rollout.add_argument("--context_mode", choices=CONTEXT_MODES, default="exact",
                         help="how each chunk's context K/V are built: exact (a Teacher prefill of the selected "
                              "frames, default), incremental (per-frame K/V cached once after each chunk), last_step "
                              "(the K/V of each chunk's last Full step); predictor_training/teacher/frame_kv_cache.py. "
                              "Recorded in the run name when not exact")
    rollout.add_argument("--revisit_weight", type=float, default=0.0,
                         help="weight of the return term: at every latent whose camera the trajectory saw in an "
                              "earlier chunk (the row's pose), the MSE between the Predictor's velocity and the one "
                              "that lands its step's x0 estimate on that first visit's latent. 0 (default) = off")
    rollout.add_argument("--init_from", type=Path, default=None,
                         help="Predictor weights to start from: an offline v4 training_latest.pt (its model part only) "
                              "or a predictor_step_XXXXX.safetensors; required for a fresh run, not allowed with "
                              "--resume (the model then comes from the resumed checkpoint)")
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52", gradient_checkpointing=True)
    add_optimization_args(parser, fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000, scheduler_warmup_steps=100,
                          block_warmup_steps=100, batch_size=None, grad_accum=1, weight_decay=0.01,
                          adam_beta1=0.9, adam_beta2=0.95, grad_clip=1.0)
    add_loss_args(parser, velocity_weight=1.0, hidden_weight=0.1)
    add_run_args(parser, experiment="predictor_v4_rollout_{schedule}", precision="fp32master", ckpt_every=100,
                 keep_last=20, log_every=10, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-predictor")
    add_validation_args(parser, val_every=0, val_videos=4)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, --preset / --config applied, then the cross-flag checks (an error names the flag and exits 2)."""
    parser = build_parser()
    args = parse_recipe_args(parser, argv, PRESETS)
    check_args(parser, args, dataset_config_name=DATASET_CONFIG_NAME)
    # Rules only this recipe has.
    check_plan(parser, args.plan)  # F-P-P-P, F-R-R-P, ...: what the run trains
    args.experiment = args.experiment.replace("{schedule}", args.plan.tag)
    if args.resume is None and args.init_from is None:
        parser.error("--init_from is missing: a rollout run starts from an offline v4 checkpoint "
                     "(training_latest.pt or predictor_step_XXXXX.safetensors)")
    if args.resume is not None and args.init_from is not None:
        parser.error(f"--init_from={str(args.init_from)!r} with --resume: the model comes from the resumed "
                     "checkpoint; drop --init_from")
    if args.init_from is not None:
        if args.init_from.suffix not in (".pt", ".safetensors"):
            parser.error(f"--init_from={str(args.init_from)!r}: expected a .pt training state or .safetensors")
        if not args.init_from.is_file():
            parser.error(f"--init_from={str(args.init_from)!r}: no such file")
    if args.sample_table is not None and not args.sample_table.is_file():
        parser.error(f"--sample_table={str(args.sample_table)!r}: no such file")
    if isinstance(args.subset_cases, int) and args.subset_cases < 1:
        parser.error(f"--subset_cases={args.subset_cases}: expected >= 1")
    return args


def run_tags(args) -> str:
    """The recipe's run-name part after the blocks: the context mode when not exact, then the case subset."""
    tags = [] if args.context_mode == "exact" else [f"ctx{args.context_mode}"]
    subset = subset_tag(args.subset_cases, args.subset_seed)
    return "_".join(tags + ([subset] if subset else []))


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, teacher_source: TeacherSource,
          dataset: TrajectoryTableDataset, rollout_config: RolloutConfig, run_dir=None, resuming: bool = False,
          load_teacher=load_teacher) -> RecipeParts:
    """Steps 3-5 (`recipes/rollout.py build_rollout`, from the flags): the Teacher, the Predictor from --init_from
    (unless a training state is resumed: `resuming`), AdamW with the two-group schedule, the DDP-wrapped role, the
    trajectory step and the validation. Seams: `load_teacher`."""
    return build_rollout(settings_from_flags(RolloutSettings, args), env, policy, teacher_source=teacher_source,
                         dataset=dataset, rollout_config=rollout_config, run_dir=run_dir, resuming=resuming,
                         load_teacher=load_teacher)


def summarize(args: argparse.Namespace, *, start, env: DistEnv, policy: PrecisionPolicy, data,
              parts: RecipeParts) -> dict:
    """Step 6: the run's config (train_config.json on rank 0) and the summary block; returns the config."""
    dataset, batches, rollout_config = data.dataset, data.batches, data.rollout_config
    trained_chunks = dataset.num_latents // rollout_config.chunk_latents - 1
    config = run_config(
        args, run_name=start.run_name, variant=VARIANT, recipe=RECIPE_PREFIX + args.plan.tag,
        world_size=env.world_size, device=str(env.device), backend=env.backend,
        global_batch=env.world_size * args.grad_accum, sample_table=str(data.sample_table),
        num_trajectories=len(dataset), cases=dataset.case_ids, num_latents=dataset.num_latents,
        trained_chunks=trained_chunks, **parts.derived, environment=environment_summary(), **start.recorded(),
    )
    if env.is_main:
        write_train_config(start.run_dir, config)
    log_summary(f"self-rollout {args.plan.text} Predictor training (v4)", {
        **recipe_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(),
                              optimizer=parts.roles[0].optimizer, first_step=parts.run_state.global_step + 1,
                              stop_step=start.stop_step),
        "init": f"{start.resume_path} (training state)" if start.resume_path else
                f"{args.init_from} (model only; fresh optimizer)",
        "model": f"v4, source blocks {list(args.source_blocks)}, gradient checkpointing "
                 f"{args.gradient_checkpointing}; chunk 0 F-F-F-F (no grad), chunks 1.. {args.plan.text}; "
                 f"context {args.context_mode}",
        "data": f"{data.sample_table}: {len(dataset)} trajectories of {len(dataset.case_ids)} cases, "
                f"{dataset.num_latents} latents ({trained_chunks} trained chunks); "
                f"{batches.batches_per_epoch()} per rank per epoch",
        "batch": f"1 trajectory per rank x {env.world_size} ranks x {args.grad_accum} accumulation",
    })
    return config


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    # 1. The inputs, checked before anything is created (in the launcher's --print_run_dir dry run too): the
    #    trajectory table and dataset, the source blocks against the Teacher, the --init_from weights. Then the run
    #    directory, named from the flags; a second launch continues it or finds it finished.
    open_trajectory_table(args.dataset_root, args.split, sample_table=args.sample_table,
                          subset_cases=args.subset_cases, subset_seed=args.subset_seed)
    teacher_source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
    check_source_blocks(args.source_blocks, teacher_source)
    if args.resume is None:
        check_weights_file(args.init_from, expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})
    start = plan_run(args, meta=checkpoint_meta(VARIANT, args.source_blocks, args.precision), subset=run_tags(args),
                     inputs=[(teacher_source.origin, teacher_source.folder)])
    if (code := early_exit(args, start)) is not None:
        return code
    with distributed_run(args, start) as env:
        policy = precision_policy(args.precision, env.device)
        # 2. Data: one whole trajectory (case, action) per rank per micro-batch, and the dataset's AR loop (running
        #    latents and Teacher autocast follow --precision).
        data = trajectory_batches(args.dataset_root, args.split, env, sample_table=args.sample_table, seed=args.seed,
                                  num_workers=args.num_workers, verify=args.verify_dataset,
                                  state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype,
                                  subset_cases=args.subset_cases, subset_seed=args.subset_seed,
                                  context_mode=args.context_mode)
        # 3-5. Teacher, Predictor, AdamW, the role, the trajectory step (see build). Resume (--resume, or the run
        #      directory's own unfinished run) restores the role and the data position.
        parts = build(args, env, policy, teacher_source=teacher_source, dataset=data.dataset,
                      rollout_config=data.rollout_config, run_dir=start.run_dir,
                      resuming=start.resume_path is not None)
        parts.derived["init_meta"] = recorded_init_meta(start, parts.derived["init_meta"])
        parts.derived["provenance"] = run_provenance(start, env, teacher=teacher_source.folder,
                                                     action_ckpt=teacher_source.action_ckpt, parent=args.init_from,
                                                     data_root=args.dataset_root)
        meta = checkpoint_meta(VARIANT, args.source_blocks, args.precision, recipe=RECIPE_PREFIX + args.plan.tag)
        run_state = resume_roles(start, parts.roles, data.batches, meta, parts.run_state)
        # 6. Config and summary.
        config = summarize(args, start=start, env=env, policy=policy, data=data, parts=parts)
        # 7. Train: the trajectory step and the shared loop.
        run_training(args, start, env, roles=parts.roles, batches=data.batches, step_fn=parts.step_fn,
                     run_state=run_state, config=config, meta=meta, validation=parts.validation,
                     **parts.loop_options)
        # 8. Where this Predictor stands against the samplers and caches at its cost (docs/leaderboard.md).
        log0("next, the leaderboard: " + leaderboard_command(start.run_dir, dataset_root=args.dataset_root,
                                                             world_size=env.world_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
