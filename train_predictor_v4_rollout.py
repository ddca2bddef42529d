"""On-policy recursive F-P-P-P self-rollout fine-tuning of the v4 Predictor (SPEC §6, user notes §8).

Stage 2 after offline teacher forcing: the Predictor starts from an offline v4 checkpoint (`--init_from`, model
weights only; the optimizer and LR schedule start fresh) and learns on the states it visits itself. Per optimizer
step every rank rolls out ONE whole trajectory (case, action) of the sample table: chunk 0 F-F-F-F without
gradients, chunks 1..7 F-P-P-P with a per-chunk backward of chunk_loss / 7 (`predictor_training.rollout_utils`).
The Teacher labels are computed online on the student's own latents; no stored Teacher trajectory is read, only
the offline dataset's case files (image condition + exact text K/V of every layer).

DDP: each rank holds the frozen Teacher, the DDP Predictor and its own trajectory; chunks 1..6 run under
`no_sync()` (forwards and backward), chunk 7's backward all-reduces once; then clip, AdamW, schedule.

Tiny CPU run (demo data and a short offline v4 checkpoint first: `bash tools/launch_predictor_v4_training.sh`):

    python train_predictor_v4_rollout.py --dataset_root demo_data/dataset --output_dir checkpoints/rollout_tiny \
        --init_from checkpoints/<offline demo run>/training_latest.pt --source_blocks 1,2 --precision fp32 \
        --max_steps 6 --scheduler_warmup_steps 2 --block_warmup_steps 2 --ckpt_every 3 --num_workers 0

Launchers (8 GPUs, run directory named by the convention; with no GPU the first runs the whole CPU demo):

    bash tools/launch_predictor_v4_rollout_training.sh [RUN_DIR] [RESUME]
    bash tools/launch_predictor_v4_rollout_overfit8_training.sh
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from predictor_training.ar_rollout import RolloutConfig
from predictor_training.checkpoint import (
    RunState,
    load_model_weights,
    load_training_state,
    read_training_state,
)
from predictor_training.data.pair_dataset import config_field, read_dataset_config
from predictor_training.distributed import (
    DistEnv,
    all_gather_objects,
    cleanup_distributed,
    init_distributed,
    log0,
    seed_everything,
    wrap_ddp,
)
from predictor_training.logger import MetricsLogger
from predictor_training.loop import ResumableBatches, train_loop
from predictor_training.predictor import build_predictor
from predictor_training.rollout_utils import (
    SelfRolloutSettings,
    SelfRolloutTrajectory,
    rollout_inputs_for_item,
    text_kv_from_case,
    train_trajectory,
)
from predictor_training.trajectory_dataset import TrajectoryTableDataset
from predictor_training.training_setup import (
    BatchLayout,
    OptimDefaults,
    PrecisionPolicy,
    add_data_args,
    add_optimization_args,
    add_predictor_args,
    add_run_args,
    add_teacher_args,
    add_tracker_args,
    build_optimizer_and_schedule,
    check_common_args,
    checkpoint_meta,
    environment_summary,
    experiment_name,
    load_teacher,
    log_block,
    precision_policy,
    prepare_run_dir,
    run_config,
    startup_summary,
    write_train_config,
)

VARIANT = "v4"
RECIPE = "rollout_fppp"
HIDDEN_WEIGHT = 0.1
VELOCITY_WEIGHT = 1.0


# ---------------------------------------------------------------------------------------------------------------
# 1. Flags
# ---------------------------------------------------------------------------------------------------------------
def parse_subset_cases(text: str) -> int | list[str]:
    """"8" -> 8 (a seeded choice of 8 cases); "c004,c011" -> those case ids."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"--subset_cases {text!r}: expected a count like 8 or case ids like c004,c011")
    if len(parts) == 1 and parts[0].isdigit():
        return int(parts[0])
    return parts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(parser, pairs=None)
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--sample_table", type=Path, default=None,
                         help="sample table (JSONL) of the trajectories to roll out; default: the table of --split "
                              "recorded in the dataset's dataset_config.json (sample_tables)")
    rollout.add_argument("--subset_cases", type=parse_subset_cases, default=None,
                         help="train on a subset of cases (all their actions): a count N (seeded choice, "
                              "--subset_seed) or comma-separated case ids; default: every case (overfit8: 8)")
    rollout.add_argument("--subset_seed", type=int, default=20260721,
                         help="seed of the --subset_cases choice (the notes' overfit8 used 20260721)")
    rollout.add_argument("--init_from", type=Path, default=None,
                         help="Predictor weights to start from: an offline v4 training_latest.pt (its model part only) "
                              "or a predictor_step_XXXXX.safetensors; required for a fresh run, not allowed with "
                              "--resume (the model then comes from the resumed checkpoint)")
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52")
    add_optimization_args(parser, OptimDefaults(fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000,
                                                scheduler_warmup_steps=100, block_warmup_steps=100,
                                                batch_size=1, grad_accum=1))
    add_run_args(parser, ckpt_every=100, keep_last=20)
    add_tracker_args(parser)
    args = parser.parse_args(argv)
    check_common_args(args)
    check_rollout_args(args)
    return args


