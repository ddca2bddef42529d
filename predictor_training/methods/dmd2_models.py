"""DMD2's models and roles (fvtools/train_dmd2.py): the frozen real score, the fake score (the critic) that starts
equal to it, and the generator, a few-step student or the v4 Predictor; each trained one with its AdamW and a warmup +
cosine over its own updates (`role_schedule`).

    real score   --real_score: the raw distilled Teacher ("teacher"), a LoRA adapter file on the Teacher, or a
                 model folder (`resolve_real_score`); frozen
    fake score   --fake_score_train lora: an adapter on the real score's frozen base, copied from the real score's
                 adapter or fresh; full: every parameter of a copy of the real score (replicated, gradients
                 all-reduced: tiny models only). Trained every loop step.
    student      --train lora: adapter "student" on the shared Teacher; full: every parameter of a Teacher-shaped
                 model (replicated, all-reduced). Trained every --generator_every steps.
    predictor    the v4 Predictor on the Teacher's --source_blocks (from --init_from unless resuming), DDP-wrapped.
                 Trained every --generator_every steps, two LR groups.

The generator (student or Predictor) has an EMA of its trained weights in its role's `ema` slot (Self-Forcing's
generator EMA: decay 0.99 from loop step 200; `--ema_decay`, `--ema_start_step`, -1 = none): updated after each of its
own updates (`roles.EMA`: ema <- decay ema + (1 - decay) param; before the start it copies the weights), saved in the
training state, and written next to the raw weights at the end of a run (`export_generator_ema`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from predictor_training.methods.method_model import MethodModel, build_method_model, export_method_model
from predictor_training.methods.score_models import ScoreModel
from predictor_training.predictor.model import build_predictor
from predictor_training.runtime.checkpoint import (inference_weights_name, load_model_weights, prune_checkpoints,
                                                  save_inference_weights)
from predictor_training.runtime.distributed import DistEnv, wrap_ddp
from predictor_training.runtime.optim import TwoGroupLRSchedule, WarmupCosineSchedule, build_optimizer
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.roles import EMA, Role
from predictor_training.teacher.adapters import (
    AdapterWeights,
    add_lora,
    copy_lora,
    load_lora,
    lora_parameters,
    read_lora_header,
)
from predictor_training.rollout.scheduler import DISTILLED_SIGMA_FLOOR
from predictor_training.teacher.config import DISTILLED_SHIFT, DISTILLED_STEPS
from predictor_training.teacher.source import TeacherSource, load_teacher

FAKE = "fake_score"
REAL = "real_score"
STUDENT = "student"
RAW_TEACHER = "teacher"  # --real_score teacher: the distilled Teacher itself
PREDICTOR_VARIANT = "v4"
EMA_FOLDER = "ema"  # a student's EMA export: <run_dir>/ema/lora_student.safetensors or <run_dir>/ema/model/


def resolve_real_score(path: Path) -> tuple[str, Path]:
    """("model", folder with config.json) or ("lora", adapter file) for --real_score (ValueError when neither)."""
    if path.is_file():
        read_lora_header(path)  # ValueError unless it is an adapter file
        return "lora", path
    if (path / "config.json").is_file():
        return "model", path
    if (path / "model" / "config.json").is_file():
        return "model", path / "model"
    loras = sorted(path.glob("lora_*.safetensors")) if path.is_dir() else []
    if len(loras) == 1:
        return "lora", loras[0]
    raise ValueError("expected a model folder with config.json, a df_sft run folder with model/ or one "
                     "lora_*.safetensors, a LoRA adapter file, or 'teacher'")


def resolve_real_score_flags(args: argparse.Namespace) -> tuple[str, Path | None]:
    """(kind, path) of --real_score: ("teacher", None) for the raw Teacher, only with --allow_raw_teacher_score and
    --score_sigma_min at or above the distilled sigma floor; else `resolve_real_score`. ValueError names the flags."""
    if args.real_score == RAW_TEACHER:
        if not args.allow_raw_teacher_score:
            raise ValueError(f"--real_score teacher: the distilled {DISTILLED_STEPS}-step Teacher is not a score model "
                             f"(its x - sigma v is a sample-like jump, trained only at sigma in "
                             f"[{DISTILLED_SIGMA_FLOOR}, 1]); train a real score with fvtools/train_df_sft.py and pass "
                             "its model, or add --allow_raw_teacher_score")
        if args.score_sigma_min < DISTILLED_SIGMA_FLOOR:
            raise ValueError(f"--score_sigma_min={args.score_sigma_min} with --real_score teacher: the raw Teacher was "
                             f"trained only at sigma >= {DISTILLED_SIGMA_FLOOR} ({DISTILLED_STEPS} steps at shift "
                             f"{DISTILLED_SHIFT:g}); expected --score_sigma_min >= {DISTILLED_SIGMA_FLOOR}")
        return RAW_TEACHER, None
    try:
        kind, path = resolve_real_score(Path(args.real_score))
    except ValueError as error:
        raise ValueError(f"--real_score={args.real_score!r}: {error}") from None
    if kind == "lora" and args.fake_score_train == "full":
        raise ValueError("--fake_score_train full with a LoRA --real_score: a full fake score needs a model folder; "
                         "use --fake_score_train lora (initialised from the real score's adapter)")
    return kind, path


def role_schedule(args: argparse.Namespace, optimizer, every: int, *, two_groups: bool):
    """The role's warmup + cosine over its own updates (max_steps // every; warmup_steps // every)."""
    updates, warmup = args.max_steps // every, args.warmup_steps // every
    if two_groups:
        return TwoGroupLRSchedule(optimizer, warmup_steps=warmup, max_steps=updates,
                                  block_warmup_steps=args.block_warmup_steps)
    return WarmupCosineSchedule(optimizer, warmup_steps=warmup, max_steps=updates)


