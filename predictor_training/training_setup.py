"""Setup shared by every training recipe (offline v4 / disca, rollout) and by the eval: flags, Teacher, precision,
optimizer, run directory, startup summary, and the resume -> summary -> `train_loop` tail of every run.

The recipe scripts stay short because everything they have in common lives here:

    parser = argparse.ArgumentParser(...)
    add_data_args(parser); add_teacher_args(parser); add_predictor_args(parser, source_blocks="1,52")
    add_optimization_args(parser, OptimDefaults(...)); add_run_args(parser); add_tracker_args(parser)
    args = parser.parse_args(argv); check_common_args(args)          # cross-flag rules, ValueError naming the flag

    env = init_distributed(args.backend)
    run_dir, policy = start_run(args, env)        # run directory, per-rank seed, dtypes + autocast of --precision
    ... the recipe's data ...
    teacher = load_teacher(args, env.device)                         # --teacher or the dataset's teacher
    predictor = build_predictor(teacher, variant, args.source_blocks, args.gradient_checkpointing)
    optimizer, lr_schedule = build_optimizer_and_schedule(predictor, args)
    config = run_config(args, ...)                                   # every flag + the derived global batch
    resume_and_train(args, ..., make_step_fn=...)  # resume, train_config.json, summary, DDP, logger, train_loop

Precision modes (`--precision`):
* "fp32master" (the real recipe): frozen Teacher weights in BF16, trainable Predictor weights and the AdamW moments
  in FP32, forward under BF16 autocast, losses in FP32.
* "fp32": everything in FP32, no autocast (the CPU demo and the exact tests).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from predictor_training.checkpoint import RunState, load_training_state
from predictor_training.data.pair_dataset import DATASET_CONFIG_NAME
from predictor_training.data.shards import sha256_json
from predictor_training.distributed import DistEnv, log0, seed_everything, wrap_ddp
from predictor_training.logger import TRACKERS, MetricsLogger, redact_secrets, write_json_atomic
from predictor_training.loop import ResumableBatches, train_loop
from predictor_training.optim import BLOCKS_GROUP, FUSION_GROUP, TwoGroupLRSchedule, build_optimizer
from predictor_training.teacher import WorldPlayTransformer

PRECISIONS = ("fp32master", "fp32")
BACKENDS = ("auto", "nccl", "gloo")
TRAIN_CONFIG_NAME = "train_config.json"
DEFAULT_PAIRS_TEXT = "0-1,1-2,2-3"


# ---------------------------------------------------------------------------------------------------------------
# 1. Small parsers for list-valued flags
# ---------------------------------------------------------------------------------------------------------------
def parse_source_blocks(text: str) -> tuple[int, int]:
    """"1,52" -> (1, 52). Two distinct non-negative block indices (validated against the Teacher later)."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    try:
        blocks = tuple(int(part) for part in parts)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--source_blocks {text!r}: expected two integers like '1,52'") from error
    if len(blocks) != 2 or blocks[0] == blocks[1] or min(blocks) < 0:
        raise argparse.ArgumentTypeError(f"--source_blocks {text!r}: expected two distinct indices >= 0 like '1,52'")
    return blocks


def parse_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """"0-1,1-2,2-3" -> ((0, 1), (1, 2), (2, 3)): (anchor step, target step) pairs, anchor < target."""
    pairs = []
    for part in [part.strip() for part in str(text).split(",") if part.strip()]:
        pieces = part.split("-")
        if len(pieces) != 2 or not all(piece.strip().isdigit() for piece in pieces):
            raise argparse.ArgumentTypeError(f"--pairs {text!r}: item {part!r} is not 'anchor-target' like '0-1'")
        anchor, target = int(pieces[0]), int(pieces[1])
        if anchor >= target:
            raise argparse.ArgumentTypeError(f"--pairs {text!r}: item {part!r} needs anchor < target")
        pairs.append((anchor, target))
    if not pairs:
        raise argparse.ArgumentTypeError(f"--pairs {text!r}: no pair given")
    if len(set(pairs)) != len(pairs):
        raise argparse.ArgumentTypeError(f"--pairs {text!r}: a pair is listed twice")
    return tuple(pairs)


