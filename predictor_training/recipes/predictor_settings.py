"""What the two Predictor recipes build alike: the offline recipe (`recipes/offline.py`, train_predictor_v4.py and
train_predictor_disca.py) and the rollout recipe (`recipes/rollout.py`, train_predictor_v4_rollout.py) train one
Predictor with AdamW over its two groups under the warmup + cosine schedule, a velocity + hidden loss, and validate
it on held-out videos. `PredictorSettings` holds those values (each recipe's settings add their own), `predictor_role`
builds the trained role and `held_out_validation` the validation from them; `log_leaderboard_command` is the line
both print after training.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from predictor_training.eval.leaderboard_command import leaderboard_command
from predictor_training.eval.validation import PredictorValidation, predictor_validation
from predictor_training.rollout.schedule import StepPlan
from predictor_training.runtime.distributed import DistEnv, log0, wrap_ddp
from predictor_training.runtime.launch import Launch
from predictor_training.runtime.optim import build_optimizer_and_schedule
from predictor_training.runtime.roles import Role


@dataclass(frozen=True)
class PredictorSettings:
    """The Predictor recipes' common values, named as their scripts' flags (`flags.settings_from_flags`): the
    Predictor (source_blocks, gradient_checkpointing), AdamW over its two groups (fusion_lr, blocks_lr,
    adam_beta1/2, weight_decay; grad_clip) with the warmup + cosine (scheduler_warmup_steps, max_steps,
    block_warmup_steps), the loss's weights (velocity_weight, hidden_weight) and the validation (val_every,
    val_split, val_videos, val_vae, val_ground_truth on dataset_root)."""

    source_blocks: tuple[int, int]
    gradient_checkpointing: bool
    fusion_lr: float
    blocks_lr: float
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    scheduler_warmup_steps: int
    max_steps: int
    block_warmup_steps: int
    grad_clip: float
    velocity_weight: float
    hidden_weight: float
    dataset_root: Path
    val_every: int
    val_split: str | None
    val_videos: int
    val_vae: Path | None
    val_ground_truth: Path | None


def predictor_role(predictor, settings: PredictorSettings, env: DistEnv) -> Role:
    """The one trained role of a Predictor recipe: AdamW over the Predictor's two groups (fusion + head, blocks) with
    the warmup + cosine schedule, both fresh; the DDP-wrapped Predictor as the module the step calls; the gradient
    clip."""
    optimizer, lr_schedule = build_optimizer_and_schedule(
        predictor, fusion_lr=settings.fusion_lr, blocks_lr=settings.blocks_lr,
        betas=(settings.adam_beta1, settings.adam_beta2), weight_decay=settings.weight_decay,
        warmup_steps=settings.scheduler_warmup_steps, max_steps=settings.max_steps,
        block_warmup_steps=settings.block_warmup_steps)
    return Role("predictor", predictor, optimizer, lr_schedule, module=wrap_ddp(predictor, env),
                grad_clip=settings.grad_clip)


def held_out_validation(settings: PredictorSettings, *, teacher, predictor, teacher_folder: Path, env: DistEnv,
                        run_dir, plan: StepPlan, **rollout) -> PredictorValidation | None:
    """`eval.validation.predictor_validation` at the settings' validation values (None with val_every 0) of the
    recipe's `plan`; `rollout`: its rollout_config and, as it needs it, autocast_dtype."""
    return predictor_validation(
        every=settings.val_every, split=settings.val_split, videos=settings.val_videos, vae=settings.val_vae,
        ground_truth=settings.val_ground_truth, dataset_root=settings.dataset_root, teacher=teacher,
        predictor=predictor, teacher_folder=teacher_folder, env=env, run_dir=run_dir, plan=plan, **rollout)


def log_leaderboard_command(launch: Launch) -> None:
    """After a Predictor recipe's loop: the command that puts this Predictor on the leaderboard, against the
    samplers and caches at its cost (docs/leaderboard.md)."""
    log0("next, the leaderboard: " + leaderboard_command(launch.start.run_dir, dataset_root=launch.args.dataset_root,
                                                         world_size=launch.env.world_size))
