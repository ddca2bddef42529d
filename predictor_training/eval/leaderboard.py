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

The leaderboard's modules: the rows and their methods (here), the trained students (eval/students.py), the
calibration of the adaptive rows (eval/adaptive_calibration.py), the analysis (eval/leaderboard_analysis.py), the
reports and plots (eval/leaderboard_report.py, eval/leaderboard_plots.py), the trained rows' training cost
(eval/training_cost.py) and the recipes' closing command (eval/leaderboard_command.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Sequence

from predictor_training.eval.caches import (
    AdaptiveSkip,
    BlockResidual,
    PreviousChunkReuse,
    TaylorForecast,
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
from predictor_training.eval.predictor_checkpoints import load_predictor
from predictor_training.eval.run import MethodRows, build_runtime, open_dataset
from predictor_training.eval.runtime import GROUND_TRUTH
from predictor_training.eval.students import StudentSource, load_student
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.schedule import StepPlan
from predictor_training.rollout.scheduler import flow_match_sigmas
from predictor_training.runtime.errors import UserInputError
from predictor_training.teacher.source import load_teacher
from predictor_training.video.ground_truth import find_ground_truth_videos, load_ground_truth, video_key

CACHE_LETTERS = {"reuse_hidden": "H", "taylor": "T", "prev_chunk": "C", "block_residual": "B"}
CACHES = (*CACHE_LETTERS, "teacache")
CACHE_TITLES = {"reuse_hidden": "hidden reuse", "taylor": "TaylorSeer forecast", "prev_chunk": "previous-chunk reuse",
                "block_residual": "block-residual cache"}
DEFAULT_RESIDUAL_BLOCKS = (0, -1)  # the B steps' Teacher blocks: the first and the last (eval/caches.BlockResidual)
COUNTERPART_LETTERS = ("H", "B")  # letters that stand in for P in every Predictor plan, as baseline rows
PREDICTOR_FAMILY = "predictor"
DEFAULT_BASELINE = "sampler_1step_frrr"  # the cheapest honest alternative: one Full step per chunk


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



def trained_source(spec: RowSpec) -> str | None:
    """The label of what a row trained (its Predictor or student; None for a training-free row)."""
    return spec.checkpoint or spec.student


# =============================================================================================================
# 2. The side-by-side videos of the front
# =============================================================================================================
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