def format_pairs(pairs: Sequence[tuple[int, int]]) -> str:
    """((0, 1), (1, 2)) -> "0-1,1-2" (inverse of parse_pairs)."""
    return ",".join(f"{anchor}-{target}" for anchor, target in pairs)


# ---------------------------------------------------------------------------------------------------------------
# 2. Flag groups
# ---------------------------------------------------------------------------------------------------------------
def add_data_args(parser: argparse.ArgumentParser, *, pairs: str | None = DEFAULT_PAIRS_TEXT) -> None:
    """--dataset_root, --split, --num_workers, --verify_dataset and (unless pairs=None) --pairs."""
    group = parser.add_argument_group("data")
    group.add_argument("--dataset_root", type=Path, required=True,
                       help="dataset root made by tools/build_predictor_dataset.py (dataset_config.json, "
                            "manifest.jsonl)")
    group.add_argument("--split", type=str, default="train", help="manifest split to train on")
    if pairs is not None:
        group.add_argument("--pairs", type=parse_pairs, default=parse_pairs(pairs),
                           help=f"supervision pairs 'anchor-target' of denoising steps, comma-separated (default "
                                f"{pairs}; '0-1,2-3' reproduces the F-P-F-P recipes v1-v3)")
    group.add_argument("--num_workers", type=int, default=4, help="DataLoader worker processes per rank (0 = main)")
    group.add_argument("--verify_dataset", action="store_true",
                       help="check size and sha256 of every dataset file against the manifest before training")


def add_teacher_args(parser: argparse.ArgumentParser) -> None:
    """--teacher, --action_ckpt (see `resolve_teacher_source` for the defaults)."""
    group = parser.add_argument_group("teacher")
    group.add_argument("--teacher", type=Path, default=None,
                       help="Teacher transformer folder (config.json + safetensors); default: the folder recorded in "
                            "the dataset's dataset_config.json, so the Predictor learns from the Teacher that made "
                            "the data")
    group.add_argument("--action_ckpt", type=Path, default=None,
                       help="WorldPlay action checkpoint loaded strictly on top of --teacher; default: the one "
                            "recorded in dataset_config.json when --teacher is not given, else none")


def add_predictor_args(parser: argparse.ArgumentParser, *, source_blocks: str = "1,52") -> None:
    """--source_blocks, --gradient_checkpointing / --no_gradient_checkpointing."""
    group = parser.add_argument_group("predictor")
    group.add_argument("--source_blocks", type=parse_source_blocks, default=parse_source_blocks(source_blocks),
                       help=f"the two Teacher double blocks copied into the Predictor, 'a,b' (default {source_blocks}; "
                            "the real Teacher also has '0,53')")
    group.add_argument("--gradient_checkpointing", dest="gradient_checkpointing", action="store_true", default=True,
                       help="non-reentrant activation checkpointing of the two Predictor blocks (default on)")
    group.add_argument("--no_gradient_checkpointing", dest="gradient_checkpointing", action="store_false",
                       help="turn activation checkpointing off (faster, more memory)")


@dataclass(frozen=True)
class OptimDefaults:
    """The recipe's numbers for `add_optimization_args` (offline stage 1 of the notes by default)."""

    fusion_lr: float = 1e-4
    blocks_lr: float = 1e-5
    max_steps: int = 2000
    scheduler_warmup_steps: int = 100
    block_warmup_steps: int = 100
    batch_size: int = 16
    grad_accum: int = 1


def add_optimization_args(parser: argparse.ArgumentParser, defaults: OptimDefaults = OptimDefaults()) -> None:
    """Learning rates, schedule, AdamW, clipping, batch and accumulation."""
    group = parser.add_argument_group("optimisation")
    group.add_argument("--fusion_lr", type=float, default=defaults.fusion_lr,
                       help="peak LR of the image fusion + residual head group")
    group.add_argument("--blocks_lr", type=float, default=defaults.blocks_lr,
                       help="peak LR of the two copied Teacher blocks")
    group.add_argument("--max_steps", type=int, default=defaults.max_steps,
                       help="optimizer steps of the schedule: the cosine reaches 0 here")
    group.add_argument("--stop_at_step", type=int, default=-1,
                       help="end this run at this optimizer step (checkpoint written), keeping the max_steps schedule; "
                            "-1 = run to max_steps")
    group.add_argument("--scheduler_warmup_steps", type=int, default=defaults.scheduler_warmup_steps,
                       help="linear warmup steps of both groups before the cosine decay")
    group.add_argument("--block_warmup_steps", type=int, default=defaults.block_warmup_steps,
                       help="steps during which the blocks group has LR 0 (only fusion/head train); -1 = none")
    group.add_argument("--batch_size", type=int, default=defaults.batch_size, help="micro-batch per rank (per GPU)")
    group.add_argument("--grad_accum", type=int, default=defaults.grad_accum,
                       help="micro-batches accumulated per optimizer step")
    group.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay")
    group.add_argument("--adam_beta1", type=float, default=0.9, help="AdamW beta1")
    group.add_argument("--adam_beta2", type=float, default=0.95, help="AdamW beta2")
    group.add_argument("--grad_clip", type=float, default=1.0, help="global gradient-norm clip; -1 = measure only")


