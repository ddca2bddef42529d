"""The rollout recipe's flags and build (`train_predictor_v4_rollout.py`, docs/rollout.md; the script keeps its
presets, the cross-flag checks, the data and `main()`): the Teacher kept whole (it makes the labels online), the v4
Predictor, AdamW with the two-group schedule, the DDP-wrapped role and `RolloutStep`, the loop's step function of one
trajectory per micro-batch. benchmarks/gpu_acceptance.py builds it here too, on its own Teacher.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.eval.validation import predictor_validation
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.self_rollout import SelfRolloutSettings, train_trajectory, trajectory_for_row
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, parse_replace_steps
from predictor_training.runtime.checkpoint import load_model_weights
from predictor_training.runtime.distributed import DistEnv, all_gather_objects, log0, wrap_ddp
from predictor_training.runtime.flags import (
    add_data_args,
    add_loss_args,
    add_optimization_args,
    add_predictor_args,
    add_run_args,
    add_teacher_args,
    add_tracker_args,
    add_validation_args,
    parse_subset_cases,
)
from predictor_training.runtime.optim import build_optimizer_and_schedule
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.teacher.frame_kv_cache import CONTEXT_MODES
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher

VARIANT = "v4"
# The recipe at the size the memory rehearsal plans for (tools/estimate_memory.py): its defaults.
REAL_SIZE = ["--source_blocks", "1,52", "--precision", "fp32master", "--gradient_checkpointing"]


def add_rollout_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The rollout recipe's flags on `parser`: every default below is the recipe (docs/rollout.md)."""
    add_data_args(parser, pairs=None, num_workers=2)
    rollout = parser.add_argument_group("rollout")
    rollout.add_argument("--sample_table", type=Path, default=None,
                         help="sample table (JSONL) of the trajectories to roll out; default: the table of --split "
                              "recorded in the dataset's dataset_config.json (sample_tables)")
    rollout.add_argument("--subset_cases", type=parse_subset_cases, default=None,
                         help="train on a subset of cases (all their actions): a count N (seeded choice, "
                              "--subset_seed) or comma-separated case ids; default: every case (overfit8: 8)")
    rollout.add_argument("--subset_seed", type=int, default=20260721,
                         help="seed of the --subset_cases choice (default %(default)s, the overfit8 run's)")
    rollout.add_argument("--replace_steps", type=parse_replace_steps, default=DEFAULT_REPLACE_STEPS,
                         help="steps the Predictor runs in every trained chunk, as the eval's --replace_steps: "
                              "1,2,3 = F-P-P-P (default), 1,2 = F-P-P-F, 1,3 = F-P-F-P; the others are Full "
                              "Teacher steps, where gradients stop. The run name and checkpoints record it")
    rollout.add_argument("--reuse_steps", type=parse_replace_steps, default=(),
                         help="steps filled by velocity reuse in every trained chunk (the fewer-step sampler's skipped "
                              "steps: no model call, no label), disjoint from --replace_steps: --reuse_steps 1,2 "
                              "--replace_steps 3 = F-R-R-P. Default: none. The run name and checkpoints record it")
    rollout.add_argument("--context_mode", choices=CONTEXT_MODES, default="exact",
                         help="how each chunk's context K/V are built: exact (a Teacher prefill of the selected "
                              "frames, default), incremental (per-frame K/V cached once after each chunk), last_step "
                              "(the K/V of each chunk's last Full step); predictor_training/teacher/frame_kv_cache.py. "
                              "Recorded in the run name when not exact")
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


class DuplicateTrajectoryError(RuntimeError):
    """Two ranks (or two micro-batches of one step) got the same (case_id, action_id)."""


def latent_grad_check(replace_steps) -> Callable[[int, dict], None] | None:
    """`check_latent_grads` when the schedule has two consecutive Predictor steps (whose latent path can be checked),
    else None (F-P-F-P: every Predictor step starts from a Teacher-made latent, no latent path to check)."""
    consecutive = any(step + 1 in replace_steps for step in replace_steps)
    return check_latent_grads if consecutive else None


