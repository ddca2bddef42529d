"""On-policy recursive F-P-P-P self-rollout training of the v4 Predictor: flags, data, checks, the trajectory step
and the run (SPEC §6, user notes §8); the entry script is `train_predictor_v4_rollout.py`.

One item is one whole trajectory (case, action) of the sample table. `RolloutStep` is the loop's step function:
chunk 0 F-F-F-F without gradients, chunks 1..7 F-P-P-P with a per-chunk backward of chunk_loss / 7
(`predictor_training.rollout_utils`), the Teacher labelling the student's own latents online.
`run_rollout_training(args)` builds the dataset, the Teacher and the Predictor from `--init_from`, then hands over
to the shared `training_setup.resume_and_train` (resume, summary, DDP, logger, `loop.train_loop`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from predictor_training.ar_rollout import RolloutConfig
from predictor_training.checkpoint import RunState, load_model_weights, read_training_state
from predictor_training.data.pair_dataset import config_field, read_dataset_config
from predictor_training.distributed import DistEnv, all_gather_objects, cleanup_distributed, init_distributed
from predictor_training.loop import ResumableBatches
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
    PrecisionPolicy,
    build_optimizer_and_schedule,
    checkpoint_meta,
    environment_summary,
    load_teacher,
    resume_and_train,
    run_config,
    start_run,
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


def add_rollout_args(parser: argparse.ArgumentParser) -> None:
    """--sample_table, --subset_cases, --subset_seed, --init_from (checked by `check_rollout_args`)."""
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
def run_rollout_training(args: argparse.Namespace) -> RunState:
    """Self-rollout training with the flags of `train_predictor_v4_rollout.py`; every rank calls it (under torchrun
    or as plain python). Returns the final RunState."""
    env = init_distributed(args.backend)
    try:
        # 1. Run directory, RNG, precision, data.
        run_dir, policy = start_run(args, env)
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

        # 3. Config; a resumed state must be FP32-master (checked before anything is loaded from it).
        layout = BatchLayout(1, env.world_size, args.grad_accum)
        config = run_config(
            args, variant=VARIANT, env=env, layout=layout, recipe=RECIPE, sample_table=str(sample_table),
            num_trajectories=len(dataset), cases=dataset.case_ids, num_latents=dataset.num_latents,
            trained_chunks=dataset.num_latents // rollout_config.chunk_latents - 1,
            rollout=f"chunk 0 F-F-F-F (no grad), chunks 1.. F-P-P-P, loss 1.0 mse_v + {HIDDEN_WEIGHT} mse_h",
            init_meta=init_meta, predictor=predictor.predictor_config(), teacher_double_blocks=teacher.num_layers,
            environment=environment_summary(),
        )
        if args.resume is not None:
            check_fp32_master_state(args.resume)
        settings = SelfRolloutSettings(hidden_weight=HIDDEN_WEIGHT, velocity_weight=VELOCITY_WEIGHT,
                                       predictor_autocast_dtype=policy.autocast_dtype)

        # 4. Resume, summary, train.
        return resume_and_train(
            args, env=env, run_dir=run_dir, policy=policy, predictor=predictor, optimizer=optimizer,
            lr_schedule=lr_schedule, batches=batches, layout=layout, config=config,
            meta={**checkpoint_meta(VARIANT, args.source_blocks, args.precision), "recipe": RECIPE},
            title="self-rollout F-P-P-P Predictor training (v4)",
            model_rows={
                "init": "resumed checkpoint" if args.resume else f"{args.init_from} (model only; fresh optimizer)",
                "predictor": f"v4, source blocks {list(args.source_blocks)}, gradient checkpointing "
                             f"{args.gradient_checkpointing}",
            },
            data_row=f"{sample_table}: {len(dataset)} trajectories of {len(dataset.case_ids)} cases, "
                     f"{dataset.num_latents} latents; {batches.batches_per_epoch()} per rank per epoch",
            make_step_fn=lambda model: RolloutStep(model=model, teacher=teacher, dataset=dataset,
                                                   rollout_config=rollout_config, settings=settings, env=env),
            extra_step_check=check_latent_grads,
        )
    finally:
        cleanup_distributed()
