"""The resolved inputs of one evaluation (`EvalSettings`) and how the flags of tools/eval_predictor.py (and
tools/leaderboard.py) become them: the checkpoints read and labelled, the schedule checked against them, the dtypes
chosen, and the Teacher resolved and checked against what the checkpoints' training recorded (config and weights
hashes)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from predictor_training.data.dataset_config import resolve_teacher_source
from predictor_training.eval.methods import EXACT_CONTEXT, PredictorCheckpoint, parse_context_modes
from predictor_training.eval.predictor_checkpoints import label_checkpoints, read_predictor_checkpoint
from predictor_training.rollout.schedule import StepPlan
from predictor_training.runtime.checkpoint import check_weights_file
from predictor_training.runtime.distributed import log0
from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.provenance import (
    describe_provenance,
    file_sha256,
    recorded_provenance,
    weight_files,
    weights_sha256,
)
from predictor_training.teacher.source import TeacherSource

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}  # --dtype / --vae_dtype
PRECISION_DTYPES = {"fp32master": torch.bfloat16, "fp32": torch.float32}  # checkpoint precision -> --dtype auto


@dataclass
class EvalSettings:
    """Resolved inputs of one evaluation (`resolve_eval_settings` builds it from tools/eval_predictor.py's flags)."""

    teacher_source: TeacherSource
    vae: Path
    sample_table: Path
    split: str
    case_source: str  # "encoded" | "dataset"
    case_root: Path  # encoded dir or dataset root
    num_latents: int
    checkpoints: list[Path]
    # What the Predictors run (F-P-P-P; with --reuse_steps e.g. F-R-R-P); the reuse baselines replace every step
    # of it that is not Full (`baseline_plan`).
    plan: StepPlan
    dtype: torch.dtype
    vae_dtype: torch.dtype
    output_root: Path
    context_modes: tuple[str, ...] = (EXACT_CONTEXT,)  # parse_context_modes: exact first, then the others
    run_name: str | None = None
    max_videos: int | None = None
    num_side_by_side: int = 2
    side_by_side_scale: int = 0  # 0 = auto (reports.side_by_side_scale_for)
    fps: float = 24.0
    ground_truth: Path | None = None  # folder of <key>/ (PNG frames) or <key>.mp4, one per row
    lpips_alexnet: Path | None = None
    lpips_random_backbone: bool = False
    warmup_chunks: int = 2
    vae_tiling: bool = False
    progress: bool = True
    seeds: int = 1  # every video under this many noise seeds (`seed_for`); 1 = the sample table's seed alone
    timing_repeats: int = 1  # rollouts timed per method and video (EvalRuntime.timing_repeats); 1 = the scored one
    timing_statistic: str = "median"  # of the repeated rollout times: median | min
    revisit_sheets: bool = True  # a revisit_sheet/<key>.png for every row whose path revisits a camera
    extra: dict = field(default_factory=dict)


def check_schedule_fits(checkpoints: Sequence[PredictorCheckpoint], plan: StepPlan) -> None:
    """A v4 Predictor needs the previous chunk's hidden and context K/V: refuse replaced steps in chunk 0 for it."""
    if not plan.chunk0_full and plan.replaced_steps:
        v4 = [ckpt.label for ckpt in checkpoints if ckpt.variant == "v4"]
        if v4:
            raise UserInputError(f"checkpoints {v4} are v4 Predictors: they need the previous chunk's hidden and context "
                             "K/V, which chunk 0 does not have; keep chunk 0 F-F-F-F (--chunk0 full)")


def resolve_dtype(choice: str, checkpoint_meta: Sequence[dict], device: torch.device) -> tuple[torch.dtype, str]:
    """--dtype: a named dtype as given; "auto" = the checkpoints' training precision (fp32master -> bfloat16,
    fp32 -> float32), and without checkpoints bfloat16 on a CUDA device, float32 on any other. Returns (dtype, the
    reason, for the log)."""
    if choice != "auto":
        return DTYPES[choice], f"--dtype {choice}"
    precisions = sorted({meta["precision"] for meta in checkpoint_meta})
    if len(precisions) > 1:
        raise UserInputError(f"the checkpoints were trained with precisions {precisions}; choose --dtype")
    if precisions:
        if precisions[0] not in PRECISION_DTYPES:
            raise UserInputError(f"checkpoint precision {precisions[0]!r} unknown; choose --dtype")
        return PRECISION_DTYPES[precisions[0]], f"--dtype auto: the checkpoints' training precision {precisions[0]}"
    if device.type == "cuda":
        return torch.bfloat16, "--dtype auto without checkpoints: bfloat16 on CUDA"
    return torch.float32, f"--dtype auto without checkpoints: float32 on {device.type}"


def recorded_teacher_config_sha256(ckpt: PredictorCheckpoint, teacher: Path, action_ckpt: Path | None) -> str | None:
    """The Teacher config sha256 that `ckpt`'s training checked its Teacher against: its provenance's
    `teacher_config_sha256` when it records one, else the `teacher.config_sha256` of the dataset its run trained on
    (`flags.dataset_root` -> dataset_config.json). None when neither is recorded (runs on the light sample table);
    also None, with a warning, when that dataset's config cannot be read here (e.g. the dataset is not mounted on
    this machine)."""
    provenance = recorded_provenance(ckpt.meta)
    if provenance is not None and provenance["teacher_config_sha256"] is not None:
        return provenance["teacher_config_sha256"]
    dataset_root = ckpt.run_flags.get("dataset_root")
    if dataset_root is None:
        return None
    try:
        return resolve_teacher_source(teacher, action_ckpt, Path(dataset_root)).expected_config_sha256
    except (FileNotFoundError, KeyError) as error:
        log0(f"WARNING: {ckpt.path}: {describe_provenance(provenance)}, and the Teacher config recorded by its "
             f"training dataset cannot be read ({error}); the Teacher {teacher} is not checked against it")
        return None


def check_teacher_by_hash(source: TeacherSource, checkpoints: Sequence[PredictorCheckpoint]) -> None:
    """The Teacher's weights against each checkpoint's provenance (runtime/provenance.py): a checkpoint that
    records `teacher_sha256` must have been trained on exactly the weights in `source` (and on the action checkpoint
    it records, or none), else UserInputError naming both hashes and files. A checkpoint without it keeps the
    config check (`recorded_teacher_config_sha256`, `load_teacher`); one line per checkpoint says which applies."""
    actual = None
    for ckpt in checkpoints:
        provenance = recorded_provenance(ckpt.meta)
        if provenance is None or provenance["teacher_sha256"] is None:
            log0(f"{ckpt.label}: {describe_provenance(provenance)}; its Teacher is checked by config only")
            continue
        recorded, name = provenance["teacher_sha256"], provenance["names"]["teacher"]
        if not Path(source.folder).exists():
            raise MissingFileError(f"Teacher {source.folder} ({source.origin}): no such folder; pass --teacher with "
                                   f"the Teacher {ckpt.path} was trained on (weights sha256 {recorded}, {name})")
        if actual is None:
            actual = weights_sha256(source.folder)
        if actual != recorded:
            files = ", ".join(str(file) for file in weight_files(source.folder))
            raise UserInputError(f"--ckpt {ckpt.path}: trained on the Teacher whose weights have sha256 {recorded} "
                                 f"({name}), but the Teacher {source.folder} ({source.origin}) has {actual} ({files}); "
                                 "pass --teacher with the Teacher it was trained on")
        recorded_action = provenance["teacher_action_ckpt_sha256"]
        actual_action = None if source.action_ckpt is None else file_sha256(source.action_ckpt)
        if actual_action != recorded_action:
            raise UserInputError(f"--ckpt {ckpt.path}: trained with Teacher action checkpoint sha256 "
                                 f"{recorded_action}, but this eval loads {source.action_ckpt} (sha256 "
                                 f"{actual_action}); pass --action_ckpt with the one it was trained with")
        log0(f"{ckpt.label}: Teacher checked by hash (weights sha256 {actual[:12]}... as its provenance records); "
             f"{describe_provenance(provenance)}")


def resolve_teacher(teacher: Path | None, action_ckpt: Path | None, origin: str,
                    checkpoints: Sequence[PredictorCheckpoint]) -> TeacherSource:
    """An explicit Teacher (`origin`: "--teacher" or "--demo"), else the Teacher every checkpoint's run recorded (they
    must agree). An explicit Teacher gets the check training made: its config must match the Teacher config recorded
    by the checkpoints' provenance or training datasets (see `recorded_teacher_config_sha256`; unchecked when none
    records one). Either Teacher is then checked by hash where a checkpoint's provenance records its weights
    (`check_teacher_by_hash`)."""
    if teacher is not None:
        recorded: dict[str, list[str]] = defaultdict(list)
        for ckpt in checkpoints:
            sha = recorded_teacher_config_sha256(ckpt, Path(teacher), action_ckpt)
            if sha is not None:
                recorded[sha].append(ckpt.label)
        if len(recorded) > 1:
            groups = "; ".join(f"{sha[:12]}...: {labels}" for sha, labels in recorded.items())
            raise UserInputError(f"the checkpoints were trained on datasets made by Teachers of different configs "
                             f"({groups}); evaluate them in separate runs")
        source = TeacherSource(Path(teacher), action_ckpt, origin, next(iter(recorded), None))
        check_teacher_by_hash(source, checkpoints)
        return source
    if not checkpoints:
        raise UserInputError("no Teacher: pass --teacher DIR (or --demo D, or a --ckpt whose run records its Teacher)")
    sources = []
    for ckpt in checkpoints:
        flags = ckpt.run_flags
        dataset_root = flags.get("dataset_root")  # runs on the light sample table have none
        sources.append(resolve_teacher_source(
            None if flags.get("teacher") is None else Path(flags["teacher"]),
            None if flags.get("action_ckpt") is None else Path(flags["action_ckpt"]),
            None if dataset_root is None else Path(dataset_root),
        ))
    folders = {(str(source.folder), str(source.action_ckpt)) for source in sources}
    if len(folders) != 1:
        raise UserInputError(f"the checkpoints were trained on different Teachers {sorted(folders)}; pass --teacher")
    check_teacher_by_hash(sources[0], checkpoints)
    return sources[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The flags of tools/eval_predictor.py (and tools/leaderboard.py) that `resolve_eval_settings` takes by name.
EVAL_FLAGS = ("ckpt", "plan", "dtype", "vae_dtype", "demo", "teacher", "action_ckpt", "vae", "sample_table",
              "split", "encoded", "dataset_root", "num_latents", "context_modes", "output_root", "run_name",
              "max_videos", "num_side_by_side", "side_by_side_scale", "fps", "ground_truth", "lpips_alexnet",
              "lpips_random_backbone", "warmup_chunks", "vae_tiling", "no_progress")


def resolve_eval_settings(*, ckpt: Sequence[Path], plan: StepPlan, dtype: str, vae_dtype: str, demo: Path | None,
                          teacher: Path | None, action_ckpt: Path | None, vae: Path, sample_table: Path, split: str,
                          encoded: Path | None, dataset_root: Path | None, num_latents: int,
                          context_modes: str | Sequence[str], output_root: Path, run_name: str | None,
                          max_videos: int | None, num_side_by_side: int, side_by_side_scale: int, fps: float,
                          ground_truth: Path | None, lpips_alexnet: Path | None, lpips_random_backbone: bool,
                          warmup_chunks: int, vae_tiling: bool, no_progress: bool, argv: Sequence[str],
                          device: torch.device) -> EvalSettings:
    """`EvalSettings` from the flags of tools/eval_predictor.py (`EVAL_FLAGS`, by name), after its own checks
    (--demo expanded into teacher, vae, samples_dir and encoded; `sample_table` and `plan` set). Reads the
    checkpoints' metadata (Teacher, dtype, labels) and logs the chosen dtypes first. A problem with the flags is a
    `UserInputError` (the tool's one-line error); anything else is a bug."""
    checkpoints = label_checkpoints([read_predictor_checkpoint(path) for path in ckpt])
    for checkpoint in checkpoints:  # readable, finite, its checksum: refused before the eval directory exists
        check_weights_file(checkpoint.path)
    check_schedule_fits(checkpoints, plan)
    eval_dtype, dtype_reason = resolve_dtype(dtype, [ckpt.meta for ckpt in checkpoints], device)
    if vae_dtype == "auto":
        eval_vae_dtype, vae_reason = eval_dtype, "--vae_dtype auto = --dtype"
    else:
        eval_vae_dtype, vae_reason = DTYPES[vae_dtype], f"--vae_dtype {vae_dtype}"
    log0(f"eval dtype {_dtype_name(eval_dtype)} ({dtype_reason}); VAE dtype {_dtype_name(eval_vae_dtype)} "
         f"({vae_reason})")
    return EvalSettings(
        teacher_source=resolve_teacher(teacher, action_ckpt, "--demo" if demo else "--teacher", checkpoints),
        vae=vae,
        sample_table=sample_table,
        split=split,
        case_source="encoded" if encoded is not None else "dataset",
        case_root=encoded if encoded is not None else dataset_root,
        num_latents=num_latents,
        checkpoints=list(ckpt),
        plan=plan,
        context_modes=parse_context_modes(context_modes),
        dtype=eval_dtype,
        vae_dtype=eval_vae_dtype,
        output_root=output_root,
        run_name=run_name,
        max_videos=max_videos,
        num_side_by_side=num_side_by_side,
        side_by_side_scale=side_by_side_scale,
        fps=fps,
        ground_truth=ground_truth,
        lpips_alexnet=lpips_alexnet,
        lpips_random_backbone=lpips_random_backbone,
        warmup_chunks=warmup_chunks,
        vae_tiling=vae_tiling,
        progress=not no_progress,
        extra={"argv": list(argv)},
    )
