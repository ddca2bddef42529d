"""Flow-matching Euler scheduler: golden vectors (conformance set A), stateful == pure step, gradients."""


import pytest
import torch
from safetensors.torch import load_file

from predictor_training.conformance import SET_A
from predictor_training.rollout.scheduler import FlowMatchEulerScheduler, differentiable_euler_step, flow_match_sigmas


NUM_STEPS = 4


@pytest.fixture(scope="module")
def golden():
    vectors = load_file(str(SET_A / "vectors.safetensors"))
    return {name: tensor for name, tensor in vectors.items() if name.startswith("sched.")}


def test_sigmas_and_timesteps_match_golden(golden):
    sigmas = flow_match_sigmas(NUM_STEPS, shift=5.0)
    assert sigmas.dtype == torch.float32 and sigmas.device.type == "cpu"
    torch.testing.assert_close(sigmas, golden["sched.sigmas"], atol=1e-7, rtol=0)

    scheduler = FlowMatchEulerScheduler(shift=5.0)
    scheduler.set_timesteps(NUM_STEPS)
    assert torch.equal(scheduler.sigmas, sigmas)
    assert scheduler.timesteps.dtype == torch.float32
    torch.testing.assert_close(scheduler.timesteps, golden["sched.timesteps"], atol=1e-4, rtol=0)


def test_sigmas_follow_the_shift_formula_in_float64():
    shift = 5.0
    linear = torch.linspace(1, 0, NUM_STEPS + 1, dtype=torch.float64)
    expected = shift * linear / (1 + (shift - 1) * linear)
    torch.testing.assert_close(flow_match_sigmas(NUM_STEPS, shift).double(), expected, atol=1e-7, rtol=0)
    assert flow_match_sigmas(NUM_STEPS, shift)[0] == 1 and flow_match_sigmas(NUM_STEPS, shift)[-1] == 0


def test_stateful_chain_matches_golden(golden):
    scheduler = FlowMatchEulerScheduler(shift=5.0)
    scheduler.set_timesteps(NUM_STEPS)
    sample = golden["sched.x0"]
    for step in range(NUM_STEPS):
        sample = scheduler.step(golden[f"sched.step{step}.model_output"], scheduler.timesteps[step], sample)
        assert sample.dtype == torch.float32
        torch.testing.assert_close(sample, golden[f"sched.step{step}.prev_sample"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("sample_dtype", [torch.float32, torch.bfloat16])
def test_stateful_step_equals_differentiable_step_bitwise(golden, sample_dtype):
    scheduler = FlowMatchEulerScheduler(shift=5.0)
    scheduler.set_timesteps(NUM_STEPS)
    stateful = pure = golden["sched.x0"].to(sample_dtype)
    for step in range(NUM_STEPS):
        velocity = golden[f"sched.step{step}.model_output"].to(sample_dtype)
        stateful = scheduler.step(velocity, scheduler.timesteps[step], stateful)
        pure = differentiable_euler_step(pure, velocity, scheduler.sigmas, step)
        assert stateful.dtype == pure.dtype == torch.float32
        assert torch.equal(stateful, pure)
        # the pipeline writes each result back into a buffer of the latent dtype
        stateful, pure = stateful.to(sample_dtype), pure.to(sample_dtype)


def test_gradient_flows_through_differentiable_steps():
    generator = torch.Generator().manual_seed(0)
    sigmas = flow_match_sigmas(NUM_STEPS)
    start = torch.randn(1, 4, 2, 3, 3, generator=generator, requires_grad=True)
    velocities = [torch.randn(1, 4, 2, 3, 3, generator=generator, requires_grad=True) for _ in range(NUM_STEPS)]
    versions = [start._version] + [velocity._version for velocity in velocities]

    sample = start
    for step, velocity in enumerate(velocities):
        sample = differentiable_euler_step(sample, velocity, sigmas, step)
    sample.sum().backward()

    # x_4 = x_0 + sum_i v_i * (sigma[i+1] - sigma[i])  =>  dx_4/dx_0 = 1, dx_4/dv_i = sigma[i+1] - sigma[i]
    assert torch.equal(start.grad, torch.ones_like(start))
    for step, velocity in enumerate(velocities):
        assert torch.equal(velocity.grad, torch.full_like(velocity, float(sigmas[step + 1] - sigmas[step])))
    assert [start._version] + [velocity._version for velocity in velocities] == versions  # nothing written in place


def test_first_step_looks_up_the_index_then_increments(golden):
    scheduler = FlowMatchEulerScheduler(shift=5.0)
    scheduler.set_timesteps(NUM_STEPS)
    sample, velocity = golden["sched.x0"], golden["sched.step0.model_output"]
    out = scheduler.step(velocity, scheduler.timesteps[2], sample)
    assert torch.equal(out, differentiable_euler_step(sample, velocity, scheduler.sigmas, 2))
    assert scheduler.step_index == 3
    scheduler.step(velocity, float(scheduler.timesteps[3]), sample)
    with pytest.raises(RuntimeError, match="only 4 steps"):
        scheduler.step(velocity, float(scheduler.timesteps[3]), sample)
    scheduler.set_timesteps(NUM_STEPS)
    assert scheduler.step_index is None


def test_bad_timesteps_are_rejected(golden):
    scheduler = FlowMatchEulerScheduler(shift=5.0)
    sample, velocity = golden["sched.x0"], golden["sched.step0.model_output"]
    with pytest.raises(RuntimeError, match="set_timesteps"):
        scheduler.step(velocity, 1000.0, sample)
    scheduler.set_timesteps(NUM_STEPS)
    with pytest.raises(ValueError, match="integer"):
        scheduler.step(velocity, 1000, sample)
    with pytest.raises(ValueError, match="integer"):
        scheduler.step(velocity, torch.tensor(1000), sample)
    with pytest.raises(ValueError, match="not in the schedule"):
        scheduler.step(velocity, 999.0, sample)
    with pytest.raises(IndexError, match="outside the schedule"):
        differentiable_euler_step(sample, velocity, scheduler.sigmas, NUM_STEPS)
