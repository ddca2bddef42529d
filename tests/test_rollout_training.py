"""Self-rollout F-P-P-P training: the recipe's 12 acceptance checks (train.md § 2), one test each.

Tiny Teacher (3 double blocks, hidden 64), latent grid 2 x 3, 16 latents (= 4 chunks) unless a check needs the
memory selection of the real 32 latents. The DDP checks (distinct keys, all-reduce count, 1-/2-step smoke and
resume) share ONE torchrun launch of this very file on 2 gloo ranks (`__main__` at the bottom), made by the
`ddp_report` fixture.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.rollout.ar_rollout import (
    ARRollout,
    RolloutConfig,
    RolloutInputs,
    build_cond_latents,
    make_initial_noise,
)
from predictor_training.rollout.camera import make_retrieval_points, select_aligned_memory_frames
from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.self_rollout import SelfRolloutSettings, SelfRolloutTrajectory, train_trajectory
from predictor_training.rollout.scheduler import (
    FlowMatchEulerScheduler,
    differentiable_euler_step,
    flow_match_sigmas,
)
from predictor_training.teacher import TextKV, WorldPlayTransformer, randomize_zero_initialised_

REPO_ROOT = Path(__file__).resolve().parents[1]

CHANNELS, HEIGHT, WIDTH = 4, 2, 3
SOURCE_BLOCKS = (0, 2)
TEACHER_DEPTH = 3
SETTINGS = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1)  # the recipe's loss weights


# ---------------------------------------------------------------------------------------------------------------
# Tiny Teacher, Predictor and trajectory inputs
# ---------------------------------------------------------------------------------------------------------------
def make_teacher(seed: int = 0) -> WorldPlayTransformer:
    torch.manual_seed(seed)
    teacher = WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=TEACHER_DEPTH)
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(seed + 1))
    return teacher.eval().requires_grad_(False)


def make_predictor(teacher, seed: int = 3):
    """A v4 Predictor whose zero-initialised output layers got small random values, as after offline training
    (a fresh one returns its anchor unchanged, so no gradient could reach the latents)."""
    predictor = build_predictor(teacher, "v4", SOURCE_BLOCKS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (predictor.fusion.proj, predictor.residual_head.fc2):
            for param in module.parameters():
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return predictor


def make_text_kv(teacher, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    config = teacher.config
    with torch.no_grad():
        return teacher.text_prefill(
            torch.randn(1, 6, config.text_states_dim, generator=generator), torch.tensor([[1, 1, 1, 1, 1, 0]]),
            torch.randn(1, 3, config.byt5_states_dim, generator=generator), torch.tensor([[1, 0, 1]]),
            torch.randn(1, 2, config.vision_states_dim, generator=generator),
        )


def make_inputs(num_latents: int = 16, seed: int = 5) -> RolloutInputs:
    """A camera that turns and walks (so the memory selection of 32 latents is not just the last frames)."""
    generator = torch.Generator().manual_seed(seed)
    half = num_latents // 2
    angles = torch.cat([torch.linspace(0, 1.2, half), torch.linspace(1.2, 0, num_latents - half)]).to(torch.float64)
    viewmats = torch.eye(4, dtype=torch.float64).repeat(num_latents, 1, 1)
    viewmats[:, 0, 0], viewmats[:, 0, 2] = torch.cos(angles), torch.sin(angles)
    viewmats[:, 2, 0], viewmats[:, 2, 2] = -torch.sin(angles), torch.cos(angles)
    viewmats[:, 2, 3] = -0.05 * torch.arange(num_latents, dtype=torch.float64)
    Ks = torch.tensor([[0.5, 0, 0.5], [0, 0.9, 0.5], [0, 0, 1]], dtype=torch.float64).repeat(num_latents, 1, 1)
    return RolloutInputs(
        noise=make_initial_noise(seed, (1, CHANNELS, num_latents, HEIGHT, WIDTH)),
        image_cond=torch.randn(1, CHANNELS, 1, HEIGHT, WIDTH, generator=generator),
        viewmats=viewmats,
        Ks=Ks,
        action=torch.randint(0, 81, (num_latents,), generator=generator),
        memory_points=make_retrieval_points(seed, num_points=2000),
    )


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def teacher():
    return make_teacher()


@pytest.fixture(scope="module")
def text_kv(teacher):
    return make_text_kv(teacher)


class RecordingPredictor(torch.nn.Module):
    """Calls the real Predictor and keeps every call's arguments and outputs (the objects themselves)."""

    def __init__(self, predictor):
        super().__init__()
        self.inner = predictor
        self.calls: list[dict] = []

    @property
    def variant(self):
        return self.inner.variant

    @property
    def source_blocks(self):
        return self.inner.source_blocks

    def forward(self, *args, **kwargs):
        outputs = self.inner(*args, **kwargs)
        self.calls.append({"args": args, "kwargs": kwargs, "outputs": outputs})
        return outputs


