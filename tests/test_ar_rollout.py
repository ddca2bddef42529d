"""The Teacher's AR chunk loop: golden F-F-F-F trajectory (set A), the trajectory check tool, hooks, bf16 state."""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import predictor_training.conformance.trajectory as trajectory_check
from predictor_training.rollout.ar_rollout import (
    ARRollout,
    RolloutConfig,
    RolloutInputs,
    TrajectoryRecorder,
    build_cond_latents,
    make_initial_noise,
    record_rollout,
)
from predictor_training.data.synthetic import turning_camera_row
from predictor_training.rollout.camera import make_retrieval_points
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_

REPO_ROOT = Path(__file__).resolve().parents[1]
SET_A = REPO_ROOT / "tests" / "data" / "conformance" / "worldplay_tiny_A"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- set A --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def set_a_run():
    """One run of the check on set A as the tool runs it (check_trajectory + print_report): (exit status the tool
    returns, printed lines, our tensors under the golden names)."""
    captured = {}
    original = trajectory_check.our_trajectory

    def spy(golden, config=None):
        captured["ours"] = original(golden, config)
        return captured["ours"]

    trajectory_check.our_trajectory = spy
    stream = io.StringIO()
    try:
        report = trajectory_check.check_trajectory(SET_A, "strict")
        trajectory_check.print_report(report, stream)
    finally:
        trajectory_check.our_trajectory = original
    return 0 if report.passed else 1, stream.getvalue().splitlines(), captured["ours"]


@pytest.fixture(scope="module")
def set_a_ours(set_a_run):
    return set_a_run[2]


def test_trajectory_tool_passes_set_a_at_strict_tier(set_a_run):
    status, lines, _ = set_a_run
    assert status == 0
    chunk_lines = [line for line in lines if line.split()[1:2] and line.split()[1].startswith("chunk")]
    assert len(chunk_lines) == 8 and all(line.startswith("PASS") for line in chunk_lines)
    assert sum("ctx_indices=exact" in line for line in chunk_lines) == 7  # chunk 0 has no context
    assert lines[-1].startswith("PASS: ") and " 0 failed" in lines[-1]


def test_trajectory_tool_command_line(tmp_path):
    """tools/check_trajectory_conformance.py as a command: exit status 1 and the failing tensor on a damaged copy."""
    folder = tmp_path / "set"
    shutil.copytree(SET_A, folder)
    golden = load_file(folder / "trajectory.safetensors")
    golden["chunk1.step2.velocity"] = golden["chunk1.step2.velocity"] + 1e-3
    save_file(golden, folder / "trajectory.safetensors")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "check_trajectory_conformance.py"),
                             str(folder), "--tier", "portable", "--threads", "1"],
                            capture_output=True, text=True, timeout=300)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert lines[-1].startswith("FAIL: ") and any(line.startswith("FAILED chunk1.step2.velocity") for line in lines)


def test_trajectory_comparison_flags_wrong_context_indices_and_small_errors(set_a_ours, capsys):
    golden = trajectory_check.GoldenTrajectory.load(SET_A)
    assert trajectory_check.compare_with_golden(golden, set_a_ours, "strict").passed
    # chunk 6 with the second-best memory group (tests/data/conformance/README.md F.6), one velocity 2.5x outside the
    # strict budget
    golden.tensors["chunk6.ctx.indices"] = torch.cat([torch.arange(4), torch.arange(8, 24)])
    velocity = golden.tensors["chunk3.step1.velocity"].clone()
    velocity[0, 0, 0, 0, 0] += 2.5 * 3e-6 * (1 + velocity[0, 0, 0, 0, 0].abs())
    golden.tensors["chunk3.step1.velocity"] = velocity
    report = trajectory_check.compare_with_golden(golden, set_a_ours, "strict")
    assert {item.name for item in report.failures()} == {"chunk6.ctx.indices", "chunk3.step1.velocity"}
    trajectory_check.print_report(report)
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("FAIL: ") and "FAIL  chunk6" in out and "ctx_indices=DIFFER" in out
    # the same error is inside the portable budget (1e-5): only the indices fail there
    portable = trajectory_check.compare_with_golden(golden, set_a_ours, "portable")
    assert {item.name for item in portable.failures()} == {"chunk6.ctx.indices"}
    # a tensor we do not produce is a failure, not silently skipped
    golden.tensors["chunk2.ctx.block7_in"] = torch.zeros(1)
    assert "chunk2.ctx.block7_in" in {item.name for item in trajectory_check.compare_with_golden(
        golden, set_a_ours, "portable").failures()}


