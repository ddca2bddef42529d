"""The rollout recipe's build (`train_predictor_v4_rollout.py` holds its flags, presets, cross-flag checks, data
and `main()`; docs/rollout.md): the Teacher kept whole (it makes the labels online), the v4 Predictor, AdamW with the
two-group schedule, the DDP-wrapped role and `RolloutStep`, the loop's step function of one trajectory per
micro-batch. benchmarks/gpu_acceptance.py builds it here too, with its own Teacher and named real-size values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.self_rollout import SelfRolloutSettings, train_trajectory, trajectory_for_row
from predictor_training.recipes.predictor_settings import PredictorSettings, held_out_validation, predictor_role
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.schedule import StepPlan
from predictor_training.runtime.checkpoint import load_model_weights
from predictor_training.runtime.distributed import DistEnv, all_gather_objects, log0
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher
from predictor_training.world.revisits import revisits

VARIANT = "v4"


@dataclass(frozen=True)
class RolloutSettings(PredictorSettings):
    """What `build_rollout` builds from, named as the rollout script's flags (`flags.settings_from_flags`): the
    Predictor recipes' values (`PredictorSettings`), the Predictor's weights (init_from, unless resuming), the
    schedule it trains (plan: `recipes.flags.add_plan_args`, from --replace_steps / --reuse_steps) and the return
    term's weight (revisit_weight)."""

    init_from: Path | None
    plan: StepPlan
    revisit_weight: float


class DuplicateTrajectoryError(RuntimeError):
    """Two ranks (or two micro-batches of one step) got the same (case_id, action_id)."""


def latent_grad_check(plan: StepPlan) -> Callable[[int, dict], None] | None:
    """`check_latent_grads` when the plan has two consecutive Predictor steps (whose latent path can be checked),
    else None (F-P-F-P: every Predictor step starts from a Teacher-made latent, no latent path to check)."""
    consecutive = any(step + 1 in plan.predictor_steps for step in plan.predictor_steps)
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


def row_revisit_pairs(item: dict, revisit_weight: float) -> dict[int, int] | None:
    """{latent: the earliest latent with its camera} of a sample-table row's pose file (`world.revisits`), which the
    return term reads; None when the term is off (revisit_weight 0)."""
    if revisit_weight <= 0:
        return None
    return {seen.latent: seen.first_latent for seen in revisits(item["pose"])}


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
        self.revisit_pairs: dict[str, dict[int, int]] = {}  # by pose file: read once, not every step

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
        pairs = None
        if self.settings.revisit_weight > 0:  # the return term reads the row's pose file, once per file
            if item["pose"] not in self.revisit_pairs:
                self.revisit_pairs[item["pose"]] = row_revisit_pairs(item, self.settings.revisit_weight)
            pairs = self.revisit_pairs[item["pose"]]
        trajectory = trajectory_for_row(item, self.dataset.load_case(item["case_id"]), teacher=self.teacher,
                                        predictor=self.model, config=self.rollout_config, settings=self.settings,
                                        device=self.env.device, revisit_pairs=pairs)
        # 3. Roll out and train.
        metrics = train_trajectory(trajectory, sync=sync)
        if "latent_grad_l1_min" in metrics:  # the same on every rank: the schedule decides
            gathered = all_gather_objects(metrics["latent_grad_l1_min"])
            metrics["latent_grad_l1_min"] = min(gathered) if all(math.isfinite(v) for v in gathered) else math.nan
        metrics["trajectory/distinct_keys"] = distinct
        return metrics


def build_rollout(settings: RolloutSettings, env: DistEnv, policy: PrecisionPolicy, *, teacher_source: TeacherSource,
                  dataset: TrajectoryTableDataset, rollout_config: RolloutConfig, run_dir=None,
                  resuming: bool = False, load_teacher=load_teacher) -> RecipeParts:
    """Steps 3-5: the Teacher (kept whole: it makes the labels online), the Predictor from --init_from (unless a
    training state is resumed: `resuming`), AdamW with the two-group schedule, the DDP-wrapped role, the trajectory
    step and the validation. Seams: `load_teacher`."""
    # 3. Teacher and Predictor.
    teacher = load_teacher(teacher_source, env.device, policy.frozen_dtype)
    log0(describe_teacher(teacher_source, teacher))
    predictor = build_predictor(teacher, VARIANT, settings.source_blocks, settings.gradient_checkpointing)
    init_meta = None
    if not resuming:
        init_meta = load_model_weights(settings.init_from, predictor,
                                       expect={"variant": VARIANT, "source_blocks": list(settings.source_blocks)})
    # 4-5. The one trained role (AdamW over two groups with the warmup + cosine schedule, fresh for a new run; the
    #      DDP-wrapped Predictor), the trajectory step and the validation.
    role = predictor_role(predictor, settings, env)
    step_settings = SelfRolloutSettings(
        velocity_weight=settings.velocity_weight, hidden_weight=settings.hidden_weight,
        predictor_autocast_dtype=policy.autocast_dtype, plan=settings.plan, revisit_weight=settings.revisit_weight)
    step_fn = RolloutStep(model=role.module, teacher=teacher, dataset=dataset, rollout_config=rollout_config,
                          settings=step_settings, env=env)
    validation = held_out_validation(settings, teacher=teacher, predictor=predictor,
                                     teacher_folder=teacher_source.folder, env=env, run_dir=run_dir,
                                     plan=settings.plan, rollout_config=rollout_config)
    return RecipeParts(
        roles=[role], step_fn=step_fn, models=[teacher, predictor], validation=validation,
        derived={"init_meta": init_meta, "predictor": predictor.predictor_config(),
                 "teacher_double_blocks": teacher.num_layers},
        loop_options={"extra_step_check": latent_grad_check(settings.plan)})