def record_teacher_calls(monkeypatch, teacher, name: str) -> list[dict]:
    """Wrap `teacher.<name>` (chunk_step / context_prefill) to record its inputs and outputs."""
    calls, original = [], getattr(teacher, name)

    def wrapper(*args, **kwargs):
        output = original(*args, **kwargs)
        calls.append({"args": args, "kwargs": kwargs, "output": output, "grad_enabled": torch.is_grad_enabled()})
        return output

    monkeypatch.setattr(teacher, name, wrapper)
    return calls


SHORT_POSE_STRINGS = {0: "w-{n}", 1: "s-{n}", 2: "w+left-{n}", 3: "w+right-{n}"}


def write_sample_table(folder: Path, case_ids, actions=(0, 1, 2, 3), num_latents: int = 16) -> Path:
    """A sample table (train.jsonl) whose pose files have `num_latents` latents (the standard ones have 32)."""
    from PIL import Image

    from predictor_training.rollout.camera import pose_string_to_json
    from predictor_training.data.sample_table import SampleRow, sample_seed
    from predictor_training.data.sample_table import write_sample_table as write_rows

    (folder / "poses").mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    for action in actions:
        pose = pose_string_to_json(SHORT_POSE_STRINGS[action].format(n=num_latents - 1))
        (folder / "poses" / f"action{action}.json").write_text(json.dumps(pose))
    rows = []
    for case_id in case_ids:
        Image.new("RGB", (6, 4), color=(40, 90, 140)).save(folder / "images" / f"{case_id}.png")
        for action in actions:
            rows.append(SampleRow(case_id, f"images/{case_id}.png", f"caption of {case_id}", action,
                                  f"poses/action{action}.json", sample_seed(case_id, action)))
    write_rows(folder / "train.jsonl", rows)
    return folder / "train.jsonl"


def trainable_grads(predictor) -> dict[str, torch.Tensor | None]:
    return {name: param.grad for name, param in predictor.named_parameters() if param.requires_grad}


# ---------------------------------------------------------------------------------------------------------------
# Trainer fixtures: a case-only dataset, a saved Teacher and an "offline" init checkpoint
# ---------------------------------------------------------------------------------------------------------------
def write_rollout_setup(root: Path, num_latents: int, case_ids, actions) -> dict[str, Path]:
    """Teacher folder, dataset root (case files + dataset_config.json, no trajectories), sample table and a
    predictor_step safetensors to start from. Returns their paths."""
    from predictor_training.runtime.checkpoint import save_inference_weights
    from predictor_training.teacher.source import teacher_config_sha256
    from predictor_training.data.synthetic import SyntheticSpec, write_synthetic_dataset

    teacher = make_teacher()
    teacher.save_pretrained(str(root / "teacher"))
    spec = SyntheticSpec(cases={case_id: "train" for case_id in case_ids}, num_chunks=num_latents // 4,
                         height=HEIGHT, width=WIDTH, hidden=teacher.config.hidden_size, depth=TEACHER_DEPTH,
                         heads=teacher.heads_num, head_dim=teacher.config.hidden_size // teacher.heads_num,
                         prefeature_layers=SOURCE_BLOCKS, with_trajectories=False)
    write_synthetic_dataset(root / "dataset", spec)
    table = write_sample_table(root / "samples", case_ids, actions, num_latents)
    config_path = root / "dataset" / "dataset_config.json"
    config = json.loads(config_path.read_text())
    config.update({
        "teacher": {"folder": str(root / "teacher"), "config_sha256": teacher_config_sha256(teacher),
                    "action_ckpt": None},
        "sample_tables": [str(table)],
        "shift": 5.0,
        "memory": {"memory_frames": 20, "temporal_context_size": 12},
    })
    config_path.write_text(json.dumps(config))
    init = root / "init" / "predictor_step_00100.safetensors"
    init.parent.mkdir()
    save_inference_weights(init, make_predictor(teacher),
                           metadata={"variant": "v4", "source_blocks": list(SOURCE_BLOCKS), "precision": "fp32"})
    return {"teacher": root / "teacher", "dataset": root / "dataset", "table": table, "init": init}


