"""Training-free caches adapted to the AR chunk loop: what a user can run instead of training a Predictor.

Each fills a replaced step of a `PlannedMethod` (letters of `rollout.schedule.PLAN_LETTERS`); velocity reuse (R,
the fewer-step Euler sampler) and hidden reuse (H) live in eval/methods.py. Every chunk restarts from noise at step 0,
so a cache's state never crosses a chunk except where it reads the previous chunk on purpose (C, and T with one Full
step).

    T  TaylorForecast      TaylorSeer (Liu et al., "From Reusing to Forecasting: Accelerating Diffusion Models with
                           TaylorSeers", ICCV 2025): a feature at a skipped step is the first-order Taylor expansion
                           of the cached features of earlier Full steps, f(s) = f(s_b) + (s - s_b) (f(s_b) - f(s_a)) /
                           (s_b - s_a), here on the final hidden in sigma, then the Teacher's final layer.
    C  PreviousChunkReuse  the same step's output of the chunk before (temporal redundancy across chunks).
    A  AdaptiveSkip        TeaCache (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion
                           Model", CVPR 2025): accumulate the rescaled relative L1 change of the timestep-modulated
                           input, rel = |m_k - m_{k-1}|_1 / |m_{k-1}|_1, and skip while the sum stays below a
                           threshold; a skipped step adds the residual cached at the last Full step (hidden out minus
                           embedded input) to its own embedded input. The threshold is calibrated to a target number
                           of Full steps per chunk (`calibrate_threshold`).
    B  BlockResidual       a block-residual cache at the Predictor's block count (Delta-DiT, Chen et al., "Delta-DiT:
                           A Training-Free Acceleration Method Tailored for Diffusion Transformers", 2024; FORA,
                           Selvaraju et al., 2024): the input embedding and b chosen Teacher double blocks run on
                           this step's input with the chunk's text and context K/V, exactly as in a Full step; each
                           skipped span of blocks a..b is stood in for by the residual it added at the chunk's last
                           Full step, x_out(b) - x_in(a); then the final layer. With b = 2 it costs what a Predictor
                           step's two blocks cost (teacher/flops.py `block_residual_step_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from predictor_training.eval.methods import DoneStep, Method
from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.policy import StepCall, StepOutput
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.model import skipped_block_spans


def _final_layer_velocity(teacher: WorldPlayTransformer, hidden: Tensor, call: StepCall) -> Tensor:
    """v = final_layer(hidden, vec_k) at this step's timestep: hidden [1, 4*HW, D] -> velocity [1, C, 4, H, W]."""
    _, _, frames, height, width = call.latent.shape
    vec = teacher.frame_vec(call.timestep, call.action)
    return teacher.unpatchify(teacher.final_projection(hidden, vec, height * width), frames, height, width)


def taylor_forecast(earlier: DoneStep, later: DoneStep, sigma: float) -> Tensor:
    """First-order forecast of the final hidden at noise level `sigma` from two Full steps (float32 arithmetic, cast
    back): h(sigma) = h_b + (sigma - s_b) * (h_b - h_a) / (s_b - s_a)."""
    h_a, h_b = earlier.output.final_hidden.float(), later.output.final_hidden.float()
    slope = (h_b - h_a) / (later.sigma - earlier.sigma)
    return (h_b + (sigma - later.sigma) * slope).to(later.output.final_hidden.dtype)


class TaylorForecast(Method):
    """T: the final hidden forecast to this step's sigma from the chunk's last two Full steps. With one Full step
    (F-T-T-T) the slope comes from the previous chunk: h_k = h_j + (h'_k - h'_j), j the Full step, h' the previous
    chunk's hiddens at the same steps."""

    name = "taylor_forecast"
    kind = "forecast"
    timer = "forecast_step"
    panel = "taylor"

    def __init__(self, teacher: WorldPlayTransformer):
        self.teacher = teacher

    def fill(self, call: StepCall, history: Sequence[DoneStep]) -> StepOutput:
        full = [step for step in history if step.full]
        if not full:
            raise RuntimeError(f"chunk {call.chunk_index} step {call.step_index}: no Full step to forecast from")
        sigma = float(call.timestep[0]) / 1000.0
        if len(full) >= 2:
            hidden = taylor_forecast(full[-2], full[-1], sigma)
        else:
            if call.previous_chunk is None:
                raise RuntimeError(f"chunk {call.chunk_index}: one Full step and no previous chunk to take the "
                                   "forecast's slope from")
            anchor = full[-1]
            previous = call.previous_chunk
            delta = previous[call.step_index].final_hidden.float() - previous[anchor.step].final_hidden.float()
            hidden = (anchor.output.final_hidden.float() + delta).to(anchor.output.final_hidden.dtype)
        return StepOutput(velocity=_final_layer_velocity(self.teacher, hidden, call), final_hidden=hidden)


