"""The step protocol of the AR loop (`rollout/ar_rollout.py`) and the trainer's policy over its chunks.

A step hook sees a `StepCall` (the chunk's inputs, its `ChunkContext`, the previous outputs and `run_teacher()`, the
Full step) and returns a `StepOutput`; `ARRollout.denoise_chunk` collects a chunk's outputs in a `ChunkRun`.
`ARRollout.run_chunks(policy)` asks a `ChunkPolicy` for each chunk's scope, step hook and hooks around its commit.
`TrainingPolicy` is a trainer's schedule (where `--replace_steps` acts): which step of a trained chunk runs Full, the
student or velocity reuse, which calls carry a graph and where the graph is cut (docs/rollout.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
from torch import Tensor

from predictor_training.rollout.schedule import StepPlan
from predictor_training.teacher import ContextKV, TextKV


@dataclass
class StepOutput:
    """velocity [1, C, 4, H, W]; final_hidden [1, 4*H*W, hidden] (None if the producer has none); raw_kv: the
    Teacher's per-layer raw K/V of the chunk (only Full steps of a `last_step` context-mode rollout). graph_stops:
    the next latent is advanced from the detached latent, so no gradient flows back through this step (a trainer's
    Full step whose Teacher call is a label)."""

    velocity: Tensor
    final_hidden: Tensor | None = None
    raw_kv: list[tuple[Tensor, Tensor]] | None = None
    graph_stops: bool = False


@dataclass
class ChunkContext:
    """The context of one chunk: indices (ascending), prefill input [1, 2C+1, n, H, W], K/V, pre-features.

    For chunk 0 (and any chunk without history) indices is empty and everything else is None / {}.
    vec [n, hidden] = time_in(14) + action_in(action) of the context frames (computed only when recording).
    """

    indices: list[int]
    model_input: Tensor | None = None
    kv: ContextKV | None = None
    prefeatures: dict[int, Tensor] = field(default_factory=dict)
    vec: Tensor | None = None

    @property
    def num_frames(self) -> int:
        return len(self.indices)


@dataclass
class StepCall:
    """What a step hook sees (all tensors on the rollout device).

    latent [1, C, 4, H, W] (running-buffer dtype); model_input [1, 2C+1, 4, H, W] (Teacher dtype);
    timestep [4] float32; action [1, 4]; viewmats [1, 4, 4, 4]; Ks [1, 4, 3, 3] (Teacher dtype); rope_start = n.
    previous: this chunk's previous step output (None at step 0); previous_chunk: the previous chunk's step outputs
    (None for the first chunk run). ``run_teacher()`` runs the Full Teacher step on exactly these inputs
    (``run_teacher(other_input)`` on another [1, 2C+1, 4, H, W] input with the same timestep, cameras and context,
    e.g. the detached one for a trainer's label).
    """

    chunk_index: int
    step_index: int
    latent: Tensor
    model_input: Tensor
    timestep: Tensor
    action: Tensor
    viewmats: Tensor
    Ks: Tensor
    text_kv: TextKV
    context: ChunkContext
    rope_start: int
    previous: StepOutput | None
    previous_chunk: list[StepOutput] | None
    run_teacher: Callable[[], StepOutput]


StepFn = Callable[[StepCall], StepOutput]


@dataclass
class ChunkRun:
    """One chunk's denoising (`ARRollout.denoise_chunk`): its context, every step's output (from `first_step` on) and
    the final latent [1, C, 4, H, W] (state dtype; with a graph when a step kept one)."""

    chunk_index: int
    context: ChunkContext
    outputs: list[StepOutput]
    final_latent: Tensor


class ChunkPolicy:
    """The caller's side of `ARRollout.run_chunks`, the one loop over a rollout's chunks: the scope each chunk runs
    in, its step hook, what happens between its last step and its commit, and after its commit. This one runs
    `step_fn` (default: the Full Teacher step) at every step of every chunk without gradients; `on_chunk_end(run)`
    (optional) sees each chunk's `ChunkRun` before its commit, `on_commit(run)` (optional) right after it."""

    def __init__(self, step_fn: StepFn | None = None, on_chunk_end: Callable[[ChunkRun], None] | None = None,
                 on_commit: Callable[[ChunkRun], None] | None = None):
        self.step_fn = step_fn
        self.on_chunk_end = on_chunk_end
        self.on_commit = on_commit

    def chunk_scope(self, chunk_index: int) -> ContextManager:
        """Entered around the chunk's steps and `end_chunk` (grad mode; a trainer's DDP `no_sync`)."""
        return torch.no_grad()

    def chunk_step_fn(self, chunk_index: int) -> StepFn | None:
        """The chunk's step hook (None: the Full Teacher step)."""
        return self.step_fn

    def end_chunk(self, run: ChunkRun) -> None:
        """After the chunk's last step, inside its scope, before its commit."""
        if self.on_chunk_end is not None:
            self.on_chunk_end(run)

    def after_commit(self, run: ChunkRun) -> None:
        """After the chunk's commit (outside its scope): the running latents hold its final latent, and a caller
        may read or replace it there (teacher forcing writes the data)."""
        if self.on_commit is not None:
            self.on_commit(run)


StudentFn = Callable[[StepCall, Tensor, StepOutput], StepOutput]
TRAINED_LETTERS = "FPR"  # what a trainer's plan may hold: Full (a label), the student (P), velocity reuse (R)


class TrainingPolicy(ChunkPolicy):
    """A trainer's schedule over a rollout's chunks: which step runs Full, the student or velocity reuse, which
    calls carry a graph and where it is cut (docs/rollout.md).

    Chunks before `first_trained_chunk` are the Teacher's F-F-F-F without gradients (the history seed). In a trained
    chunk (grad mode: the caller's) step k is what `plan` (a `StepPlan` of F, P and R) says:
    * R: the previous step's output again (velocity and hidden; no model call, no label);
    * otherwise the Teacher's step on the detached latent, without a graph: a label on the state the student
      visits. At step 0 it is the step's output. At any other F step too, and the next latent is advanced from
      the detached latent (`StepOutput.graph_stops`): gradients stop there. At a P step it goes to
      `student(call, label_input, label)` (label_input [1, 2C+1, 4, H, W]: the detached input the label was
      computed on), whose output, with its graph, advances the latent.
    trained_scope(chunk_index): the context a trained chunk's steps and `end_chunk` run in (default none: e.g. a
    trainer's DDP `no_sync`); on_chunk_end(run): every chunk's `ChunkRun` before its commit (a trainer's backward);
    on_commit(run): every chunk's right after its commit.
    """

    def __init__(self, plan: StepPlan, student: StudentFn, *, first_trained_chunk: int = 1,
                 trained_scope: Callable[[int], ContextManager] | None = None,
                 on_chunk_end: Callable[[ChunkRun], None] | None = None,
                 on_commit: Callable[[ChunkRun], None] | None = None):
        super().__init__(None, on_chunk_end, on_commit)
        unknown = sorted(plan.letters_used - set(TRAINED_LETTERS))
        if unknown:
            raise ValueError(f"a trainer's plan {plan.text} holds {unknown}; expected letters of {TRAINED_LETTERS}")
        self.plan = plan
        self.student = student
        self.first_trained_chunk = first_trained_chunk
        self.trained_scope = trained_scope

    def chunk_scope(self, chunk_index: int) -> ContextManager:
        if chunk_index < self.first_trained_chunk:
            return torch.no_grad()
        return contextlib.nullcontext() if self.trained_scope is None else self.trained_scope(chunk_index)

    def chunk_step_fn(self, chunk_index: int) -> StepFn | None:
        return None if chunk_index < self.first_trained_chunk else self.trained_step

    def trained_step(self, call: StepCall) -> StepOutput:
        """Step ``call.step_index`` of a trained chunk (the class docstring)."""
        k = call.step_index
        letter = self.plan.letter(call.chunk_index, k)
        if letter == "R":  # the eval's velocity reuse: the anchor is handed on unchanged
            return StepOutput(velocity=call.previous.velocity, final_hidden=call.previous.final_hidden)
        label_input = call.model_input.detach()
        with torch.no_grad():
            label = call.run_teacher(label_input)
        if k == 0:
            if call.context.kv is None:
                raise RuntimeError(f"chunk {call.chunk_index} got no context frames; a trained chunk needs history")
            return label
        if letter != "P":
            return dataclasses.replace(label, graph_stops=True)
        return self.student(call, label_input, label)
