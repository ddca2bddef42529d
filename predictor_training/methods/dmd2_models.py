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

from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path

import torch

from predictor_training.methods.method_model import MethodModel, MethodSettings, build_method_model, export_method_model
from predictor_training.methods.score_models import ScoreModel
from predictor_training.predictor.model import build_predictor
from predictor_training.runtime.checkpoint import load_model_weights
from predictor_training.runtime.inference_weights import (
    inference_weights_name,
    prune_checkpoints,
    save_inference_weights,
)
from predictor_training.runtime.distributed import DistEnv, wrap_ddp
from predictor_training.runtime.optim import TwoGroupLRSchedule, WarmupCosineSchedule, build_optimizer
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.provenance import with_provenance
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


def resolve_real_score_flags(real_score: str, *, allow_raw_teacher_score: bool, score_sigma_min: float,
                             fake_score_train: str) -> tuple[str, Path | None]:
    """(kind, path) of --real_score: ("teacher", None) for the raw Teacher, only with --allow_raw_teacher_score and
    --score_sigma_min at or above the distilled sigma floor; else `resolve_real_score`. ValueError names the flags."""
    if real_score == RAW_TEACHER:
        if not allow_raw_teacher_score:
            raise ValueError(f"--real_score teacher: the distilled {DISTILLED_STEPS}-step Teacher is not a score model "
                             f"(its x - sigma v is a sample-like jump, trained only at sigma in "
                             f"[{DISTILLED_SIGMA_FLOOR}, 1]); train a real score with fvtools/train_df_sft.py and pass "
                             "its model, or add --allow_raw_teacher_score")
        if score_sigma_min < DISTILLED_SIGMA_FLOOR:
            raise ValueError(f"--score_sigma_min={score_sigma_min} with --real_score teacher: the raw Teacher was "
                             f"trained only at sigma >= {DISTILLED_SIGMA_FLOOR} ({DISTILLED_STEPS} steps at shift "
                             f"{DISTILLED_SHIFT:g}); expected --score_sigma_min >= {DISTILLED_SIGMA_FLOOR}")
        return RAW_TEACHER, None
    try:
        kind, path = resolve_real_score(Path(real_score))
    except ValueError as error:
        raise ValueError(f"--real_score={real_score!r}: {error}") from None
    if kind == "lora" and fake_score_train == "full":
        raise ValueError("--fake_score_train full with a LoRA --real_score: a full fake score needs a model folder; "
                         "use --fake_score_train lora (initialised from the real score's adapter)")
    return kind, path


@dataclass(frozen=True)
class ScoreSettings:
    """What `build_scores` builds from, named as train_dmd2.py's flags. real_score_kind / real_score_path: the
    resolved --real_score (`resolve_real_score_flags`); teacher: the Teacher folder (the base of a full fake copy of
    the raw Teacher); fake_score_train: "lora" | "full"; lora_rank, lora_alpha, seed: a fresh fake adapter (the real
    score is no adapter); fake_score_lr, fake_score_adam_beta1/2, weight_decay, fake_score_grad_clip: the fake
    score's AdamW and clip; gradient_checkpointing: of the fake score's blocks; max_steps, warmup_steps: its warmup +
    cosine (it trains every loop step)."""

    real_score_kind: str
    real_score_path: Path | None
    teacher: Path
    fake_score_train: str
    lora_rank: int
    lora_alpha: float
    seed: int
    fake_score_lr: float
    fake_score_adam_beta1: float
    fake_score_adam_beta2: float
    weight_decay: float
    fake_score_grad_clip: float
    gradient_checkpointing: bool
    max_steps: int
    warmup_steps: int


@dataclass(frozen=True)
class PredictorGeneratorSettings:
    """What `build_predictor_role` builds from, named as train_dmd2.py's flags: the v4 Predictor on `source_blocks`
    (from `init_from` unless resuming; `gradient_checkpointing` of its blocks and of the frozen Teacher's), AdamW
    over its two groups (fusion_lr, blocks_lr, adam_beta1/2, weight_decay; grad_clip), updated every
    `generator_every` loop steps with a warmup + cosine over its own updates (max_steps, warmup_steps in loop steps;
    block_warmup_steps in its updates, -1 = none), and its EMA (ema_decay, -1 = none; ema_start_step in loop
    steps)."""

    source_blocks: tuple[int, int]
    init_from: Path | None
    gradient_checkpointing: bool
    fusion_lr: float
    blocks_lr: float
    adam_beta1: float
    adam_beta2: float
    weight_decay: float
    grad_clip: float
    generator_every: int
    max_steps: int
    warmup_steps: int
    block_warmup_steps: int
    ema_decay: float
    ema_start_step: int


