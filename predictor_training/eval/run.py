"""One evaluation run: Predictor checkpoints, settings (from the flags of tools/eval_predictor.py), the
fingerprint that guards resume, sharding over ranks, gathering and the reports (see the package docstring).

Files of the run directory `<output_root>/<run_name>` written here: eval_config.json (settings and the fingerprint
of everything that changes the numbers), videos/<case>__a<action>.json (one per finished video, the unit of
resume), side_by_side/*.mp4, revisit_sheet/*.png (every row whose path revisits a camera), and, on rank 0, the reports of `reports.write_reports`. With `--ground_truth` every
row's ground-truth video is located before anything runs, and the results and reports carry the scores against it.
With `--context_modes` other than exact, the reference and every Predictor also run in each other mode
(`methods.add_context_modes`: `reference@M`, `predictor_<ckpt>@M`), scored and timed against the exact reference.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.checkpoint import check_weights_file, load_model_weights, read_training_state
from predictor_training.runtime.inference_weights import read_inference_config, read_inference_metadata
from predictor_training.runtime.errors import MissingFieldError, MissingFileError, UserInputError
from predictor_training.runtime.io import read_json_file, sha256_file, sha256_json
from predictor_training.runtime.provenance import (
    describe_provenance,
    expand_run_dir,
    file_sha256,
    recorded_provenance,
    weight_files,
    weights_sha256,
    with_provenance,
)
from predictor_training.runtime.distributed import DistEnv, all_gather_objects, barrier, log0
from predictor_training.eval.methods import (
    PredictorCheckpoint,
    EXACT_CONTEXT,
    REFERENCE,
    REPEAT_FIRST_FRAME,
    HiddenReuse,
    Method,
    PlannedMethod,
    PredictorMethod,
    ReferenceMethod,
    VelocityReuse,
    add_context_modes,
    context_mode_name,
    parse_context_modes,
)
from predictor_training.rollout.schedule import StepPlan
from predictor_training.eval.reports import (
    aggregate_ground_truth,
    aggregate_results,
    read_video_result,
    write_reports,
    write_revisit_sheet,
    write_side_by_side,
)
from predictor_training.eval.revisits import aggregate_revisits
from predictor_training.eval.runtime import RESULT_VERSION, EvalRuntime
from predictor_training.video.vae_decoder import VaeDecoder
from predictor_training.video.ground_truth import find_ground_truth_videos, video_key
from predictor_training.runtime.io import write_json_atomic
from predictor_training.predictor.model import Predictor, build_predictor_from_config
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import TeacherSource, load_teacher, teacher_config_sha256, teacher_depth
from predictor_training.data.dataset_config import resolve_teacher_source
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.video.metrics import LpipsScorer, jsonable, resolve_alexnet_weights

EVAL_CONFIG_NAME = "eval_config.json"
MAX_RUN_NAME_LENGTH = 255  # NAME_MAX of Linux file systems
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}  # --dtype / --vae_dtype
PRECISION_DTYPES = {"fp32master": torch.bfloat16, "fp32": torch.float32}  # checkpoint precision -> --dtype auto
_STEP_NAME = re.compile(r"^predictor_step_(\d+)\.safetensors$")


# =============================================================================================================
# 1. Predictor checkpoints
# =============================================================================================================
def read_predictor_checkpoint(path: str | Path) -> PredictorCheckpoint:
    """Read a checkpoint's metadata and saved run config (no weights). Errors name the file and the field. The
    config's `$RUN_DIR/...` paths (runtime/provenance.py) are made paths under the file's folder; a training
    state's provenance (`derived.provenance`) joins its meta, as an inference file's is there."""
    path = Path(path).resolve()
    if path.suffix == ".safetensors":
        meta = read_inference_metadata(path)
        config = expand_run_dir(read_inference_config(path), path.parent)
        if "step" not in meta:
            raise MissingFieldError(f"{path}: inference metadata has no 'step' (keys {sorted(meta)})")
        step = int(meta["step"])
        name_match = _STEP_NAME.match(path.name)
        if name_match and int(name_match.group(1)) != step:
            raise UserInputError(f"{path}: the file name says step {int(name_match.group(1))}, its metadata step {step}")
    elif path.suffix == ".pt":
        payload = read_training_state(path)
        meta, config = with_provenance(payload["meta"], payload["config"]), payload["config"]
        step = int(payload["run_state"]["global_step"])
    else:
        raise UserInputError(f"--ckpt {path}: expected predictor_step_XXXXX.safetensors or training_latest.pt")
    for key in ("derived", "flags"):
        if key not in config:
            raise MissingFieldError(f"{path}: the saved run config has no '{key}' section (expected train_config.json layout)")
    if "predictor" not in config["derived"]:
        raise MissingFieldError(f"{path}: the saved run config has no 'derived.predictor' (the Predictor's architecture)")
    predictor_config = dict(config["derived"]["predictor"])
    for key in ("variant", "source_blocks"):
        if key not in meta or key not in predictor_config:
            raise MissingFieldError(f"{path}: '{key}' is missing from the checkpoint meta or from derived.predictor")
        if predictor_config[key] != meta[key]:
            raise UserInputError(f"{path}: meta {key}={meta[key]!r} but derived.predictor {key}={predictor_config[key]!r}")
    return PredictorCheckpoint(path, path.parent.name, step, dict(meta), predictor_config, dict(config["flags"]))


def label_checkpoints(checkpoints: Sequence[PredictorCheckpoint]) -> list[PredictorCheckpoint]:
    """Give each checkpoint a unique label: `ckptstep<N>` when all come from one run, else `<run>_ckptstep<N>`."""
    single_run = len({ckpt.run_name for ckpt in checkpoints}) <= 1
    labelled = [
        replace(ckpt, label=f"ckptstep{ckpt.step}" if single_run else f"{ckpt.run_name}_ckptstep{ckpt.step}",
                panel=f"ckptstep{ckpt.step}" if single_run else f"#{position} ckptstep{ckpt.step}")
        for position, ckpt in enumerate(checkpoints, start=1)
    ]
    labels = [ckpt.label for ckpt in labelled]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise UserInputError(f"--ckpt: checkpoints {duplicates} are given twice (same run and step)")
    return labelled


def load_predictor(teacher: WorldPlayTransformer, ckpt: PredictorCheckpoint) -> Predictor:
    """Rebuild the checkpoint's Predictor on `teacher` from its saved config and load its weights (strict). A
    training state of several roles (adversarial: predictor + discriminator) gives its "predictor" role."""
    predictor = build_predictor_from_config(teacher, ckpt.predictor_config)
    load_model_weights(ckpt.path, predictor, expect={"variant": ckpt.meta["variant"],
                                                      "source_blocks": ckpt.meta["source_blocks"]},
                       role="predictor" if ckpt.path.suffix == ".pt" else None)
    return predictor.eval().requires_grad_(False)


def context_modes_tag(context_modes: Sequence[str]) -> str:
    """Run-name suffix of the context modes: '' for exact alone, else '_ctx-<mode>[+<mode>...]' (the modes other
    than exact, e.g. '_ctx-incremental+last_step')."""
    others = [mode for mode in parse_context_modes(context_modes) if mode != EXACT_CONTEXT]
    return f"_ctx-{'+'.join(others)}" if others else ""


def baseline_plan(plan: StepPlan) -> StepPlan:
    """What the reuse baselines replace: every step of `plan` that is not Full, written P (F-R-R-P -> F-P-P-P; the
    eval's schedule record and header name it so)."""
    return plan.with_letter("P")


def default_run_name(checkpoints: Sequence[PredictorCheckpoint], plan: StepPlan, split: str,
                     context_modes: Sequence[str] = (EXACT_CONTEXT,)) -> str:
    """`<train_run>_ckptstep<N>[+<M>...]_<schedule>_<split>` (runs joined by '__'); `reuse_<schedule>_<split>`
    without checkpoints; with context modes other than exact, `_ctx-<mode>[+<mode>...]` appended.

    A name that would pass `MAX_RUN_NAME_LENGTH` (two runs of the recipes' long names do) keeps its first run's
    part, cut to fit, and stands for the rest with `__and<K>more_<sha8>`: K more runs, the first 8 hex digits of
    the sha256 of the full name. The same checkpoints, schedule and split give the same name, so a rerun resumes."""
    tag, suffix = plan.tag, context_modes_tag(context_modes)
    if not checkpoints:
        return f"reuse_{tag}_{split}{suffix}"
    steps_by_run: dict[str, list[int]] = defaultdict(list)
    for ckpt in checkpoints:
        steps_by_run[ckpt.run_name].append(ckpt.step)
    runs = [f"{run}_ckptstep{'+'.join(str(step) for step in sorted(steps))}" for run, steps in steps_by_run.items()]
    tail = f"_{tag}_{split}{suffix}"
    name = f"{'__'.join(runs)}{tail}"
    if len(name) <= MAX_RUN_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode("utf-8")).hexdigest()[:8]
    stands_for = (f"__and{len(runs) - 1}more" if len(runs) > 1 else "") + f"_{digest}"
    return runs[0][: MAX_RUN_NAME_LENGTH - len(stands_for) - len(tail)] + stands_for + tail


