"""The leaderboard: every schedule, the fewer-step samplers, training-free caches and every Predictor, on the same
videos and seeds, at matched cost, with intervals (SPEC § 13; the command is tools/leaderboard.py).

Rows (each a `PlannedMethod` of eval/methods.py run by the eval's own per-video loop, `run.run_evaluation`):

    reference            F-F-F-F
    sampler_<k>step_*    the k-step Euler sampler on the Teacher's sigma grid = velocity reuse at the steps it skips
                         (F-R-R-R is the 1-step sampler; F-R-R-F the 2-step one at sigma 1 and 0.625); every subset
                         of the steps that keeps step 0
    reuse_hidden_*       hidden reuse at the same plans (H), and at each Predictor plan with H for P (F-R-R-H: what
                         an untrained F-R-R-P Predictor computes)
    block_residual_*     the block-residual cache (B; eval/caches.py): the Predictor's count of Teacher blocks run,
                         the rest stood in for by their residual at the chunk's last Full step; at the same plans,
                         and at each Predictor plan with B for P (F-R-R-B: the Predictor's exact cost, training-free)
    taylor_*             TaylorSeer-style first-order forecast of the hidden (T; eval/caches.py)
    prev_chunk_*         the previous chunk's output of the same step (C)
    teacache_nfe<n>      TeaCache-style adaptive skipping (A), its threshold calibrated to n Full steps per chunk on
                         calibration videos of another split
    mixture_*            per-chunk mixtures of plans ("F-R-R-R|F-R-R-F": chunks alternate), measured
    student_<label>_*    a trained student (the Teacher distilled to fewer steps per chunk: kd, DMD2 / Self-Forcing;
                         full or LoRA) at its own steps on the Teacher's sigma grid (S-R-R-R = 1 step, S-R-R-S = 2 at
                         sigma 1 and 0.625), every chunk (chunk 0 too) on the student: what its user runs
    predictor_<ckpt>_*   each Predictor at each plan asked for (and @<mode> under another context mode)
    reference@<mode>     the reference under another context mode

Every row but the Predictors' is a baseline (the students too: the strongest alternative of a user who will train
something): the **front** of the baselines (eval/front.py; mixtures interpolated in
MSE) is what a Predictor must beat at its own cost. Costs on four axes: the FLOP bound on the config that ran, the
FLOP bound of the same work at the real 8.6B config (54 blocks, 30 x 52 latents, 1000 text tokens; text prefill not
counted), and the measured DiT and end-to-end speedups (every method of a video in one process, order rotated per
video; each row's time the median of --timing_repeats rollouts in interleaved rounds, the measured DiT speedup with
the interquartile range of its per-video speedups). Quality against F-F-F-F (PSNR with a paired bootstrap
interval, SSIM, LPIPS, last chunk, temporal-delta error) and, where given, against the ground truth (chunks 1..)
and at revisited cameras.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Sequence

import numpy as np
from peft.tuners.lora import LoraLayer

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
from predictor_training.eval.caches import (
    AdaptiveSkip,
    BlockResidual,
    PreviousChunkReuse,
    TaylorForecast,
    calibrate_threshold,
    fit_rescale,
)
from predictor_training.eval.front import (
    BOOTSTRAP_UNITS,
    Estimate,
    FrontRow,
    Units,
    front_curve,
    margin_over_front,
    paired_difference,
    pareto_rows,
    weighted_mean,
)
from predictor_training.eval.methods import (
    EXACT_CONTEXT,
    REFERENCE,
    HiddenReuse,
    Method,
    PlannedMethod,
    PredictorMethod,
    ReferenceMethod,
    VelocityReuse,
    context_mode_name,
    with_context_mode,
)
from predictor_training.eval.reports import write_side_by_side
from predictor_training.eval.run import MethodRows, build_runtime, load_predictor, open_dataset
from predictor_training.eval.runtime import GROUND_TRUTH, LETTER_KINDS, EvalRuntime
from predictor_training.eval.timing import Stopwatch, speedup_spread
from predictor_training.eval.training_cost import cost_columns, training_cost, unknown_cost
from predictor_training.rollout.schedule import StepPlan
from predictor_training.rollout.scheduler import flow_match_sigmas
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.distributed import log0
from predictor_training.runtime.io import read_json_file, write_json_atomic, write_text_atomic
from predictor_training.teacher.adapters import load_lora
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.source import TeacherSource, load_teacher
from predictor_training.video.metrics import jsonable
from predictor_training.video.ground_truth import find_ground_truth_videos, load_ground_truth, video_key
from predictor_training.teacher.flops import (
    REAL_LATENT_GRID,
    REAL_TEXT_TOKENS,
    TeacherShape,
    rollout_flops,
)

CACHE_LETTERS = {"reuse_hidden": "H", "taylor": "T", "prev_chunk": "C", "block_residual": "B"}
CACHES = (*CACHE_LETTERS, "teacache")
CACHE_TITLES = {"reuse_hidden": "hidden reuse", "taylor": "TaylorSeer forecast", "prev_chunk": "previous-chunk reuse",
                "block_residual": "block-residual cache"}
DEFAULT_RESIDUAL_BLOCKS = (0, -1)  # the B steps' Teacher blocks: the first and the last (eval/caches.BlockResidual)
COUNTERPART_LETTERS = ("H", "B")  # letters that stand in for P in every Predictor plan, as baseline rows
PREDICTOR_FAMILY = "predictor"
DEFAULT_BASELINE = "sampler_1step_frrr"  # the cheapest honest alternative: one Full step per chunk
COST_AXES = {  # key -> what the axis measures
    "flops_run": "FLOP bound, config that ran",
    "flops_real": "FLOP bound at the real 8.6B config (a projection: this run's quality at the real per-step costs)",
    "measured_dit": "measured DiT",
    "measured_end_to_end": "measured end-to-end",
}
MARGIN_AXES = ("flops_run", "flops_real", "measured_dit")
# the spread of the measured DiT speedup over the videos (eval/timing.speedup_spread): figures
# speedup_measured_dit_q25 / _q75 (printed beside the pooled speedup) / _min / _max
MEASURED_SPREAD_PREFIX = "speedup_measured_dit_"
MEASURED_SPREAD_PARTS = ("q25", "q75", "min", "max")
TEACACHE_TOLERANCE = 0.1  # Full steps per chunk: a TeaCache row within this of its target reached it


# =============================================================================================================
# 1. Rows
# =============================================================================================================
@dataclass(frozen=True)
class RowSpec:
    """One leaderboard row, declaratively (it joins the eval fingerprint).

    key: the method key in the results; family: reference | sampler | cache | mixture | student | predictor; plan:
    the `StepPlan` text; checkpoint: the Predictor's label (P rows); adaptive: {"target_full_steps", "threshold",
    "rescale"} of an A row (threshold None until calibrated); student: the student's label (S rows, whose plan runs
    in every chunk, chunk 0 too); blocks: the Teacher blocks a B row's block-residual steps run (negative indices
    count from the last)."""

    key: str
    family: str
    plan: str
    display: str
    panel: str
    checkpoint: str | None = None
    context_mode: str = EXACT_CONTEXT
    adaptive: dict | None = None
    student: str | None = None
    blocks: tuple[int, ...] | None = None

    @property
    def baseline(self) -> bool:
        return self.family != PREDICTOR_FAMILY

    @property
    def step_plan(self) -> StepPlan:
        """The row's `StepPlan`: a student's in every chunk (chunk 0 too), the others with chunk 0 F-F-F-F."""
        return StepPlan.parse(self.plan, chunk0_full=self.student is None,
                              num_steps=len(self.plan.split("|")[0].replace("-", "")))

    def record(self) -> dict:
        """The row as it joins the eval fingerprint."""
        record = asdict(self)
        for optional in ("student", "blocks"):  # rows without them record as before these fields existed
            if record[optional] is None:
                del record[optional]
        return record


def sampler_sigmas(num_steps: int, shift: float) -> list[float]:
    """The Teacher's sigma grid [num_steps] (1 ... the last step's level)."""
    return [float(sigma) for sigma in flow_match_sigmas(num_steps, shift)[:-1]]


def sampler_plans(num_steps: int, step_counts: Sequence[int]) -> list[tuple[int, str]]:
    """(k, plan) of every k-step sampler, k in `step_counts` (< num_steps): step 0 and k-1 of the later steps
    kept, the rest filled by velocity reuse."""
    plans = []
    for k in step_counts:
        if not 1 <= k < num_steps:
            raise UserInputError(f"--samplers: a sampler takes 1..{num_steps - 1} steps, got {k}")
        for kept in combinations(range(1, num_steps), k - 1):
            plans.append((k, "-".join("F" if step == 0 or step in kept else "R" for step in range(num_steps))))
    return plans


def _tag(plan: str) -> str:
    return StepPlan.parse(plan, num_steps=len(plan.split("|")[0].replace("-", ""))).tag


# =============================================================================================================
# 1b. Trained students: the Teacher distilled to fewer steps per chunk
# =============================================================================================================
@dataclass(frozen=True)
class StudentSource:
    """One `--student`: a trained few-step student of the Teacher. path: its model folder (config.json + weights:
    a run's model/ or ema/model/) or LoRA file (a run's lora_student.safetensors or ema/lora_student.safetensors);
    run_dir: the run directory whose train_config.json names its recipe; method: kd | dmd2 | ...; train: full |
    lora; steps, shift: its denoising schedule per chunk; ema: the generator's EMA weights; label: the row name."""

    path: Path
    run_dir: Path
    method: str
    train: str
    steps: int
    shift: float
    ema: bool
    label: str = ""

    def record(self) -> dict:
        return {"path": str(self.path), "method": self.method, "train": self.train, "steps": self.steps,
                "shift": self.shift, "ema": self.ema, "label": self.label}


