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

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.checkpoint import (
    check_weights_file,
    load_model_weights,
    read_inference_config,
    read_inference_metadata,
    read_training_state,
)
from predictor_training.runtime.errors import MissingFieldError, UserInputError
from predictor_training.runtime.io import sha256_file, sha256_json
from predictor_training.runtime.distributed import DistEnv, all_gather_objects, barrier, log0
from predictor_training.eval.methods import (
    PredictorCheckpoint,
    EXACT_CONTEXT,
    REFERENCE,
    REPEAT_FIRST_FRAME,
    HiddenReuse,
    Method,
    PredictorMethod,
    ReferenceMethod,
    VelocityReuse,
    add_context_modes,
    context_mode_name,
    parse_context_modes,
)
from predictor_training.rollout.schedule import Schedule
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
from predictor_training.teacher.source import TeacherSource, load_teacher, teacher_config_sha256
from predictor_training.data.dataset_config import resolve_teacher_source
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.video.metrics import LpipsScorer, jsonable

EVAL_CONFIG_NAME = "eval_config.json"
MAX_RUN_NAME_LENGTH = 255  # NAME_MAX of Linux file systems
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}  # --dtype / --vae_dtype
PRECISION_DTYPES = {"fp32master": torch.bfloat16, "fp32": torch.float32}  # checkpoint precision -> --dtype auto
_STEP_NAME = re.compile(r"^predictor_step_(\d+)\.safetensors$")


# =============================================================================================================
# 1. Predictor checkpoints
# =============================================================================================================
def read_predictor_checkpoint(path: str | Path) -> PredictorCheckpoint:
    """Read a checkpoint's metadata and saved run config (no weights). Errors name the file and the field."""
    path = Path(path).resolve()
    if path.suffix == ".safetensors":
        meta = read_inference_metadata(path)
        config = read_inference_config(path)
        if "step" not in meta:
            raise MissingFieldError(f"{path}: inference metadata has no 'step' (keys {sorted(meta)})")
        step = int(meta["step"])
        name_match = _STEP_NAME.match(path.name)
        if name_match and int(name_match.group(1)) != step:
            raise UserInputError(f"{path}: the file name says step {int(name_match.group(1))}, its metadata step {step}")
    elif path.suffix == ".pt":
        payload = read_training_state(path)
        meta, config = payload["meta"], payload["config"]
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


def default_run_name(checkpoints: Sequence[PredictorCheckpoint], schedule: Schedule, split: str,
                     context_modes: Sequence[str] = (EXACT_CONTEXT,)) -> str:
    """`<train_run>_ckptstep<N>[+<M>...]_<schedule>_<split>` (runs joined by '__'); `reuse_<schedule>_<split>`
    without checkpoints; with context modes other than exact, `_ctx-<mode>[+<mode>...]` appended."""
    suffix = context_modes_tag(context_modes)
    if not checkpoints:
        return f"reuse_{schedule.tag}_{split}{suffix}"
    steps_by_run: dict[str, list[int]] = defaultdict(list)
    for ckpt in checkpoints:
        steps_by_run[ckpt.run_name].append(ckpt.step)
    runs = [f"{run}_ckptstep{'+'.join(str(step) for step in sorted(steps))}" for run, steps in steps_by_run.items()]
    name = f"{'__'.join(runs)}_{schedule.tag}_{split}{suffix}"
    if len(name) > MAX_RUN_NAME_LENGTH:
        raise UserInputError(f"the automatic eval run name is {len(name)} characters long; pass --run_name")
    return name


# =============================================================================================================
# 2. Settings from the flags of tools/eval_predictor.py
# =============================================================================================================
def check_schedule_fits(checkpoints: Sequence[PredictorCheckpoint], schedule: Schedule) -> None:
    """A v4 Predictor needs the previous chunk's hidden and context K/V: refuse replaced steps in chunk 0 for it."""
    if not schedule.chunk0_full and schedule.replace_steps:
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
    """The Teacher config sha256 that `ckpt`'s training checked its Teacher against: the `teacher.config_sha256` of
    the dataset its run trained on (`flags.dataset_root` -> dataset_config.json). The run config records no Teacher
    config of its own, so None when the run records no dataset (runs on the light sample table); also None, with a
    warning, when that dataset's config cannot be read here (e.g. the dataset is not mounted on this machine)."""
    dataset_root = ckpt.run_flags.get("dataset_root")
    if dataset_root is None:
        return None
    try:
        return resolve_teacher_source(teacher, action_ckpt, Path(dataset_root)).expected_config_sha256
    except (FileNotFoundError, KeyError) as error:
        log0(f"WARNING: {ckpt.path}: the Teacher config recorded by its training dataset cannot be read ({error}); "
             f"the Teacher {teacher} is not checked against it")
        return None