def add_run_args(parser: argparse.ArgumentParser, *, ckpt_every: int = 100, keep_last: int = 20) -> None:
    """Run directory, resume, checkpoint cadence, logging, seed, precision, backend."""
    group = parser.add_argument_group("run")
    group.add_argument("--output_dir", type=Path, required=True,
                       help="run directory (the launchers name it by the run-name convention); holds "
                            "train_config.json, train_log.jsonl, checkpoints")
    group.add_argument("--resume", type=Path, default=None,
                       help="training_latest.pt to resume from (model, optimizer, schedule, steps, data position, "
                            "RNG); a missing file is an error")
    group.add_argument("--ckpt_every", type=int, default=ckpt_every,
                       help="write predictor_step_XXXXX.safetensors + training_latest.pt every N optimizer steps "
                            "(and always at the last step); -1 = last step only")
    group.add_argument("--keep_last", type=int, default=keep_last,
                       help="predictor_step_*.safetensors files kept (oldest pruned); -1 = keep all")
    group.add_argument("--log_every", type=int, default=1, help="write a train_log.jsonl record every N steps")
    group.add_argument("--seed", type=int, default=0, help="seed of the data order and the per-rank RNG streams")
    group.add_argument("--precision", choices=PRECISIONS, default="fp32master",
                       help="fp32master: BF16 frozen Teacher, FP32 trainable weights and AdamW state, BF16 autocast; "
                            "fp32: everything FP32 (CPU demo, exact tests)")
    group.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="process-group backend: auto = nccl with CUDA, gloo without")
    group.add_argument("--no_progress", action="store_true", help="no tqdm progress bar")


def add_tracker_args(parser: argparse.ArgumentParser, *, project: str = "hy-predictor") -> None:
    """--tracker, --swanlab_project, --swanlab_mode, --experiment_name."""
    group = parser.add_argument_group("tracking")
    group.add_argument("--tracker", choices=TRACKERS, default="none",
                       help="swanlab: mirror train_log.jsonl to SwanLab from rank 0 (SWANLAB_API_KEY only from the "
                            "environment or SwanLab's login cache)")
    group.add_argument("--swanlab_project", type=str, default=project, help="SwanLab project")
    group.add_argument("--swanlab_mode", choices=("cloud", "offline", "local", "disabled"), default=None,
                       help="SwanLab mode; default $SWANLAB_MODE, else cloud")
    group.add_argument("--experiment_name", type=str, default=None,
                       help="SwanLab experiment name; default: the run directory's name")


