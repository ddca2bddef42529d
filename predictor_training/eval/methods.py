"""What the evaluation compares: the replacement schedule and the methods that fill a replaced step.

    reference        F-F-F-F in every chunk
    reuse_velocity   a replaced step k reuses the previous step's velocity:        v_k = v_{k-1}
    reuse_hidden     a replaced step k reuses the previous hidden through the final layer:
                     h_k = h_{k-1},  v_k = final_layer(h_{k-1}, vec_k)   (what an untrained Predictor computes)
    predictor_<ckpt> a replaced step k runs the Predictor (see `PredictorMethod`)

Context modes (`--context_modes`, predictor_training/teacher/frame_kv_cache.py): every method above runs with the exact
context (each chunk re-prefills its selected context frames: the reference). For another mode M, the reference and
each Predictor also run once more with the context K/V of mode M, as `reference@M` and `predictor_<ckpt>@M`
(`with_context_mode`); the reuse baselines are not repeated. Every metric and speedup stays measured against the
exact reference.

With ground truth (`--ground_truth`), every method is also scored against the ground-truth video, next to one
baseline that is no rollout at all:

    repeat_first_frame   the ground truth's first frame held still for the whole video ("does the model do better
                         than a still image?")

A `PlannedMethod` (the leaderboard's rows, predictor_training/eval/leaderboard.py) carries its own `StepPlan`: one
letter per step naming what fills it (F Full, R velocity reuse, H hidden reuse, P a Predictor, T / C / A / B the
training-free caches of predictor_training/eval/caches.py), so one run compares methods of different schedules.

`make_step_fn` turns a method into the `ar_rollout.ARRollout` step hook and records the FLOP-count step kind of
every (chunk, step) that ran.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from predictor_training.rollout.policy import StepCall, StepFn, StepOutput
from predictor_training.teacher.frame_kv_cache import CONTEXT_MODES, check_context_mode
from predictor_training.predictor.model import Predictor
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.schedule import FULL_STEP_LETTERS, StepPlan

REFERENCE = "reference"
REUSE_VELOCITY = "reuse_velocity"
REUSE_HIDDEN = "reuse_hidden"
PREDICTOR_PREFIX = "predictor_"
REPEAT_FIRST_FRAME = "repeat_first_frame"  # ground-truth baseline, scored against the ground truth only
EXACT_CONTEXT = "exact"  # the reference context mode: every chunk re-prefills its context (always run)
CONTEXT_MODE_SEPARATOR = "@"  # method key of a method under another context mode: f"{name}@{mode}"


# =============================================================================================================
# 1. The Predictor checkpoints an evaluation compares
# =============================================================================================================
@dataclass(frozen=True)
class PredictorCheckpoint:
    """One `--ckpt`: an inference file (`predictor_step_XXXXX.safetensors`) or a `training_latest.pt`.

    run_name: the training run directory's name; step: the checkpoint's optimizer step; meta: variant,
    source_blocks, precision (+ step); predictor_config: `Predictor.predictor_config()` saved with the run config;
    label: unique name within this eval (`ckptstep300`, or `<run>_ckptstep300` across runs); panel: the short
    side-by-side label (`ckptstep300`, or `#<position in --ckpt> ckptstep300` across runs).
    """

    path: Path
    run_name: str
    step: int
    meta: dict
    predictor_config: dict
    run_flags: dict
    label: str = ""
    panel: str = ""

    @property
    def method(self) -> str:
        return f"{PREDICTOR_PREFIX}{self.label}"

    @property
    def variant(self) -> str:
        return self.predictor_config["variant"]


# =============================================================================================================
# 2. Methods: what runs at a replaced step
# =============================================================================================================
class Method:
    """A way to fill the replaced steps. name: output key; kind: the FLOP-count step kind; timer: stopwatch name;
    panel: side-by-side label; context_mode: how the rollout obtains each chunk's context K/V (`RolloutConfig.
    context_mode`; "exact" unless the method is a `with_context_mode` copy); model: the transformer the method's
    rollout runs (its text and context prefills and its Full steps), None for the Teacher (a student row's own);
    residual_blocks: the Teacher blocks its block-residual steps run (the FLOP count's; None when it has none)."""

    name: str
    kind: str
    timer: str
    panel: str
    context_mode: str = EXACT_CONTEXT
    model: WorldPlayTransformer | None = None
    residual_blocks: int | None = None

    def replaced_step(self, call: StepCall) -> StepOutput:
        raise NotImplementedError

    def fill(self, call: StepCall, history: Sequence["DoneStep"]) -> StepOutput:
        """The step as one letter of a `PlannedMethod` (history: this chunk's earlier steps; unused here)."""
        return self.replaced_step(call)

    def run_step(self, call: StepCall, plan: StepPlan, stopwatch: Stopwatch,
                 autocast: Callable) -> tuple[StepOutput, str]:
        """One step under the eval's `plan` (the method fills every step it does not run Full): (output, FLOP-count
        step kind)."""
        if not plan.replaces(call.chunk_index, call.step_index):
            with stopwatch.measure("full_step"):
                return call.run_teacher(), "full"
        with stopwatch.measure(self.timer), autocast():
            return self.replaced_step(call), self.kind


class ReferenceMethod(Method):
    name = REFERENCE
    kind = "full"
    timer = "full_step"
    panel = "reference"

    def replaced_step(self, call: StepCall) -> StepOutput:
        raise RuntimeError("the reference never replaces a step")

    def run_step(self, call: StepCall, plan: StepPlan, stopwatch: Stopwatch,
                 autocast: Callable) -> tuple[StepOutput, str]:
        with stopwatch.measure("full_step"):
            return call.run_teacher(), "full"


class VelocityReuse(Method):
    name = REUSE_VELOCITY
    kind = REUSE_VELOCITY
    timer = "reuse_step"
    panel = "reuse v"

    def replaced_step(self, call: StepCall) -> StepOutput:
        return StepOutput(velocity=call.previous.velocity, final_hidden=call.previous.final_hidden)


class HiddenReuse(Method):
    name = REUSE_HIDDEN
    kind = REUSE_HIDDEN
    timer = "reuse_step"
    panel = "reuse h"

    def __init__(self, teacher: WorldPlayTransformer):
        self.teacher = teacher

    def replaced_step(self, call: StepCall) -> StepOutput:
        """v_k = final_layer(h_{k-1}, vec_k), vec_k = time_in(t_k) + action_in(a); the hidden is carried on."""
        hidden = call.previous.final_hidden
        _, _, frames, height, width = call.latent.shape
        vec = self.teacher.frame_vec(call.timestep, call.action)  # [1, T, D]
        tokens = self.teacher.final_projection(hidden, vec, height * width)
        return StepOutput(velocity=self.teacher.unpatchify(tokens, frames, height, width), final_hidden=hidden)


class PredictorMethod(Method):
    """A replaced step k runs the Predictor: anchor = the Teacher's h_0 at step 1, then its own pred_h; v4 also gets
    this rollout's previous-chunk hidden of the same step and the exact context K/V of its source layers from the
    Teacher's prefill of this chunk. name / panel come from the checkpoint's label."""

    kind = "predictor"
    timer = "predictor_step"

    def __init__(self, predictor: Predictor, ckpt: PredictorCheckpoint):
        self.predictor = predictor
        self.ckpt = ckpt
        self.name = ckpt.method
        self.panel = f"P {ckpt.panel}"

    def replaced_step(self, call: StepCall) -> StepOutput:
        """Anchor = previous step's hidden (Teacher h_0, then this Predictor's own pred_h). v4: exact context K/V of
        the source layers and the previous chunk's hidden of the same step, both from this very rollout."""
        blocks = self.predictor.source_blocks
        context, prev_chunk_hidden = None, None
        if self.predictor.variant == "v4":
            if call.context.kv is None or call.previous_chunk is None:
                raise RuntimeError(
                    f"chunk {call.chunk_index}: the v4 Predictor needs context K/V and a previous chunk (run chunk 0 "
                    "F-F-F-F)"
                )
            context = call.context.kv.select(blocks)
            prev_chunk_hidden = call.previous_chunk[call.step_index].final_hidden
        # rope_start: the Predictor's default (n_ctx for v4, 0 for disca), as in both trainers
        pred_hidden, pred_velocity = self.predictor(
            call.model_input, call.previous.final_hidden, call.timestep[None], call.action, call.viewmats, call.Ks,
            call.text_kv.select(blocks), context=context, prev_chunk_hidden=prev_chunk_hidden,
        )
        return StepOutput(velocity=pred_velocity, final_hidden=pred_hidden)


@dataclass
class DoneStep:
    """A finished step of the chunk being denoised: its index, noise level sigma (= timestep / 1000), output, and
    whether the Full Teacher computed it."""

    step: int
    sigma: float
    output: StepOutput
    full: bool


class PlannedMethod(Method):
    """A method with its own `StepPlan`: each step's letter picks what fills it (see `rollout.schedule.PLAN_LETTERS`).

    fillers: letter -> a method whose `fill(call, history)` computes that step (R `VelocityReuse`, H `HiddenReuse`,
    P a `PredictorMethod`, T / C / B from eval/caches.py); adaptive: the rule of the letter A (`caches.AdaptiveSkip`),
    which sees every step of the chunks it runs in; model: the transformer of the row's rollout (a student's, for a
    plan of S steps; None: the Teacher). In a plan with B the Full steps run through the B filler's `full_step`
    (the same Full step, which also caches the residuals B reads). The eval's plan is ignored: the method's own is
    its schedule.
    """

    kind = "planned"
    timer = "planned_step"

    def __init__(self, name: str, plan: StepPlan, fillers: dict[str, Method], panel: str, adaptive=None,
                 ckpt: "PredictorCheckpoint | None" = None, model: WorldPlayTransformer | None = None):
        missing = sorted(plan.letters_used - set(fillers) - set(FULL_STEP_LETTERS) - {"A"})
        if missing:
            raise ValueError(f"{name}: plan {plan.text} uses {missing} but no method fills them")
        if ("A" in plan.letters_used) != (adaptive is not None):
            raise ValueError(f"{name}: the letter A needs an adaptive rule, and an adaptive rule the letter A")
        self.name, self.plan, self.fillers, self.panel = name, plan, dict(fillers), panel
        if ("S" in plan.letters_used) != (model is not None):
            raise ValueError(f"{name}: the letter S needs the row's own model, and a model of its own the letter S")
        self.adaptive, self.ckpt, self.model = adaptive, ckpt, model
        self.block_cache = self.fillers["B"] if "B" in plan.letters_used else None
        self.residual_blocks = None if self.block_cache is None else len(self.block_cache.blocks)
        self.history: list[DoneStep] = []

    def run_step(self, call: StepCall, plan: StepPlan, stopwatch: Stopwatch,
                 autocast: Callable) -> tuple[StepOutput, str]:
        if call.step_index == 0:
            self.history = []
        letter = self.plan.letter(call.chunk_index, call.step_index)
        pattern_adaptive = self.adaptive is not None and (not self.plan.chunk0_full or call.chunk_index > 0)
        if pattern_adaptive:  # the rule sees every step of its chunks: it probes Full steps too
            output, kind = self.adaptive.step(call, letter == "F", stopwatch, autocast)
        elif letter == "F" and self.block_cache is not None:
            with stopwatch.measure("full_step"), autocast():
                output, kind = self.block_cache.full_step(call), "full"
        elif letter in FULL_STEP_LETTERS:  # the rollout's own model: the Teacher's, or the student's for S
            with stopwatch.measure("full_step"):
                output, kind = call.run_teacher(), "full"
        else:
            filler = self.fillers[letter]
            with stopwatch.measure(filler.timer), autocast():
                output, kind = filler.fill(call, self.history), filler.kind
        self.history.append(DoneStep(call.step_index, float(call.timestep[0]) / 1000.0, output, kind == "full"))
        return output, kind


def make_step_fn(method: Method, plan: StepPlan | None, stopwatch: Stopwatch, autocast: Callable,
                 kinds: dict[tuple[int, int], str] | None = None) -> StepFn:
    """The ARRollout hook of `method` (`Method.run_step`: Full steps where the eval's `plan` or the method's own
    plan keeps them; None: a method that replaces nothing, the reference). `kinds`, when given, receives the FLOP-count step kind of every (chunk, step) that ran."""

    def step_fn(call: StepCall) -> StepOutput:
        output, kind = method.run_step(call, plan, stopwatch, autocast)
        if kinds is not None:
            kinds[(call.chunk_index, call.step_index)] = kind
        return output

    return step_fn


# =============================================================================================================
# 3. Context modes: the reference and the Predictors once more under another context mode
# =============================================================================================================
def parse_context_modes(text: str | Sequence[str]) -> tuple[str, ...]:
    """--context_modes "incremental,exact" (or a sequence of modes) -> ("exact", "incremental"): "exact" first
    (always run: the baseline of every metric and speedup), the others in the order of `CONTEXT_MODES`, each once.
    An unknown or empty entry is a ValueError naming the flag and the allowed values."""
    parts = [part.strip() for part in text.split(",")] if isinstance(text, str) else [str(part) for part in text]
    allowed = ", ".join(CONTEXT_MODES)
    if not parts or any(not part for part in parts):
        raise ValueError(f"--context_modes {text!r}: expected a comma-separated list of context modes from {allowed}")
    unknown = [part for part in parts if part not in CONTEXT_MODES]
    if unknown:
        raise ValueError(f"--context_modes {text!r}: unknown context mode(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {allowed}")
    return tuple(mode for mode in CONTEXT_MODES if mode == EXACT_CONTEXT or mode in parts)


def context_mode_name(name: str, mode: str) -> str:
    """Method key of `name` under context mode `mode`: `name` for exact, else f"{name}@{mode}"."""
    return name if mode == EXACT_CONTEXT else f"{name}{CONTEXT_MODE_SEPARATOR}{mode}"


def with_context_mode(method: Method, mode: str) -> Method:
    """A copy of `method` whose rollout uses context mode `mode`: name f"{name}@{mode}", side-by-side panel
    f"{panel} @{mode}". The copy shares the method's modules (a Predictor is not duplicated) and keeps its class, so
    a reference copy still runs F-F-F-F and counts Full steps only."""
    check_context_mode(mode)
    if method.context_mode != EXACT_CONTEXT:
        raise ValueError(f"{method.name} already runs in the {method.context_mode!r} context mode")
    if mode == EXACT_CONTEXT:
        return method
    other = copy.copy(method)
    other.name = context_mode_name(method.name, mode)
    other.panel = f"{method.panel} @{mode}"
    other.context_mode = mode
    return other


def add_context_modes(methods: Sequence[Method], modes: Sequence[str]) -> list[Method]:
    """`methods` (all exact) followed, for every mode of `modes` other than exact, by the reference and every
    Predictor (a `PredictorMethod`, or a `PlannedMethod` of a checkpoint) in that mode (grouped by mode); the reuse
    baselines are not repeated."""
    out = list(methods)
    for mode in modes:
        if mode != EXACT_CONTEXT:
            out += [with_context_mode(method, mode) for method in methods
                    if isinstance(method, (ReferenceMethod, PredictorMethod))
                    or isinstance(method, PlannedMethod) and method.ckpt is not None]
    return out