def read_student(path: str | Path) -> StudentSource:
    """The student at `path` (see `StudentSource`), its recipe read from the nearest run directory above it
    (train_config.json: the method and the flags student_steps, student_shift, train). UserInputError naming the
    path when it is no student."""
    path = Path(path)
    is_model = path.is_dir() and (path / "config.json").is_file()
    is_lora = path.is_file() and path.suffix == ".safetensors"
    if not (is_model or is_lora):
        raise UserInputError(f"--student {path}: expected a student's model folder (config.json + weights, e.g. "
                             "RUN/model or RUN/ema/model) or its LoRA file (RUN/lora_student.safetensors)")
    run_dir = next((folder for folder in path.resolve().parents if (folder / "train_config.json").is_file()), None)
    if run_dir is None:
        raise UserInputError(f"--student {path}: no train_config.json in a folder above it, so its recipe (steps "
                             "per chunk, shift) is unknown; pass a student inside its run directory")
    config = read_json_file(run_dir / "train_config.json")
    flags = config.get("flags", {})
    if "student_steps" not in flags or flags.get("generator", "student") != "student":
        raise UserInputError(f"--student {path}: the run {run_dir.name} trained no few-step student (its "
                             "train_config.json flags have no student_steps, or its generator is not a student)")
    return StudentSource(path=path, run_dir=run_dir, method=str(config.get("method", flags.get("experiment", "?"))),
                         train=str(flags.get("train", "full")), steps=int(flags["student_steps"]),
                         shift=float(flags["student_shift"]), ema="ema" in path.resolve().relative_to(run_dir).parts[:-1])


def student_plan(steps: int, shift: float, num_steps: int, teacher_shift: float) -> str:
    """The plan of a `steps`-step student on the Teacher's `num_steps`-step sigma grid: S where the student's
    schedule visits the grid, R (velocity reuse = one Euler step of the student across the skipped levels) elsewhere;
    e.g. 2 steps at shift 5/3 (sigma 1, 0.625) -> S-R-R-S. UserInputError when a level is not on the grid."""
    grid = sampler_sigmas(num_steps, teacher_shift)
    own = [float(sigma) for sigma in flow_match_sigmas(steps, shift)[:-1]]
    steps_on_grid = []
    for sigma in own:
        match = [index for index, level in enumerate(grid) if abs(level - sigma) < 1e-5]
        if not match:
            raise UserInputError(f"a {steps}-step student at shift {shift:g} visits sigma {sigma:.4g}, which is not on "
                                 f"the Teacher's {num_steps}-step grid ({', '.join(f'{g:.4g}' for g in grid)}); "
                                 "train it at a shift whose levels are on the grid")
        steps_on_grid.append(match[0])
    return "-".join("S" if step in steps_on_grid else "R" for step in range(num_steps))


def student_labels(students: Sequence[StudentSource]) -> list[StudentSource]:
    """The students with short unique labels: '<method>_<steps>step_<train>' (+ '_ema'), a counter where they
    repeat."""
    bases = [f"{student.method}_{student.steps}step_{student.train}{'_ema' if student.ema else ''}"
             for student in students]
    seen: dict[str, int] = {}
    out = []
    for base, student in zip(bases, students):
        seen[base] = seen.get(base, 0) + 1
        out.append(replace(student, label=base if bases.count(base) == 1 else f"{base}_{seen[base]}"))
    return out


def load_student(student: StudentSource, teacher_source, device, dtype):
    """The student's transformer, frozen, on `device` in `dtype`: its model folder, or the Teacher with its LoRA
    merged into the weights (what its user deploys: no adapter cost at inference)."""
    if student.train != "lora" or student.path.is_dir():
        return load_teacher(TeacherSource(student.path, None, "--student", None), device, dtype)
    model = load_teacher(teacher_source, device, dtype)
    name = load_lora(model, student.path, "student").name
    for _, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and name in layer.lora_A:
            layer.merge(adapter_names=[name])
    return model