def check_rollout_args(args: argparse.Namespace) -> None:
    """Rules only this recipe has; ValueError naming the flag, its value and what was expected."""
    problems = []
    if args.batch_size != 1:
        problems.append(f"--batch_size={args.batch_size}: expected 1 (one trajectory per rank per micro-step; "
                        "use --grad_accum to accumulate several trajectories per optimizer step)")
    if args.resume is None and args.init_from is None:
        problems.append("--init_from is missing: a rollout run starts from an offline v4 checkpoint "
                        "(training_latest.pt or predictor_step_XXXXX.safetensors)")
    if args.resume is not None and args.init_from is not None:
        problems.append(f"--init_from={str(args.init_from)!r} with --resume: the model comes from the resumed "
                        "checkpoint; drop --init_from")
    if args.init_from is not None:
        if args.init_from.suffix not in (".pt", ".safetensors"):
            problems.append(f"--init_from={str(args.init_from)!r}: expected a .pt training state or .safetensors")
        elif not args.init_from.is_file():
            problems.append(f"--init_from={str(args.init_from)!r}: no such file")
    if args.sample_table is not None and not args.sample_table.is_file():
        problems.append(f"--sample_table={str(args.sample_table)!r}: no such file")
    if isinstance(args.subset_cases, int) and args.subset_cases < 1:
        problems.append(f"--subset_cases={args.subset_cases}: expected >= 1")
    if problems:
        raise ValueError("invalid arguments: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------------------------
# 2. Data
# ---------------------------------------------------------------------------------------------------------------
def resolve_sample_table(args: argparse.Namespace, dataset_config: dict) -> Path:
    """--sample_table, else the dataset's recorded table named `<split>.jsonl`."""
    if args.sample_table is not None:
        return args.sample_table
    where = Path(args.dataset_root) / "dataset_config.json"
    recorded = [Path(path) for path in config_field(dataset_config, "sample_tables", args.dataset_root)]
    matching = [path for path in recorded if path.stem == args.split]
    if len(matching) != 1:
        raise ValueError(f"{where}: sample_tables {[str(p) for p in recorded]} hold {len(matching)} table(s) named "
                         f"{args.split}.jsonl; pass --sample_table")
    if not matching[0].is_file():
        raise FileNotFoundError(f"{where}: recorded sample table {matching[0]} does not exist; pass --sample_table")
    return matching[0]


def first_item(items: list[dict]) -> dict:
    """Collate of one trajectory per micro-batch: the item itself."""
    if len(items) != 1:
        raise ValueError(f"expected one trajectory per micro-batch, got {len(items)}")
    return items[0]


def build_trajectory_batches(dataset: TrajectoryTableDataset, args: argparse.Namespace, env: DistEnv):
    """One trajectory per rank per micro-batch, DistributedSampler(shuffle, drop_last) so ranks never share one."""
    if len(dataset) < env.world_size:
        raise ValueError(f"{len(dataset)} trajectories cannot give one to each of {env.world_size} ranks")
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    return ResumableBatches(sampler, dataset, first_item, batch_size=1, drop_last=True,
                            num_workers=args.num_workers, seed=args.seed)


def rollout_config_from_dataset(dataset_config: dict, root: Path, policy: PrecisionPolicy) -> RolloutConfig:
    """The AR loop settings the dataset was built with; running latents and Teacher autocast follow --precision
    (bf16 like the real pipeline in fp32master, fp32 in fp32)."""
    memory = config_field(dataset_config, "memory", root)
    return RolloutConfig(
        num_steps=int(config_field(dataset_config, "num_steps", root)),
        shift=float(config_field(dataset_config, "shift", root)),
        chunk_latents=int(config_field(dataset_config, "chunk_latents", root)),
        context_timestep=float(config_field(dataset_config, "context_timestep", root)),
        memory_frames=int(memory["memory_frames"]),
        temporal_context_size=int(memory["temporal_context_size"]),
        state_dtype=policy.frozen_dtype,
        autocast_dtype=policy.autocast_dtype,
    )


# ---------------------------------------------------------------------------------------------------------------
# 3. Checks
# ---------------------------------------------------------------------------------------------------------------
class DuplicateTrajectoryError(RuntimeError):
    """Two ranks (or two micro-batches of one step) got the same (case_id, action_id)."""


def check_distinct_keys(keys: list) -> None:
    """Raise when a (case_id, action_id) appears twice in `keys` (the same list on every rank, so all raise)."""
    seen, repeated = set(), []
    for key in map(tuple, keys):
        if key in seen:
            repeated.append(key)
        seen.add(key)
    if repeated:
        raise DuplicateTrajectoryError(f"trajectory keys {repeated} are used twice in one optimizer step: {keys}")


def check_fp32_master_state(path: Path) -> None:
    """Refuse a checkpoint whose trainable weights or AdamW moments are not FP32 (e.g. an old BF16 rollout state):
    `optimizer.load_state_dict` would silently cast its moments to the parameters' dtype."""
    payload = read_training_state(path)
    problems = [f"model.{name} is {tensor.dtype}" for name, tensor in payload["model"].items()
                if tensor.is_floating_point() and tensor.dtype != torch.float32]
    for index, state in payload["optimizer"]["state"].items():
        for name, value in state.items():
            is_moment = torch.is_tensor(value) and value.is_floating_point() and value.numel() > 1
            if is_moment and value.dtype != torch.float32:
                problems.append(f"optimizer state {index}.{name} is {value.dtype}")
    if problems:
        raise ValueError(f"{path}: not an FP32-master training state ({len(problems)} problems, e.g. "
                         f"{problems[:3]}); refusing to resume it into an fp32master run")


def check_latent_grads(step: int, metrics: dict[str, float]) -> None:
    """notes §8.10: the Predictor-made latents x2, x3 must receive a gradient (the BPTT path is alive)."""
    value = metrics["latent_grad_l1_min"]
    if not value > 0:
        raise RuntimeError(
            f"step {step}: latent_grad_l1_min={value}: some x2/x3 got no gradient, so the latent BPTT path is cut "
            "(an untrained Predictor, with zero-initialised output layers, ignores its input latent: start from an "
            "offline v4 checkpoint with --init_from)"
        )


# ---------------------------------------------------------------------------------------------------------------
# 4. The trajectory step
# ---------------------------------------------------------------------------------------------------------------
class RolloutStep:
    """`step_fn` of the loop: one trajectory per call (micro-batch), forward + per-chunk backward inside.

    Before the rollout it gathers every rank's (case_id, action_id) and refuses duplicates within the optimizer
    step; after it, `latent_grad_l1_min` is replaced by its minimum over ranks, so the loop's rank mean is that
    minimum and `check_latent_grads` decides identically on every rank.
    """

    def __init__(self, *, model, teacher, dataset: TrajectoryTableDataset, rollout_config: RolloutConfig,
                 settings: SelfRolloutSettings, env: DistEnv):
        self.model = model
        self.teacher = teacher
        self.dataset = dataset
        self.rollout_config = rollout_config
        self.settings = settings
        self.env = env
        self.step_keys: list = []

    def __call__(self, item: dict, *, sync: bool) -> dict[str, float]:
        # 1. Distinct trajectories across ranks (and micro-batches) of this optimizer step.
        self.step_keys.extend(all_gather_objects(list(item["key"])))
        check_distinct_keys(self.step_keys)
        distinct = float(len(self.step_keys))
        if sync:
            self.step_keys = []
        # 2. The trajectory's static inputs: image condition and exact text K/V of every layer.
        case = self.dataset.load_case(item["case_id"])
        device, model_dtype = self.env.device, self.teacher.dtype
        text_kv = text_kv_from_case(case, device, model_dtype)
        inputs = rollout_inputs_for_item(item, case["image_cond"].to(torch.float32), self.rollout_config.state_dtype)
        # 3. Roll out and train.
        trajectory = SelfRolloutTrajectory(self.teacher, self.model, text_kv, inputs, self.rollout_config,
                                           self.settings, device)
        metrics = train_trajectory(trajectory, sync=sync)
        gathered = all_gather_objects(metrics["latent_grad_l1_min"])
        metrics["latent_grad_l1_min"] = min(gathered) if all(math.isfinite(v) for v in gathered) else math.nan
        metrics["trajectory/distinct_keys"] = distinct
        return metrics


# ---------------------------------------------------------------------------------------------------------------
# 5. The run
# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    env = init_distributed(args.backend)
    metrics_logger = None
    try:
        # 1. Run directory, RNG, precision, data.
        run_dir = prepare_run_dir(args.output_dir, args.resume, env)
        seed_everything(args.seed, rank=env.rank)
        policy = precision_policy(args.precision, env.device)
        dataset_config = read_dataset_config(args.dataset_root)
        sample_table = resolve_sample_table(args, dataset_config)
        dataset = TrajectoryTableDataset(
            sample_table, dataset_root=args.dataset_root,
            num_latents=int(config_field(dataset_config, "num_latents", args.dataset_root)),
            subset_cases=args.subset_cases, subset_seed=args.subset_seed, verify=args.verify_dataset,
        )
        batches = build_trajectory_batches(dataset, args, env)
        rollout_config = rollout_config_from_dataset(dataset_config, args.dataset_root, policy)

        # 2. Teacher (kept whole: it makes the labels) and the Predictor from the offline checkpoint.
        teacher = load_teacher(args, env.device)
        predictor = build_predictor(teacher, VARIANT, args.source_blocks, args.gradient_checkpointing)
        init_meta = None
        if args.init_from is not None:
            init_meta = load_model_weights(args.init_from, predictor,
                                           expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})
        optimizer, lr_schedule = build_optimizer_and_schedule(predictor, args)

        # 3. Config, resume.
        layout = BatchLayout(1, env.world_size, args.grad_accum)
        meta = {**checkpoint_meta(VARIANT, args.source_blocks, args.precision), "recipe": RECIPE}
        config = run_config(
            args, variant=VARIANT, env=env, layout=layout, recipe=RECIPE, sample_table=str(sample_table),
            num_trajectories=len(dataset), cases=dataset.case_ids, num_latents=dataset.num_latents,
            trained_chunks=dataset.num_latents // rollout_config.chunk_latents - 1,
            rollout=f"chunk 0 F-F-F-F (no grad), chunks 1.. F-P-P-P, loss 1.0 mse_v + {HIDDEN_WEIGHT} mse_h",
            init_meta=init_meta, predictor=predictor.predictor_config(), teacher_double_blocks=teacher.num_layers,
            environment=environment_summary(),
        )
        run_state = RunState()
        if args.resume is not None:
            check_fp32_master_state(args.resume)
            run_state = load_training_state(args.resume, model=predictor, optimizer=optimizer,
                                            lr_schedule=lr_schedule, expect=meta)
            batches.load_state_dict(run_state.data)
            log0(f"resumed from {args.resume} at step {run_state.global_step} (epoch {run_state.epoch})")
        write_train_config(run_dir, config, env)
        stop_step = args.max_steps if args.stop_at_step == -1 else args.stop_at_step
        log_block(startup_summary(
            title="self-rollout F-P-P-P Predictor training (v4)",
            optimizer=optimizer, layout=layout, max_steps=args.max_steps, stop_step=stop_step,
            resume_step=run_state.global_step,
            extra={
                "run dir": str(run_dir),
                "init": "resumed checkpoint" if args.resume else f"{args.init_from} (model only; fresh optimizer)",
                "predictor": f"v4, source blocks {list(args.source_blocks)}, gradient checkpointing "
                             f"{args.gradient_checkpointing}",
                "precision": policy.describe(),
                "data": f"{sample_table}: {len(dataset)} trajectories of {len(dataset.case_ids)} cases, "
                        f"{dataset.num_latents} latents; {batches.batches_per_epoch()} per rank per epoch",
                "schedule": f"lr fusion {args.fusion_lr:g}, blocks {args.blocks_lr:g}; warmup "
                            f"{args.scheduler_warmup_steps}, block warmup {args.block_warmup_steps}, cosine to 0",
                "checkpoints": f"every {args.ckpt_every} steps, keep {args.keep_last}",
                "tracker": args.tracker,
            },
        ))

        # 4. Train.
        model = wrap_ddp(predictor, env)
        metrics_logger = MetricsLogger(run_dir, env, tracker=args.tracker, project=args.swanlab_project,
                                       experiment=experiment_name(args, run_dir), config=config,
                                       swanlab_mode=args.swanlab_mode)
        settings = SelfRolloutSettings(hidden_weight=HIDDEN_WEIGHT, velocity_weight=VELOCITY_WEIGHT,
                                       predictor_autocast_dtype=policy.autocast_dtype)
        step_fn = RolloutStep(model=model, teacher=teacher, dataset=dataset, rollout_config=rollout_config,
                              settings=settings, env=env)
        train_loop(
            ddp_model=model, raw_model=predictor, optimizer=optimizer, lr_schedule=lr_schedule, batches=batches,
            step_fn=step_fn, run_dir=run_dir, env=env, run_state=run_state, max_steps=args.max_steps,
            grad_accum=args.grad_accum, grad_clip=args.grad_clip, ckpt_every=args.ckpt_every,
            keep_last=args.keep_last, log_every=args.log_every, metrics_logger=metrics_logger, config=config,
            meta=meta, progress=not args.no_progress, extra_step_check=check_latent_grads, stop_at_step=stop_step,
        )
    finally:
        if metrics_logger is not None:
            metrics_logger.close()
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
