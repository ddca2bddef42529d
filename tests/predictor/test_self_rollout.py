"""Self-rollout F-P-P-P training (predictor_training/predictor/self_rollout.py): the
single-process checks of the recipe's acceptance list (docs/rollout.md § One step = one trajectory per GPU), one
test each, and the other schedules and the incremental context (docs/rollout.md § Schedules and context modes).

Tiny Teacher (3 double blocks, hidden 64), latent grid 2 x 3, 16 latents (= 4 chunks) unless a check needs the
memory selection of the real 32 latents."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from predictor_training.predictor.self_rollout import SelfRolloutSettings, SelfRolloutTrajectory, train_trajectory
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs, build_cond_latents
from predictor_training.rollout.memory_retrieval import select_aligned_memory_frames
from predictor_training.rollout.schedule import StepPlan
from predictor_training.rollout.scheduler import FlowMatchEulerScheduler, differentiable_euler_step, flow_match_sigmas
from predictor_training.teacher import TextKV
from tests.helpers.rollout_setup import (
    CHANNELS,
    HEIGHT,
    TEACHER_DEPTH,
    WIDTH,
    make_inputs,
    make_predictor,
    make_teacher,
    make_text_kv,
    write_sample_table,
)
from tests.helpers.recording_models import RecordingPredictor, RecordingTeacher


SETTINGS = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1)  # the recipe's loss weights
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def teacher():
    return make_teacher()


@pytest.fixture(scope="module")
def text_kv(teacher):
    return make_text_kv(teacher)


def trainable_grads(predictor) -> dict[str, torch.Tensor | None]:
    return {name: param.grad for name, param in predictor.named_parameters() if param.requires_grad}


# ---------------------------------------------------------------------------------------------------------------
# 2. Chunk 0: Full Teacher only, no parameter gradient, previous-chunk hidden of steps 1, 2, 3
# ---------------------------------------------------------------------------------------------------------------
def test_02_chunk0_is_full_teacher_without_gradients_and_keeps_prev_hidden(teacher, text_kv):
    predictor = RecordingPredictor(make_predictor(teacher))
    inputs = make_inputs()
    reference = ARRollout(teacher, text_kv, inputs)
    with torch.no_grad():
        reference_outputs = reference.run_chunk(0)
    recording = RecordingTeacher(teacher, "chunk_step")
    teacher_calls = recording.calls["chunk_step"]
    trajectory = SelfRolloutTrajectory(recording, predictor, text_kv, inputs, settings=SETTINGS)
    outputs = trajectory.run_chunk_zero()

    assert len(teacher_calls) == 4 and not any(call["grad_enabled"] for call in teacher_calls)
    assert predictor.calls == []
    assert all(grad is None for grad in trainable_grads(predictor.inner).values())
    assert sorted(trajectory.prev_chunk_hidden) == [1, 2, 3]
    for k in (1, 2, 3):
        hidden = trajectory.prev_chunk_hidden[k]
        assert hidden is outputs[k].final_hidden and not hidden.requires_grad
        assert hidden.shape == (1, 4 * HEIGHT * WIDTH, teacher.config.hidden_size)
        torch.testing.assert_close(hidden, reference_outputs[k].final_hidden, rtol=0, atol=0)
    torch.testing.assert_close(trajectory.rollout.latents[:, :, :4], reference.latents[:, :, :4], rtol=0, atol=0)
    assert not torch.equal(trajectory.rollout.latents[:, :, :4], inputs.noise[:, :, :4])


# ---------------------------------------------------------------------------------------------------------------
# 3. Anchors: step 1 <- h0, step 2 <- pred_h1, step 3 <- pred_h2 (same objects, same values)
# ---------------------------------------------------------------------------------------------------------------
def test_03_anchor_of_each_predictor_step_is_the_previous_step_hidden(teacher, text_kv):
    predictor = RecordingPredictor(make_predictor(teacher))
    recording = RecordingTeacher(teacher, "chunk_step")
    trajectory = SelfRolloutTrajectory(recording, predictor, text_kv, make_inputs(), settings=SETTINGS)
    trajectory.run_chunk_zero()
    teacher_calls = recording.calls["chunk_step"]
    teacher_calls.clear()  # chunk 1's calls only
    graph = trajectory.run_trained_chunk(1)

    anchors = [call["args"][1] for call in predictor.calls]
    pred_hiddens = [call["outputs"][0] for call in predictor.calls]
    assert len(predictor.calls) == 3
    full_step0 = teacher_calls[0]["output"].final_hidden  # the Teacher's step-0 hidden h0
    assert anchors[0] is full_step0 is graph.full_hidden
    assert anchors[1] is pred_hiddens[0] is graph.steps[0].pred_hidden
    assert anchors[2] is pred_hiddens[1] is graph.steps[1].pred_hidden
    for anchor, source in zip(anchors, (full_step0, pred_hiddens[0], pred_hiddens[1])):
        torch.testing.assert_close(anchor, source, rtol=0, atol=0)
    assert anchors[1].requires_grad and anchors[2].requires_grad  # the hidden anchor path keeps its graph
    # the previous-chunk hidden of step k is chunk 0's Full hidden of step k
    for k, call in zip((1, 2, 3), predictor.calls):
        assert call["kwargs"]["prev_chunk_hidden"] is trajectory.prev_chunk_hidden[k]


# ---------------------------------------------------------------------------------------------------------------
# 4. The Teacher label is computed on the detached student latent (no stored F-F-F-F state is read)
# ---------------------------------------------------------------------------------------------------------------
def test_04_teacher_target_input_is_the_detached_student_latent(teacher, text_kv, tmp_path):
    from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
    from predictor_training.data.synthetic import SyntheticSpec, write_synthetic_dataset

    # A dataset with case files only (no trajectories/): the rollout gets everything else from the sample table.
    spec = SyntheticSpec(cases={"c000": "train"}, num_chunks=4, height=HEIGHT, width=WIDTH,
                         hidden=teacher.config.hidden_size, depth=TEACHER_DEPTH, heads=teacher.heads_num,
                         head_dim=teacher.config.hidden_size // teacher.heads_num, with_trajectories=False)
    write_synthetic_dataset(tmp_path / "dataset", spec)
    table = write_sample_table(tmp_path / "samples", ["c000"], actions=(1,))
    dataset = TrajectoryTableDataset(table, dataset_root=tmp_path / "dataset", num_latents=16)
    assert not (tmp_path / "dataset" / "trajectories").exists()
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    inputs = RolloutInputs.from_seed(item["seed"], case["image_cond"].float(), item["viewmats"], item["Ks"],
                                     item["action"])
    case_text_kv = TextKV.from_layer_stack(case["text_k"], case["text_v"], "cpu", torch.float32)

    predictor = RecordingPredictor(make_predictor(teacher))
    recording = RecordingTeacher(teacher, "chunk_step")
    trajectory = SelfRolloutTrajectory(recording, predictor, case_text_kv, inputs, settings=SETTINGS)
    trajectory.run_chunk_zero()
    teacher_calls = recording.calls["chunk_step"]
    teacher_calls.clear()  # chunk 1's calls only
    graph = trajectory.run_trained_chunk(1)
    assert len(teacher_calls) == 4  # step 0 (Full) + one label per Predictor step

    reference = ARRollout(teacher, case_text_kv, inputs)  # the Teacher's own F-F-F-F of the same trajectory
    with torch.no_grad():
        reference.run_chunk(0)
        reference_chunk1 = []
        reference.run_chunk(1, step_fn=lambda call: reference_chunk1.append(call.latent) or call.run_teacher())
    for step, teacher_call, predictor_call in zip(graph.steps, teacher_calls[1:], predictor.calls):
        teacher_input = teacher_call["args"][0]
        predictor_input = predictor_call["args"][0]
        assert teacher_call["grad_enabled"] is False and not teacher_input.requires_grad
        assert teacher_input is step.teacher_input
        torch.testing.assert_close(teacher_input[:, :CHANNELS], step.latent.detach(), rtol=0, atol=0)
        torch.testing.assert_close(teacher_input, predictor_input.detach(), rtol=0, atol=0)
        assert teacher_call["output"].velocity is step.target_velocity
        assert teacher_call["output"].final_hidden is step.target_hidden
    # the labels of steps 2 and 3 follow the student, not the Teacher's own trajectory
    for k in (2, 3):
        assert not torch.allclose(graph.steps[k - 1].latent.detach(), reference_chunk1[k], atol=1e-4)
    torch.testing.assert_close(graph.steps[0].latent, reference_chunk1[1], rtol=0, atol=0)  # x1 is still the Teacher's


# ---------------------------------------------------------------------------------------------------------------
# 5. Context: self-generated history at the indices of the inference selection function (32 latents)
# ---------------------------------------------------------------------------------------------------------------
def test_05_context_comes_from_self_history_with_the_selection_function_indices(teacher, text_kv):
    inputs = make_inputs(num_latents=32)
    recording = RecordingTeacher(teacher, "context_prefill")
    trajectory = SelfRolloutTrajectory(recording, make_predictor(teacher), text_kv, inputs, settings=SETTINGS)
    prefill_calls = recording.calls["context_prefill"]
    final_latents = {}
    with torch.no_grad():  # forward only: this check is about what the context reads
        trajectory.run_chunk_zero()
        final_latents[0] = trajectory.rollout.latents[:, :, :4].clone()
        for chunk in trajectory.trained_chunks:
            graph = trajectory.run_trained_chunk(chunk)
            final_latents[chunk] = graph.final_latent.clone()
            trajectory.commit(graph)
    assert len(prefill_calls) == 7
    history = torch.cat([final_latents[chunk] for chunk in range(8)], dim=2)  # [1, C, 32, H, W]
    cond = build_cond_latents(inputs.image_cond, 32)
    nontrivial = 0
    for chunk, call in zip(range(1, 8), prefill_calls):
        start = 4 * chunk
        selected = select_aligned_memory_frames(inputs.viewmats, start, points=inputs.memory_points)
        expected = sorted(set(selected) - set(range(start, start + 4)))
        nontrivial += expected != list(range(max(0, start - 20), start))
        hidden_states = call["args"][0]
        assert hidden_states.shape[2] == len(expected)
        torch.testing.assert_close(hidden_states[:, :CHANNELS], history[:, :, expected], rtol=0, atol=0)
        torch.testing.assert_close(hidden_states[:, CHANNELS:], cond[:, :, expected], rtol=0, atol=0)
        assert not call["grad_enabled"]
    assert nontrivial >= 1, "the camera path never exercised the memory selection"
    # the history really is the student's: chunk 1 differs from the Teacher's own chunk 1
    reference = ARRollout(teacher, text_kv, inputs)
    with torch.no_grad():
        reference.run(chunks=[0, 1])
    assert not torch.allclose(final_latents[1], reference.latents[:, :, 4:8], atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# 6. Differentiable Euler = the scheduler's step, on every step of the schedule and inside the rollout
# ---------------------------------------------------------------------------------------------------------------
def test_06_differentiable_euler_matches_the_scheduler_on_all_steps(teacher, text_kv):
    generator = torch.Generator().manual_seed(11)
    scheduler = FlowMatchEulerScheduler()
    scheduler.set_timesteps(4)
    sample = torch.randn(1, CHANNELS, 4, HEIGHT, WIDTH, generator=generator)
    pure = sample.clone().requires_grad_(True)
    stateful, chained = sample.clone(), pure
    for k, timestep in enumerate(scheduler.timesteps):
        velocity = torch.randn(sample.shape, generator=generator)
        stateful = scheduler.step(velocity, timestep, stateful)
        chained = differentiable_euler_step(chained, velocity, flow_match_sigmas(4, 5.0), k)
        torch.testing.assert_close(chained.detach(), stateful, rtol=1e-6, atol=1e-6)
        assert chained.dtype == stateful.dtype == torch.float32 and chained.grad_fn is not None
    # inside the rollout: x1 from the scheduler on the Teacher velocity, then the pure step on each Predictor velocity
    trajectory = SelfRolloutTrajectory(teacher, make_predictor(teacher), text_kv, make_inputs(), settings=SETTINGS)
    trajectory.run_chunk_zero()
    noise = trajectory.rollout.latents[:, :, 4:8].clone()
    graph = trajectory.run_trained_chunk(1)
    check = FlowMatchEulerScheduler()
    check.set_timesteps(4)
    x = check.step(graph.full_velocity, check.timesteps[0], noise)
    torch.testing.assert_close(graph.steps[0].latent, x, rtol=0, atol=0)
    for k, step in enumerate(graph.steps, start=1):
        x = check.step(step.pred_velocity.detach(), check.timesteps[k], x)
        following = graph.steps[k].latent if k < 3 else graph.final_latent
        torch.testing.assert_close(following.detach(), x, rtol=1e-6, atol=1e-6)
        assert following.requires_grad


# ---------------------------------------------------------------------------------------------------------------
# 7. Step-3 loss alone reaches x2, x3 and the parameters through the first two Predictor calls
# ---------------------------------------------------------------------------------------------------------------
def test_07_step3_loss_alone_reaches_x2_x3_and_the_first_two_predictor_calls(teacher, text_kv):
    predictor = RecordingPredictor(make_predictor(teacher))
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=SETTINGS)
    trajectory.run_chunk_zero()
    graph = trajectory.run_trained_chunk(1)
    params = [param for param in predictor.inner.parameters() if param.requires_grad]
    step3 = graph.steps[2]
    x2, x3 = graph.tracked_latents[2], graph.tracked_latents[3]
    assert x2 is graph.steps[1].latent and x3 is step3.latent

    grads = torch.autograd.grad(step3.loss, [x2, x3, *params], retain_graph=True, allow_unused=True)
    assert float(grads[0].abs().sum()) > 0 and float(grads[1].abs().sum()) > 0
    full = torch.cat([grad.flatten() for grad in grads[2:]])

    def step3_loss_without(cut: int) -> torch.Tensor:
        """Step-3 loss with the calls before Predictor call `cut` (1-based) cut off: their inputs detached."""
        call = predictor.calls[cut - 1]
        latent, anchor = graph.steps[cut - 1].latent.detach(), call["args"][1].detach()
        cond = call["args"][0][:, CHANNELS:].detach()
        sigmas = flow_match_sigmas(4, 5.0)
        for index in range(cut - 1, 3):
            call = predictor.calls[index]
            args = (torch.cat([latent, cond], dim=1), anchor, *call["args"][2:])
            hidden, velocity = predictor.inner(*args, **call["kwargs"])
            latent, anchor = differentiable_euler_step(latent, velocity, sigmas, index + 1), hidden
        torch.testing.assert_close(velocity, step3.pred_velocity)  # same forward values, shorter graph
        return torch.nn.functional.mse_loss(velocity.float(), step3.target_velocity.float()) + 0.1 * (
            torch.nn.functional.mse_loss(hidden.float(), step3.target_hidden.float()))

    for cut in (3, 2):  # cut 3: only the third call remains; cut 2: the second and third remain
        local = torch.autograd.grad(step3_loss_without(cut), params, allow_unused=True)
        local = torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(local, params)])
        contribution = full - local  # what the calls before `cut` add to the parameter gradient
        assert float(contribution.norm()) > 1e-3 * float(full.norm()), cut


# ---------------------------------------------------------------------------------------------------------------
# 8. No gradient across chunks
# ---------------------------------------------------------------------------------------------------------------
def test_08_chunk2_loss_does_not_reach_chunk1_final_latent_or_hidden(teacher, text_kv):
    predictor = make_predictor(teacher)
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=SETTINGS)
    trajectory.run_chunk_zero()
    chunk1 = trajectory.run_trained_chunk(1)  # kept with its graph (no backward)
    trajectory.commit(chunk1)
    chunk2 = trajectory.run_trained_chunk(2)
    chunk1_outputs = [chunk1.final_latent, *chunk1.pred_hidden_by_step().values()]
    assert all(tensor.requires_grad for tensor in chunk1_outputs)
    grads = torch.autograd.grad(chunk2.loss, chunk1_outputs, retain_graph=True, allow_unused=True)
    assert all(grad is None for grad in grads)
    # yet chunk 2 did read those values: as its previous-chunk hidden and through its context
    for k, hidden in chunk1.pred_hidden_by_step().items():
        torch.testing.assert_close(chunk2.steps[k - 1].prev_chunk_hidden, hidden.detach(), rtol=0, atol=0)
    assert 7 in chunk2.context.indices
    torch.testing.assert_close(chunk2.context.model_input[:, :CHANNELS, chunk2.context.indices.index(7)],
                               chunk1.final_latent.detach()[:, :, 3], rtol=0, atol=0)
    # positive control: the same probe does find the in-chunk path to x2
    (to_x2,) = torch.autograd.grad(chunk2.loss, [chunk2.tracked_latents[2]], retain_graph=True)
    assert float(to_x2.abs().sum()) > 0


# ---------------------------------------------------------------------------------------------------------------
# 10. Per-chunk backward = one backward over all chunks
# ---------------------------------------------------------------------------------------------------------------
def test_10_per_chunk_backward_equals_one_backward_over_all_chunks(teacher, text_kv):
    predictor = make_predictor(teacher)
    inputs = make_inputs()
    metrics = train_trajectory(SelfRolloutTrajectory(teacher, predictor, text_kv, inputs, settings=SETTINGS))
    per_chunk = {name: grad.clone() for name, grad in trainable_grads(predictor).items()}
    predictor.zero_grad(set_to_none=True)

    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, inputs, settings=SETTINGS)
    trajectory.run_chunk_zero()
    losses = []
    for chunk in trajectory.trained_chunks:
        graph = trajectory.run_trained_chunk(chunk)
        losses.append(graph.loss)
        trajectory.commit(graph)
    total = torch.stack(losses).mean()
    total.backward()
    assert math.isclose(float(total.detach()), metrics["loss"], rel_tol=1e-6)
    for name, grad in trainable_grads(predictor).items():
        torch.testing.assert_close(grad, per_chunk[name], rtol=1e-5, atol=1e-8, msg=name)
    assert any(float(grad.abs().sum()) > 0 for grad in per_chunk.values())


# ---------------------------------------------------------------------------------------------------------------
# Other schedules and the incremental context (docs/rollout.md § Schedules and context modes)
# ---------------------------------------------------------------------------------------------------------------
def test_fppf_runs_the_teacher_at_step_3_where_gradients_stop(teacher, text_kv):
    """F-P-P-F: the Predictor runs steps 1, 2 (losses, x2 tracked); step 3 is a Teacher step on the detached x3,
    so the chunk's final latent carries no graph and the next chunk's previous hiddens are those of steps 1, 2."""
    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1, plan=StepPlan.from_steps((1, 2)))
    predictor = RecordingPredictor(make_predictor(teacher))
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=settings)
    trajectory.run_chunk_zero()
    assert sorted(trajectory.prev_chunk_hidden) == [1, 2]
    graph = trajectory.run_trained_chunk(1)
    assert [step.step_index for step in graph.steps] == [1, 2] and len(predictor.calls) == 2
    assert sorted(graph.tracked_latents) == [2]
    assert len(graph.full_outputs) == 2  # steps 0 and 3
    assert not graph.final_latent.requires_grad and graph.loss.requires_grad
    graph.loss.backward()
    assert graph.tracked_latents[2].grad is not None and graph.tracked_latents[2].grad.abs().sum() > 0
    trajectory.commit(graph)
    assert sorted(trajectory.prev_chunk_hidden) == [1, 2]


def test_fpfp_anchors_step_3_on_the_teachers_step_2(teacher, text_kv):
    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1, plan=StepPlan.from_steps((1, 3)))
    predictor = RecordingPredictor(make_predictor(teacher))
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=settings)
    trajectory.run_chunk_zero()
    graph = trajectory.run_trained_chunk(1)
    assert [step.step_index for step in graph.steps] == [1, 3] and not graph.tracked_latents
    step3 = graph.steps[1]
    assert step3.anchor is graph.full_outputs[1].final_hidden and not step3.anchor.requires_grad
    assert not step3.latent.requires_grad  # made by the Teacher's step 2 from the detached x2
    with pytest.raises(ValueError, match="expected a Predictor step"):  # a plan with no P trains nothing
        SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(),
                              settings=SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1,
                                                           plan=StepPlan.from_steps((), (1,))))


def test_frrp_reuses_v0_for_steps_1_2_and_trains_step_3_on_the_eval_plans_latent(teacher, text_kv):
    """F-R-R-P (--reuse_steps 1,2 --replace_steps 3): steps 1, 2 repeat the Teacher's v0 (no model call, no label),
    the Predictor runs step 3 on x3 = x0 + v0 (sigma_3 - sigma_0) anchored on h0, and that latent is exactly the one
    the leaderboard's F-R-R-P plan (velocity reuse, eval/methods.py) hands its step 3."""
    from predictor_training.eval.methods import PlannedMethod, PredictorMethod, VelocityReuse, make_step_fn
    from predictor_training.eval.timing import Stopwatch

    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.0, plan=StepPlan.from_steps((3,), (1, 2)))
    predictor = RecordingPredictor(make_predictor(teacher))
    recording = RecordingTeacher(teacher, "chunk_step")
    trajectory = SelfRolloutTrajectory(recording, predictor, text_kv, make_inputs(), settings=settings)
    trajectory.run_chunk_zero()
    teacher_calls = recording.calls["chunk_step"]
    teacher_calls.clear()  # chunk 1's calls only
    graph = trajectory.run_trained_chunk(1)
    assert [step.step_index for step in graph.steps] == [3] and len(predictor.calls) == 1
    assert len(teacher_calls) == 2  # step 0 and step 3's label: the reused steps call nothing
    step3 = graph.steps[0]
    assert step3.anchor is graph.full_hidden
    sigmas = flow_match_sigmas(4, 5.0)
    noise = make_inputs().noise[:, :, 4:8]
    expected = noise + graph.full_velocity * (sigmas[3] - sigmas[0])
    torch.testing.assert_close(step3.latent.detach(), expected, rtol=1e-6, atol=1e-6)
    # the same x3 as the eval's plan F-R-R-P gives the Predictor (recorded by a spy on its forward)
    seen = []

    class Spy(PredictorMethod):
        def replaced_step(self, call):
            seen.append(call.latent.clone())
            return super().replaced_step(call)

    from predictor_training.eval.methods import PredictorCheckpoint

    raw = make_predictor(teacher)
    label = PredictorCheckpoint(Path("."), "t", 0, {}, raw.predictor_config(), {}, label="t", panel="t")
    method = PlannedMethod("p", StepPlan.parse("F-R-R-P"), {"R": VelocityReuse(), "P": Spy(raw, label)}, "p")
    rollout = ARRollout(teacher, text_kv, make_inputs(), RolloutConfig())
    rollout.run(make_step_fn(method, StepPlan.from_steps((1, 2, 3)), Stopwatch("cpu"), torch.no_grad), chunks=[0, 1])
    torch.testing.assert_close(seen[0], expected, rtol=1e-6, atol=1e-6)