def build_rows(*, num_steps: int, shift: float, samplers: Sequence[int], caches: Sequence[str],
               teacache_full_steps: Sequence[float], mixtures: Sequence[str], predictor_plans: dict[str, Sequence[str]],
               context_modes: Sequence[str] = (EXACT_CONTEXT,), counterparts: Sequence[str] = COUNTERPART_LETTERS,
               residual_blocks: Sequence[int] = DEFAULT_RESIDUAL_BLOCKS,
               students: Sequence[StudentSource] = ()) -> list[RowSpec]:
    """The rows of one leaderboard, in table order.

    samplers: the k of the k-step samplers; caches: of `CACHES` (the letter caches run at every sampler plan);
    teacache_full_steps: one adaptive row per target of Full steps per chunk; mixtures: extra baseline plans (with
    '|'); predictor_plans: {checkpoint label: plans to run it at}; context_modes: exact first, then the modes whose
    reference and Predictor rows run once more; counterparts: letters of `COUNTERPART_LETTERS` that stand in for P
    in every Predictor plan (and every P plan of `mixtures`) as a baseline row at that plan's exact schedule (H:
    F-R-R-H, what an untrained F-R-R-P Predictor computes; B: F-R-R-B, the block-residual cache), unless a row
    already runs that plan; residual_blocks: the Teacher blocks of the B rows' block-residual steps; students:
    labelled `StudentSource`s, one row each at its own steps."""
    unknown = sorted(set(caches) - set(CACHES))
    if unknown:
        raise UserInputError(f"--caches: unknown {unknown}; expected some of {', '.join(CACHES)}")
    wrong = sorted(set(counterparts) - set(COUNTERPART_LETTERS))
    if wrong:
        raise UserInputError(f"--counterparts: unknown letter(s) {wrong}; expected some of "
                             f"{', '.join(COUNTERPART_LETTERS)}")
    blocks = tuple(int(index) for index in residual_blocks)
    cache_of = {letter: cache for cache, letter in CACHE_LETTERS.items()}
    sigmas = sampler_sigmas(num_steps, shift)
    rows = [RowSpec(REFERENCE, "reference", "-".join("F" * num_steps), "reference F-F-F-F", "reference")]
    plans = sampler_plans(num_steps, samplers)
    for k, plan in plans:
        kept = [sigmas[step] for step, letter in enumerate(plan.split("-")) if letter == "F"]
        levels = ", ".join(f"{sigma:.4g}" for sigma in kept)
        rows.append(RowSpec(f"sampler_{k}step_{_tag(plan)}", "sampler", plan, f"{k}-step sampler σ{{{levels}}}",
                            f"{k}-step {plan}"))
    for cache in caches:
        if cache == "teacache":
            continue
        letter = CACHE_LETTERS[cache]
        for _, plan in plans:
            cached = plan.replace("R", letter)
            rows.append(RowSpec(f"{cache}_{_tag(cached)}", "cache", cached, f"{CACHE_TITLES[cache]} {cached}",
                                f"{cache} {cached}", blocks=blocks if letter == "B" else None))
    if "teacache" in caches:
        for target in teacache_full_steps:
            if not 1 <= target <= num_steps:
                raise UserInputError(f"--teacache_full_steps: a target is 1..{num_steps} Full steps per chunk, "
                                 f"got {target}")
            rows.append(RowSpec(f"teacache_full{target:g}", "cache", "-".join("F" + "A" * (num_steps - 1)),
                                f"TeaCache adaptive, {target:g} Full steps/chunk", f"teacache {target:g}",
                                adaptive={"target_full_steps": float(target), "threshold": None, "rescale": None}))
    for plan in mixtures:
        parsed = StepPlan.parse(plan, num_steps=num_steps)
        if "P" in parsed.letters_used:
            continue
        family = "mixture" if len(parsed.patterns) > 1 else "cache"
        rows.append(RowSpec(f"plan_{parsed.tag}", family, parsed.text, f"{family} {parsed.text}", parsed.text,
                            blocks=blocks if "B" in parsed.letters_used else None))
    mixed = [StepPlan.parse(plan, num_steps=num_steps) for plan in mixtures]
    predictor_texts = [StepPlan.parse(plan, num_steps=num_steps).text for plans_of in predictor_plans.values()
                       for plan in plans_of] + [plan.text for plan in mixed if "P" in plan.letters_used]
    for plan in dict.fromkeys(predictor_texts):
        for letter in counterparts:
            stand_in = StepPlan.parse(plan.replace("P", letter), num_steps=num_steps)
            if any(row.plan == stand_in.text for row in rows):
                continue
            cache = cache_of[letter]
            family = "mixture" if len(stand_in.patterns) > 1 else "cache"
            rows.append(RowSpec(f"{cache}_{stand_in.tag}", family, stand_in.text,
                                f"{CACHE_TITLES[cache]} {stand_in.text}", f"{cache} {stand_in.text}",
                                blocks=blocks if letter == "B" else None))
    for student in students:
        plan = student_plan(student.steps, student.shift, num_steps, shift)
        tag = plan.replace("-", "").lower()
        rows.append(RowSpec(f"student_{student.label}_{tag}", "student", plan,
                            f"student {student.label} {plan} (every chunk)", f"S {student.label}",
                            student=student.label))
    for label, plans_of in predictor_plans.items():
        for plan in plans_of:
            parsed = StepPlan.parse(plan, num_steps=num_steps)
            for mode in context_modes:
                key = context_mode_name(f"predictor_{label}_{parsed.tag}", mode)
                suffix = "" if mode == EXACT_CONTEXT else f" @{mode}"
                rows.append(RowSpec(key, PREDICTOR_FAMILY, parsed.text, f"P {label} {parsed.text}{suffix}",
                                    f"P {label} {parsed.text}{suffix}", checkpoint=label, context_mode=mode))
    for mode in context_modes:
        if mode != EXACT_CONTEXT:
            rows.append(RowSpec(context_mode_name(REFERENCE, mode), "reference", rows[0].plan,
                                f"reference F-F-F-F @{mode}", f"reference @{mode}", context_mode=mode))
    keys = [row.key for row in rows]
    duplicates = sorted({key for key in keys if keys.count(key) > 1})
    if duplicates:
        raise UserInputError(f"leaderboard rows {duplicates} are given twice")
    return rows


def choose_baseline(specs: Sequence[RowSpec], requested: str | None) -> str:
    """The row every paired difference is taken from: `requested` (an error naming the rows when it is not one), or
    by default the 1-step sampler, else the first baseline row after the reference."""
    keys = [spec.key for spec in specs]
    if requested is not None:
        if requested not in keys:
            raise UserInputError(f"--baseline {requested}: not a row of this leaderboard; its rows: {', '.join(keys)}")
        return requested
    if DEFAULT_BASELINE in keys:
        return DEFAULT_BASELINE
    return next((spec.key for spec in specs if spec.baseline and spec.key != REFERENCE), REFERENCE)


def with_short_labels(checkpoints: list) -> list:
    """The checkpoints with their `short_labels` as label and panel."""
    return [replace(ckpt, label=label, panel=label) for ckpt, label in zip(checkpoints, short_labels(checkpoints))]


def short_labels(checkpoints) -> list[str]:
    """A short row label per checkpoint: its run's experiment without the 'predictor_' / '_demo' decoration, then
    '_s<step>' ('v4_rollout_frrp_s480'); '_b<a>-<b>' (source blocks) and then a counter are added only where labels
    would repeat."""
    def base(ckpt) -> str:
        experiment = str(ckpt.run_flags.get("experiment") or ckpt.meta.get("recipe") or ckpt.variant)
        return f"{experiment.removeprefix('predictor_').removesuffix('_demo')}_s{ckpt.step}"

    labels = [base(ckpt) for ckpt in checkpoints]
    labels = [label if labels.count(label) == 1 else f"{label}_b{'-'.join(map(str, ckpt.meta['source_blocks']))}"
              for label, ckpt in zip(labels, checkpoints)]
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if labels.count(label) == 1 else f"{label}_{seen[label]}")
    return out