def role_schedule(optimizer, *, max_steps: int, warmup_steps: int, every: int, block_warmup_steps: int | None = None):
    """The role's warmup + cosine over its own updates (max_steps // every; warmup_steps // every); with
    `block_warmup_steps` (the Predictor's) the two-group schedule that holds its blocks at LR 0 that long."""
    updates, warmup = max_steps // every, warmup_steps // every
    if block_warmup_steps is not None:
        return TwoGroupLRSchedule(optimizer, warmup_steps=warmup, max_steps=updates,
                                  block_warmup_steps=block_warmup_steps)
    return WarmupCosineSchedule(optimizer, warmup_steps=warmup, max_steps=updates)


def generator_ema(module: torch.nn.Module, *, decay: float, start_step: int, every: int) -> EMA | None:
    """The generator's EMA (--ema_decay `decay`, -1 = none), or None. --ema_start_step counts loop steps, as
    Self-Forcing's `ema_start_step` does; the EMA counts the generator's own updates (one every `every` loop steps),
    so it starts averaging after update start_step // every (before, its shadow copies the weights)."""
    if decay == -1:
        return None
    return EMA(module, decay, start_update=start_step // every)


def build_scores(settings: ScoreSettings, teacher, env: DistEnv, policy: PrecisionPolicy, *,
                 load_teacher=load_teacher, load_lora=load_lora) -> tuple[ScoreModel, ScoreModel, Role]:
    """(real score, fake score, the fake score's role) from the resolved --real_score, --fake_score_train and the
    --fake_score_* optimizer flags (`settings`). The fake score starts equal to the real score. load_teacher /
    load_lora: the loaders of a model folder / an adapter file (a memory rehearsal passes stand-ins)."""
    # 1. The real score: the Teacher itself, an adapter on it, or a model folder (frozen dtype).
    if settings.real_score_kind == RAW_TEACHER:
        real = ScoreModel(teacher, None, REAL)
    elif settings.real_score_kind == "lora":
        load_lora(teacher, settings.real_score_path, REAL, trainable=False)
        real = ScoreModel(teacher, REAL, REAL)
    else:
        model = load_teacher(TeacherSource(settings.real_score_path, None, "--real_score", None), env.device,
                             policy.frozen_dtype)
        real = ScoreModel(model, None, REAL)
    # 2. The fake score: an adapter on the real score's base, or a trainable FP32 copy of the real score.
    if settings.fake_score_train == "lora":
        if real.adapter_name is not None:
            copy_lora(real.model, real.adapter_name, FAKE, trainable=True)
        else:
            add_lora(real.model, FAKE, settings.lora_rank, settings.lora_alpha, seed=settings.seed)
        fake = ScoreModel(real.model, FAKE, FAKE)
        raw_module, parameters = AdapterWeights(real.model, FAKE), lora_parameters(real.model, FAKE)
        real.model.set_gradient_checkpointing(settings.gradient_checkpointing)
    else:
        folder = settings.teacher if settings.real_score_kind == RAW_TEACHER else settings.real_score_path
        source = TeacherSource(folder, None, "--real_score (fake score copy)", None)
        model = load_teacher(source, env.device, torch.float32).requires_grad_(True).train()
        model.set_gradient_checkpointing(settings.gradient_checkpointing)
        fake = ScoreModel(model, None, FAKE)
        raw_module, parameters = model, [param for param in model.parameters() if param.requires_grad]
    # 3. Its role: trained every loop step, gradients all-reduced (the frozen base is not DDP-wrapped).
    optimizer = build_optimizer({FAKE: parameters}, {FAKE: settings.fake_score_lr},
                                betas=(settings.fake_score_adam_beta1, settings.fake_score_adam_beta2),
                                weight_decay=settings.weight_decay)
    schedule = role_schedule(optimizer, max_steps=settings.max_steps, warmup_steps=settings.warmup_steps, every=1)
    role = Role(FAKE, raw_module, optimizer, schedule, grad_clip=settings.fake_score_grad_clip, grad_sync="all_reduce")
    return real, fake, role


def build_student(settings: MethodSettings, teacher, env: DistEnv, policy: PrecisionPolicy, *, teacher_folder: Path,
                  generator_every: int, ema_decay: float, ema_start_step: int, load_teacher=load_teacher
                  ) -> tuple[ScoreModel, Role, MethodModel]:
    """(the student as a score model, its role, the `MethodModel` that `export_method_model` writes):
    `build_method_model` for a generator that shares the loaded `teacher` with the scores (a LoRA goes on it), is
    replicated rather than sharded (full: loaded from `teacher_folder` by `load_teacher`), is updated every
    `generator_every` loop steps and keeps an EMA (`generator_ema`)."""
    source = TeacherSource(teacher_folder, None, "--teacher", None)
    student = build_method_model(source, settings, env, policy, role_name=STUDENT, base_model=teacher,
                                 every=generator_every, shard=False, load_teacher=load_teacher)
    student.role.ema = generator_ema(student.role.raw_module, decay=ema_decay, start_step=ema_start_step,
                                     every=generator_every)
    return ScoreModel(student.model, student.adapter, STUDENT), student.role, student


def build_predictor_role(settings: PredictorGeneratorSettings, teacher, env: DistEnv, *, resuming: bool
                         ) -> tuple[torch.nn.Module, Role, dict | None]:
    """(the v4 Predictor on the Teacher, its role, the `init_from` file's metadata or None when resuming): loaded
    from `init_from` unless a training state is resumed, DDP-wrapped, two LR groups (fusion_lr, blocks_lr), due
    every `generator_every` loop steps, with its EMA."""
    predictor = build_predictor(teacher, PREDICTOR_VARIANT, settings.source_blocks, settings.gradient_checkpointing)
    # A schedule ending on Full steps (F-P-P-F) re-runs them on the frozen Teacher with a graph to the sample
    # (`CompositeRollout.differentiable_sample`): checkpoint its blocks too, whatever model the scores sit on.
    teacher.set_gradient_checkpointing(settings.gradient_checkpointing)
    init_meta = None
    if not resuming:
        init_meta = load_model_weights(settings.init_from, predictor, expect={
            "variant": PREDICTOR_VARIANT, "source_blocks": list(settings.source_blocks)})
    groups = predictor.trainable_parameter_groups()
    optimizer = build_optimizer(groups, {"fusion": settings.fusion_lr, "blocks": settings.blocks_lr},
                                betas=(settings.adam_beta1, settings.adam_beta2), weight_decay=settings.weight_decay)
    every = settings.generator_every
    schedule = role_schedule(optimizer, max_steps=settings.max_steps, warmup_steps=settings.warmup_steps, every=every,
                             block_warmup_steps=settings.block_warmup_steps)
    module = wrap_ddp(predictor, env)
    ema = generator_ema(predictor, decay=settings.ema_decay, start_step=settings.ema_start_step, every=every)
    role = Role("predictor", predictor, optimizer, schedule, module=module, every=every, grad_clip=settings.grad_clip,
                ema=ema)
    return predictor, role, init_meta


def export_generator_ema(role: Role, run_dir: Path, step: int, *, meta: dict, config: dict, keep_last: int,
                         written: Sequence[str], env: DistEnv, student_model: MethodModel | None = None) -> Path:
    """Write the generator's EMA weights next to its raw ones (a collective for a student; call on every rank).

    predictor: `predictor_ema_step_XXXXX.safetensors` (inference weights as `predictor_step_XXXXX.safetensors`, BF16,
    the same meta and run config plus "ema"; tools/eval_predictor.py --ckpt reads it), pruned to --keep_last among
    `written`, the files the run recorded (`RunState.checkpoints`; the loop recorded this step's).
    student: `export_method_model` of the EMA weights into `<run_dir>/ema/` (lora_student.safetensors or model/): the
    shadow is copied into the student for the export and the trained weights are put back after it."""
    if role.ema is None:
        raise ValueError(f"role {role.name!r} has no EMA to export")
    ema_meta = with_provenance({**meta, "role": role.name, "step": step, "ema": {
        "decay": role.ema.decay, "start_update": role.ema.start_update, "updates": role.ema.updates}}, config)
    run_dir = Path(run_dir)
    if student_model is None:
        path = run_dir / inference_weights_name(step, f"{role.name}_ema")
        if env.is_main:
            save_inference_weights(path, role.ema.state_dict_of(role.raw_module), metadata=ema_meta, config=config)
            prune_checkpoints(run_dir, keep_last, f"{role.name}_ema", written)
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