def test_incremental_context_trains_like_exact_where_they_must_agree(teacher, text_kv):
    """Chunk 1's context is chunk 0's frames, which had no context: the cached K/V equal the exact prefill's, so
    chunk 1's loss is the same in both modes; later chunks see the approximation."""
    losses = {}
    for mode in ("exact", "incremental"):
        torch.manual_seed(0)
        config = RolloutConfig(context_mode=mode)
        trajectory = SelfRolloutTrajectory(teacher, make_predictor(teacher), text_kv, make_inputs(), config,
                                           settings=SETTINGS)
        metrics = train_trajectory(trajectory)
        losses[mode] = metrics
        if mode == "incremental":
            assert trajectory.rollout.frame_cache.frames == list(range(12))  # every chunk but the last
    assert losses["exact"]["chunk1/loss"] == pytest.approx(losses["incremental"]["chunk1/loss"], rel=1e-5)
    assert losses["exact"]["chunk3/loss"] != pytest.approx(losses["incremental"]["chunk3/loss"], rel=1e-5)


def test_the_return_term_pulls_a_revisited_latent_onto_its_first_visit(teacher, text_kv):
    """--revisit_weight: at a latent whose camera the trajectory saw in a committed chunk, the Predictor step's loss
    adds w * mse(v, (x_k - x_first) / sigma_k), the velocity whose x0 estimate x_k - sigma_k v is the first visit's
    committed latent; both are labels (no graph). A first visit in the chunk itself, and a chunk without revisits,
    add nothing; weight 0 adds no term."""
    from types import SimpleNamespace

    pairs = {5: 1, 7: 4, 9: 6}  # chunk 1: latent 5 revisits latent 1 (chunk 0); 7's first visit is in chunk 1 itself
    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.0, plan=StepPlan.from_steps((3,), (1, 2)),
                                   revisit_weight=0.5)
    trajectory = SelfRolloutTrajectory(teacher, make_predictor(teacher), text_kv, make_inputs(), settings=settings,
                                       revisit_pairs=pairs)
    trajectory.run_chunk_zero()
    graph = trajectory.run_trained_chunk(1)
    step = graph.steps[0]
    sigma = flow_match_sigmas(4, 5.0)[3]
    first = trajectory.rollout.latents[:, :, [1]].float()
    target = (step.latent.detach()[:, :, [1]].float() - first) / sigma
    torch.testing.assert_close(step.latent.detach()[:, :, [1]].float() - sigma * target, first)
    revisit_mse = torch.nn.functional.mse_loss(step.pred_velocity.detach().float()[:, :, [1]], target)
    torch.testing.assert_close(step.metrics["revisit_mse"], revisit_mse)
    torch.testing.assert_close(step.loss.detach(), step.metrics["velocity_mse"] + 0.5 * revisit_mse)
    assert float(revisit_mse) > 0
    # the label carries no graph, even where x_k has one (a Predictor-made latent under F-P-P-P)
    latent = step.latent.detach().clone().requires_grad_(True)
    slots, label = trajectory.revisit_target(SimpleNamespace(chunk_index=1, timestep=step.timestep, latent=latent * 2))
    assert slots == [1] and not label.requires_grad
    # chunk 2: latent 9 revisits latent 6 of the committed chunk 1 (slot 1); chunk 3 has no revisit: a zero term
    trajectory.commit(graph)
    graph = trajectory.run_trained_chunk(2)
    first = trajectory.rollout.latents[:, :, [6]].float()
    target = (graph.steps[0].latent.detach()[:, :, [1]].float() - first) / sigma
    torch.testing.assert_close(graph.steps[0].metrics["revisit_mse"], torch.nn.functional.mse_loss(
        graph.steps[0].pred_velocity.detach().float()[:, :, [1]], target))
    trajectory.commit(graph)
    graph = trajectory.run_trained_chunk(3)
    assert float(graph.steps[0].metrics["revisit_mse"]) == 0.0
    torch.testing.assert_close(graph.steps[0].loss.detach(), graph.steps[0].metrics["velocity_mse"])
    # weight 0: no term, whatever the pairs
    off = SelfRolloutTrajectory(teacher, make_predictor(teacher), text_kv, make_inputs(), revisit_pairs=pairs,
                                settings=SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.0,
                                                             plan=StepPlan.from_steps((3,), (1, 2))))
    off.run_chunk_zero()
    assert "revisit_mse" not in off.run_trained_chunk(1).steps[0].metrics