class PreviousChunkReuse(Method):
    """C: the previous chunk's output of the same step (velocity and hidden), no model call."""

    name = "previous_chunk_reuse"
    kind = "reuse_velocity"
    timer = "reuse_step"
    panel = "prev chunk"

    def fill(self, call: StepCall, history: Sequence[DoneStep]) -> StepOutput:
        if call.previous_chunk is None:
            raise RuntimeError(f"chunk {call.chunk_index}: previous-chunk reuse needs a previous chunk")
        previous = call.previous_chunk[call.step_index]
        return StepOutput(velocity=previous.velocity, final_hidden=previous.final_hidden)


def resolve_blocks(blocks: Sequence[int], depth: int) -> tuple[int, ...]:
    """Block indices with Python's negative indexing resolved against `depth` (0,-1 -> 0, depth-1), ascending; a
    repeated or out-of-range index is a ValueError."""
    resolved = [int(index) + depth if int(index) < 0 else int(index) for index in blocks]
    if not resolved or len(set(resolved)) != len(resolved) or any(not 0 <= index < depth for index in resolved):
        raise ValueError(f"block-residual blocks {list(blocks)}: expected distinct indices of the Teacher's {depth} "
                         "double blocks (negative counts from the last)")
    return tuple(sorted(resolved))


class BlockResidual(Method):
    """B: the block-residual cache (see the module docstring). blocks: the Teacher double blocks a B step runs
    (negative indices count from the last; default in the leaderboard: 0,-1).

    Why the first and the last block by default: with the Predictor's budget of two blocks, one contiguous skipped
    span keeps one cached residual per chunk (Delta-DiT's form: the offset of a run of consecutive blocks), the
    first block computes on the step's own input at its own timestep (where TeaCache's indicator says a step's
    change enters), and the last block writes the hidden the final layer reads. The Predictor's source blocks
    (1, depth-2; three spans) are the other natural choice and one setting away (`--block_residual_blocks 1,-2`).

    Every Full step of a plan with B runs through `full_step`, which is the Teacher's Full step
    (`chunk_step_blocks` over every block, same inputs, text and context K/V and RoPE start as `run_teacher`) that
    also keeps the hiddens at the spans' ends, so the residuals come from the chunk's last Full step. A B step
    with no Full step before it in its chunk is an error (step 0 is always Full). Exact context only: the Full step
    here keeps no raw K/V for the cached context modes (baseline rows never run in them)."""

    name = "block_residual"
    kind = "block_residual"
    timer = "block_residual_step"
    panel = "block residual"

    def __init__(self, teacher: WorldPlayTransformer, blocks: Sequence[int]):
        self.teacher = teacher
        self.blocks = resolve_blocks(blocks, teacher.num_layers)
        self.spans = skipped_block_spans(teacher.num_layers, self.blocks)
        self.boundaries = sorted({first for first, _ in self.spans} | {last + 1 for _, last in self.spans})
        self.residuals: dict[int, Tensor] | None = None
        self.residual_chunk = -1  # the chunk whose Full step the residuals come from

    def _inputs(self, call: StepCall) -> tuple:
        return (call.model_input, call.timestep, call.action, call.viewmats, call.Ks, call.text_kv,
                call.context.kv, call.rope_start)

    def full_step(self, call: StepCall) -> StepOutput:
        """The Full Teacher step of `call` that also caches x_out(b) - x_in(a) of every skipped span a..b."""
        output, hiddens = self.teacher.chunk_step_blocks(*self._inputs(call), keep_hidden=self.boundaries)
        self.residuals = {first: hiddens[last + 1] - hiddens[first] for first, last in self.spans}
        self.residual_chunk = call.chunk_index
        return StepOutput(velocity=output.velocity, final_hidden=output.final_hidden)

    def fill(self, call: StepCall, history: Sequence[DoneStep]) -> StepOutput:
        if self.residuals is None or self.residual_chunk != call.chunk_index:
            raise RuntimeError(f"chunk {call.chunk_index} step {call.step_index}: a block-residual step needs a Full "
                               "step of its chunk before it (run by `BlockResidual.full_step`)")
        output, _ = self.teacher.chunk_step_blocks(*self._inputs(call), run_blocks=self.blocks,
                                                   span_residuals=self.residuals)
        return StepOutput(velocity=output.velocity, final_hidden=output.final_hidden)


def relative_l1(current: Tensor, previous: Tensor) -> float:
    """|current - previous|_1 / |previous|_1 (float64)."""
    return float((current.double() - previous.double()).abs().mean() / previous.double().abs().mean())