# =============================================================================================================
# 2. Settings from the flags of tools/eval_predictor.py
# =============================================================================================================
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


# =============================================================================================================
# 3. The run: settings, fingerprint, sharding, resume, gathering
# =============================================================================================================
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


def rollout_config_for(dtype: torch.dtype) -> RolloutConfig:
    """bf16: the real pipeline (bf16 weights, bf16 autocast, bf16 running latents); fp32: exact."""
    return RolloutConfig(state_dtype=dtype, autocast_dtype=None if dtype == torch.float32 else dtype)


def schedule_record(plan: StepPlan) -> dict:
    """The fingerprint's "schedule": the steps the baselines replace (`baseline_plan`), as every eval recorded it."""
    baselines = baseline_plan(plan)
    return {"replace_steps": list(baselines.replaced_steps), "num_steps": baselines.num_steps,
            "chunk0_full": baselines.chunk0_full, "letters": baselines.pattern}


def settings_fingerprint(settings: EvalSettings, checkpoints: Sequence[PredictorCheckpoint], teacher_sha: str,
                         scorer: LpipsScorer, device: torch.device, rows: "MethodRows | None" = None
                         ) -> tuple[str, dict]:
    """sha256 of everything that changes a per-video result, and that record itself. The ground-truth folder
    (resolved) is part of it only when given, the context modes only when other than exact alone, the seeds only
    when more than one and the method rows only when given, so runs without them keep their fingerprint."""
    record = {
        "result_version": RESULT_VERSION,
        "teacher": {"folder": str(Path(settings.teacher_source.folder).resolve()),
                    "action_ckpt": None if settings.teacher_source.action_ckpt is None
                    else str(Path(settings.teacher_source.action_ckpt).resolve()),
                    "config_sha256": teacher_sha},
        "vae": str(Path(settings.vae).resolve()),
        "sample_table": str(Path(settings.sample_table).resolve()),
        "split": settings.split,
        "case_source": settings.case_source,
        "case_root": str(Path(settings.case_root).resolve()),
        "num_latents": settings.num_latents,
        "checkpoints": [{"path": str(ckpt.path), "label": ckpt.label, "sha256": sha256_file(ckpt.path)}
                        for ckpt in checkpoints],
        "schedule": schedule_record(settings.plan),
        "dtype": str(settings.dtype).removeprefix("torch."),
        "vae_dtype": str(settings.vae_dtype).removeprefix("torch."),
        "vae_tiling": settings.vae_tiling,
        "device_type": device.type,
        "lpips": {"metric_name": scorer.metric_name, "backbone_sha256": scorer.backbone_sha256,
                  "backbone_source": scorer.backbone_source},
    }
    if settings.ground_truth is not None:
        record["ground_truth"] = str(Path(settings.ground_truth).resolve())
    context_modes = parse_context_modes(settings.context_modes)
    if context_modes != (EXACT_CONTEXT,):
        record["context_modes"] = list(context_modes)
    if settings.seeds != 1:
        record["seeds"] = settings.seeds
    if settings.plan.reuse_steps:
        record["reuse_steps"] = list(settings.plan.reuse_steps)
    if settings.timing_repeats != 1:  # likewise: one timing per rollout keeps the fingerprint of older runs
        record["timing"] = {"repeats": settings.timing_repeats, "statistic": settings.timing_statistic}
    if rows is not None:
        record["rows"] = rows.record()
    return sha256_json(record), record