def check_common_args(args: argparse.Namespace) -> None:
    """Cross-flag rules of the groups above (only those present on `args`); ValueError naming flag and value."""
    problems = []

    def need(flag: str, ok: bool, expected: str) -> None:
        if not ok:
            problems.append(f"--{flag}={getattr(args, flag)!r}: expected {expected}")

    present = vars(args)
    if "fusion_lr" in present:
        need("fusion_lr", args.fusion_lr > 0, "> 0")
        need("blocks_lr", args.blocks_lr > 0, "> 0")
        need("max_steps", args.max_steps >= 1, ">= 1")
        need("scheduler_warmup_steps", 0 <= args.scheduler_warmup_steps < args.max_steps,
             f"in [0, max_steps={args.max_steps})")
        need("block_warmup_steps", args.block_warmup_steps == -1 or 0 <= args.block_warmup_steps < args.max_steps,
             f"-1 or in [0, max_steps={args.max_steps})")
        need("stop_at_step", args.stop_at_step == -1 or 1 <= args.stop_at_step <= args.max_steps,
             f"-1 or in [1, max_steps={args.max_steps}]")
        need("batch_size", args.batch_size >= 1, ">= 1")
        need("grad_accum", args.grad_accum >= 1, ">= 1")
        need("weight_decay", args.weight_decay >= 0, ">= 0")
        need("adam_beta1", 0 <= args.adam_beta1 < 1, "in [0, 1)")
        need("adam_beta2", 0 <= args.adam_beta2 < 1, "in [0, 1)")
        need("grad_clip", args.grad_clip == -1 or args.grad_clip > 0, "> 0, or -1 for no clipping")
    if "ckpt_every" in present:
        need("ckpt_every", args.ckpt_every == -1 or args.ckpt_every >= 1, ">= 1, or -1 for the last step only")
        need("keep_last", args.keep_last == -1 or args.keep_last >= 1, ">= 1, or -1 to keep all")
        need("log_every", args.log_every >= 1, ">= 1")
        need("seed", args.seed >= 0, ">= 0")
        if args.resume is not None and not args.resume.is_file():
            problems.append(f"--resume={str(args.resume)!r}: no such file (refusing to start from scratch instead)")
    if "num_workers" in present:
        need("num_workers", args.num_workers >= 0, ">= 0")
        if not (args.dataset_root / DATASET_CONFIG_NAME).is_file():
            problems.append(f"--dataset_root={str(args.dataset_root)!r}: no {DATASET_CONFIG_NAME} there "
                            "(build it with tools/build_predictor_dataset.py)")
    if "action_ckpt" in present and args.action_ckpt is not None and not args.action_ckpt.is_file():
        problems.append(f"--action_ckpt={str(args.action_ckpt)!r}: no such file")
    if "teacher" in present and args.teacher is not None and not (args.teacher / "config.json").is_file():
        problems.append(f"--teacher={str(args.teacher)!r}: no config.json in that folder")
    if problems:
        raise ValueError("invalid arguments: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------------------------
# 3. Precision
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrecisionPolicy:
    """name: "fp32master" | "fp32"; frozen_dtype: dtype of the frozen Teacher weights; autocast_dtype: the forward's
    autocast dtype (None = no autocast). Trainable weights are always FP32 (`build_optimizer` checks)."""

    name: str
    frozen_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    device: torch.device

    def autocast(self):
        """Context for the forward passes (a null context in "fp32")."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def describe(self) -> str:
        """e.g. "fp32master (frozen bfloat16, trainable float32, autocast bfloat16)"."""
        def name(dtype: torch.dtype) -> str:
            return str(dtype).removeprefix("torch.")

        autocast = "no autocast" if self.autocast_dtype is None else f"autocast {name(self.autocast_dtype)}"
        return f"{self.name} (frozen {name(self.frozen_dtype)}, trainable float32, {autocast})"


def precision_policy(name: str, device: torch.device) -> PrecisionPolicy:
    """The dtypes of a `--precision` mode on `device` (BF16 autocast also runs on the CPU, slowly)."""
    if name == "fp32master":
        return PrecisionPolicy(name, torch.bfloat16, torch.bfloat16, device)
    if name == "fp32":
        return PrecisionPolicy(name, torch.float32, None, device)
    raise ValueError(f"--precision={name!r}: expected one of {PRECISIONS}")


# ---------------------------------------------------------------------------------------------------------------
# 4. Teacher
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TeacherSource:
    """Where the Teacher comes from. folder: transformer folder; action_ckpt: strict overlay or None;
    origin: human-readable reason (a flag or the dataset config); expected_config_sha256: the dataset's record of
    the Teacher config (None when there is no dataset to compare with)."""

    folder: Path
    action_ckpt: Path | None
    origin: str
    expected_config_sha256: str | None


def read_dataset_teacher(dataset_root: Path) -> dict:
    """The `teacher` record of `dataset_root/dataset_config.json` (folder, config_sha256, action_ckpt, ...)."""
    path = Path(dataset_root) / DATASET_CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no dataset config (build the dataset with tools/build_predictor_dataset.py)")
    config = json.loads(path.read_text(encoding="utf-8"))
    if "teacher" not in config:
        raise KeyError(f"{path}: missing field 'teacher' (folder, config_sha256, action_ckpt)")
    teacher = config["teacher"]
    for field in ("folder", "config_sha256", "action_ckpt"):
        if field not in teacher:
            raise KeyError(f"{path}: missing field 'teacher.{field}'")
    return teacher


def resolve_teacher_source(
    teacher: Path | None, action_ckpt: Path | None, dataset_root: Path | None
) -> TeacherSource:
    """--teacher given: that folder (+ --action_ckpt if given). Else the dataset's recorded folder and action
    checkpoint (an explicit --action_ckpt replaces the recorded one). With a dataset, its config hash is kept so
    `load_teacher` can refuse a Teacher of another architecture than the one that made the data."""
    record = None if dataset_root is None else read_dataset_teacher(dataset_root)
    expected_sha = None if record is None else record["config_sha256"]
    if teacher is not None:
        return TeacherSource(Path(teacher), action_ckpt, "--teacher", expected_sha)
    if record is None:
        raise ValueError("no Teacher: pass --teacher DIR (or a --dataset_root whose dataset_config.json records one)")
    where = Path(dataset_root) / DATASET_CONFIG_NAME
    folder = Path(record["folder"])
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{where}: teacher.folder={str(folder)!r} has no config.json; pass --teacher DIR")
    if action_ckpt is None and record["action_ckpt"] is not None:
        action_ckpt = Path(record["action_ckpt"])
        if not action_ckpt.is_file():
            raise FileNotFoundError(f"{where}: teacher.action_ckpt={str(action_ckpt)!r} does not exist; "
                                    "pass --action_ckpt FILE")
    return TeacherSource(folder, action_ckpt, f"teacher.folder of {where}", expected_sha)


def teacher_config_sha256(teacher: WorldPlayTransformer) -> str:
    """sha256 of the Teacher's constructor arguments as one canonical JSON line (the dataset builder's record)."""
    constructor_args = WorldPlayTransformer.constructor_arguments(teacher.config, source="the loaded Teacher")
    return sha256_json(constructor_args)


def load_teacher_weights(source: TeacherSource, device: torch.device, dtype: torch.dtype) -> WorldPlayTransformer:
    """Load (strict), overlay the action checkpoint (strict), check the config against the dataset's record, move to
    `device`; returns the Teacher in eval mode with `requires_grad=False` everywhere."""
    teacher = WorldPlayTransformer.from_pretrained(str(source.folder), torch_dtype=dtype)
    if source.action_ckpt is not None:
        WorldPlayTransformer.load_action_checkpoint(source.action_ckpt, teacher)
    if source.expected_config_sha256 is not None:
        actual = teacher_config_sha256(teacher)
        if actual != source.expected_config_sha256:
            raise ValueError(
                f"Teacher {source.folder} ({source.origin}) has config sha256 {actual[:12]}..., but the dataset was "
                f"built by a Teacher with config sha256 {source.expected_config_sha256[:12]}...; use the same Teacher"
            )
    return teacher.to(device=device).eval().requires_grad_(False)


def load_teacher(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype | None = None
) -> WorldPlayTransformer:
    """The Teacher of a run, from `args.teacher`, `args.action_ckpt` and `args.dataset_root` (any may be None).

    dtype: the frozen weights' dtype; default from `args.precision` (BF16 for "fp32master", FP32 for "fp32").
    Logs (rank 0) where it came from. Raises when no Teacher is named, a file is missing, or its config differs
    from the one recorded in the dataset.
    """
    if dtype is None:
        dtype = precision_policy(args.precision, device).frozen_dtype
    source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
    teacher = load_teacher_weights(source, device, dtype)
    overlay = "" if source.action_ckpt is None else f" + action checkpoint {source.action_ckpt}"
    log0(f"teacher: {source.folder}{overlay} (from {source.origin}); {teacher.num_layers} double blocks, hidden "
         f"{teacher.config.hidden_size}, {str(dtype).removeprefix('torch.')} on {device}")
    return teacher


# ---------------------------------------------------------------------------------------------------------------
# 5. Optimizer, schedule, checkpoint identity
# ---------------------------------------------------------------------------------------------------------------
def build_optimizer_and_schedule(predictor, args: argparse.Namespace):
    """AdamW over `predictor.trainable_parameter_groups()` (fusion / blocks) and the two-group warmup + cosine
    schedule, from --fusion_lr, --blocks_lr, --adam_beta1/2, --weight_decay, --scheduler_warmup_steps,
    --max_steps, --block_warmup_steps. Returns (optimizer, lr_schedule)."""
    optimizer = build_optimizer(
        predictor.trainable_parameter_groups(),
        {FUSION_GROUP: args.fusion_lr, BLOCKS_GROUP: args.blocks_lr},
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay,
    )
    lr_schedule = TwoGroupLRSchedule(
        optimizer,
        warmup_steps=args.scheduler_warmup_steps,
        max_steps=args.max_steps,
        block_warmup_steps=args.block_warmup_steps,
    )
    return optimizer, lr_schedule


def checkpoint_meta(variant: str, source_blocks: Sequence[int], precision: str) -> dict:
    """What identifies a run's checkpoints; saved as `meta` and required back on resume (the `expect` dict): a
    checkpoint of another variant, other source blocks or another precision mode is refused."""
    return {"variant": variant, "source_blocks": [int(block) for block in source_blocks], "precision": precision}


# ---------------------------------------------------------------------------------------------------------------
# 6. Run directory, train_config.json, summary
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchLayout:
    """per_rank: micro-batch on one rank; world_size: ranks; grad_accum: micro-batches per optimizer step."""

    per_rank: int
    world_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.per_rank * self.world_size * self.grad_accum


def prepare_run_dir(output_dir: Path, resume: Path | None, env: DistEnv) -> Path:
    """Create the run directory (rank 0). A directory that already holds a training_latest.pt is only reused with
    --resume, so a new run never overwrites another run's checkpoints."""
    run_dir = Path(output_dir)
    existing = run_dir / "training_latest.pt"
    if resume is None and existing.is_file():
        raise FileExistsError(
            f"--output_dir {run_dir} already holds {existing.name}; pass --resume {existing} to continue it, or "
            "choose a new --output_dir"
        )
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _plain(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


def run_config(args: argparse.Namespace, *, variant: str, env: DistEnv, layout: BatchLayout, **derived) -> dict:
    """The run's config as plain JSON data: every flag (paths as strings, pairs as lists), then the derived values
    (variant, world size, per-rank / global batch, device, plus `derived`, e.g. the Predictor config)."""
    config = {"flags": _plain(vars(args))}
    config["derived"] = _plain({
        "variant": variant,
        "world_size": env.world_size,
        "device": str(env.device),
        "backend": env.backend,
        "batch_per_rank": layout.per_rank,
        "grad_accum": layout.grad_accum,
        "global_batch": layout.global_batch,
        **derived,
    })
    return redact_secrets(config)


def write_train_config(run_dir: Path, config: dict, env: DistEnv) -> None:
    """`run_dir/train_config.json`, atomically, on rank 0 (rewritten on resume: it describes this invocation)."""
    if env.is_main:
        write_json_atomic(Path(run_dir) / TRAIN_CONFIG_NAME, config)


def startup_summary(
    *,
    title: str,
    optimizer: torch.optim.Optimizer,
    layout: BatchLayout,
    max_steps: int,
    stop_step: int,
    resume_step: int,
    extra: dict[str, str],
) -> str:
    """The block printed before the first step: trainable parameters per group, per-rank / global batch,
    accumulation, total steps and the resume step, then `extra` rows (label -> text)."""
    groups = {group["name"]: sum(param.numel() for param in group["params"]) for group in optimizer.param_groups}
    rows = {
        "trainable params": " | ".join(f"{name} {count:,}" for name, count in groups.items())
        + f" | total {sum(groups.values()):,}",
        "batch": f"{layout.per_rank} per rank x {layout.world_size} ranks x {layout.grad_accum} accumulation = "
                 f"{layout.global_batch} global",
        "steps": f"{max_steps} in the schedule; this run {resume_step + 1}..{stop_step}",
        "resume step": str(resume_step) if resume_step else "0 (fresh start)",
        **extra,
    }
    width = max(len(label) for label in rows)
    lines = [f"==== {title} ===="] + [f"  {label.ljust(width)}  {text}" for label, text in rows.items()]
    return "\n".join(lines)


def log_block(text: str) -> None:
    """Log a multi-line block on rank 0, one timestamped line each."""
    for line in text.splitlines():
        log0(line)


def experiment_name(args: argparse.Namespace, run_dir: Path) -> str:
    """--experiment_name, else the run directory's name (which carries the full run name)."""
    return args.experiment_name or Path(run_dir).resolve().name


def environment_summary() -> dict[str, str]:
    """torch version and CUDA devices, for train_config.json."""
    return {
        "torch": torch.__version__,
        "cuda_devices": str(torch.cuda.device_count() if torch.cuda.is_available() else 0),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
    }


# ---------------------------------------------------------------------------------------------------------------
# 7. The run around the recipe: start, then resume, summary and the loop
# ---------------------------------------------------------------------------------------------------------------
def start_run(args: argparse.Namespace, env: DistEnv) -> tuple[Path, PrecisionPolicy]:
    """First step of every recipe after `init_distributed`: the run directory (`prepare_run_dir`), the per-rank
    seed, and the `--precision` policy on this rank's device. Returns (run_dir, policy)."""
    run_dir = prepare_run_dir(args.output_dir, args.resume, env)
    seed_everything(args.seed, rank=env.rank)
    return run_dir, precision_policy(args.precision, env.device)


def resume_and_train(
    args: argparse.Namespace,
    *,
    env: DistEnv,
    run_dir: Path,
    policy: PrecisionPolicy,
    predictor: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_schedule,
    batches: ResumableBatches,
    layout: BatchLayout,
    config: dict,
    meta: dict,
    title: str,
    model_rows: dict[str, str],
    data_row: str,
    make_step_fn: Callable[[nn.Module], Callable[..., dict[str, float]]],
    extra_step_check: Callable[[int, dict[str, float]], None] | None = None,
) -> RunState:
    """What every recipe does once its data, Predictor, optimizer and schedule exist; returns the final RunState.

    1. --resume: model, optimizer, schedule and data position from the training state (`meta` must match);
    2. train_config.json (rank 0) and the startup summary: run dir, `model_rows`, precision, `data_row`, schedule,
       checkpoints, tracker;
    3. the DDP wrapper, the metrics logger (closed on success and on error) and `train_loop` with the step function
       `make_step_fn(ddp_model)`.
    """
    # 1. Resume.
    run_state = RunState()
    if args.resume is not None:
        run_state = load_training_state(args.resume, model=predictor, optimizer=optimizer, lr_schedule=lr_schedule,
                                        expect=meta)
        batches.load_state_dict(run_state.data)
        log0(f"resumed from {args.resume} at step {run_state.global_step} (epoch {run_state.epoch})")

    # 2. Config file, summary.
    write_train_config(run_dir, config, env)
    stop_step = args.max_steps if args.stop_at_step == -1 else args.stop_at_step
    log_block(startup_summary(
        title=title, optimizer=optimizer, layout=layout, max_steps=args.max_steps, stop_step=stop_step,
        resume_step=run_state.global_step,
        extra={
            "run dir": str(run_dir),
            **model_rows,
            "precision": policy.describe(),
            "data": data_row,
            "schedule": f"lr fusion {args.fusion_lr:g}, blocks {args.blocks_lr:g}; warmup "
                        f"{args.scheduler_warmup_steps}, block warmup {args.block_warmup_steps}, cosine to 0",
            "checkpoints": f"every {args.ckpt_every} steps, keep {args.keep_last}",
            "tracker": args.tracker,
        },
    ))

    # 3. Train.
    model = wrap_ddp(predictor, env)
    metrics_logger = MetricsLogger(run_dir, env, tracker=args.tracker, project=args.swanlab_project,
                                   experiment=experiment_name(args, run_dir), config=config,
                                   swanlab_mode=args.swanlab_mode)
    try:
        return train_loop(
            ddp_model=model, raw_model=predictor, optimizer=optimizer, lr_schedule=lr_schedule, batches=batches,
            step_fn=make_step_fn(model), run_dir=run_dir, env=env, run_state=run_state, max_steps=args.max_steps,
            grad_accum=args.grad_accum, grad_clip=args.grad_clip, ckpt_every=args.ckpt_every,
            keep_last=args.keep_last, log_every=args.log_every, metrics_logger=metrics_logger, config=config,
            meta=meta, progress=not args.no_progress, extra_step_check=extra_step_check, stop_at_step=stop_step,
        )
    finally:
        metrics_logger.close()