def trainer_args(paths: dict[str, Path], output_dir: Path, *extra: str) -> list[str]:
    return ["--dataset_root", str(paths["dataset"]), "--output_dir", str(output_dir), "--teacher",
            str(paths["teacher"]), "--source_blocks", ",".join(map(str, SOURCE_BLOCKS)), "--precision", "fp32",
            "--backend", "gloo", "--num_workers", "0", "--tracker", "none", "--no_progress", *extra]


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ddp_report(tmp_path_factory):
    """One torchrun launch (2 gloo ranks) of this file's `ddp_checks`; returns its report plus the run dirs."""
    root = tmp_path_factory.mktemp("rollout_ddp")
    paths = write_rollout_setup(root, num_latents=16, case_ids=["c000", "c001"], actions=(0, 3))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).resolve()), str(root)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-6000:]
    report = json.loads((root / "report.json").read_text())
    report["root"] = root
    report["logs"] = {name: read_log(root / name) for name in ("smoke_1step", "full_2step")}
    return report


@pytest.fixture(scope="module")
def overfit_run(tmp_path_factory):
    """20 optimizer steps on ONE trajectory of 8 latents (chunk 0 + one trained chunk), single process."""
    import train_predictor_v4_rollout as trainer

    root = tmp_path_factory.mktemp("rollout_overfit")
    paths = write_rollout_setup(root, num_latents=8, case_ids=["c000"], actions=(2,))
    run_dir = root / "run"
    trainer.main(trainer_args(paths, run_dir, "--init_from", str(paths["init"]), "--max_steps", "20",
                              "--scheduler_warmup_steps", "2", "--block_warmup_steps", "2", "--fusion_lr", "3e-3",
                              "--blocks_lr", "3e-4", "--ckpt_every", "10"))
    return run_dir


# ---------------------------------------------------------------------------------------------------------------
# 1. Distinct (case_id, action_id) keys: the dataset, the sampler, and the per-step check on 2 ranks
# ---------------------------------------------------------------------------------------------------------------
def test_01_ranks_read_distinct_trajectory_keys_every_step(ddp_report):
    sampler = ddp_report["sampler_epoch_keys"]  # rank -> keys of one epoch, in order
    rank0, rank1 = (set(map(tuple, sampler[str(rank)])) for rank in (0, 1))
    assert len(rank0) == len(sampler["0"]) and len(rank1) == len(sampler["1"])  # no repeat within a rank
    assert not rank0 & rank1 and rank0 | rank1 == set(map(tuple, ddp_report["dataset_keys"]))
    assert len(ddp_report["dataset_keys"]) == len(set(map(tuple, ddp_report["dataset_keys"])))
    # the trainer's own per-step check: it passed on every step and refuses duplicates on both ranks alike
    for run in ("smoke_1step", "full_2step"):
        assert [record["trajectory/distinct_keys"] for record in ddp_report["logs"][run]] == [2.0] * len(
            ddp_report["logs"][run])
    assert ddp_report["duplicate_keys_error"] == {"0": True, "1": True}