def build_method(spec: RowSpec, teacher, predictors: dict, students: dict | None = None) -> Method:
    """The method of one row (Predictor modules shared between rows: `predictors` {label: (Predictor, ckpt)};
    students: {label: the student's transformer})."""
    if spec.family == "reference":
        return with_context_mode(ReferenceMethod(), spec.context_mode)
    fillers: dict[str, Method] = {"R": VelocityReuse(), "H": HiddenReuse(teacher), "T": TaylorForecast(teacher),
                                  "C": PreviousChunkReuse()}
    if spec.blocks is not None:
        fillers["B"] = BlockResidual(teacher, spec.blocks)
    ckpt = None
    if spec.checkpoint is not None:
        predictor, ckpt = predictors[spec.checkpoint]
        fillers["P"] = PredictorMethod(predictor, ckpt)
    adaptive = None
    if spec.adaptive is not None:
        if spec.adaptive["threshold"] is None:
            raise ValueError(f"{spec.key}: the adaptive row is not calibrated")
        adaptive = AdaptiveSkip(teacher, float(spec.adaptive["threshold"]), tuple(spec.adaptive["rescale"]))
    model = None if spec.student is None else (students or {})[spec.student]
    method = PlannedMethod(spec.key, spec.step_plan, fillers, spec.panel, adaptive=adaptive, ckpt=ckpt, model=model)
    method.context_mode = spec.context_mode
    return method


@dataclass
class LeaderboardRows(MethodRows):
    """The rows as an evaluation's method set (`run.run_evaluation(settings, env, rows)`)."""

    specs: list[RowSpec]
    students: list[StudentSource] = field(default_factory=list)
    teacher_source: object = None  # the Teacher's TeacherSource (the base of a LoRA student)

    def record(self) -> list:
        records = [spec.record() for spec in self.specs]
        return records + [{"student": student.record()} for student in self.students]

    def display_names(self) -> dict[str, str]:
        return {spec.key: spec.display for spec in self.specs}

    def build(self, teacher, predictors: dict) -> list[Method]:
        models = {student.label: load_student(student, self.teacher_source, teacher.device, teacher.dtype)
                  for student in self.students}
        return [build_method(spec, teacher, predictors, models) for spec in self.specs]

    def label(self, checkpoints: list) -> list:
        return with_short_labels(checkpoints)


# =============================================================================================================
# 2. Calibration of the adaptive rows
# =============================================================================================================
def full_steps_per_chunk(step_kinds: dict[tuple[int, int], str], first_chunk: int = 1) -> float:
    """Mean Full steps per chunk over chunks >= first_chunk of one rollout's recorded step kinds."""
    chunks = sorted({chunk for chunk, _ in step_kinds if chunk >= first_chunk})
    full = sum(kind == "full" for (chunk, _), kind in step_kinds.items() if chunk >= first_chunk)
    return full / max(len(chunks), 1)


def calibrate_adaptive(specs: Sequence[RowSpec], runtime: EvalRuntime, items: Sequence[dict],
                       log=print) -> list[RowSpec]:
    """Thresholds (and TeaCache's rescaling polynomial) of the adaptive rows, on `items` (rows of a calibration
    split, never the evaluated one; `caches.spread_rows` picks them across its scenes): the rescaling is fitted on
    their all-Full rollouts, then each threshold is bisected until the mean Full steps per scheduled chunk is
    closest to its target (a threshold tried for one target is not rolled out again for another).

    A target between two whole numbers of Full steps is reached only through the chunk-to-chunk spread of the
    accumulated distance (docs/leaderboard.md § TeaCache's targets): the row records the count reached on the
    calibration videos (`calibration_full_steps`) and the leaderboard the count it ran on the evaluated split."""
    targets = [spec for spec in specs if spec.adaptive is not None]
    if not targets:
        return list(specs)
    teacher = runtime.teacher
    cases = [(item, runtime.dataset.load_case(item["case_id"])) for item in items]
    cases = [(item, case, runtime.text_kv(case)[0]) for item, case in cases]
    plan = StepPlan.parse(targets[0].plan)

    tried: dict[tuple, tuple[float, list]] = {}

    def rollouts(threshold: float, rescale) -> tuple[float, list]:
        key = (float(threshold), tuple(float(c) for c in rescale))
        if key not in tried:
            tried[key] = roll_out(threshold, rescale)
        return tried[key]

    def roll_out(threshold: float, rescale) -> tuple[float, list]:
        rule = AdaptiveSkip(teacher, threshold, tuple(rescale))
        method = PlannedMethod("calibration", plan, {}, "calibration", adaptive=rule)
        full = []
        for item, case, text_kv in cases:
            rollout = runtime.rollout(method, text_kv, item, case, Stopwatch(runtime.device))
            full.append(full_steps_per_chunk(rollout.step_kinds))
        return float(np.mean(full)), rule.observed

    _, observed = rollouts(0.0, (1.0, 0.0))
    rescale = fit_rescale(observed)
    log(f"[leaderboard] TeaCache rescaling fitted on {len(observed)} consecutive Full steps of {len(items)} "
        f"calibration video(s): {', '.join(f'{c:.4g}' for c in rescale)} (highest power first)")
    calibrated = {}
    for spec in targets:
        target = spec.adaptive["target_full_steps"]
        threshold, reached = calibrate_threshold(lambda value: rollouts(value, rescale)[0], target)
        log(f"[leaderboard] {spec.key}: threshold {threshold:.5g} gives {reached:.3f} Full steps per chunk on the "
            f"calibration videos (target {target:g})")
        calibrated[spec.key] = RowSpec(**{**asdict(spec), "adaptive": {
            "target_full_steps": target, "threshold": threshold, "rescale": list(rescale),
            "calibration_full_steps": reached}})
    return [calibrated.get(spec.key, spec) for spec in specs]


# =============================================================================================================
# 3. The analysis: costs, qualities, intervals, the front
# =============================================================================================================
def real_config_flops(result: dict, method: str, predictor_config: dict | None,
                      residual_blocks: int | None = None) -> int:
    """DiT FLOPs of `method`'s recorded steps of one result, at the real config (REAL_LATENT_GRID, REAL_TEXT_TOKENS,
    the same context frames per chunk; no text prefill). residual_blocks: the Teacher blocks of its block-residual
    steps (B rows)."""
    config = preset_config("worldplay_480p_i2v")
    shape = TeacherShape.from_config(config)
    letters = result["methods"][method]["step_kinds"]
    kind = lambda chunk, step: LETTER_KINDS[letters[chunk][step]]  # noqa: E731
    real_predictor = None if predictor_config is None else {**predictor_config, "hidden_size": shape.hidden_size}
    mode = EXACT_CONTEXT if "@" not in method else method.split("@", 1)[1]
    height, width = REAL_LATENT_GRID
    return rollout_flops(shape, height * width, REAL_TEXT_TOKENS, result["context_frames_per_chunk"], kind,
                         num_steps=len(letters[0]), predictor_config=real_predictor, context_mode=mode,
                         residual_blocks=residual_blocks)["total"]


def _unit_values(results: Sequence[dict], method: str, path: Sequence[str]) -> np.ndarray:
    """One number per unit from each result's method entry (NaN where missing)."""
    values = []
    for result in results:
        node = result["methods"].get(method)
        for key in path:
            node = None if node is None else node.get(key) if isinstance(node, dict) else node[key]
        values.append(math.nan if node is None else float(node))
    return np.asarray(values)


def _truth_values(results: Sequence[dict], method: str, path: Sequence[str]) -> np.ndarray | None:
    if any("against_ground_truth" not in result for result in results):
        return None
    values = []
    for result in results:
        node = result["against_ground_truth"]["methods"][method]
        for key in path:
            node = node[key]
        values.append(float(node))
    return np.asarray(values)