def test_the_return_terms_gradient_reaches_the_predictor(teacher, text_kv):
    """Two chunks, F-R-R-P, weight 0.5; latent 5 (chunk 1, slot 1) revisits latent 1 of the committed chunk 0, and
    latent 6 revisits latent 5 of its own, uncommitted chunk (no term). The step's gradient on the Predictor is that
    of the hand-written loss
        1.0 mse(v, v_teacher) + 0.1 mse(h, h_teacher) + 0.5 mse(v[slot 1], (x_3[slot 1] - x[1]) / sigma_3),
    sigma_3 = 5 (1/4) / (1 + 4 (1/4)) = 0.625 (shift 5, 4 steps), and its return term alone moves the weights."""
    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1, plan=StepPlan.from_steps((3,), (1, 2)),
                                   revisit_weight=0.5)
    predictor = make_predictor(teacher)
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(num_latents=8), settings=settings,
                                       revisit_pairs={5: 1, 6: 5})
    trajectory.run_chunk_zero()
    step = trajectory.run_trained_chunk(1).steps[0]
    first_visit = trajectory.rollout.latents[:, :, [1]].float()
    target = (step.latent.detach()[:, :, [1]].float() - first_visit) / 0.625
    mse = torch.nn.functional.mse_loss
    return_term = 0.5 * mse(step.pred_velocity.float()[:, :, [1]], target)
    by_hand = (mse(step.pred_velocity.float(), step.target_velocity.float())
               + 0.1 * mse(step.pred_hidden.float(), step.target_hidden.float()) + return_term)
    params = [param for param in predictor.parameters() if param.requires_grad]
    grads = torch.autograd.grad(step.loss, params, retain_graph=True, allow_unused=True)
    expected = torch.autograd.grad(by_hand, params, retain_graph=True, allow_unused=True)
    term_only = torch.autograd.grad(return_term, params, allow_unused=True)
    for grad, reference in zip(grads, expected):
        assert (grad is None) == (reference is None)
        if grad is not None:
            torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-8)
    assert sum(float(grad.abs().sum()) for grad in term_only if grad is not None) > 0
    torch.testing.assert_close(step.metrics["revisit_mse"], 2 * return_term.detach())
