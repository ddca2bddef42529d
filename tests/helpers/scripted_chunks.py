"""A scripted Teacher and chunk loop for the leaderboard's rows: every Full step returns numbers from a table, so a
row's output over several chunks can be worked out by hand (tests/eval/test_caches.py, test_methods.py,
test_leaderboard.py).

The loop hands each step what `rollout.ar_rollout.ARRollout` hands a step hook: `previous` = this chunk's previous
step output, `previous_chunk` = the previous chunk's step outputs (as the method returned them), `run_teacher()` =
the Full step. The Teacher's final layer is v = 2 h + sigma, so a velocity made from a hidden is told apart from
the Teacher's own velocity, which the tables set to -h.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Callable

import torch

from predictor_training.eval.timing import Stopwatch
from predictor_training.rollout.policy import StepOutput
from predictor_training.rollout.schedule import StepPlan

# The distilled grid (shift 5, 4 steps): sigma(s) = 5 s / (1 + 4 s) at s = 1, 3/4, 1/2, 1/4.
SIGMAS = (1.0, 15 / 16, 5 / 6, 5 / 8)
BASE = (1.0, 3.0, 4.0, 8.0)  # the Teacher's hidden at steps 0..3 of chunk 0; chunk c: (c + 1) x BASE


def value(number: float) -> torch.Tensor:
    """A hidden, velocity or model input: [1, 1, 2] float32, both entries `number`."""
    return torch.full((1, 1, 2), float(number))


def table_hidden(chunk: int, step: int) -> float:
    return (chunk + 1) * BASE[step]


class ScriptedTeacher:
    """The Teacher parts the caches call: frame_vec -> sigma, final_projection(h, vec) = 2 h + vec, unpatchify =
    identity, modulated_input(x) = (x, x, sigma): embedded input and modulated input are the model input itself."""

    def frame_vec(self, timestep, action):
        return timestep[:1] / 1000.0

    def final_projection(self, hidden, vec, tokens):
        return 2.0 * hidden + vec

    def unpatchify(self, tokens, frames, height, width):
        return tokens

    def modulated_input(self, model_input, timestep, action):
        return model_input, model_input, timestep[:1] / 1000.0


def run_chunks(method, num_chunks: int = 3, *, hidden: Callable[[int, int], float] = table_hidden,
               velocity: Callable[[int, int], float] | None = None,
               model_input: Callable[[int, int], float] = lambda chunk, step: 1.0):
    """Run `method` (`Method.run_step`) over `num_chunks` chunks of the 4 steps of `SIGMAS`. The Full step of
    (chunk, step) returns hidden(chunk, step) and velocity(chunk, step) (default: -hidden). Returns
    (outputs[chunk][step], {(chunk, step): FLOP-count kind}, the (chunk, step) of every Full step that ran)."""
    velocity = velocity or (lambda chunk, step: -hidden(chunk, step))
    plan = StepPlan.from_steps((1, 2, 3))  # a PlannedMethod ignores it: its own plan is its schedule
    outputs, kinds, teacher_calls, previous_chunk = [], {}, [], None
    for chunk in range(num_chunks):
        done: list[StepOutput] = []
        for step in range(len(SIGMAS)):
            def run_teacher(chunk=chunk, step=step):
                teacher_calls.append((chunk, step))
                return StepOutput(velocity=value(velocity(chunk, step)), final_hidden=value(hidden(chunk, step)))

            call = SimpleNamespace(
                chunk_index=chunk, step_index=step, timestep=torch.full((4,), 1000.0 * SIGMAS[step]), action=None,
                latent=torch.zeros(1, 1, 4, 1, 1), model_input=value(model_input(chunk, step)),
                previous=done[-1] if done else None, previous_chunk=previous_chunk, run_teacher=run_teacher)
            output, kind = method.run_step(call, plan, Stopwatch(torch.device("cpu")), contextlib.nullcontext)
            done.append(output)
            kinds[(chunk, step)] = kind
        outputs.append(done)
        previous_chunk = done
    return outputs, kinds, teacher_calls


def numbers(outputs, chunk: int, field: str) -> list[float]:
    """One number per step of `chunk`: the first entry of each step's `field` (final_hidden / velocity)."""
    return [float(getattr(output, field).flatten()[0]) for output in outputs[chunk]]


class ScriptedRuntime:
    """The eval runtime `calibrate_adaptive` rolls its calibration videos through, scripted: every rollout runs the
    method over `run_chunks` with the given model input and hidden tables and returns its step kinds. `methods`
    records each rolled-out method in order."""

    def __init__(self, *, model_input: Callable[[int, int], float], hidden: Callable[[int, int], float]):
        self.teacher, self.device = ScriptedTeacher(), torch.device("cpu")
        self.dataset = SimpleNamespace(load_case=lambda case_id: {})
        self.model_input, self.hidden = model_input, hidden
        self.methods = []

    def text_kv(self, case):
        return None, {}

    def rollout(self, method, text_kv, item, case, stopwatch):
        self.methods.append(method)
        _, kinds, _ = run_chunks(method, model_input=self.model_input, hidden=self.hidden)
        return SimpleNamespace(step_kinds=kinds)