def resolve_teacher(teacher: Path | None, action_ckpt: Path | None, origin: str,
                    checkpoints: Sequence[PredictorCheckpoint]) -> TeacherSource:
    """An explicit Teacher (`origin`: "--teacher" or "--demo"), else the Teacher every checkpoint's run recorded (they
    must agree). An explicit Teacher gets the check training made: its config must match the Teacher config recorded
    by the checkpoints' training datasets (see `recorded_teacher_config_sha256`; unchecked when none records one)."""
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
        return TeacherSource(Path(teacher), action_ckpt, origin, next(iter(recorded), None))
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
    return sources[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The flags of tools/eval_predictor.py (and tools/leaderboard.py) that `resolve_eval_settings` takes by name.
EVAL_FLAGS = ("ckpt", "schedule", "dtype", "vae_dtype", "demo", "teacher", "action_ckpt", "vae", "sample_table",
              "split", "encoded", "dataset_root", "num_latents", "context_modes", "output_root", "run_name",
              "max_videos", "num_side_by_side", "side_by_side_scale", "fps", "ground_truth", "lpips_alexnet",
              "lpips_random_backbone", "warmup_chunks", "vae_tiling", "no_progress")


def resolve_eval_settings(*, ckpt: Sequence[Path], schedule: Schedule, dtype: str, vae_dtype: str, demo: Path | None,
                          teacher: Path | None, action_ckpt: Path | None, vae: Path, sample_table: Path, split: str,
                          encoded: Path | None, dataset_root: Path | None, num_latents: int,
                          context_modes: str | Sequence[str], output_root: Path, run_name: str | None,
                          max_videos: int | None, num_side_by_side: int, side_by_side_scale: int, fps: float,
                          ground_truth: Path | None, lpips_alexnet: Path | None, lpips_random_backbone: bool,
                          warmup_chunks: int, vae_tiling: bool, no_progress: bool, argv: Sequence[str],
                          device: torch.device) -> EvalSettings:
    """`EvalSettings` from the flags of tools/eval_predictor.py (`EVAL_FLAGS`, by name), after its own checks
    (--demo expanded into teacher, vae, samples_dir and encoded; `sample_table` and `schedule` set). Reads the
    checkpoints' metadata (Teacher, dtype, labels) and logs the chosen dtypes first. A problem with the flags is a
    `UserInputError` (the tool's one-line error); anything else is a bug."""
    checkpoints = label_checkpoints([read_predictor_checkpoint(path) for path in ckpt])
    for checkpoint in checkpoints:  # readable, finite, its checksum: refused before the eval directory exists
        check_weights_file(checkpoint.path)
    check_schedule_fits(checkpoints, schedule)
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
        schedule=schedule,
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
    schedule: Schedule
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
        "schedule": settings.schedule.to_dict(),
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
    saved = json.loads(path.read_text(encoding="utf-8"))
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
        teacher=teacher, methods=list(methods), schedule=settings.schedule,
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


def classic_methods(teacher: WorldPlayTransformer, predictors: dict, context_modes: Sequence[str]) -> list[Method]:
    """reference, reuse_velocity, reuse_hidden, every Predictor; then the reference and the Predictors once more per
    context mode other than exact."""
    methods: list[Method] = [ReferenceMethod(), VelocityReuse(), HiddenReuse(teacher)]
    methods += [PredictorMethod(predictor, ckpt) for predictor, ckpt in predictors.values()]
    return add_context_modes(methods, context_modes)


def run_evaluation(settings: EvalSettings, env: DistEnv, rows: MethodRows | None = None) -> dict:
    """Evaluate every selected video under every seed (sharded over ranks, finished ones skipped), then aggregate
    and report on rank 0. `rows`: the methods to compare (default: the classic set, `classic_methods`). Returns
    {"out_dir", "computed", "skipped", "aggregate" (rank 0), "aggregate_ground_truth" (rank 0; None without ground
    truth), "written" (rank 0), "results" (rank 0: every per-video result)}."""
    device = env.device
    # 1. Checkpoints (metadata), precision, output directory, LPIPS.
    checkpoints = label_checkpoints([read_predictor_checkpoint(path) for path in settings.checkpoints])
    if rows is not None:
        checkpoints = rows.label(checkpoints)
    check_schedule_fits(checkpoints, settings.schedule)
    context_modes = parse_context_modes(settings.context_modes)
    run_name = settings.run_name or default_run_name(checkpoints, settings.schedule, settings.split, context_modes)
    out_dir = Path(settings.output_root) / run_name
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
    check_or_write_eval_config(out_dir, fingerprint, record, settings, env)

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
         f"{settings.schedule.describe()}; LPIPS column '{scorer.metric_name}'"
         + ("" if context_modes == (EXACT_CONTEXT,) else f"; context modes {', '.join(context_modes)}")
         + ("" if settings.ground_truth is None else f"; ground truth from {settings.ground_truth}"))

    # 4. This rank's videos.
    computed = []
    if mine:
        predictors = {ckpt.label: (load_predictor(teacher, ckpt), ckpt) for ckpt in checkpoints}
        methods = (classic_methods(teacher, predictors, context_modes) if rows is None
                   else rows.build(teacher, predictors))
        runtime = build_runtime(settings, teacher, methods, dataset, device, scorer=scorer)
        runtime.warm_up(dataset[mine[0][0]], settings.warmup_chunks)
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
                  "schedule": settings.schedule.describe(), "replace_steps": list(settings.schedule.replace_steps),
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