def generator_ema(args: argparse.Namespace, module: torch.nn.Module) -> EMA | None:
    """The generator's EMA (--ema_decay, -1 = none), or None. --ema_start_step counts loop steps, as Self-Forcing's
    `ema_start_step` does; the EMA counts the generator's own updates, so it starts averaging after update
    ema_start_step // generator_every (before, its shadow copies the weights)."""
    if args.ema_decay == -1:
        return None
    return EMA(module, args.ema_decay, start_update=args.ema_start_step // args.generator_every)


def build_scores(args: argparse.Namespace, teacher, env: DistEnv, policy: PrecisionPolicy
                 ) -> tuple[ScoreModel, ScoreModel, Role]:
    """(real score, fake score, the fake score's role) from --real_score (resolved by the recipe's checks into
    `args.real_score_kind` / `args.real_score_path`), --fake_score_train and the --fake_score_* optimizer flags. The
    fake score starts equal to the real score."""
    # 1. The real score: the Teacher itself, an adapter on it, or a model folder (frozen dtype).
    if args.real_score_kind == RAW_TEACHER:
        real = ScoreModel(teacher, None, REAL)
    elif args.real_score_kind == "lora":
        load_lora(teacher, args.real_score_path, REAL, trainable=False)
        real = ScoreModel(teacher, REAL, REAL)
    else:
        model = load_teacher(TeacherSource(args.real_score_path, None, "--real_score", None), env.device,
                             policy.frozen_dtype)
        real = ScoreModel(model, None, REAL)
    # 2. The fake score: an adapter on the real score's base, or a trainable FP32 copy of the real score.
    if args.fake_score_train == "lora":
        if real.adapter_name is not None:
            copy_lora(real.model, real.adapter_name, FAKE, trainable=True)
        else:
            add_lora(real.model, FAKE, args.lora_rank, args.lora_alpha, seed=args.seed)
        fake = ScoreModel(real.model, FAKE, FAKE)
        raw_module, parameters = AdapterWeights(real.model, FAKE), lora_parameters(real.model, FAKE)
        real.model.set_gradient_checkpointing(args.gradient_checkpointing)
    else:
        folder = args.teacher if args.real_score_kind == RAW_TEACHER else args.real_score_path
        source = TeacherSource(folder, None, "--real_score (fake score copy)", None)
        model = load_teacher(source, env.device, torch.float32).requires_grad_(True).train()
        model.set_gradient_checkpointing(args.gradient_checkpointing)
        fake = ScoreModel(model, None, FAKE)
        raw_module, parameters = model, [param for param in model.parameters() if param.requires_grad]
    # 3. Its role: trained every loop step, gradients all-reduced (the frozen base is not DDP-wrapped).
    optimizer = build_optimizer({FAKE: parameters}, {FAKE: args.fake_score_lr},
                                betas=(args.fake_score_adam_beta1, args.fake_score_adam_beta2),
                                weight_decay=args.weight_decay)
    role = Role(FAKE, raw_module, optimizer, role_schedule(args, optimizer, 1, two_groups=False),
                grad_clip=args.fake_score_grad_clip, grad_sync="all_reduce")
    return real, fake, role


def build_student(args: argparse.Namespace, teacher, env: DistEnv, policy: PrecisionPolicy
                  ) -> tuple[ScoreModel, Role, MethodModel]:
    """(the student as a score model, its role, the `MethodModel` that `export_method_model` writes):
    `build_method_model` for a generator that shares the loaded `teacher` with the scores (a LoRA goes on it), is
    replicated rather than sharded (full), is updated every --generator_every steps and keeps an EMA."""
    source = TeacherSource(args.teacher, None, "--teacher", None)
    student = build_method_model(source, args, env, policy, role_name=STUDENT, base_model=teacher,
                                 every=args.generator_every, shard=False)
    student.role.ema = generator_ema(args, student.role.raw_module)
    return ScoreModel(student.model, student.adapter, STUDENT), student.role, student


def build_predictor_role(args: argparse.Namespace, teacher, env: DistEnv, resuming: bool
                         ) -> tuple[torch.nn.Module, Role, dict | None]:
    """(the v4 Predictor on the Teacher, its role, the --init_from file's metadata or None when resuming): loaded
    from --init_from unless a training state is resumed, DDP-wrapped, two LR groups (--fusion_lr, --blocks_lr),
    due every --generator_every steps."""
    predictor = build_predictor(teacher, PREDICTOR_VARIANT, args.source_blocks, args.gradient_checkpointing)
    # A schedule ending on Full steps (F-P-P-F) re-runs them on the frozen Teacher with a graph to the sample
    # (`CompositeRollout.differentiable_sample`): checkpoint its blocks too, whatever model the scores sit on.
    teacher.set_gradient_checkpointing(args.gradient_checkpointing)
    init_meta = None
    if not resuming:
        init_meta = load_model_weights(args.init_from, predictor, expect={
            "variant": PREDICTOR_VARIANT, "source_blocks": list(args.source_blocks)})
    groups = predictor.trainable_parameter_groups()
    optimizer = build_optimizer(groups, {"fusion": args.fusion_lr, "blocks": args.blocks_lr},
                                betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    role = Role("predictor", predictor, optimizer, role_schedule(args, optimizer, args.generator_every,
                                                                 two_groups=True),
                module=wrap_ddp(predictor, env), every=args.generator_every, grad_clip=args.grad_clip,
                ema=generator_ema(args, predictor))
    return predictor, role, init_meta


def export_generator_ema(role: Role, run_dir: Path, step: int, *, meta: dict, config: dict, keep_last: int,
                         env: DistEnv, student_model: MethodModel | None = None) -> Path:
    """Write the generator's EMA weights next to its raw ones (a collective for a student; call on every rank).

    predictor: `predictor_ema_step_XXXXX.safetensors` (inference weights as `predictor_step_XXXXX.safetensors`, BF16,
    the same meta and run config plus "ema"; tools/eval_predictor.py --ckpt reads it), pruned to --keep_last.
    student: `export_method_model` of the EMA weights into `<run_dir>/ema/` (lora_student.safetensors or model/): the
    shadow is copied into the student for the export and the trained weights are put back after it."""
    if role.ema is None:
        raise ValueError(f"role {role.name!r} has no EMA to export")
    ema_meta = {**meta, "role": role.name, "step": step,
                "ema": {"decay": role.ema.decay, "start_update": role.ema.start_update, "updates": role.ema.updates}}
    run_dir = Path(run_dir)
    if student_model is None:
        path = run_dir / inference_weights_name(step, f"{role.name}_ema")
        if env.is_main:
            save_inference_weights(path, role.ema.state_dict_of(role.raw_module), metadata=ema_meta, config=config)
            prune_checkpoints(run_dir, keep=keep_last, role=f"{role.name}_ema")
        return path
    trained = {name: param.detach().clone() for name, param in role.raw_module.named_parameters()
               if name in role.ema.shadow}
    if env.is_main:
        (run_dir / EMA_FOLDER).mkdir(parents=True, exist_ok=True)
    role.ema.copy_to(role.raw_module)
    try:
        return export_method_model(student_model, run_dir / EMA_FOLDER, ema_meta, env)
    finally:
        with torch.no_grad():
            for name, param in role.raw_module.named_parameters():
                if name in trained:
                    param.copy_(trained[name])