def _revisit_values(results: Sequence[dict], method: str, figure: str) -> float | None:
    values = [result["revisits"]["methods"][method][figure] for result in results if result.get("revisits")]
    return float(np.mean(values)) if values else None


@dataclass
class RowResult:
    spec: RowSpec
    costs: dict[str, float]  # axis -> fraction of the reference's cost
    psnr: np.ndarray  # per unit, vs F-F-F-F
    quality: Estimate  # mean PSNR vs F-F-F-F, with its interval
    figures: dict[str, float | None] = field(default_factory=dict)
    vs_baseline: Estimate | None = None
    margins: dict[str, tuple[Estimate, str]] = field(default_factory=dict)
    on_front: bool = False

    def speedup(self, axis: str) -> float:
        return 1.0 / self.costs[axis]


def analyse(results: Sequence[dict], specs: Sequence[RowSpec], predictor_configs: dict[str, dict], *,
            baseline: str = DEFAULT_BASELINE, resamples: int = 2000, seed: int = 0, unit: str = "scene") -> dict:
    """Every row's costs, quality with interval, difference from `baseline`, margin over the baselines' front
    (on `MARGIN_AXES`), and whether it is on the front of all measured rows (on the real-config FLOP axis).
    predictor_configs: {checkpoint label: its predictor config} (for the real-config FLOPs); unit: what the
    bootstrap resamples, "scene" (a case with all its videos and seeds) or "video" (its seeds together)."""
    if unit not in BOOTSTRAP_UNITS:
        raise ValueError(f"bootstrap unit {unit!r}: expected one of {BOOTSTRAP_UNITS}")
    videos = [result.get("video_key", result["key"]) for result in results]
    units = Units.from_keys(videos if unit == "video" else [result["case_id"] for result in results], videos)
    num_videos = len(dict.fromkeys(videos))
    weights = units.weights(resamples, seed)
    lpips = next((key for key in results[0]["methods"][specs[1].key]["metrics"] if key.startswith("lpips")), None)

    def total(method: str, path: Sequence[str]) -> float:
        return float(np.nansum(_unit_values(results, method, path)))

    reference_cost = {
        "flops_run": total(REFERENCE, ("flops", "total")),
        "flops_real": float(sum(real_config_flops(result, REFERENCE, None) for result in results)),
        "measured_dit": total(REFERENCE, ("timings", "dit_s")),
        "measured_end_to_end": total(REFERENCE, ("timings", "end_to_end_s")),
    }
    rows: list[RowResult] = []
    for spec in specs:
        config = predictor_configs.get(spec.checkpoint) if spec.checkpoint else None
        blocks = None if spec.blocks is None else len(spec.blocks)
        costs = {
            "flops_run": total(spec.key, ("flops", "total")) / reference_cost["flops_run"],
            "flops_real": sum(real_config_flops(result, spec.key, config, blocks) for result in results)
            / reference_cost["flops_real"],
            "measured_dit": total(spec.key, ("timings", "dit_s")) / reference_cost["measured_dit"],
            "measured_end_to_end": total(spec.key, ("timings", "end_to_end_s"))
            / reference_cost["measured_end_to_end"],
        }
        if spec.key == REFERENCE:
            psnr = np.full(len(results), np.inf)
        else:
            psnr = _unit_values(results, spec.key, ("metrics", "psnr_full"))
        row = RowResult(spec, costs, psnr, Estimate.from_samples(weighted_mean(weights, psnr)))
        spread = speedup_spread(videos, _unit_values(results, REFERENCE, ("timings", "dit_s")),
                                _unit_values(results, spec.key, ("timings", "dit_s")))
        row.figures.update({f"{MEASURED_SPREAD_PREFIX}{part}": spread[part] for part in MEASURED_SPREAD_PARTS})
        if spec.key != REFERENCE:
            figures = {
                "ssim": np.nanmean(_unit_values(results, spec.key, ("metrics", "ssim"))),
                "temporal_delta_mse": np.nanmean(_unit_values(results, spec.key, ("metrics", "temporal_delta_mse"))),
                "last_chunk_psnr": np.nanmean([result["methods"][spec.key]["per_chunk"][-1]["psnr_full"]
                                               for result in results]),
            }
            if lpips is not None:
                figures["lpips"] = np.nanmean(_unit_values(results, spec.key, ("metrics", lpips)))
            row.figures.update({key: float(value) for key, value in figures.items()})
        truth = _truth_values(results, spec.key, ("after_first_chunk", "psnr_full"))
        if truth is not None:
            row.figures["gt_psnr_after_first_chunk"] = float(np.mean(truth))
            row.figures["gt_ssim_after_first_chunk"] = float(np.mean(
                _truth_values(results, spec.key, ("after_first_chunk", "ssim"))))
        for figure in ("self_psnr", "return_minus_first_visit"):
            row.figures[f"revisit_{figure}"] = _revisit_values(results, spec.key, figure)
        row.figures["full_steps_per_chunk"] = float(np.mean([
            np.mean([letters.count("F") for letters in result["methods"][spec.key]["step_kinds"][1:]])
            for result in results]))
        rows.append(row)
    by_key = {row.spec.key: row for row in rows}
    if baseline not in by_key:
        raise ValueError(f"--baseline {baseline}: no such row (rows: {', '.join(by_key)})")
    for row in rows:
        if row.spec.key not in (REFERENCE, baseline):
            row.vs_baseline = paired_difference(FrontRow(row.spec.key, 0, row.psnr),
                                                FrontRow(baseline, 0, by_key[baseline].psnr), weights)
    for axis in MARGIN_AXES:
        front_rows = [FrontRow(row.spec.key, row.costs[axis], row.psnr) for row in rows if row.spec.baseline]
        for row in rows:
            if not row.spec.baseline:
                row.margins[axis] = margin_over_front(FrontRow(row.spec.key, row.costs[axis], row.psnr), front_rows,
                                                      weights)
    on_front = pareto_rows([row.costs["flops_real"] for row in rows], [row.quality.value for row in rows])
    for row, flag in zip(rows, on_front):
        row.on_front = flag
    return {"rows": rows, "num_videos": num_videos, "num_units": len(results), "baseline": baseline,
            "resamples": resamples, "lpips_key": lpips, "weights": weights, "bootstrap_unit": unit,
            "num_clusters": units.num_clusters}


# =============================================================================================================
# 4. Reports: leaderboard.md / .csv / .json and the Pareto plots
# =============================================================================================================
def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"{value:.{digits}f}{suffix}"


def row_record(row: RowResult) -> dict:
    return {"key": row.spec.key, "family": row.spec.family, "plan": row.spec.plan, "display": row.spec.display,
            "checkpoint": row.spec.checkpoint, "student": row.spec.student, "context_mode": row.spec.context_mode, "adaptive": row.spec.adaptive,
            "blocks": row.spec.blocks, "speedup": {axis: 1.0 / cost for axis, cost in row.costs.items()},
            "psnr_vs_reference": row.quality.to_dict(), "figures": row.figures,
            "vs_baseline": None if row.vs_baseline is None else row.vs_baseline.to_dict(),
            "margin_over_front": {axis: {**estimate.to_dict(), "front": front}
                                  for axis, (estimate, front) in row.margins.items()},
            "on_front_flops_real": row.on_front}