def check_or_write_eval_config(out_dir: Path, fingerprint: str, record: dict, settings: EvalSettings,
                               env: DistEnv) -> None:
    """A new run writes eval_config.json (rank 0); an existing one must have the same fingerprint, else every rank
    raises (nothing in the directory is touched)."""
    path = out_dir / EVAL_CONFIG_NAME
    if env.is_main and not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"fingerprint": fingerprint, "settings": record, "run": {
            "max_videos": settings.max_videos, "num_side_by_side": settings.num_side_by_side,
            "fps": settings.fps, **settings.extra}})
    barrier()
    check_eval_config(out_dir, fingerprint, record)


def check_eval_config(out_dir: Path, fingerprint: str, record: dict) -> None:
    """An existing eval_config.json must have this run's fingerprint (nothing is written; no file: nothing to
    check). A run checks it before it loads anything, and again once it is written."""
    path = out_dir / EVAL_CONFIG_NAME
    if not path.is_file():
        return
    saved = read_json_file(path)
    if not isinstance(saved, dict) or "fingerprint" not in saved or not isinstance(saved.get("settings"), dict):
        raise UserInputError(f"{path}: not an eval_config.json (no 'fingerprint' / 'settings'); expected the file an "
                             "eval wrote")
    if saved["fingerprint"] != fingerprint:
        changed = sorted(key for key in record.keys() | saved["settings"].keys()
                         if saved["settings"].get(key) != record.get(key))
        raise UserInputError(f"{path}: this eval directory was made with other settings (differences in {changed}); "
                         "use another --output_root / --run_name, or remove the directory")