def test_trajectory_tool_regenerates_points_from_the_seed(tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    for name in ("trajectory.json", "trajectory.safetensors"):
        shutil.copy(SET_A / name, folder / name)
    vectors = load_file(SET_A / "vectors.safetensors")
    stored_points = vectors.pop("retr.points")
    save_file(vectors, folder / "vectors.safetensors")
    points, source = trajectory_check.GoldenTrajectory.load(folder).memory_points()
    assert source == "make_retrieval_points(0)"
    # equal up to float32 rounding: the vectorised sin/cos/pow of the point rule differ by an ulp between thread counts
    torch.testing.assert_close(points, stored_points, rtol=0, atol=1e-6)
    with pytest.raises(trajectory_check.ConformanceInputError, match="config.json"):
        trajectory_check.check_trajectory(folder)


# ---- a tiny random Teacher ------------------------------------------------------------------------------------
def make_tiny_teacher() -> WorldPlayTransformer:
    """The tiny preset, its zero-initialised layers random (seed 1), frozen, in eval mode."""
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("tiny")
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    return teacher.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def tiny_teacher():
    return make_tiny_teacher()


def tiny_text_kv(teacher):
    generator = torch.Generator().manual_seed(2)
    config = teacher.config
    text = torch.randn(1, 6, config.text_states_dim, generator=generator)
    byt5 = torch.randn(1, 3, config.byt5_states_dim, generator=generator)
    vision = torch.randn(1, 2, config.vision_states_dim, generator=generator)
    with torch.no_grad():
        return teacher.text_prefill(text, torch.tensor([[1, 1, 1, 1, 0, 0]]), byt5, torch.tensor([[1, 0, 1]]), vision)


def tiny_rollout_inputs(teacher, num_latents=12, height=2, width=3, seed=5) -> RolloutInputs:
    channels = teacher.config.in_channels
    generator = torch.Generator().manual_seed(seed)
    cameras = turning_camera_row(num_latents, turn=0.5, step_back=0.1)
    return RolloutInputs(
        noise=make_initial_noise(seed, (1, channels, num_latents, height, width)),
        image_cond=torch.randn(1, channels, 1, height, width, generator=generator),
        viewmats=cameras["viewmats"],
        Ks=cameras["Ks"],
        action=torch.randint(0, 81, (num_latents,), generator=generator),
        memory_points=make_retrieval_points(seed, num_points=2000),
    )


def test_initial_noise_and_condition_channels():
    noise = make_initial_noise(7, (1, 4, 8, 2, 3))
    assert torch.equal(noise, torch.randn(1, 4, 8, 2, 3, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(make_initial_noise(7, (1, 4, 8, 2, 3), dtype=torch.bfloat16), noise.bfloat16())
    assert not torch.equal(make_initial_noise(8, (1, 4, 8, 2, 3)), noise)
    image_cond = torch.randn(1, 4, 1, 2, 3)
    cond = build_cond_latents(image_cond, 8)
    assert cond.shape == (1, 5, 8, 2, 3)
    assert torch.equal(cond[:, :4, 0], image_cond[:, :, 0]) and bool((cond[:, 4, 0] == 1).all())
    assert not cond[:, :, 1:].any()


def test_hook_that_runs_the_teacher_reproduces_the_plain_rollout(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher)
    config = RolloutConfig(prefeature_layers=(0, 1))
    plain, recorder = record_rollout(tiny_teacher, text_kv, inputs, config)
    seen = []

    def full_step(call):
        seen.append((call.chunk_index, call.step_index, call.rope_start, call.context.num_frames))
        assert (call.previous is None) == (call.step_index == 0)
        assert (call.previous_chunk is None) == (call.chunk_index == 0)
        assert call.model_input.shape == (1, 9, 4, 2, 3) and call.timestep.dtype == torch.float32
        return call.run_teacher()

    hooked = ARRollout(tiny_teacher, text_kv, inputs, config).run(step_fn=full_step)
    assert torch.equal(hooked, plain.latents)
    assert seen == [(c, k, 4 * c, 4 * c) for c in range(3) for k in range(4)]
    # loop identities (tests/data/conformance/README.md F.3, item 7) on a different model and grid
    for chunk in recorder.chunks:
        for before, after in zip(chunk.steps, chunk.steps[1:]):
            assert torch.equal(before.latent_out, after.latent_in)
        assert torch.equal(chunk.final_latent, chunk.steps[-1].latent_out)
        start = 4 * chunk.chunk_index
        assert torch.equal(chunk.steps[0].latent_in, inputs.noise[:, :, start:start + 4])
        if chunk.ctx_indices:
            index = torch.tensor(chunk.ctx_indices)
            cond = build_cond_latents(inputs.image_cond, 12)
            expected = torch.cat([plain.latents[:, :, index], cond[:, :, index]], dim=1)
            assert torch.equal(chunk.ctx_input, expected)
            assert sorted(chunk.prefeatures) == [0, 1]
            assert chunk.prefeatures[0].shape == (1, len(index) * 6, tiny_teacher.config.hidden_size)


def test_reuse_hook_replaces_steps_and_euler_uses_its_velocity(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher)
    recorder = TrajectoryRecorder()

    def reuse_steps_1_2(call):
        if call.step_index in (1, 2):
            return call.previous
        return call.run_teacher()

    final = ARRollout(tiny_teacher, text_kv, inputs, RolloutConfig(), recorder).run(step_fn=reuse_steps_1_2)
    full, _ = record_rollout(tiny_teacher, text_kv, inputs, RolloutConfig())
    assert not torch.allclose(final, full.latents)
    sigmas = torch.tensor([1.0, 0.9375, 0.8333333, 0.625, 0.0])
    for chunk in recorder.chunks:
        assert torch.equal(chunk.steps[1].velocity, chunk.steps[0].velocity)
        assert torch.equal(chunk.steps[2].velocity, chunk.steps[0].velocity)
        step = chunk.steps[2]
        expected = step.latent_in + step.velocity * (sigmas[3] - sigmas[2])
        torch.testing.assert_close(step.latent_out, expected, rtol=0, atol=1e-6)

    with pytest.raises(TypeError, match="StepOutput"):
        ARRollout(tiny_teacher, text_kv, inputs).run(step_fn=lambda call: call.run_teacher().velocity)


def test_bfloat16_state_rounds_every_write_back(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher, num_latents=8)
    inputs = dataclasses.replace(inputs, noise=inputs.noise.bfloat16())
    config = RolloutConfig(state_dtype=torch.bfloat16)
    rollout, recorder = record_rollout(tiny_teacher, text_kv, inputs, config)
    assert rollout.latents.dtype == torch.bfloat16
    for chunk in recorder.chunks:
        for before, after in zip(chunk.steps, chunk.steps[1:]):
            assert before.latent_out.dtype == torch.float32 and after.latent_in.dtype == torch.bfloat16
            assert torch.equal(before.latent_out.bfloat16(), after.latent_in)
    fp32, _ = record_rollout(tiny_teacher, text_kv, dataclasses.replace(inputs, noise=inputs.noise.float()),
                             RolloutConfig())
    difference = (fp32.latents - rollout.latents.float()).abs().max()
    assert 0 < difference < 0.1


def test_rollout_rejects_bad_inputs(tiny_teacher):
    text_kv, inputs = tiny_text_kv(tiny_teacher), tiny_rollout_inputs(tiny_teacher)
    with pytest.raises(ValueError, match="prefeature_layers"):
        ARRollout(tiny_teacher, text_kv, inputs, RolloutConfig(prefeature_layers=(5,)))
    with pytest.raises(ValueError, match="multiple of chunk_latents"):
        ARRollout(tiny_teacher, text_kv, tiny_rollout_inputs(tiny_teacher, num_latents=10))
    with pytest.raises(ValueError, match="viewmats"):
        dataclasses.replace(inputs, viewmats=inputs.viewmats[:-1])
    with pytest.raises(ValueError, match="exactly one of memory_points and memory_generator"):
        dataclasses.replace(inputs, memory_points=None)
    rollout = ARRollout(tiny_teacher, text_kv, inputs)
    with pytest.raises(ValueError, match="chunk 1: latent must be"):
        rollout.write_chunk(1, torch.zeros(1, 4, 3, 2, 3))
    rollout.write_chunk(1, torch.ones(1, 4, 4, 2, 3))  # what a caller that denoises a chunk itself commits
    assert bool((rollout.latents[:, :, 4:8] == 1).all())
    assert torch.equal(rollout.latents[:, :, :4], inputs.noise[:, :, :4])