def check_latent_grads(step: int, metrics: dict[str, float]) -> None:
    """The Predictor-made latents (x2, x3 under F-P-P-P) must receive a gradient (the BPTT path through them is
    alive)."""
    value = metrics["latent_grad_l1_min"]
    if not value > 0:
        raise RuntimeError(
            f"step {step}: latent_grad_l1_min={value}: some x2/x3 got no gradient, so the latent BPTT path is cut "
            "(an untrained Predictor, with zero-initialised output layers, ignores its input latent: start from an "
            "offline v4 checkpoint with --init_from)"
        )


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

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        if due != {"predictor"}:
            raise ValueError(f"RolloutStep trains the role 'predictor' every step; the loop says {sorted(due)}")
        # 1. Distinct trajectories across ranks (and micro-batches) of this optimizer step.
        self.step_keys.extend(map(tuple, all_gather_objects(list(item["key"]))))
        if len(set(self.step_keys)) != len(self.step_keys):
            raise DuplicateTrajectoryError(f"trajectory keys used twice in one optimizer step: {self.step_keys}")
        distinct = float(len(self.step_keys))
        if sync:
            self.step_keys = []
        # 2. The trajectory's static inputs: the exact text K/V of every layer, the image condition, and what the
        #    row's seed gives (noise, memory points).
        trajectory = trajectory_for_row(item, self.dataset.load_case(item["case_id"]), teacher=self.teacher,
                                        predictor=self.model, config=self.rollout_config, settings=self.settings,
                                        device=self.env.device)
        # 3. Roll out and train.
        metrics = train_trajectory(trajectory, sync=sync)
        if "latent_grad_l1_min" in metrics:  # the same on every rank: the schedule decides
            gathered = all_gather_objects(metrics["latent_grad_l1_min"])
            metrics["latent_grad_l1_min"] = min(gathered) if all(math.isfinite(v) for v in gathered) else math.nan
        metrics["trajectory/distinct_keys"] = distinct
        return metrics


def build_rollout(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, teacher_source: TeacherSource,
                  dataset: TrajectoryTableDataset, rollout_config: RolloutConfig, run_dir=None,
                  resuming: bool = False, load_teacher=load_teacher) -> RecipeParts:
    """Steps 3-5: the Teacher (kept whole: it makes the labels online), the Predictor from --init_from (unless a
    training state is resumed: `resuming`), AdamW with the two-group schedule, the DDP-wrapped role, the trajectory
    step and the validation. Seams: `load_teacher`."""
    # 3. Teacher and Predictor.
    teacher = load_teacher(teacher_source, env.device, policy.frozen_dtype)
    log0(describe_teacher(teacher_source, teacher))
    predictor = build_predictor(teacher, VARIANT, args.source_blocks, args.gradient_checkpointing)
    init_meta = None
    if not resuming:
        init_meta = load_model_weights(args.init_from, predictor,
                                       expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})
    # 4. AdamW over two groups (fusion + head, blocks) and the warmup + cosine schedule; fresh for a new run.
    optimizer, lr_schedule = build_optimizer_and_schedule(
        predictor, fusion_lr=args.fusion_lr, blocks_lr=args.blocks_lr, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay, warmup_steps=args.scheduler_warmup_steps, max_steps=args.max_steps,
        block_warmup_steps=args.block_warmup_steps)
    # 5. The one trained role (the DDP-wrapped Predictor), the trajectory step and the validation.
    model = wrap_ddp(predictor, env)
    role = Role("predictor", predictor, optimizer, lr_schedule, module=model, grad_clip=args.grad_clip)
    settings = SelfRolloutSettings(velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight,
                                   predictor_autocast_dtype=policy.autocast_dtype,
                                   replace_steps=tuple(args.replace_steps), reuse_steps=tuple(args.reuse_steps))
    step_fn = RolloutStep(model=model, teacher=teacher, dataset=dataset, rollout_config=rollout_config,
                          settings=settings, env=env)
    validation = predictor_validation(
        every=args.val_every, split=args.val_split, videos=args.val_videos, vae=args.val_vae,
        ground_truth=args.val_ground_truth, dataset_root=args.dataset_root, teacher=teacher, predictor=predictor,
        teacher_folder=teacher_source.folder, replace_steps=args.replace_steps, reuse_steps=args.reuse_steps,
        rollout_config=rollout_config, env=env, run_dir=run_dir)
    return RecipeParts(
        roles=[role], step_fn=step_fn, models=[teacher, predictor], validation=validation,
        derived={"init_meta": init_meta, "predictor": predictor.predictor_config(),
                 "teacher_double_blocks": teacher.num_layers},
        loop_options={"extra_step_check": latent_grad_check(args.replace_steps)})