# ---------------------------------------------------------------------------------------------------------------
# 2. Chunk 0: Full Teacher only, no parameter gradient, previous-chunk hidden of steps 1, 2, 3
# ---------------------------------------------------------------------------------------------------------------
def test_02_chunk0_is_full_teacher_without_gradients_and_keeps_prev_hidden(teacher, text_kv, monkeypatch):
    predictor = RecordingPredictor(make_predictor(teacher))
    inputs = make_inputs()
    reference = ARRollout(teacher, text_kv, inputs)
    with torch.no_grad():
        reference_outputs = reference.run_chunk(0)
    teacher_calls = record_teacher_calls(monkeypatch, teacher, "chunk_step")
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, inputs, settings=SETTINGS)
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
def test_03_anchor_of_each_predictor_step_is_the_previous_step_hidden(teacher, text_kv, monkeypatch):
    predictor = RecordingPredictor(make_predictor(teacher))
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=SETTINGS)
    trajectory.run_chunk_zero()
    teacher_calls = record_teacher_calls(monkeypatch, teacher, "chunk_step")
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
def test_04_teacher_target_input_is_the_detached_student_latent(teacher, text_kv, monkeypatch, tmp_path):
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
    trajectory = SelfRolloutTrajectory(teacher, predictor, case_text_kv, inputs, settings=SETTINGS)
    trajectory.run_chunk_zero()
    teacher_calls = record_teacher_calls(monkeypatch, teacher, "chunk_step")
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
def test_05_context_comes_from_self_history_with_the_selection_function_indices(teacher, text_kv, monkeypatch):
    inputs = make_inputs(num_latents=32)
    trajectory = SelfRolloutTrajectory(teacher, make_predictor(teacher), text_kv, inputs, settings=SETTINGS)
    prefill_calls = record_teacher_calls(monkeypatch, teacher, "context_prefill")
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
# 9. All-reduce only on the last chunk (2 gloo ranks, counted with a DDP comm hook)
# ---------------------------------------------------------------------------------------------------------------
def test_09_only_the_last_chunk_all_reduces(ddp_report):
    for rank in ("0", "1"):
        counts = ddp_report["allreduce_per_chunk"][rank]  # comm-hook calls during chunks 1, 2, 3
        buckets = counts[-1]
        assert buckets >= 1 and counts[:-1] == [0, 0], counts
        assert ddp_report["allreduce_total"][rank] == buckets  # one round per optimizer step, nothing else
        assert ddp_report["allreduce_total_without_sync"][rank] == 0  # an accumulating trajectory never syncs
    # the single all-reduce gives every rank the mean of the two ranks' full-trajectory gradients
    assert ddp_report["grads_equal_across_ranks"] is True
    assert ddp_report["max_error_vs_mean_of_local_grads"] < 1e-6
    assert ddp_report["local_grads_differ_between_ranks"] is True


# ---------------------------------------------------------------------------------------------------------------
# 11. Smoke: 1-step and 2-step DDP runs, resume = uninterrupted; then a 20-step overfit whose loss falls
# ---------------------------------------------------------------------------------------------------------------
def test_11a_ddp_smoke_one_and_two_steps_and_resume(ddp_report):
    from predictor_training.runtime.checkpoint import read_inference_metadata, read_training_state

    root = ddp_report["root"]
    smoke, full, cut = root / "smoke_1step", root / "full_2step", root / "cut_resumed"
    assert [record["step"] for record in ddp_report["logs"]["smoke_1step"]] == [1]
    assert [record["step"] for record in read_log(full)] == [1, 2] == [record["step"] for record in read_log(cut)]
    states = {name: read_training_state(path / "training_latest.pt") for name, path in
              (("smoke", smoke), ("full", full), ("cut", cut))}
    assert states["smoke"]["run_state"]["global_step"] == 1 and states["full"]["run_state"]["global_step"] == 2
    assert states["full"]["world_size"] == 2
    assert states["full"]["meta"] == {"variant": "v4", "source_blocks": list(SOURCE_BLOCKS), "precision": "fp32",
                                      "recipe": "rollout_fppp"}
    # the 4 trajectories make 2 steps per epoch on 2 ranks: the data position is saved with the step
    assert states["full"]["run_state"]["data"]["position"] == 2
    assert states["full"]["run_state"] == states["cut"]["run_state"]
    for name, tensor in states["full"]["roles"]["predictor"]["model"].items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, states["cut"]["roles"]["predictor"]["model"][name]), name
    smoke_model = states["smoke"]["roles"]["predictor"]["model"]
    full_model = states["full"]["roles"]["predictor"]["model"]
    assert not all(torch.equal(tensor, smoke_model[name]) for name, tensor in full_model.items())
    full_step2, cut_step2 = read_log(full)[1], read_log(cut)[1]
    for key in ("loss", "step1/loss", "step2/loss", "step3/loss", "grad_norm", "latent_grad_l1_min"):
        assert full_step2[key] == cut_step2[key], key
    assert read_inference_metadata(full / "predictor_step_00002.safetensors")["step"] == 2
    assert ddp_report["resume_refusals"] == {"bf16_master": True, "other_source_blocks": True}