def select_items(dataset: TrajectoryTableDataset, max_videos: int | None) -> list[int]:
    indices = list(range(len(dataset)))
    return indices if max_videos is None else indices[:max_videos]


def open_dataset(settings: EvalSettings, sample_table: Path | None = None) -> TrajectoryTableDataset:
    """The rows of `sample_table` (default: the evaluated split's) with the settings' case source."""
    table = settings.sample_table if sample_table is None else sample_table
    if settings.case_source == "encoded":
        return TrajectoryTableDataset(table, encoded_dir=settings.case_root, num_latents=settings.num_latents)
    return TrajectoryTableDataset(table, dataset_root=settings.case_root, num_latents=settings.num_latents)


def build_runtime(settings: EvalSettings, teacher: WorldPlayTransformer, methods: Sequence[Method],
                  dataset: TrajectoryTableDataset, device: torch.device, *, scorer: LpipsScorer | None = None,
                  decoder: bool = True) -> EvalRuntime:
    """The per-rank runtime of `methods` on `dataset` (no VAE decoder with decoder=False: rollouts only)."""
    return EvalRuntime(
        teacher=teacher, methods=list(methods), plan=settings.plan,
        rollout_config=rollout_config_for(settings.dtype),
        decoder=VaeDecoder.from_folder(settings.vae, device, settings.vae_dtype, settings.vae_tiling)
        if decoder else None,
        scorer=scorer, dataset=dataset, case_source=settings.case_source, device=device, state_dtype=settings.dtype,
        timing_repeats=settings.timing_repeats, timing_statistic=settings.timing_statistic,
    )


SEED_STRIDE = 100_003  # --seeds: seed j of a row is its table seed + j * SEED_STRIDE (j = 0: the table's own)


def seed_for(table_seed: int, seed_index: int) -> int:
    return int(table_seed) + seed_index * SEED_STRIDE


def unit_key(video: str, seed_index: int) -> str:
    """Result name of one (video, seed): the video key for seed 0, `<key>__s<j>` for the others."""
    return video if seed_index == 0 else f"{video}__s{seed_index}"


