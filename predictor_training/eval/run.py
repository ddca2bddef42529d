"""One evaluation run: its name, the fingerprint that guards resume, sharding over ranks, gathering and the reports
(see the package docstring). The Predictor checkpoints are read in eval/predictor_checkpoints.py, the settings from
the flags of tools/eval_predictor.py resolved in eval/settings.py.

Files of the run directory `<output_root>/<run_name>` written here: eval_config.json (settings and the fingerprint
of everything that changes the numbers), videos/<case>__a<action>.json (one per finished video, the unit of
resume), side_by_side/*.mp4, revisit_sheet/*.png (every row whose path revisits a camera), and, on rank 0, the reports of `reports.write_reports`. With `--ground_truth` every
row's ground-truth video is located before anything runs, and the results and reports carry the scores against it.
With `--context_modes` other than exact, the reference and every Predictor also run in each other mode
(`methods.add_context_modes`: `reference@M`, `predictor_<ckpt>@M`), scored and timed against the exact reference.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.io import read_json_file, sha256_file, sha256_json
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
from predictor_training.eval.predictor_checkpoints import label_checkpoints, load_predictor, read_predictor_checkpoint
from predictor_training.eval.revisits import aggregate_revisits
from predictor_training.eval.runtime import RESULT_VERSION, EvalRuntime
from predictor_training.eval.settings import EvalSettings, check_schedule_fits
from predictor_training.video.vae_decoder import VaeDecoder
from predictor_training.video.ground_truth import find_ground_truth_videos, video_key
from predictor_training.runtime.io import write_json_atomic
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.source import load_teacher, teacher_config_sha256, teacher_depth
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.video.metrics import LpipsScorer, jsonable, resolve_alexnet_weights

EVAL_CONFIG_NAME = "eval_config.json"
MAX_RUN_NAME_LENGTH = 255  # NAME_MAX of Linux file systems


# =============================================================================================================
# 1. Run names
# =============================================================================================================
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
# 2. The run: fingerprint, sharding, resume, gathering
# =============================================================================================================
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

