"""The step protocol and the trainer's policy (predictor_training/rollout/policy.py), on stand-in step calls (no
Teacher): which chunks a `TrainingPolicy` trains, what each letter of its plan runs at a step, where the graph stops.
The policy driving a real rollout is tested in tests/predictor/test_self_rollout.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

from predictor_training.rollout.policy import ChunkContext, ChunkPolicy, ChunkRun, StepCall, StepOutput, TrainingPolicy
from predictor_training.rollout.schedule import StepPlan


def step_call(step_index: int, *, context_kv=object(), previous: StepOutput | None = None, seen: list | None = None):
    """Step `step_index` of chunk 1 whose Teacher step returns twice its input (and records each input it ran on)."""
    model_input = torch.ones(1, 3, 4, 1, 1, requires_grad=True)

    def run_teacher(other_input=None):
        used = model_input if other_input is None else other_input
        if seen is not None:
            seen.append(used)
        return StepOutput(velocity=2 * used[:, :1])

    return StepCall(chunk_index=1, step_index=step_index, latent=model_input[:, :1], model_input=model_input,
                    timestep=torch.zeros(4), action=torch.zeros(1, 4), viewmats=torch.zeros(1, 4, 4, 4),
                    Ks=torch.zeros(1, 4, 3, 3), text_kv=None,
                    context=ChunkContext(indices=[0] if context_kv is not None else [], kv=context_kv),
                    rope_start=1, previous=previous, previous_chunk=None, run_teacher=run_teacher)


def test_a_trainers_plan_holds_only_full_student_and_reuse_steps():
    with pytest.raises(ValueError, match="expected letters of FPR"):
        TrainingPolicy(StepPlan.parse("F-H-H-H"), student=lambda call, label_input, label: label)


def test_chunks_before_the_first_trained_one_run_the_teachers_steps_without_gradients():
    scopes = []
    policy = TrainingPolicy(StepPlan.parse("F-P-P-P"), student=lambda call, label_input, label: label,
                            first_trained_chunk=2, trained_scope=lambda chunk: scopes.append(chunk) or
                            contextlib.nullcontext())
    for chunk in (0, 1):
        assert policy.chunk_step_fn(chunk) is None
        with policy.chunk_scope(chunk):
            assert not torch.is_grad_enabled()
    assert policy.chunk_step_fn(2) == policy.trained_step
    with policy.chunk_scope(2):
        assert torch.is_grad_enabled()
    assert scopes == [2]


def test_each_letter_of_a_trained_chunk():
    """F at step 0: the label is the output; R: the previous output again, no call; P: the student gets the detached
    input and the no-grad label; F after step 0: the label, and the graph stops there."""
    students = []

    def student(call, label_input, label):
        students.append((label_input, label))
        return StepOutput(velocity=label_input[:, :1] * 3)

    policy = TrainingPolicy(StepPlan.parse("F-R-P-F"), student)
    seen = []
    first = policy.trained_step(step_call(0, seen=seen))
    assert not first.velocity.requires_grad and not first.graph_stops
    assert not seen[0].requires_grad  # the label's input is the detached one
    with pytest.raises(RuntimeError, match="needs history"):
        policy.trained_step(step_call(0, context_kv=None))

    reused = policy.trained_step(step_call(1, previous=first, seen=seen))
    assert reused.velocity is first.velocity and len(seen) == 1  # no model call

    replaced = policy.trained_step(step_call(2, previous=reused))
    (label_input, label), = students
    assert not label_input.requires_grad and not label.velocity.requires_grad
    assert torch.equal(replaced.velocity, 3 * label_input[:, :1]) and not replaced.graph_stops

    full = policy.trained_step(step_call(3, previous=replaced))
    assert full.graph_stops and not full.velocity.requires_grad


def test_a_chunk_policy_runs_its_hooks_around_the_commit():
    ends, commits = [], []
    policy = ChunkPolicy(on_chunk_end=ends.append, on_commit=commits.append)
    run = ChunkRun(chunk_index=0, context=ChunkContext(indices=[]), outputs=[], final_latent=torch.zeros(1))
    with policy.chunk_scope(0):
        assert not torch.is_grad_enabled()
    assert policy.chunk_step_fn(0) is None
    policy.end_chunk(run)
    policy.after_commit(run)
    assert ends == [run] and commits == [run]