def test_11b_overfit_20_steps_on_one_trajectory_lowers_the_loss(overfit_run):
    log = read_log(overfit_run)
    assert [record["step"] for record in log] == list(range(1, 21))
    first, last = log[0]["loss"], sum(record["loss"] for record in log[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    assert all(record["latent_grad_l1_min"] > 0 for record in log)
    assert sorted(path.name for path in overfit_run.glob("predictor_step_*.safetensors")) == [
        "predictor_step_00010.safetensors", "predictor_step_00020.safetensors"]


# ---------------------------------------------------------------------------------------------------------------
# 12. No NaN/Inf, every step's loss falls, peak memory in the log
# ---------------------------------------------------------------------------------------------------------------
def test_12_finite_metrics_falling_step_losses_and_peak_memory_logged(overfit_run, ddp_report):
    logs = [read_log(overfit_run), *ddp_report["logs"].values()]
    for log in logs:
        for record in log:
            memory = [key for key in record if key.startswith("memory/")]
            assert memory and all(record[key] > 0 for key in memory), record
            numbers = {key: value for key, value in record.items() if isinstance(value, (int, float))}
            assert all(math.isfinite(value) for value in numbers.values()), record
            for k in (1, 2, 3):
                assert f"step{k}/hidden_mse" in record and f"step{k}/velocity_mse" in record
    overfit = logs[0]
    for k in (1, 2, 3):
        first, last = overfit[0][f"step{k}/loss"], sum(r[f"step{k}/loss"] for r in overfit[-3:]) / 3
        assert last < first, (k, first, last)


def test_resume_refuses_a_bf16_master_state(tmp_path):
    from predictor_training.runtime.checkpoint import check_fp32_training_state

    def state(dtype):
        return {"roles": {"predictor": {
            "model": {"fusion.proj.weight": torch.zeros(2, 2)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2, 2, dtype=dtype),
                                        "exp_avg_sq": torch.zeros(2, 2, dtype=dtype)}}, "param_groups": []}}}}

    check_fp32_training_state(state(torch.float32), tmp_path / "fp32.pt")
    with pytest.raises(ValueError, match="exp_avg is torch.bfloat16"):
        check_fp32_training_state(state(torch.bfloat16), tmp_path / "bf16.pt")