class MethodRows:
    """What an evaluation compares when it is not the classic set (reference, the two reuses, the Predictors at one
    schedule): the leaderboard's rows (eval/leaderboard.py). `record()` joins the fingerprint; `build(teacher,
    predictors)` returns the methods ({label: (Predictor, PredictorCheckpoint)} loaded once)."""

    def record(self) -> list:
        raise NotImplementedError

    def build(self, teacher: WorldPlayTransformer, predictors: dict) -> list[Method]:
        raise NotImplementedError

    def label(self, checkpoints: list[PredictorCheckpoint]) -> list[PredictorCheckpoint]:
        """The checkpoints relabelled as `build` names them (default: the labels of `label_checkpoints`)."""
        return checkpoints


def classic_methods(teacher: WorldPlayTransformer, predictors: dict, context_modes: Sequence[str],
                    plan: StepPlan | None = None) -> list[Method]:
    """reference, reuse_velocity, reuse_hidden, every Predictor; then the reference and the Predictors once more per
    context mode other than exact. `plan` (with --reuse_steps, e.g. F-R-R-P): each Predictor runs it, velocity
    reuse at its R steps."""
    methods: list[Method] = [ReferenceMethod(), VelocityReuse(), HiddenReuse(teacher)]
    for predictor, ckpt in predictors.values():
        method = PredictorMethod(predictor, ckpt)
        if plan is not None:
            method = PlannedMethod(method.name, plan, {"R": VelocityReuse(), "P": method}, method.panel, ckpt=ckpt)
        methods.append(method)
    return add_context_modes(methods, context_modes)


def describe_schedule(settings: EvalSettings) -> str:
    """The schedule of the log line and the report header ('chunk 0 F-F-F-F, later chunks F-P-P-P'), with
    --reuse_steps the Predictors' plan and the baselines' schedule."""
    baselines = baseline_plan(settings.plan).describe()
    if not settings.plan.reuse_steps:
        return baselines
    return f"{baselines} (reuse baselines); Predictors {settings.plan.text}"


def predictor_plan(settings: EvalSettings) -> StepPlan | None:
    """The Predictors' plan with --reuse_steps (P at the steps left, R at the reused ones), else None."""
    return settings.plan if settings.plan.reuse_steps else None


def planned_run(settings: EvalSettings, rows: MethodRows | None = None):
    """(the checkpoints, read and labelled (by `rows` when given) and checked against the plan; the context modes;
    the run name; the output directory) of an eval: what its check and its run both start from."""
    checkpoints = label_checkpoints([read_predictor_checkpoint(path) for path in settings.checkpoints])
    if rows is not None:
        checkpoints = rows.label(checkpoints)
    check_schedule_fits(checkpoints, settings.plan)
    context_modes = parse_context_modes(settings.context_modes)
    run_name = settings.run_name or default_run_name(checkpoints, settings.plan, settings.split, context_modes)
    return checkpoints, context_modes, run_name, Path(settings.output_root) / run_name


def check_evaluation(settings: EvalSettings, rows: MethodRows | None = None) -> list[str]:
    """--check_only of tools/eval_predictor.py and tools/leaderboard.py: what `run_evaluation` checks before its
    directory exists, from the files' kinds and headers (no model is loaded): the checkpoints' labels against the
    schedule, the Teacher's config.json and action checkpoint, the VAE folder, the LPIPS weights file, every row's
    case files and camera path, and every row's ground-truth video. Returns the lines to report: the run name, its
    directory (new, or one whose fingerprint the eval compares when it starts) and the videos."""
    _, _, run_name, out_dir = planned_run(settings, rows)
    source = settings.teacher_source
    teacher_depth(source)  # its config.json
    if source.action_ckpt is not None and not Path(source.action_ckpt).is_file():
        raise MissingFileError(f"--action_ckpt {source.action_ckpt} ({source.origin}): no such file")
    vae = Path(settings.vae)
    if not ((vae / "config.json").is_file() or (vae / "vae" / "config.json").is_file()):
        raise MissingFileError(f"--vae {vae}: no config.json (expected an AutoencoderKLHunyuanVideo15 folder or a "
                               "pipeline folder with vae/)")
    if not settings.lpips_random_backbone:
        resolve_alexnet_weights(settings.lpips_alexnet)
    dataset = open_dataset(settings)
    selected = select_items(dataset, settings.max_videos)
    if settings.ground_truth is not None:
        find_ground_truth_videos(settings.ground_truth, [video_key(*dataset.keys()[index]) for index in selected])
    state = ("exists: a start compares its settings, then skips its finished videos"
             if (out_dir / EVAL_CONFIG_NAME).is_file() else "new")
    return [f"eval run name {run_name}", f"eval directory {out_dir} ({state})",
            f"{len(selected)} videos of {settings.sample_table}, {describe_schedule(settings)}"]


