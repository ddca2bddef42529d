"""Flow-matching Euler schedule of the distilled 4-step WorldPlay Teacher.

The Teacher is trained for the velocity ``v = noise - x0`` with ``x_sigma = (1 - sigma) * x0 + sigma * noise`` and
receives ``timestep = 1000 * sigma``. Sampling runs from noise (sigma 1) to data (sigma 0):

    sigmas    = shift * s / (1 + (shift - 1) * s),  s = linspace(1, 0, n + 1)   (float32)
    timesteps = 1000 * sigmas[:-1]                                              (float32)
    x_next    = float32(x) + float32(v) * (sigmas[i + 1] - sigmas[i])           (float32)

With n = 4 and shift 5: sigmas [1, 0.9375, 0.8333, 0.625, 0], timesteps [1000, 937.5, 833.33, 625].

Two forms of the Euler step exist and give bit-identical results:
* ``differentiable_euler_step`` is pure (no in-place writes, no detach), so gradients flow through a chain of steps
  (self-rollout BPTT);
* ``FlowMatchEulerScheduler.step`` keeps the upstream stateful interface (step index looked up from the timestep on
  the first call, then incremented) and calls the pure step.
"""

from __future__ import annotations

import torch

from predictor_training.teacher.config import DISTILLED_SHIFT, DISTILLED_STEPS

NUM_TRAIN_TIMESTEPS = 1000


def flow_match_sigmas(num_steps: int = DISTILLED_STEPS, shift: float = DISTILLED_SHIFT) -> torch.Tensor:
    """Shifted flow-matching sigmas, from noise to data.

    Returns:
        sigmas [num_steps + 1] float32 on the CPU, sigmas[0] = 1 and sigmas[-1] = 0.
    """
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be > 0, got {shift!r}")
    linear = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32)
    return (shift * linear) / (1 + (shift - 1) * linear)


def sigmas_to_timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """Model timesteps for each step: ``sigmas[:-1] * 1000`` -> [n] float32."""
    return (sigmas[:-1] * NUM_TRAIN_TIMESTEPS).to(torch.float32)


def differentiable_euler_step(
    sample: torch.Tensor, velocity: torch.Tensor, sigmas: torch.Tensor, step_index: int
) -> torch.Tensor:
    """One Euler step ``sample + velocity * (sigmas[i+1] - sigmas[i])`` computed in float32.

    Pure: nothing is written in place and nothing is detached, so autograd sees the whole step.

    Args:
        sample: x at sigmas[step_index], any shape (e.g. [B, C, T, H, W]), any float dtype.
        velocity: model output, same shape as ``sample``.
        sigmas: [n + 1] schedule (``flow_match_sigmas``).
        step_index: i in [0, n - 1].
    Returns:
        x at sigmas[step_index + 1], float32, same shape as ``sample``.
    """
    num_steps = sigmas.shape[0] - 1
    if not 0 <= step_index < num_steps:
        raise IndexError(f"step_index {step_index} is outside the schedule: valid steps are 0..{num_steps - 1}")
    if sample.shape != velocity.shape:
        raise ValueError(f"sample shape {tuple(sample.shape)} differs from velocity shape {tuple(velocity.shape)}")
    # A 0-dim float32 tensor: it may stay on the CPU while the sample lives on an accelerator.
    sigma_delta = (sigmas[step_index + 1] - sigmas[step_index]).to(torch.float32)
    return sample.to(torch.float32) + velocity.to(torch.float32) * sigma_delta


class FlowMatchEulerScheduler:
    """Stateful Euler scheduler with the upstream ``FlowMatchDiscreteScheduler`` behaviour (reverse, euler, SD3 shift).

    Attributes:
        sigmas: [n + 1] float32 on the CPU.
        timesteps: [n] float32 on ``device``.
        step_index: index of the next step, None until the first ``step`` after ``set_timesteps``.
    """

    def __init__(self, shift: float = DISTILLED_SHIFT, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS):
        if num_train_timesteps != NUM_TRAIN_TIMESTEPS:
            raise ValueError(f"num_train_timesteps must be {NUM_TRAIN_TIMESTEPS}, got {num_train_timesteps}")
        self.shift = float(shift)
        self.sigmas: torch.Tensor | None = None
        self.timesteps: torch.Tensor | None = None
        self.step_index: int | None = None

    def set_timesteps(self, num_inference_steps: int, device: torch.device | str | None = None) -> None:
        """Build the schedule for ``num_inference_steps`` steps and reset the step index."""
        self.sigmas = flow_match_sigmas(num_inference_steps, self.shift)
        self.timesteps = sigmas_to_timesteps(self.sigmas).to(device if device is not None else "cpu")
        self.step_index = None

    def index_for_timestep(self, timestep: float | torch.Tensor) -> int:
        """Position of ``timestep`` in ``self.timesteps`` (exact float match)."""
        self._require_schedule()
        value = self._timestep_value(timestep)
        matches = (self.timesteps.cpu() == value).nonzero().flatten()
        if matches.numel() == 0:
            raise ValueError(
                f"timestep {value} is not in the schedule's timesteps {self.timesteps.tolist()}"
            )
        return int(matches[0])

    def step(self, model_output: torch.Tensor, timestep: float | torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """Advance ``sample`` one step with velocity ``model_output``; returns the next sample in float32.

        The step index is found from ``timestep`` on the first call after ``set_timesteps``; afterwards it only
        increments (``timestep`` is still checked to be a float).
        """
        self._require_schedule()
        value = self._timestep_value(timestep)
        if self.step_index is None:
            self.step_index = self.index_for_timestep(value)
        num_steps = self.sigmas.shape[0] - 1
        if self.step_index >= num_steps:
            raise RuntimeError(
                f"step() called {self.step_index + 1} times but the schedule has only {num_steps} steps; "
                "call set_timesteps() to start a new trajectory"
            )
        prev_sample = differentiable_euler_step(sample, model_output, self.sigmas, self.step_index)
        self.step_index += 1
        return prev_sample

    # ---- helpers ------------------------------------------------------------------------------------------
    def _require_schedule(self) -> None:
        if self.sigmas is None:
            raise RuntimeError("set_timesteps() must be called before step()")

    @staticmethod
    def _timestep_value(timestep: float | torch.Tensor) -> float:
        """The timestep as a Python float; integer timesteps are rejected as upstream does."""
        if isinstance(timestep, torch.Tensor):
            if not timestep.is_floating_point():
                raise ValueError(
                    f"integer timesteps (dtype {timestep.dtype}) are not supported: pass one of "
                    "scheduler.timesteps (float32)"
                )
            if timestep.numel() != 1:
                raise ValueError(f"timestep must be a scalar, got shape {tuple(timestep.shape)}")
            return float(timestep.reshape(()).to(torch.float32))
        if isinstance(timestep, bool) or isinstance(timestep, int):
            raise ValueError(f"integer timestep {timestep!r} is not supported: pass one of scheduler.timesteps")
        if isinstance(timestep, float):
            return timestep
        raise TypeError(f"timestep must be a float or a float tensor, got {type(timestep).__name__}")


# The lowest noise level the distilled Teacher was trained at (its last step's sigma, 0.625): below it the
# Teacher is no score model (DMD2's raw-Teacher score, NFT's training sigmas).
DISTILLED_SIGMA_FLOOR = float(flow_match_sigmas(DISTILLED_STEPS, DISTILLED_SHIFT)[-2])