# ---------------------------------------------------------------------------------------------------------------
# The torchrun worker (2 gloo ranks): python -m torch.distributed.run --nproc_per_node 2 THIS_FILE ROOT
# ---------------------------------------------------------------------------------------------------------------
def ddp_checks(root: Path) -> None:
    """Runs every DDP check in one process group and writes ROOT/report.json (rank 0)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import train_predictor_v4_rollout as trainer
    from predictor_training.runtime import launch
    from predictor_training.runtime.checkpoint import load_model_weights
    from predictor_training.runtime.distributed import all_gather_objects, init_distributed, wrap_ddp
    from predictor_training.data.trajectory_dataset import TrajectoryTableDataset

    torch.set_num_threads(1)
    env = init_distributed("gloo")
    paths = {"teacher": root / "teacher", "dataset": root / "dataset", "table": root / "samples" / "train.jsonl",
             "init": root / "init" / "predictor_step_00100.safetensors"}
    report: dict = {}

    # 1. Keys: the table, one epoch of each rank's sampler, and the step check refusing a shared key.
    dataset = TrajectoryTableDataset(paths["table"], dataset_root=paths["dataset"], num_latents=16)
    batches = one_item_per_rank_batches(dataset, env, seed=0, num_workers=0)
    epoch_keys = [list(next(batches)["key"]) for _ in range(batches.batches_per_epoch())]
    report["dataset_keys"] = [list(key) for key in dataset.keys()]
    report["sampler_epoch_keys"] = {str(rank): keys for rank, keys in enumerate(all_gather_objects(epoch_keys))}
    shared_item = dataset[0]  # the same trajectory on both ranks
    step = trainer.RolloutStep(model=None, teacher=None, dataset=dataset, rollout_config=None, settings=None,
                              env=env)
    try:
        step(shared_item, sync=True, due=frozenset({"predictor"}))
        refused = False
    except trainer.DuplicateTrajectoryError:
        refused = True
    report["duplicate_keys_error"] = {str(rank): flag for rank, flag in enumerate(all_gather_objects(refused))}

    # 2. All-reduce count per chunk, with the DDP-wrapped Predictor on a different trajectory per rank.
    teacher = make_teacher()
    text_kv = make_text_kv(teacher)
    predictor = build_predictor(teacher, "v4", SOURCE_BLOCKS)
    load_model_weights(paths["init"], predictor)
    model = wrap_ddp(predictor, env)
    counter = {"calls": 0}

    def counting_allreduce(state, bucket):
        state["calls"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(counter, counting_allreduce)
    inputs = make_inputs(seed=5 + env.rank)
    per_chunk = []

    def run(sync: bool) -> None:
        trajectory = SelfRolloutTrajectory(teacher, model, text_kv, inputs, settings=SETTINGS)
        commit = trajectory.commit

        def commit_and_count(graph):
            per_chunk.append(counter["calls"])
            commit(graph)

        trajectory.commit = commit_and_count
        train_trajectory(trajectory, sync=sync)

    run(sync=True)
    increments = [after - before for before, after in zip([0] + per_chunk[:-1], per_chunk)]
    report["allreduce_per_chunk"] = {str(k): v for k, v in enumerate(all_gather_objects(increments))}
    report["allreduce_total"] = {str(k): v for k, v in enumerate(all_gather_objects(counter["calls"]))}
    synced = {name: param.grad.clone() for name, param in predictor.named_parameters() if param.requires_grad}
    model.zero_grad(set_to_none=True)
    counter["calls"] = 0
    run(sync=False)  # accumulating: this trajectory's gradients stay local
    report["allreduce_total_without_sync"] = {str(k): v for k, v in enumerate(all_gather_objects(counter["calls"]))}
    local = {name: param.grad.clone() for name, param in predictor.named_parameters() if param.requires_grad}
    local_all = all_gather_objects(local)
    synced_all = all_gather_objects(synced)
    mean_local = {name: (local_all[0][name] + local_all[1][name]) / 2 for name in local}
    report["grads_equal_across_ranks"] = all(torch.equal(synced_all[0][n], synced_all[1][n]) for n in synced)
    report["max_error_vs_mean_of_local_grads"] = max(float((synced[n] - mean_local[n]).abs().max()) for n in synced)
    report["local_grads_differ_between_ranks"] = any(not torch.equal(local_all[0][n], local_all[1][n]) for n in local)
    del model

    # 3. The trainer itself: a 1-step smoke run, a 2-step run, and a 1-step run resumed to step 2, all under this
    #    process group (the run start's init/cleanup are bypassed so that the group is made once).
    launch.init_distributed = lambda backend: env
    launch.cleanup_distributed = lambda: None
    common = ["--init_from", str(paths["init"]), "--max_steps", "2", "--scheduler_warmup_steps", "1",
              "--block_warmup_steps", "1", "--fusion_lr", "1e-3", "--blocks_lr", "1e-4", "--ckpt_every", "1"]
    trainer.main(trainer_args(paths, root / "smoke_1step", *common, "--stop_at_step", "1"))
    trainer.main(trainer_args(paths, root / "full_2step", *common))
    trainer.main(trainer_args(paths, root / "cut_resumed", *common, "--stop_at_step", "1"))
    resume = ["--max_steps", "2", "--scheduler_warmup_steps", "1", "--block_warmup_steps", "1", "--fusion_lr", "1e-3",
              "--blocks_lr", "1e-4", "--ckpt_every", "1", "--resume", str(root / "cut_resumed" / "training_latest.pt")]
    trainer.main(trainer_args(paths, root / "cut_resumed", *resume))
    # a resume must refuse other source blocks, and (before loading anything) a BF16-master state
    refusals = {}

    def refusal(argv) -> str | None:
        """The one error line (exit code 2) of a refused launch, or None when it ran."""
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                trainer.main(argv)
        except SystemExit as exited:
            lines = stderr.getvalue().splitlines()
            return lines[-1] if exited.code == 2 and len(lines) == 1 else f"exit {exited.code}: {lines}"
        return None

    line = refusal(trainer_args(paths, root / "other_blocks", *resume, "--source_blocks", "2,0"))
    refusals["other_source_blocks"] = (line is not None and "source_blocks: saved [0, 2], requested [2, 0]" in line
                                       and not (root / "other_blocks").exists())
    if env.is_main:
        payload = torch.load(root / "cut_resumed" / "training_latest.pt", weights_only=True)
        for state in payload["roles"]["predictor"]["optimizer"]["state"].values():
            state["exp_avg"] = state["exp_avg"].bfloat16()
        torch.save(payload, root / "bf16_master.pt")
    dist.barrier()
    line = refusal(trainer_args(paths, root / "bf16_resume", *resume[:-1], str(root / "bf16_master.pt")))
    refusals["bf16_master"] = line is not None and "not an FP32-master training state" in line
    report["resume_refusals"] = refusals
    if env.is_main:
        (root / "report.json").write_text(json.dumps(report, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ddp_checks(Path(sys.argv[1]))


# ---------------------------------------------------------------------------------------------------------------
# Other schedules and the incremental context (train.md § 2, "Schedules and context modes")
# ---------------------------------------------------------------------------------------------------------------
def test_fppf_runs_the_teacher_at_step_3_where_gradients_stop(teacher, text_kv):
    """F-P-P-F: the Predictor runs steps 1, 2 (losses, x2 tracked); step 3 is a Teacher step on the detached x3,
    so the chunk's final latent carries no graph and the next chunk's previous hiddens are those of steps 1, 2."""
    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1, replace_steps=(1, 2))
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
    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1, replace_steps=(1, 3))
    predictor = RecordingPredictor(make_predictor(teacher))
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=settings)
    trajectory.run_chunk_zero()
    graph = trajectory.run_trained_chunk(1)
    assert [step.step_index for step in graph.steps] == [1, 3] and not graph.tracked_latents
    step3 = graph.steps[1]
    assert step3.anchor is graph.full_outputs[1].final_hidden and not step3.anchor.requires_grad
    assert not step3.latent.requires_grad  # made by the Teacher's step 2 from the detached x2
    with pytest.raises(ValueError, match="replace_steps"):
        SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(),
                              settings=SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1,
                                                           replace_steps=(0, 1)))


def test_frrp_reuses_v0_for_steps_1_2_and_trains_step_3_on_the_eval_plans_latent(teacher, text_kv, monkeypatch):
    """F-R-R-P (--reuse_steps 1,2 --replace_steps 3): steps 1, 2 repeat the Teacher's v0 (no model call, no label),
    the Predictor runs step 3 on x3 = x0 + v0 (sigma_3 - sigma_0) anchored on h0, and that latent is exactly the one
    the leaderboard's F-R-R-P plan (velocity reuse, eval/methods.py) hands its step 3."""
    from predictor_training.eval.methods import PlannedMethod, PredictorMethod, VelocityReuse, make_step_fn
    from predictor_training.eval.timing import Stopwatch
    from predictor_training.rollout.schedule import Schedule, StepPlan

    settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.0, replace_steps=(3,), reuse_steps=(1, 2))
    predictor = RecordingPredictor(make_predictor(teacher))
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=settings)
    teacher_calls = []
    full_step = trajectory.rollout.full_step
    monkeypatch.setattr(trajectory.rollout, "full_step", lambda *a, **k: teacher_calls.append(1) or full_step(*a, **k))
    trajectory.run_chunk_zero()
    teacher_calls.clear()
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
    rollout.run(make_step_fn(method, Schedule((1, 2, 3)), Stopwatch("cpu"), torch.no_grad), chunks=[0, 1])
    torch.testing.assert_close(seen[0], expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="disjoint"):
        SelfRolloutTrajectory(teacher, predictor, text_kv, make_inputs(), settings=SelfRolloutSettings(
            velocity_weight=1.0, hidden_weight=0.0, replace_steps=(2, 3), reuse_steps=(2,)))


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