def training_costs(trained: dict[str, Path], shared: Sequence[Path]) -> dict[str, dict]:
    """{label: `training_cost`} of each trained source {label: its weights path} (the leaderboard's --ckpt and
    --student), the models in `shared` (the Teacher every row serves) counted by none. Weights whose cost cannot
    be read (no known recipe in their run config) get an unknown cost with the reason, and a warning: the row is
    still scored."""
    costs = {}
    for label, path in trained.items():
        try:
            costs[label] = training_cost(path, shared=list(shared))
        except UserInputError as error:
            log0(f"WARNING: {label}: its training cost is unknown ({error})")
            costs[label] = unknown_cost(path, str(error))
    return costs


def trained_source(spec: RowSpec) -> str | None:
    """The label of what a row trained (its Predictor or student; None for a training-free row)."""
    return spec.checkpoint or spec.student


def training_cost_section(analysis: dict) -> list[str]:
    """The markdown section that puts each trained row's training cost beside its quality and inference cost
    (`analysis["training_costs"]`: {trained label: eval/training_cost.py's `training_cost`}); empty without any."""
    costs = analysis.get("training_costs") or {}
    rows = [row for row in analysis["rows"] if trained_source(row.spec) in costs]
    if not rows:
        return []
    lines = ["", "## Training cost of the trained rows", "",
             "What each trained row cost to train, over its lineage (docs/leaderboard.md § Training cost): CPU "
             "core-hours measured on the machine that trained it, and the FLOPs its optimizer steps take at the real "
             "config; ≥ marks a lower bound (a parent run not on this machine), ? a cost not known.", "",
             "| row | PSNR | Full steps/chunk | speedup FLOP real (projection) | train core-h (demo CPU) | "
             "train FLOPs (real config) | optimizer steps | lineage |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        cost = costs[trained_source(row.spec)]
        cells = cost_columns(cost)
        lines.append(f"| {row.spec.display} | {row.quality.value:.2f} | "
                     f"{_fmt(row.figures.get('full_steps_per_chunk'))} | {row.speedup('flops_real'):.3f}x | "
                     f"{cells['train core-h (demo CPU)']} | {cells['train FLOPs (real config)']} | {cost['steps']} | "
                     f"{cells['lineage']} |")
    return lines


def extra_teacher_steps(rows: Sequence[RowResult], axis: str = "flops_run") -> dict[str, float]:
    """{row key: its cost above the 1-step sampler's, in Full Teacher steps per chunk} on `axis`: one Full step per
    chunk costs what a 2-step sampler costs more than the 1-step sampler (their plans differ by exactly one Full
    step in every scheduled chunk). Empty when the 1-step or no 2-step sampler is a row."""
    by_key = {row.spec.key: row for row in rows}
    one = by_key.get(DEFAULT_BASELINE)
    two = next((row for row in rows if row.spec.family == "sampler" and row.spec.key.startswith("sampler_2step_")),
               None)
    if one is None or two is None:
        return {}
    step = two.costs[axis] - one.costs[axis]
    return {row.spec.key: (row.costs[axis] - one.costs[axis]) / step for row in rows}


def headline_lines(analysis: dict) -> list[str]:
    """One line per trained row (Predictors, students): what it buys over the 1-step sampler and for how many more
    Teacher steps per chunk, its margin over the baselines' front on the FLOP axis of the config that ran, and its
    quality against F-F-F-F and the ground truth, temporal jitter and revisits beside."""
    rows: list[RowResult] = analysis["rows"]
    extra = extra_teacher_steps(rows)
    lines = []
    for row in rows:
        if row.spec.family not in (PREDICTOR_FAMILY, "student"):
            continue
        figures = row.figures
        parts = [f"**{row.spec.display}**: PSNR vs F-F-F-F {row.quality.value:.2f} dB "
                 f"[{row.quality.low:.2f}, {row.quality.high:.2f}]"]
        if row.vs_baseline is not None and analysis["baseline"] == DEFAULT_BASELINE:
            parts.append(f"{row.vs_baseline.format()} dB over the 1-step sampler")
        if row.spec.key in extra:
            parts.append(f"for {extra[row.spec.key]:+.2f} Teacher steps per chunk (FLOPs of the config that ran)")
        if "flops_run" in row.margins:
            margin, front = row.margins["flops_run"]
            parts.append(f"margin over the baselines' front {margin.format()} dB (front there: {front})")
        parts.append(f"GT PSNR / SSIM (chunks 1..) {_fmt(figures.get('gt_psnr_after_first_chunk'))} / "
                     f"{_fmt(figures.get('gt_ssim_after_first_chunk'), 3)}")
        parts.append(f"temporal-Δ MSE {_fmt(figures.get('temporal_delta_mse'), 5)}")
        parts.append(f"revisit self-PSNR {_fmt(figures.get('revisit_self_psnr'))}")
        lines.append("- " + "; ".join(parts))
    return lines


def speedup_cell(row: RowResult, axis: str) -> str:
    """'1.64×'; on the measured DiT axis with the interquartile range of the per-video speedups: '1.73× [1.65, 1.80]'
    (what to quote on a shared machine, docs/leaderboard.md § Measured speed)."""
    text = f"{row.speedup(axis):.2f}×"
    low, high = (row.figures.get(f"{MEASURED_SPREAD_PREFIX}{part}") for part in ("q25", "q75"))
    if axis != "measured_dit" or low is None or high is None:
        return text
    return f"{text} [{low:.2f}, {high:.2f}]"


def teacache_notes(rows: Sequence[RowResult]) -> list[str]:
    """Markdown lines on the TeaCache rows: each one's target, its threshold, the Full steps per chunk it reached on
    the calibration videos and the ones it ran here, and whether it reached its target (within
    TEACACHE_TOLERANCE); nothing without such rows."""
    adaptive = [row for row in rows if row.spec.adaptive is not None and row.spec.adaptive.get("threshold") is not None]
    if not adaptive:
        return []
    lines = ["", "## TeaCache: the targets and what ran", "",
             "A fixed threshold reaches a count between two whole numbers of Full steps only through the chunk-to-chunk "
             "spread of the accumulated distance, so a fractional target may land elsewhere on another split "
             "(docs/leaderboard.md § TeaCache's targets).", "",
             "| row | target | threshold | on the calibration videos | here | reached |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for row in adaptive:
        setting = row.spec.adaptive
        target, here = setting["target_full_steps"], row.figures.get("full_steps_per_chunk")
        calibration = setting.get("calibration_full_steps")
        reached = here is not None and abs(here - target) <= TEACACHE_TOLERANCE
        lines.append(f"| {row.spec.display} | {target:g} | {setting['threshold']:.4g} | {_fmt(calibration)} | "
                     f"{_fmt(here)} | {'yes' if reached else f'no: ran {here - target:+.2f} from its target'} |")
    return lines


def markdown(analysis: dict, header: dict) -> str:
    rows: list[RowResult] = analysis["rows"]
    baseline = analysis["baseline"]
    unit = analysis.get("bootstrap_unit", "video")
    lines = [f"# Leaderboard: {header['split']} ({analysis['num_videos']} videos, {analysis['num_units']} units "
             f"of video x seed, {analysis.get('num_clusters', analysis['num_videos'])} {unit}s)", ""]
    lines += [f"- {key}: {value}" for key, value in header.items() if key not in ("split",)]
    headline = headline_lines(analysis)
    if headline:
        lines += ["", "## Headline (the FLOP axis of the config that ran; the real-config axis is a projection)", "",
                  *headline]
    lines += ["", "Quality is PSNR against F-F-F-F of the same seed (dB; mean over videos, every video counting "
              f"once; bracket: paired bootstrap 95 % interval resampling {unit}s, a {unit}'s "
              f"videos and seeds together, {analysis['resamples']} resamples). Speedups: FLOP bound on the config "
              "that ran / at the real 8.6B config (a projection: the demo's quality at the real model's per-step "
              "costs, not a measurement of the real model) / measured DiT [interquartile range of the per-video "
              "speedups] / measured end-to-end. ★: on the quality-cost front of all rows on the real-config FLOP "
              "axis. Δ: difference from "
              f"`{baseline}` (paired; **bold** where the interval excludes 0).", "",
              "## Cost and quality against F-F-F-F", "",
              "| row | plan | Full steps/chunk | speedup FLOP run | FLOP real (projection) | measured DiT | e2e | "
              "PSNR [95 % CI] | "
              f"Δ vs {baseline} | SSIM | LPIPS | last chunk PSNR | temporal-Δ MSE | |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in rows:
        quality = "∞" if row.spec.key == REFERENCE else (
            f"{row.quality.value:.2f} [{row.quality.low:.2f}, {row.quality.high:.2f}]")
        delta = "–" if row.vs_baseline is None else row.vs_baseline.format()
        if row.vs_baseline is not None and row.vs_baseline.excludes_zero:
            delta = f"**{delta}**"
        figures = row.figures
        lines.append(
            f"| {row.spec.display} | {row.spec.plan} | {_fmt(figures.get('full_steps_per_chunk'))} | "
            + " | ".join(speedup_cell(row, axis) for axis in COST_AXES)
            + f" | {quality} | {delta} | {_fmt(figures.get('ssim'), 3)} | {_fmt(figures.get('lpips'), 3)} | "
            f"{_fmt(figures.get('last_chunk_psnr'))} | {_fmt(figures.get('temporal_delta_mse'), 5)} | "
            f"{'★' if row.on_front else ''} |")
    predictors = [row for row in rows if not row.spec.baseline]
    if predictors:
        lines += ["", "## Predictors against the front of the baselines (samplers, caches, students)", "",
                  "Margin = the row's PSNR minus the best the baselines reach at the same cost (a measured row, or a "
                  "per-chunk time-sharing of a cheaper and a dearer one, interpolated in MSE); negative: dominated. "
                  "**Bold** where the interval excludes 0.", "",
                  "| row | margin, FLOP run axis | front there | margin, real-config FLOP axis (projection) | "
                  "front there | margin, measured DiT axis |",
                  "| --- | ---: | --- | ---: | --- | ---: |"]
        for row in predictors:
            cells = []
            for axis in MARGIN_AXES:
                estimate, front = row.margins[axis]
                text = estimate.format()
                cells.append(f"**{text}**" if estimate.excludes_zero else text)
                if axis != "measured_dit":
                    cells.append(front)
            lines.append(f"| {row.spec.display} | " + " | ".join(cells) + " |")
    if any("gt_psnr_after_first_chunk" in row.figures for row in rows) or any(
            row.figures.get("revisit_self_psnr") is not None for row in rows):
        lines += ["", "## Against the ground truth (chunks 1..) and at revisited cameras", "",
                  "| row | GT PSNR | GT SSIM | revisit self-PSNR | return − first visit |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for row in rows:
            figures = row.figures
            lines.append(f"| {row.spec.display} | {_fmt(figures.get('gt_psnr_after_first_chunk'))} | "
                         f"{_fmt(figures.get('gt_ssim_after_first_chunk'), 3)} | "
                         f"{_fmt(figures.get('revisit_self_psnr'))} | "
                         f"{_fmt(figures.get('revisit_return_minus_first_visit'))} |")
    lines += training_cost_section(analysis)
    lines += teacache_notes(rows)
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("key", "family", "plan", "checkpoint", "context_mode", "full_steps_per_chunk",
              *(f"speedup_{axis}" for axis in COST_AXES), "psnr", "psnr_low", "psnr_high", "delta_vs_baseline",
              "delta_low", "delta_high", *(f"margin_{axis}{part}" for axis in MARGIN_AXES
                                           for part in ("", "_low", "_high")),
              "ssim", "lpips", "last_chunk_psnr", "temporal_delta_mse", "gt_psnr_after_first_chunk",
              "gt_ssim_after_first_chunk", "revisit_self_psnr", "revisit_return_minus_first_visit", "on_front",
              "train_core_hours", "train_flops_real", "train_lineage_complete",
              *(f"{MEASURED_SPREAD_PREFIX}{part}" for part in MEASURED_SPREAD_PARTS))


def csv_text(analysis: dict) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in analysis["rows"]:
        record = {"key": row.spec.key, "family": row.spec.family, "plan": row.spec.plan,
                  "checkpoint": row.spec.checkpoint or "", "context_mode": row.spec.context_mode,
                  "psnr": row.quality.value, "psnr_low": row.quality.low, "psnr_high": row.quality.high,
                  "on_front": int(row.on_front)}
        record.update({f"speedup_{axis}": row.speedup(axis) for axis in COST_AXES})
        if row.vs_baseline is not None:
            record.update(delta_vs_baseline=row.vs_baseline.value, delta_low=row.vs_baseline.low,
                          delta_high=row.vs_baseline.high)
        for axis, (estimate, _) in row.margins.items():
            record.update({f"margin_{axis}": estimate.value, f"margin_{axis}_low": estimate.low,
                           f"margin_{axis}_high": estimate.high})
        record.update({key: value for key, value in row.figures.items() if key in CSV_FIELDS})
        cost = (analysis.get("training_costs") or {}).get(trained_source(row.spec))
        if cost is not None:
            record.update(train_core_hours=cost["core_hours"], train_flops_real=cost["flops"],
                          train_lineage_complete=int(cost["lineage_complete"]))
        writer.writerow(record)
    return buffer.getvalue()


def label_points(ax, points: list[tuple[str, float, float]]) -> None:
    """Name each (label, x, y) point beside it: labels of the right half point left, so the plot's edge does not
    cut them, and a label that would cover an already-labelled point (within 3 % of the y range, and within the
    label's own width along x, estimated from its length) moves one line down per such point, so rows at one cost
    or a long Predictor label beside a mixture do not print over each other."""
    if not points:
        return
    xs = [x for _, x, _ in points]
    ys = [y for _, _, y in points]
    x_mid = (min(xs) + max(xs)) / 2
    x_span = max(max(xs) - min(xs), 1e-9)
    y_near = 0.03 * max(max(ys) - min(ys), 1e-9)
    placed: list[tuple[float, float]] = []
    for label, x, y in sorted(points, key=lambda point: -point[2]):
        right = x > x_mid
        width = 0.02 * x_span + 0.0045 * 1.15 * x_span * len(label)  # fontsize 6 on a 9-inch figure
        low, high = (x - width, x) if right else (x, x + width)
        crowd = sum(low - 0.02 * x_span <= px <= high + 0.02 * x_span and abs(y - py) < y_near for px, py in placed)
        placed.append((x, y))
        ax.annotate(label, (x, y), fontsize=6, xytext=(-4 if right else 3, 2 - 8 * crowd),
                    textcoords="offset points", ha="right" if right else "left")


def point_label(panel: str, cost: dict | None) -> str:
    """A plot point's name: a trained row's carries its training cost (real-config FLOPs, demo core-hours)."""
    if cost is None:
        return panel
    cells = cost_columns(cost)
    return (f"{panel} [train {cells['train FLOPs (real config)']} FLOP, "
            f"{cells['train core-h (demo CPU)']} core-h]")


def plot_pareto(path: Path, analysis: dict, axis: str, title: str) -> None:
    """Quality vs speedup on one cost axis: every row with its interval bar, the baselines' front (mixtures in MSE)
    as a line, the Predictors highlighted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in analysis["rows"] if row.spec.key != REFERENCE]
    weights = analysis["weights"]
    baselines = [FrontRow(row.spec.key, row.costs[axis], row.psnr) for row in analysis["rows"] if row.spec.baseline]
    speedups = [row.speedup(axis) for row in rows]
    grid = np.linspace(1.0 / max(speedups) * 0.999, 1.0, 200)
    curve = front_curve(grid, baselines, weights)
    finite = np.isfinite(curve)
    colours = {"sampler": "tab:blue", "cache": "tab:green", "mixture": "tab:cyan", "reference": "tab:gray",
               "student": "tab:purple", PREDICTOR_FAMILY: "tab:red"}
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(1.0 / grid[finite], curve[finite], color="black", lw=1, label="front of the baselines")
    for family, colour in colours.items():
        members = [row for row in rows if row.spec.family == family]
        if not members:
            continue
        x = [row.speedup(axis) for row in members]
        y = [row.quality.value for row in members]
        err = [[row.quality.value - row.quality.low for row in members],
               [row.quality.high - row.quality.value for row in members]]
        ax.errorbar(x, y, yerr=err, fmt="o" if family != PREDICTOR_FAMILY else "*", ms=5 if family !=
                    PREDICTOR_FAMILY else 11, color=colour, capsize=2, lw=0.8, label=family)
    costs = analysis.get("training_costs") or {}
    label_points(ax, [(point_label(row.spec.panel, costs.get(trained_source(row.spec))), row.speedup(axis),
                       row.quality.value) for row in rows])
    ax.set_xlabel(f"speedup over F-F-F-F ({COST_AXES[axis]})")
    ax.set_ylabel("PSNR vs F-F-F-F (dB), 95 % interval")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    tmp.replace(path)


def write_leaderboard(out_dir: Path, analysis: dict, header: dict) -> list[str]:
    """leaderboard.md / .csv / .json and pareto_<axis>.png (flops_run, flops_real, measured_dit)."""
    out_dir = Path(out_dir)
    write_text_atomic(out_dir / "leaderboard.md", markdown(analysis, header))
    write_text_atomic(out_dir / "leaderboard.csv", csv_text(analysis))
    write_json_atomic(out_dir / "leaderboard.json", jsonable({
        "header": header, "num_videos": analysis["num_videos"], "num_units": analysis["num_units"],
        "baseline": analysis["baseline"], "resamples": analysis["resamples"],
        "rows": [row_record(row) for row in analysis["rows"]],
        "training_costs": analysis.get("training_costs") or {}}))
    written = ["leaderboard.md", "leaderboard.csv", "leaderboard.json"]
    for axis in MARGIN_AXES:
        name = f"pareto_{axis}.png"
        plot_pareto(out_dir / name, analysis, axis, f"{header['split']}: {COST_AXES[axis]} "
                    f"({analysis['num_videos']} videos)")
        written.append(name)
    return written


def front_keys(analysis: dict, limit: int = 6) -> list[str]:
    """The rows a side-by-side shows: the reference, every Predictor row, and the baselines on the front (on the
    real-config FLOP axis), fastest first, at most `limit` baselines."""
    rows = analysis["rows"]
    baselines = sorted((row for row in rows if row.spec.baseline and row.on_front and row.spec.key != REFERENCE),
                       key=lambda row: -row.speedup("flops_real"))[:limit]
    return [REFERENCE] + [row.spec.key for row in baselines] + [row.spec.key for row in rows
                                                                 if not row.spec.baseline]


def write_front_side_by_side(out_dir: Path, settings, keys: Sequence[str], specs: Sequence[RowSpec], checkpoints,
                             device, num_videos: int, students: Sequence[StudentSource] = ()) -> list[str]:
    """front/side_by_side/<key>.mp4 for the first `num_videos` videos: [ground truth |] the rows `keys` (rolled out
    again, seed of the table)."""
    by_key = {spec.key: spec for spec in specs}
    chosen = [by_key[key] for key in keys]
    teacher = load_teacher(settings.teacher_source, device, settings.dtype)
    labels = {spec.checkpoint for spec in chosen if spec.checkpoint}
    predictors = {ckpt.label: (load_predictor(teacher, ckpt), ckpt) for ckpt in checkpoints if ckpt.label in labels}
    wanted = {spec.student for spec in chosen if spec.student}
    models = {student.label: load_student(student, settings.teacher_source, device, settings.dtype)
              for student in students if student.label in wanted}
    methods = [build_method(spec, teacher, predictors, models) for spec in chosen]
    dataset = open_dataset(settings)
    runtime = build_runtime(settings, teacher, methods, dataset, device)
    indices = list(range(min(num_videos, len(dataset))))
    names = [video_key(*dataset.keys()[index]) for index in indices]
    truth = {} if settings.ground_truth is None else find_ground_truth_videos(settings.ground_truth, names)
    written = []
    for index, name in zip(indices, names):
        item = dataset[index]
        case = dataset.load_case(item["case_id"])
        frames = {method.name: runtime.decoder.decode(runtime.rollout(
            method, runtime.text_kv(case, method.model)[0], item, case, Stopwatch(device)).latents)
            for method in methods}
        if name in truth:
            frames[GROUND_TRUTH] = load_ground_truth(truth[name], tuple(frames[REFERENCE].shape[:3]))
        written.append("front/" + write_side_by_side(Path(out_dir) / "front", name, frames, methods, settings.fps,
                                                     settings.side_by_side_scale))
    return written


def leaderboard_command(run_dir: Path, *, dataset_root: Path, world_size: int) -> str:
    """The command that puts a finished Predictor run on the leaderboard (the recipes' closing line): its training
    state at its trained plan, against the samplers and caches, on the first held-out split its dataset records
    (holdout25 when it has one). Demo data (sample tables beside a demo_config.json) gets the demo form; a real
    dataset the real one, with $VAE and $ALEXNET left to the user (docs/walkthrough.md § Paths)."""
    config = read_json_file(Path(dataset_root) / DATASET_CONFIG_NAME)
    held_out = [split for split in config.get("splits", []) if split != "train"]
    split = "holdout25" if "holdout25" in held_out or not held_out else held_out[0]
    tables = config.get("sample_tables") or []
    samples = Path(tables[0]).parent if tables else None
    if samples is not None and (samples.parent / "demo_config.json").is_file():
        inputs = f"--demo {samples.parent} --lpips_random_backbone"
    else:
        inputs = (f"--samples_dir {samples or '$SAMPLES'} --dataset_root {dataset_root} --vae $VAE "
                  "--lpips_alexnet $ALEXNET")
    launcher = f"torchrun --nproc_per_node {world_size}" if world_size > 1 else "python"
    return (f"{launcher} tools/leaderboard.py {inputs} --split {split} --ckpt {Path(run_dir) / 'training_latest.pt'} "
            "--predictor_plans trained")