@dataclass
class AdaptiveSkip:
    """A: TeaCache's rule on one chunk at a time (see the module docstring).

    threshold: the accumulated distance at which a step is computed again; rescale: polynomial coefficients
    (highest power first, `numpy.polyval`) mapping the input's relative L1 change to the output's, fitted on
    reference rollouts by `fit_rescale`. Step 0 and every step the plan marks F are always computed.
    """

    teacher: WorldPlayTransformer
    threshold: float
    rescale: tuple[float, ...] = (1.0, 0.0)
    kind: str = "cache_residual"
    timer: str = "cache_step"

    def __post_init__(self):
        self.accumulated = 0.0
        self.previous_modulated: Tensor | None = None
        self.residual: Tensor | None = None
        self.observed: list[tuple[float, float]] = []  # (input rel-L1, output rel-L1) of consecutive Full steps
        self._last_full_step = -1

    def step(self, call: StepCall, forced: bool, stopwatch: Stopwatch, autocast: Callable) -> tuple[StepOutput, str]:
        with stopwatch.measure("cache_probe"), torch.no_grad(), autocast():
            embedded, modulated, vec = self.teacher.modulated_input(call.model_input, call.timestep, call.action)
        if call.step_index == 0:
            self.accumulated, distance = 0.0, None
        else:
            distance = relative_l1(modulated, self.previous_modulated)
            self.accumulated += float(np.polyval(self.rescale, distance))
        self.previous_modulated = modulated
        if forced or call.step_index == 0 or self.accumulated >= self.threshold:
            with stopwatch.measure("full_step"):
                output = call.run_teacher()
            if distance is not None and call.previous is not None and self._last_full_step == call.step_index - 1:
                self.observed.append((distance, relative_l1(output.velocity, call.previous.velocity)))
            self._last_full_step = call.step_index
            self.accumulated = 0.0
            self.residual = output.final_hidden - embedded
            return output, "full"
        with stopwatch.measure(self.timer), autocast():
            _, _, frames, height, width = call.latent.shape
            hidden = embedded + self.residual
            velocity = self.teacher.unpatchify(self.teacher.final_projection(hidden, vec, height * width), frames,
                                               height, width)
        return StepOutput(velocity=velocity, final_hidden=hidden), self.kind


def spread_rows(keys: Sequence[tuple[str, int]], count: int) -> list[int]:
    """Indices of `count` rows of a sample table spread over its scenes: the scenes (case ids, in table order) taken
    at evenly spaced positions, one row each (scene j of the table its row j mod its rows, so that the paths vary
    too), then another row of each, and so on (`keys`: (case_id, action_id) per row). TeaCache's calibration videos: the first rows of a table are one scene's paths, whose distances need
    not be the split's (docs/leaderboard.md § TeaCache's targets)."""
    by_scene: dict[str, list[int]] = {}
    for index, (case_id, _) in enumerate(keys):
        by_scene.setdefault(case_id, []).append(index)
    scenes = list(by_scene)
    chosen: list[int] = []
    depth = 0
    while len(chosen) < min(count, len(keys)):
        open_scenes = [scene for scene in scenes if depth < len(by_scene[scene])]
        wanted = min(count - len(chosen), len(open_scenes))
        positions = np.linspace(0, len(open_scenes) - 1, wanted).round().astype(int) if wanted > 1 else [0]
        for position in positions:
            rows = by_scene[open_scenes[position]]
            chosen.append(rows[(scenes.index(open_scenes[position]) + depth) % len(rows)])
        depth += 1
    return chosen


def fit_rescale(observed: Sequence[tuple[float, float]], degree: int = 1) -> tuple[float, ...]:
    """Least-squares polynomial (highest power first) from the input's relative L1 change to the output's, over
    consecutive Full steps of reference rollouts (TeaCache fits one per model). Identity when there are too few."""
    if len(observed) <= degree:
        return (1.0, 0.0)
    x, y = np.asarray(observed, dtype=np.float64).T
    return tuple(float(c) for c in np.polyfit(x, y, degree))


def calibrate_threshold(full_steps_at: Callable[[float], float], target: float, *, high: float = 1.0,
                        iterations: int = 12) -> tuple[float, float]:
    """The threshold whose mean Full steps per scheduled chunk (`full_steps_at(threshold)`, non-increasing in the
    threshold) is closest to `target`: bisection between 0 (every step Full) and `high` (doubled until it skips
    enough). Returns (threshold, its Full steps per chunk); ties go to the higher quality side (more Full steps)."""
    low = 0.0
    while full_steps_at(high) > target and high < 1e6:
        low, high = high, high * 2
    tried = {low: full_steps_at(low), high: full_steps_at(high)}
    for _ in range(iterations):
        middle = (low + high) / 2
        tried[middle] = full_steps_at(middle)
        if tried[middle] > target:
            low = middle
        else:
            high = middle
    best = min(tried, key=lambda threshold: (abs(tried[threshold] - target), -tried[threshold]))
    return best, tried[best]
