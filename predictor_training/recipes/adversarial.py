"""The adversarial recipe's steps and build (`fvtools/train_adversarial.py` holds its flags, presets, cross-flag checks,
data, summary and `main()`; docs/methods/adversarial.md): the Teacher -> v4 Predictor (then --init_from), the
discriminator (`methods/adversarial.py`), the two roles and the step of the data mode: `AdversarialPairStep` (--data
offline, one micro-batch of stored pairs) or `AdversarialRolloutStep` (--data rollout, one trajectory).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor, nn

from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.eval.validation import predictor_validation
from predictor_training.methods.adversarial import (
    DISCRIMINATOR,
    PREDICTOR,
    Adversary,
    adversarial_metrics,
    build_discriminator,
    build_discriminator_role,
    context_summary,
)
from predictor_training.predictor.loss import predictor_loss
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.pair_step import move_batch, predict_pairs_with_context
from predictor_training.predictor.self_rollout import (
    ChunkGraph,
    SelfRolloutSettings,
    train_trajectory,
    trajectory_for_row,
)
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, StepPlan
from predictor_training.runtime.checkpoint import load_model_weights
from predictor_training.runtime.distributed import DistEnv, log0, maybe_no_sync, seed_everything, wrap_ddp
from predictor_training.runtime.optim import build_optimizer_and_schedule
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher

VARIANT = "v4"
OFFLINE_PLAN = StepPlan.from_steps(DEFAULT_REPLACE_STEPS)  # what --data offline is validated at (it trains every step)


class AdversarialPairStep:
    """`step_fn` of the loop for --data offline: one micro-batch of stored pairs.

    The Predictor's forward and loss are `pair_step`'s (predict_pairs + predictor_loss); with weight 0 its backward
    is the same loss tensor's, so the Predictor trains exactly as train_predictor_v4.py."""

    def __init__(self, *, model: nn.Module, predictor, policy, context_timestep: float, adversary: Adversary,
                 velocity_weight: float, hidden_weight: float):
        self.model = model
        self.predictor = predictor
        self.policy = policy
        self.context_timestep = context_timestep
        self.adversary = adversary
        self.velocity_weight = velocity_weight
        self.hidden_weight = hidden_weight

    def __call__(self, batch: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        self.adversary.check_due(due)
        batch = move_batch(batch, self.policy.device)
        weight = self.adversary.weight()
        timestep = batch["timestep"]  # [B], the target step's
        # 1. The Predictor: regression (+ the adversarial term once its weight is above 0), one backward.
        with maybe_no_sync(self.model, enabled=not sync):
            pred_hidden, pred_velocity, context = predict_pairs_with_context(
                batch, model=self.model, predictor=self.predictor, policy=self.policy,
                context_timestep=self.context_timestep, release_prefeatures=True)  # `batch` is move_batch's copy
            loss, regression = predictor_loss(
                pred_hidden, pred_velocity, batch["target_hidden"], batch["target_velocity"],
                velocity_weight=self.velocity_weight, hidden_weight=self.hidden_weight)
            condition = context_summary(context)
            generator = None
            if weight > 0:
                generator = self.adversary.generator_term(pred_hidden, timestep, condition,
                                                          real_dtype=batch["target_hidden"].dtype)
                loss = loss + weight * generator
            loss.backward()
        # 2. The discriminator on the same real / (detached) fake hiddens.
        metrics = self.adversary.discriminator_pass(batch["target_hidden"], pred_hidden, timestep, condition,
                                                    train=DISCRIMINATOR in due)
        metrics.update({
            "loss": float(loss.detach()),
            "regression_loss": float(regression["loss"]),
            "hidden_mse": float(regression["hidden_mse"]),
            "velocity_mse": float(regression["velocity_mse"]),
            **adversarial_metrics(weight, None if generator is None else float(generator.detach()), metrics,
                                  pred_hidden, batch["target_hidden"]),
        })
        return metrics


class AdversarialRolloutStep:
    """`step_fn` of the loop for --data rollout: one trajectory (case, action) per call.

    `train_trajectory` runs chunk 0 and every trained chunk with its own backward; `chunk_hook` adds the weighted
    generator term of the chunk's Predictor steps (mean over them, as the chunk's regression loss) and keeps the
    chunk's (real, detached fake, timestep, context) for the discriminator, which trains on all of them after the
    trajectory."""

    def __init__(self, *, model: nn.Module, teacher, dataset: TrajectoryTableDataset, rollout_config: RolloutConfig,
                 settings: SelfRolloutSettings, adversary: Adversary, source_blocks, env: DistEnv):
        self.model = model
        self.teacher = teacher
        self.dataset = dataset
        self.rollout_config = rollout_config
        self.settings = settings
        self.adversary = adversary
        self.source_blocks = tuple(source_blocks)
        self.env = env

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        self.adversary.check_due(due)
        weight = self.adversary.weight()
        trajectory = trajectory_for_row(item, self.dataset.load_case(item["case_id"]), teacher=self.teacher,
                                        predictor=self.model, config=self.rollout_config, settings=self.settings,
                                        device=self.env.device)
        reals, fakes, timesteps, conditions, generator_terms = [], [], [], [], []

        def chunk_hook(graph: ChunkGraph) -> Tensor | None:
            condition = context_summary(graph.context.kv.select(self.source_blocks))  # [1, D]
            terms = []
            for step in graph.steps:
                timestep = step.timestep[:1].to(self.env.device)  # the step's timestep (every frame has it)
                reals.append(step.target_hidden.detach())  # its own dtype: D sees the fake on its grid
                fakes.append(step.pred_hidden.detach().float())
                timesteps.append(timestep)
                conditions.append(condition)
                if weight > 0:
                    terms.append(self.adversary.generator_term(step.pred_hidden, timestep, condition,
                                                               real_dtype=step.target_hidden.dtype))
            if not terms:
                return None
            term = torch.stack(terms).mean()
            generator_terms.append(float(term.detach()))
            return weight * term

        metrics = train_trajectory(trajectory, sync=sync, chunk_hook=chunk_hook)
        real, fake = torch.cat(reals), torch.cat(fakes)
        d_metrics = self.adversary.discriminator_pass(real, fake, torch.cat(timesteps), torch.cat(conditions),
                                                      train=DISCRIMINATOR in due)
        regression = metrics.pop("loss")
        generator = sum(generator_terms) / len(generator_terms) if generator_terms else None
        metrics.update(d_metrics)
        metrics.update({
            "loss": regression + weight * generator if generator_terms else regression,
            "regression_loss": regression,
            **adversarial_metrics(weight, generator, d_metrics, fake, real),
        })
        return metrics


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, teacher_source: TeacherSource,
          context_timestep: float | None = None, dataset: TrajectoryTableDataset | None = None,
          rollout_config: RolloutConfig | None = None, resuming: bool = False, run_dir: Path | None = None,
          load_teacher=load_teacher) -> RecipeParts:
    """Steps 3-4: the Teacher -> v4 Predictor, built as train_predictor_v4.py builds it (same seeding), then
    --init_from (unless a training state is resumed: `resuming`); the validation; the roles: the DDP-wrapped
    Predictor every step with the v4 recipe's AdamW and schedule, the discriminator on its cadence from its own random
    stream (the global RNG is left as the v4 recipe leaves it); the `Adversary` and the step of the data mode. The
    offline mode drops the Teacher (the Predictor shares the frozen modules it runs; `context_timestep` from the
    script's data step); the rollout keeps it for the online labels (its `dataset` and `rollout_config`). Seams:
    `load_teacher`."""
    # 3. Teacher -> Predictor, the validation, --init_from.
    teacher = load_teacher(teacher_source, env.device, policy.frozen_dtype)
    log0(describe_teacher(teacher_source, teacher))
    torch.manual_seed(args.seed)  # the same fusion/head initialisation on every rank
    predictor = build_predictor(teacher, VARIANT, args.source_blocks, args.gradient_checkpointing)
    teacher_layers = teacher.num_layers
    validation = predictor_validation(  # held-out F-P-P-P (offline) or the rollout's schedule, vs F-F-F-F
        every=args.val_every, split=args.val_split, videos=args.val_videos, vae=args.val_vae,
        ground_truth=args.val_ground_truth, dataset_root=args.dataset_root, teacher=teacher, predictor=predictor,
        teacher_folder=teacher_source.folder, plan=args.plan if args.data == "rollout" else OFFLINE_PLAN,
        rollout_config=None, autocast_dtype=policy.autocast_dtype, env=env, run_dir=run_dir)
    if args.data == "offline":
        del teacher
    seed_everything(args.seed, rank=env.rank)
    init_meta = None
    if not resuming and args.init_from is not None:
        init_meta = load_model_weights(args.init_from, predictor, role=PREDICTOR,
                                       expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})
    # 4. The roles, the adversary and the step.
    discriminator = build_discriminator(predictor.hidden_size, width=args.discriminator_width, seed=args.seed,
                                        device=env.device)
    optimizer, lr_schedule = build_optimizer_and_schedule(
        predictor, fusion_lr=args.fusion_lr, blocks_lr=args.blocks_lr, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay, warmup_steps=args.scheduler_warmup_steps, max_steps=args.max_steps,
        block_warmup_steps=args.block_warmup_steps)
    discriminator_role = build_discriminator_role(
        discriminator, lr=args.discriminator_lr, weight_decay=args.discriminator_weight_decay,
        betas=(args.discriminator_adam_beta1, args.discriminator_adam_beta2),
        grad_clip=args.discriminator_grad_clip, every=args.discriminator_every, max_steps=args.max_steps)
    model = wrap_ddp(predictor, env)
    predictor_role = Role(PREDICTOR, predictor, optimizer, lr_schedule, module=model, grad_clip=args.grad_clip)
    adversary = Adversary(predictor_role, discriminator_role, adv_weight=args.adv_weight,
                          adv_warmup_steps=args.adv_warmup_steps, r1_weight=args.r1_weight, r1_every=args.r1_every)
    if args.data == "offline":
        step_fn = AdversarialPairStep(model=model, predictor=predictor, policy=policy,
                                      context_timestep=context_timestep, adversary=adversary,
                                      velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight)
        models = [predictor, discriminator]
    else:
        settings = SelfRolloutSettings(velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight,
                                       predictor_autocast_dtype=policy.autocast_dtype,
                                       plan=args.plan)
        step_fn = AdversarialRolloutStep(model=model, teacher=teacher, dataset=dataset, rollout_config=rollout_config,
                                         settings=settings, adversary=adversary, source_blocks=args.source_blocks,
                                         env=env)
        models = [teacher, predictor, discriminator]
    discriminator_config = {"hidden_size": predictor.hidden_size, "width": args.discriminator_width,
                            "parameters": sum(p.numel() for p in discriminator.parameters())}
    return RecipeParts(roles=[predictor_role, discriminator_role], step_fn=step_fn, models=models,
                       validation=validation,
                       derived={"init_meta": init_meta, "predictor": predictor.predictor_config(),
                                "teacher_double_blocks": teacher_layers, "discriminator": discriminator_config})