def run_evaluation(settings: EvalSettings, env: DistEnv, rows: MethodRows | None = None) -> dict:
    """Evaluate every selected video under every seed (sharded over ranks, finished ones skipped), then aggregate
    and report on rank 0. `rows`: the methods to compare (default: the classic set, `classic_methods`). Returns
    {"out_dir", "computed", "skipped", "aggregate" (rank 0), "aggregate_ground_truth" (rank 0; None without ground
    truth), "written" (rank 0), "results" (rank 0: every per-video result)}."""
    device = env.device
    # 1. Checkpoints (metadata), precision, output directory, LPIPS.
    checkpoints, context_modes, run_name, out_dir = planned_run(settings, rows)
    scorer = LpipsScorer.from_policy(settings.lpips_alexnet, random_backbone=settings.lpips_random_backbone,
                                     device=device)
    teacher = load_teacher(settings.teacher_source, device, settings.dtype)

    # 2. Videos: the selection and its ground truth (every row's, before the run directory is touched).
    dataset = open_dataset(settings)
    selected = select_items(dataset, settings.max_videos)
    keys = {index: video_key(*dataset.keys()[index]) for index in selected}
    ground_truth = {} if settings.ground_truth is None else find_ground_truth_videos(settings.ground_truth,
                                                                                     list(keys.values()))
    fingerprint, record = settings_fingerprint(settings, checkpoints, teacher_config_sha256(teacher), scorer, device,
                                               rows)
    check_eval_config(out_dir, fingerprint, record)

    # 3. Which are finished, this rank's share: units are (video, seed).
    units = [(index, seed_index) for index in selected for seed_index in range(settings.seeds)]
    unit_keys = {unit: unit_key(keys[unit[0]], unit[1]) for unit in units}
    side_by_side_keys = {unit_keys[(index, 0)] for index in selected[: settings.num_side_by_side]}
    result_path = lambda key: out_dir / "videos" / f"{key}.json"  # noqa: E731
    pending = [unit for unit in units if not result_path(unit_keys[unit]).is_file()]
    mine = pending[env.rank :: env.world_size]
    seeds_note = "" if settings.seeds == 1 else f" x {settings.seeds} seeds"
    log0(f"eval {run_name}: {len(selected)} videos{seeds_note} of {settings.sample_table.name}, "
         f"{len(units) - len(pending)} already finished, {len(pending)} to run on {env.world_size} rank(s); schedule "
         f"{describe_schedule(settings)}; LPIPS column '{scorer.metric_name}'"
         + ("" if context_modes == (EXACT_CONTEXT,) else f"; context modes {', '.join(context_modes)}")
         + ("" if settings.ground_truth is None else f"; ground truth from {settings.ground_truth}"))

    # 4. This rank's videos: every checkpoint is loaded (keys, shapes, values checked) and the runtime built and
    #    warmed up before the run directory is made.
    computed = []
    predictors = {ckpt.label: (load_predictor(teacher, ckpt), ckpt) for ckpt in checkpoints}
    if mine:
        methods = (classic_methods(teacher, predictors, context_modes, predictor_plan(settings)) if rows is None
                   else rows.build(teacher, predictors))
        runtime = build_runtime(settings, teacher, methods, dataset, device, scorer=scorer)
        runtime.warm_up(dataset[mine[0][0]], settings.warmup_chunks)
    check_or_write_eval_config(out_dir, fingerprint, record, settings, env)
    if mine:
        for unit in tqdm(mine, desc=f"eval rank {env.rank}", unit="video", disable=not settings.progress):
            index, seed_index = unit
            item = dataset[index]
            item["seed"] = seed_for(item["seed"], seed_index)
            result, frames = runtime.evaluate(item, rotation=units.index(unit),
                                              ground_truth=ground_truth.get(keys[index]))
            if seed_index:
                result.update(key=unit_keys[unit], video_key=keys[index], seed_index=seed_index)
            result["fingerprint"] = fingerprint
            if result["key"] in side_by_side_keys:
                result["side_by_side"] = write_side_by_side(out_dir, result["key"], frames, runtime.methods,
                                                            settings.fps, settings.side_by_side_scale)
            if result.get("revisits") and settings.revisit_sheets:  # three frames: every such row gets one
                pairs = {frame: first for frame, first in result["revisits"]["pairs"]}
                result["revisit_sheet"] = write_revisit_sheet(out_dir, result["key"], frames, runtime.methods,
                                                              pairs, settings.side_by_side_scale)
            result_path(result["key"]).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(result_path(result["key"]), jsonable(result))
            computed.append(result["key"])

    # 5. Gather on rank 0 (results written by other ranks are read from the shared directory).
    gathered = all_gather_objects(computed)
    report = {"out_dir": out_dir, "computed": sorted(key for keys_ in gathered for key in keys_),
              "skipped": len(units) - len(pending)}
    barrier()
    if env.is_main:
        results = [read_video_result(result_path(unit_keys[unit]), fingerprint) for unit in units]
        method_names = list(results[0]["methods"])
        aggregate = aggregate_results(results, method_names)
        aggregate_truth = None if settings.ground_truth is None else aggregate_ground_truth(results)
        display_names = {name: name for name in method_names}
        display_names.update({ckpt.method: f"predictor {ckpt.panel}" for ckpt in checkpoints})
        if rows is not None:
            display_names.update(rows.display_names())
        for mode in context_modes[1:]:  # reference @incremental, predictor ckptstep8 @incremental, ...
            for base in [REFERENCE] + [ckpt.method for ckpt in checkpoints]:
                display_names[context_mode_name(base, mode)] = f"{display_names[base]} @{mode}"
        if aggregate_truth is not None:
            display_names[REPEAT_FIRST_FRAME] = REPEAT_FIRST_FRAME
        legend = [f"{ckpt.panel.split()[0]}: {ckpt.run_name}, step {ckpt.step} ({ckpt.path})"
                  for ckpt in checkpoints if ckpt.panel.startswith("#")]
        header = {"run_name": run_name, "split": settings.split, "num_videos": len(results),
                  "display_names": display_names, "legend": legend,
                  "schedule": describe_schedule(settings), "replace_steps": list(settings.plan.replaced_steps),
                  "lpips": scorer.describe(), "checkpoints": {ckpt.method: str(ckpt.path) for ckpt in checkpoints},
                  "dtype": str(settings.dtype).removeprefix("torch."), "device": str(device),
                  "world_size": env.world_size,
                  "speed_note": "speedups: reference time / method time (per video, warm-up excluded); FLOP bound "
                                "= reference DiT FLOPs / method DiT FLOPs (text prefill, context prefills, steps; "
                                "the VAE decode is not counted)"}
        if aggregate_truth is not None:  # only then: the header of a run without ground truth stays as it was
            header["ground_truth"] = str(Path(settings.ground_truth).resolve())
        if context_modes != (EXACT_CONTEXT,):  # likewise: the header of an exact-only run stays as it was
            header["context_modes"] = list(context_modes)
        if settings.plan.reuse_steps:  # likewise
            header["reuse_steps"] = list(settings.plan.reuse_steps)
        memory = aggregate_revisits(results)  # with ground truth whose poses revisit earlier cameras
        report["written"] = write_reports(out_dir, results, aggregate, method_names, header, aggregate_truth,
                                          memory)
        report["revisits"] = memory
        report["aggregate"] = aggregate
        report["aggregate_ground_truth"] = aggregate_truth
        report["table"] = (out_dir / "table.md").read_text(encoding="utf-8")
        report["results"] = results
    barrier()
    return report

