"""The Teacher's autoregressive chunk loop (F-F-F-F), shared by the dataset builder, eval and rollout training.

One video of T latent frames is generated as T / 4 chunks of 4 latent frames, each denoised with the distilled
4-step schedule (guidance 1, one model call per step). For chunk c, with s = 4c
(predictor_training/conformance/golden/README.md, "Full F-F-F-F trajectory", § F.2):

1. **Context** (c >= 1): ``idx = select_aligned_memory_frames(w2c, s, ...)`` minus the chunk's own frames, sorted;
   n = len(idx). The context input is ``cat(latents[:, :, idx], cond[:, :, idx])`` - the *current running* latents,
   i.e. the final latents of earlier chunks - prefilled at timestep 14 with compacted RoPE positions 0..n-1. The
   resulting context K/V replaces the previous chunk's; the text K/V never changes. The scheduler is reset.
2. **Steps** k = 0..3: ``x = latents[:, :, s:s+4]``; the Teacher's chunk step on ``cat(x, cond[:, :, s:s+4])`` at
   timestep ``timesteps[k]`` for every frame, RoPE start n; Euler ``x' = x + v * (sigma[k+1] - sigma[k])`` in
   float32; ``x'`` is written back into ``latents[:, :, s:s+4]``.

Condition channels (i2v): frame 0 carries the image-condition latent and mask 1, every other frame zeros (C + 1
channels). Model inputs are ``[latent C | image-cond C | mask 1]``.

Precision. ``RolloutConfig.state_dtype`` is the dtype of the running latent buffer: float32 reproduces the golden
trajectory; bfloat16 is what the real pipeline does (every float32 Euler result is written back into a bf16 buffer,
predictor_training/conformance/golden/README.md § F.4). viewmats / Ks (float64 inputs) and action labels are cast to the
Teacher's parameter dtype for each call; timesteps stay float32. ``autocast_dtype`` runs every Teacher call under autocast (bf16 for the real model).

Replacing steps. ``ARRollout.run(step_fn=...)`` calls ``step_fn(call: StepCall) -> StepOutput`` instead of the Full
step; ``call.run_teacher()`` runs the Full step, so a schedule such as F-P-P-F is written as a hook that either calls
the Teacher or a Predictor. The running buffer is updated in place and never carries a graph.

One loop. ``ARRollout.run_chunks(policy)`` is the one loop over a rollout's chunks: per chunk it enters the policy's
scope, denoises the chunk (``denoise_chunk``, the one loop over its steps) with the policy's step hook, calls the
policy's ``end_chunk``, commits and calls the policy's ``after_commit`` (the step protocol and the policies:
rollout/policy.py; a recorded rollout: rollout/recorder.py). ``ChunkPolicy`` runs a step hook without
gradients (``run``, ``run_chunk``); ``TrainingPolicy`` is a trainer's schedule: which step of a trained chunk runs
Full, the student or velocity reuse, which calls carry a graph and where the graph is cut, with the trainer's
per-chunk scope (DDP ``no_sync``) and hook (its backward, or a DMD generator's critic and backward: between a chunk's
last step and its commit). ``after_commit`` sees the history with the chunk in it (teacher forcing replaces it by the
data there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from predictor_training.rollout.memory_retrieval import make_retrieval_points, select_aligned_memory_frames
from predictor_training.rollout.policy import ChunkContext, ChunkPolicy, ChunkRun, StepCall, StepFn, StepOutput
from predictor_training.rollout.recorder import StepRecord, TrajectoryRecorder
from predictor_training.runtime.fake_tensors import real_values
from predictor_training.teacher.frame_kv_cache import FrameKVCache, check_context_mode
from predictor_training.runtime.precision import autocast
from predictor_training.rollout.scheduler import FlowMatchEulerScheduler, differentiable_euler_step
from predictor_training.teacher.config import DISTILLED_SHIFT, DISTILLED_STEPS
from predictor_training.teacher import ContextKV, RecomputedContextKV, TextKV
from predictor_training.teacher.adapters import active_adapter, adapter

CONTEXT_TIMESTEP = 14.0  # stabilization level 15 minus 1 (predictor_training/conformance/golden/README.md § F.3)


# ---- inputs and settings -------------------------------------------------------------------------------------
def make_initial_noise(
    seed: int, shape: Sequence[int], device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Tensor:
    """Initial latents ``[1, C, T, H, W]``: one ``torch.randn`` call from a CPU ``torch.Generator(seed)``.

    The values are drawn in float32 on the CPU and then moved/cast to ``device`` / ``dtype``, so the same seed gives
    the same noise on every device and the same trajectory on CPU and GPU (up to kernel differences). The upstream
    pipeline instead draws bf16 noise from a CUDA generator; its values cannot be reproduced on a CPU, so a dataset
    built here is not seed-compatible with upstream videos (it is self-consistent). With ``dtype=float32`` this is
    exactly how the golden trajectory's ``inputs.noise`` was made.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"noise seed must be a non-negative int, got {seed!r}")
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn(tuple(shape), generator=generator, dtype=torch.float32)
    return noise.to(device=device, dtype=dtype)


def host_retrieval_points(seed: int) -> Tensor:
    """`make_retrieval_points(seed)` on real host values (a memory rehearsal's fake mode set aside: the points decide
    which frames the memory selection keeps, hence the context length)."""
    with real_values():
        return make_retrieval_points(seed)


def build_cond_latents(image_cond: Tensor, num_latents: int) -> Tensor:
    """i2v condition channels ``[1, C + 1, T, H, W]`` from ``image_cond [1, C, 1, H, W]``.

    Channels 0..C-1: image_cond at frame 0, zeros elsewhere. Channel C (mask): 1 at frame 0, 0 elsewhere.
    """
    if image_cond.dim() != 5 or image_cond.shape[0] != 1 or image_cond.shape[2] != 1:
        raise ValueError(f"image_cond must be [1, C, 1, H, W], got {tuple(image_cond.shape)}")
    _, channels, _, height, width = image_cond.shape
    cond = image_cond.new_zeros(1, channels + 1, num_latents, height, width)
    cond[:, :channels, 0] = image_cond[:, :, 0]
    cond[:, channels, 0] = 1
    return cond


@dataclass(frozen=True)
class RolloutConfig:
    """Settings of the AR loop (defaults = the distilled WorldPlay-1.5 AR pipeline).

    num_steps / shift: the flow-matching schedule (4 steps, shift 5). chunk_latents: latent frames per chunk (4).
    context_timestep: timestep of every context frame (14). memory_frames / temporal_context_size: memory selection
    (20 / 12). state_dtype: dtype of the running latent buffer (float32 or bfloat16). autocast_dtype: autocast for
    every Teacher call (None = off). prefeature_layers: double blocks whose input hidden state is recorded during
    every context prefill. context_mode: how a chunk's context K/V are obtained - "exact" (re-prefill the selected
    frames every chunk: the reference), "incremental" or "last_step" (per-frame K/V computed once and re-used;
    predictor_training/teacher/frame_kv_cache.py).
    """

    num_steps: int = DISTILLED_STEPS
    shift: float = DISTILLED_SHIFT
    chunk_latents: int = 4
    context_timestep: float = CONTEXT_TIMESTEP
    memory_frames: int = 20
    temporal_context_size: int = 12
    state_dtype: torch.dtype = torch.float32
    autocast_dtype: torch.dtype | None = None
    prefeature_layers: tuple[int, ...] = ()
    context_mode: str = "exact"

    def __post_init__(self):
        check_context_mode(self.context_mode)
        if self.context_mode != "exact" and self.prefeature_layers:
            raise ValueError("prefeature_layers are hidden states of an exact context prefill; the "
                             f"{self.context_mode!r} context mode runs none")
        if self.state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {self.state_dtype}")
        if self.chunk_latents < 1 or self.num_steps < 1:
            raise ValueError(f"chunk_latents and num_steps must be >= 1, got {self.chunk_latents}, {self.num_steps}")

    def chunk_frames(self, chunk_index: int) -> slice:
        """The latent frames of a chunk: ``slice(4c, 4c + 4)``."""
        start = chunk_index * self.chunk_latents
        return slice(start, start + self.chunk_latents)

    @classmethod
    def from_dataset_config(
        cls, dataset_config: dict, where: str, *, state_dtype: torch.dtype, autocast_dtype: torch.dtype | None
    ) -> "RolloutConfig":
        """The AR loop settings a dataset was built with (its dataset_config.json, named `where` in errors); the
        running-latent dtype and the Teacher autocast are the caller's (they follow its --precision)."""
        missing = [name for name in ("num_steps", "shift", "chunk_latents", "context_timestep", "memory")
                   if name not in dataset_config]
        if missing:
            raise KeyError(f"{where}: missing field(s) {missing}")
        memory = dataset_config["memory"]
        return cls(
            num_steps=int(dataset_config["num_steps"]),
            shift=float(dataset_config["shift"]),
            chunk_latents=int(dataset_config["chunk_latents"]),
            context_timestep=float(dataset_config["context_timestep"]),
            memory_frames=int(memory["memory_frames"]),
            temporal_context_size=int(memory["temporal_context_size"]),
            state_dtype=state_dtype,
            autocast_dtype=autocast_dtype,
        )


@dataclass
class RolloutInputs:
    """Everything that defines one trajectory besides the Teacher and its text K/V.

    noise [1, C, T, H, W]; image_cond [1, C, 1, H, W]; viewmats [T, 4, 4] (world-to-camera, float64);
    Ks [T, 3, 3] (normalised, float64); action [T] int64. Memory selection uses ``memory_points`` [N, 3] (drawn once
    per video, e.g. ``make_retrieval_points(seed)``) or, when None, ``memory_generator``; exactly one is given.
    """

    noise: Tensor
    image_cond: Tensor
    viewmats: Tensor
    Ks: Tensor
    action: Tensor
    memory_points: Tensor | None = None
    memory_generator: torch.Generator | None = None

    def __post_init__(self):
        if self.noise.dim() != 5 or self.noise.shape[0] != 1:
            raise ValueError(f"noise must be [1, C, T, H, W], got {tuple(self.noise.shape)}")
        _, channels, num_latents, height, width = self.noise.shape
        if tuple(self.image_cond.shape) != (1, channels, 1, height, width):
            raise ValueError(
                f"image_cond must be [1, {channels}, 1, {height}, {width}] to match the noise, "
                f"got {tuple(self.image_cond.shape)}"
            )
        expected = {"viewmats": (num_latents, 4, 4), "Ks": (num_latents, 3, 3), "action": (num_latents,)}
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                found = list(getattr(self, name).shape)
                raise ValueError(f"{name} must be {list(shape)} (one row per latent), got {found}")
        if (self.memory_points is None) == (self.memory_generator is None):
            raise ValueError("give exactly one of memory_points and memory_generator for the memory selection")

    @property
    def num_latents(self) -> int:
        return self.noise.shape[2]

    @classmethod
    def from_seed(
        cls,
        seed: int,
        image_cond: Tensor,
        viewmats: Tensor,
        Ks: Tensor,
        action: Tensor,
        *,
        state_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> "RolloutInputs":
        """The trajectory of one sample-table row: its seed gives the initial noise (``make_initial_noise``) and the
        memory-retrieval points (``make_retrieval_points``). The dataset builder, the self-rollout trainer and the
        eval all call this, so one seed means one trajectory everywhere.

        image_cond [1, C, 1, H, W]; viewmats [T, 4, 4]; Ks [T, 3, 3]; action [T] (T latents).
        """
        _, channels, _, height, width = image_cond.shape
        num_latents = viewmats.shape[0]
        return cls(
            noise=make_initial_noise(int(seed), (1, channels, num_latents, height, width), device, state_dtype),
            image_cond=image_cond,
            viewmats=viewmats,
            Ks=Ks,
            action=action,
            memory_points=host_retrieval_points(int(seed)),
        )

    @classmethod
    def from_clip(cls, item, noise: Tensor, memory_seed: int) -> "RolloutInputs":
        """A trajectory on one dataset clip: the clip's conditioning (item's image_cond [1, C, 1, H, W], viewmats
        [T, 4, 4], Ks [T, 3, 3], action [T]) with the caller's running latents `noise` [1, C, T, H, W] (noise to
        sample from, or a known history) and the memory-retrieval points of `memory_seed`."""
        return cls(noise=noise, image_cond=item["image_cond"].float(), viewmats=item["viewmats"].double(),
                   Ks=item["Ks"].double(), action=item["action"], memory_points=host_retrieval_points(int(memory_seed)))


# ---- the loop --------------------------------------------------------------------------------------------------
class ARRollout:
    """State of one autoregressive rollout: the running latents ``[1, C, T, H, W]`` and the fixed inputs.

    Usage: ``ARRollout(teacher, text_kv, inputs, config, recorder).run()`` -> final latents; a trainer passes its
    ``TrainingPolicy`` to ``run_chunks`` (so do the DMD generators, whose per-chunk hook runs the critic before the
    commit: ``methods/chunk_generators.py``). Pieces (``select_context``, ``prefill_context``, ``denoise_chunk``,
    ``commit_chunk``) are public for the rollout layer's other drivers (teacher forcing) and for re-running part of
    a chunk (the F-P-P-F generator's trailing Full step with a graph).
    """

    def __init__(
        self,
        teacher,
        text_kv: TextKV,
        inputs: RolloutInputs,
        config: RolloutConfig = RolloutConfig(),
        recorder: "TrajectoryRecorder | None" = None,
        device: torch.device | str | None = None,
    ):
        self.teacher = teacher
        self.config = config
        self.recorder = recorder
        self.device = torch.device(device) if device is not None else inputs.noise.device
        self.model_dtype = teacher.dtype
        # 1. Validate sizes against the Teacher.
        depth = len(teacher.double_blocks)
        if text_kv.num_layers != depth:
            raise ValueError(f"text K/V has {text_kv.num_layers} layers, the Teacher has {depth} double blocks")
        bad_layers = [layer for layer in config.prefeature_layers if not 0 <= layer < depth]
        if bad_layers:
            raise ValueError(f"prefeature_layers {bad_layers} are outside the Teacher's blocks 0..{depth - 1}")
        channels = teacher.config.in_channels
        if inputs.noise.shape[1] != channels:
            raise ValueError(f"noise has {inputs.noise.shape[1]} channels, the Teacher expects {channels}")
        if inputs.num_latents % config.chunk_latents:
            raise ValueError(
                f"num_latents {inputs.num_latents} is not a multiple of chunk_latents {config.chunk_latents}"
            )
        # 2. Fixed inputs on the device; poses stay float64 for the memory selection.
        self.text_kv = text_kv.to(self.device)
        self.inputs = inputs
        self.w2c = inputs.viewmats.to(torch.float64)
        self.cond = build_cond_latents(inputs.image_cond, inputs.num_latents).to(self.device)
        self.latents = inputs.noise.to(device=self.device, dtype=config.state_dtype, copy=True)
        self.scheduler = FlowMatchEulerScheduler(shift=config.shift)
        self.scheduler.set_timesteps(config.num_steps)
        self.previous_chunk_outputs: list[StepOutput] | None = None
        self.num_chunks = inputs.num_latents // config.chunk_latents
        height, width = inputs.noise.shape[3:]
        self.frame_cache = None if config.context_mode == "exact" else FrameKVCache(depth, height * width)

    # ---- helpers ----------------------------------------------------------------------------------------------
    @property
    def sigmas(self) -> Tensor:
        """[num_steps + 1] float32 (CPU)."""
        return self.scheduler.sigmas

    @property
    def timesteps(self) -> Tensor:
        """[num_steps] float32 (CPU)."""
        return self.scheduler.timesteps

    def autocast(self):
        """The Teacher's autocast context of this rollout (a null context without ``config.autocast_dtype``)."""
        return autocast(self.device, self.config.autocast_dtype)

    def frame_inputs(self, frames: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(action [1, n], viewmats [1, n, 4, 4], Ks [1, n, 3, 3]) of ``frames``, cast to the Teacher dtype."""
        index = torch.as_tensor(list(frames), dtype=torch.long)
        to_model = dict(device=self.device, dtype=self.model_dtype)
        action = self.inputs.action[index].to(**to_model)[None]
        viewmats = self.inputs.viewmats[index].to(**to_model)[None]
        Ks = self.inputs.Ks[index].to(**to_model)[None]
        return action, viewmats, Ks

    def model_input(self, frames: Sequence[int] | slice) -> Tensor:
        """``cat(latents, cond)`` at ``frames`` -> [1, 2C+1, n, H, W] in the Teacher dtype."""
        if not isinstance(frames, slice):
            frames = torch.as_tensor(list(frames), dtype=torch.long, device=self.device)
        latent = self.latents[:, :, frames].to(self.model_dtype)
        return torch.cat([latent, self.cond[:, :, frames].to(self.model_dtype)], dim=1)

    def chunk_frames(self, chunk_index: int) -> slice:
        """The latent frames of a chunk: ``slice(4c, 4c + 4)`` (`RolloutConfig.chunk_frames`)."""
        return self.config.chunk_frames(chunk_index)

    @torch.no_grad()
    def write_chunk(self, chunk_index: int, latent: Tensor) -> None:
        """Write ``latent [1, C, 4, H, W]`` into the running latents (cast to the state dtype).

        A caller that denoises a chunk itself (the self-rollout trainer) commits its final latent with this, so the
        next chunk's context is built from it.
        """
        frames = self.chunk_frames(chunk_index)
        expected = tuple(self.latents[:, :, frames].shape)
        if tuple(latent.shape) != expected:
            raise ValueError(f"chunk {chunk_index}: latent must be {list(expected)}, got {list(latent.shape)}")
        self.latents[:, :, frames] = latent.to(self.config.state_dtype)

    # ---- 1. context ---------------------------------------------------------------------------------------------
    def select_context(self, chunk_index: int) -> list[int]:
        """Memory/context latent indices for the chunk (ascending, never including the chunk's own frames)."""
        start = chunk_index * self.config.chunk_latents
        if start == 0:
            return []
        with real_values():  # host work on the poses; under a memory rehearsal too, as its result sizes the context
            selected = select_aligned_memory_frames(
                self.w2c,
                start,
                memory_frames=self.config.memory_frames,
                temporal_context_size=self.config.temporal_context_size,
                pred_latent_size=self.config.chunk_latents,
                points=self.inputs.memory_points,
                generator=self.inputs.memory_generator,
            )
        own = set(range(start, start + self.config.chunk_latents))
        return sorted(int(index) for index in selected if int(index) not in own)

    def prefill_context(
        self, chunk_index: int, with_vec: bool = False, *, grad: bool = False, text_kv: TextKV | None = None
    ) -> ChunkContext:
        """Select the context and run the Teacher's context prefill on the current running latents.

        Without gradients by default (the AR loop). A trainer whose model learns from its context (diffusion
        forcing, KD) passes ``grad=True``, and ``text_kv`` when its text K/V are recomputed under grad per chunk.
        """
        indices = self.select_context(chunk_index)
        if not indices:
            return ChunkContext(indices=[])
        if max(indices) >= chunk_index * self.config.chunk_latents:
            raise RuntimeError(f"context {indices} of chunk {chunk_index} reaches frames that are not generated yet")
        model_input = self.model_input(indices)
        action, viewmats, Ks = self.frame_inputs(indices)
        timestep = torch.full((len(indices),), self.config.context_timestep, dtype=torch.float32, device=self.device)
        if self.frame_cache is not None:  # cached modes: place the stored K/V at their positions and cameras
            if grad:
                raise ValueError(f"the {self.config.context_mode!r} context mode re-uses stored K/V; it cannot "
                                 "train through the context (use context_mode 'exact')")
            height, width = model_input.shape[3:]
            with torch.no_grad(), self.autocast():
                kv = self.teacher.assemble_context_kv(self.frame_cache.gather(indices), viewmats, Ks, height, width)
                vec = self.teacher.frame_vec(timestep, action)[0] if with_vec else None
            return ChunkContext(indices=indices, model_input=model_input, kv=kv, vec=vec)
        kv, prefeatures = self._prefill(model_input, indices, grad=grad, text_kv=text_kv)
        vec = None
        if with_vec:
            with torch.set_grad_enabled(grad), self.autocast():
                vec = self.teacher.frame_vec(timestep, action)[0]
        return ChunkContext(indices=indices, model_input=model_input, kv=kv, prefeatures=dict(prefeatures), vec=vec)

    def _prefill(self, model_input: Tensor, indices: list[int], *, grad: bool, text_kv: TextKV | None):
        action, viewmats, Ks = self.frame_inputs(indices)
        timestep = torch.full((len(indices),), self.config.context_timestep, dtype=torch.float32, device=self.device)
        with torch.set_grad_enabled(grad), self.autocast():
            return self.teacher.context_prefill(
                model_input, timestep, action, viewmats, Ks, self.text_kv if text_kv is None else text_kv,
                prefeature_layers=tuple(self.config.prefeature_layers),
            )

    def prefill_again(self, context: ChunkContext, text_kv: TextKV | None = None) -> ContextKV:
        """The no-grad context prefill of ``context`` run again on its own input snapshot (same frames, cameras,
        actions and text): the same K/V, for a `RecomputedContextKV` whose K/V were released. Exact mode only."""
        if self.frame_cache is not None:
            raise ValueError(f"the {self.config.context_mode!r} context mode assembles stored K/V; only an 'exact' "
                             "context is prefilled again")
        return self._prefill(context.model_input, context.indices, grad=False, text_kv=text_kv)[0]

    def recomputed_context(self, context: ChunkContext, text_kv: TextKV | None = None) -> RecomputedContextKV:
        """``context``'s K/V (a no-grad prefill of this rollout, exact mode) behind handles that can release them
        after a forward under grad and prefill them again for its backward (`RecomputedContextKV`). The rebuild
        keeps only the prefill's input snapshot, not the K/V, and runs under the adapter active now (a Teacher
        shared by adapters switches between the forward and the backward)."""
        snapshot = ChunkContext(indices=context.indices, model_input=context.model_input)
        name = active_adapter(self.teacher)

        def rebuild() -> ContextKV:
            with adapter(self.teacher, name):
                return self.prefill_again(snapshot, text_kv)

        return RecomputedContextKV(context.kv, rebuild)

    # ---- 2. steps -----------------------------------------------------------------------------------------------
    def full_step(self, model_input, timestep, action, viewmats, Ks, context: ChunkContext) -> StepOutput:
        """One Full Teacher step of a chunk: velocity and final hidden (no ``no_grad`` here: callers choose)."""
        with self.autocast():
            output = self.teacher.chunk_step(
                model_input, timestep, action, viewmats, Ks, self.text_kv,
                context_kv=context.kv, rope_start=context.num_frames, return_final_hidden=True,
                return_raw_kv=self.config.context_mode == "last_step",
            )
        return StepOutput(velocity=output.velocity, final_hidden=output.final_hidden, raw_kv=output.raw_kv)

    @torch.no_grad()
    def cache_chunk(self, chunk_index: int, context: ChunkContext, outputs: Sequence[StepOutput]) -> None:
        """Store the finished chunk's per-frame K/V for later chunks (cached context modes; not the last chunk,
        whose frames no chunk selects). incremental: one Teacher pass over the final latents at the context
        timestep, attending to the chunk's own context; last_step: the K/V of the chunk's last Full step."""
        if self.frame_cache is None or chunk_index == self.num_chunks - 1:
            return
        frames = self.chunk_frames(chunk_index)
        frame_ids = list(range(frames.start, frames.stop))
        if self.config.context_mode == "last_step":
            full_steps = [output for output in outputs if output.raw_kv is not None]
            if not full_steps:
                raise RuntimeError(f"chunk {chunk_index}: the 'last_step' context mode needs at least one Full "
                                   "Teacher step per chunk; this schedule replaced them all")
            self.frame_cache.put(frame_ids, full_steps[-1].raw_kv)
            return
        action, viewmats, Ks = self.frame_inputs(frame_ids)
        timestep = torch.full((len(frame_ids),), self.config.context_timestep, dtype=torch.float32,
                              device=self.device)
        with self.autocast():
            raw_kv = self.teacher.frame_kv_pass(self.model_input(frames), timestep, action, viewmats, Ks,
                                                self.text_kv, context_kv=context.kv, rope_start=context.num_frames)
        self.frame_cache.put(frame_ids, raw_kv)

    def denoise_chunk(self, chunk_index: int, step_fn: StepFn | None = None, *, context: ChunkContext | None = None,
                      latent: Tensor | None = None, first_step: int = 0) -> ChunkRun:
        """The one loop over a chunk's denoising steps: what runs at each step is `step_fn`'s (default: the Full
        Teacher step), where the graph stops is its outputs' `graph_stops`; the latent stays local, so a graph can
        live through it (nothing is written to the running latents: `run_chunks` commits).

        context: default, the chunk's context prefilled now (no grad). latent [1, C, 4, H, W]: the latent entering
        `first_step` (default: the chunk's slot of the running latents, i.e. its noise). Each step's input is cast to
        the Teacher dtype, the Euler update is float32 and the next latent is cast to the state dtype, as the
        pipeline's running buffer does. Grad mode is the caller's: under no_grad nothing keeps a graph.
        """
        if not 0 <= chunk_index < self.num_chunks:
            raise IndexError(f"chunk {chunk_index} is outside 0..{self.num_chunks - 1}")
        size = self.config.chunk_latents
        frames = self.chunk_frames(chunk_index)
        # 1. Context (rebuilt from scratch unless given).
        if context is None:
            context = self.prefill_context(chunk_index, with_vec=self.recorder is not None)
            if self.recorder is not None:
                self.recorder.on_context(chunk_index, frames.start, context)
        action, viewmats, Ks = self.frame_inputs(range(frames.start, frames.stop))
        cond = self.cond[:, :, frames].to(self.model_dtype)
        latent = self.latents[:, :, frames].clone() if latent is None else latent
        # 2. Steps: the Full step (or the hook), Euler in float32, the next latent in the state dtype.
        outputs: list[StepOutput] = []
        for step_index in range(first_step, self.config.num_steps):
            timestep = self.timesteps[step_index].expand(size).to(device=self.device, dtype=torch.float32)
            model_input = torch.cat([latent.to(self.model_dtype), cond], dim=1)
            run_teacher = (
                lambda model_input=model_input, timestep=timestep: self.full_step(
                    model_input, timestep, action, viewmats, Ks, context
                )
            )
            if step_fn is None:
                output = run_teacher()
            else:
                output = step_fn(StepCall(
                    chunk_index=chunk_index, step_index=step_index, latent=latent, model_input=model_input,
                    timestep=timestep, action=action, viewmats=viewmats, Ks=Ks, text_kv=self.text_kv,
                    context=context, rope_start=context.num_frames, previous=outputs[-1] if outputs else None,
                    previous_chunk=self.previous_chunk_outputs, run_teacher=run_teacher,
                ))
                if not isinstance(output, StepOutput):
                    raise TypeError(f"step_fn must return a StepOutput, got {type(output).__name__}")
            stepped = differentiable_euler_step(latent.detach() if output.graph_stops else latent, output.velocity,
                                                self.sigmas, step_index)
            if self.recorder is not None:
                self.recorder.on_step(chunk_index, step_index, StepRecord(
                    latent_in=latent, timestep=timestep, velocity=output.velocity,
                    final_hidden=output.final_hidden, latent_out=stepped,
                ))
            outputs.append(output)
            latent = stepped.to(self.config.state_dtype)
        return ChunkRun(chunk_index, context, outputs, latent)

    def commit_chunk(self, run: ChunkRun) -> None:
        """A finished chunk becomes history: its final latent (detached) is written into the running latents, the
        cached context modes store its K/V, and its step outputs become the next chunk's `previous_chunk`."""
        self.write_chunk(run.chunk_index, run.final_latent.detach())
        if self.recorder is not None:
            self.recorder.on_chunk_end(run.chunk_index, self.latents[:, :, self.chunk_frames(run.chunk_index)])
        self.cache_chunk(run.chunk_index, run.context, run.outputs)
        self.previous_chunk_outputs = list(run.outputs)

    def run_chunks(self, policy: ChunkPolicy, chunks: Sequence[int] | None = None) -> Tensor:
        """The one loop over the chunks (default: all, in order): each chunk is denoised inside
        ``policy.chunk_scope`` with ``policy.chunk_step_fn``, handed to ``policy.end_chunk`` (still in the scope),
        committed, then handed to ``policy.after_commit``. Returns the running latents [1, C, T, H, W]."""
        for chunk_index in range(self.num_chunks) if chunks is None else chunks:
            with policy.chunk_scope(chunk_index):
                run = self.denoise_chunk(chunk_index, policy.chunk_step_fn(chunk_index))
                policy.end_chunk(run)
            self.commit_chunk(run)
            policy.after_commit(run)
            del run  # nothing of a finished chunk outlives its commit here
        return self.latents

    def run_chunk(self, chunk_index: int, step_fn: StepFn | None = None) -> list[StepOutput]:
        """Chunk ``chunk_index`` through `run_chunks` (no grad, context prefill + ``num_steps`` Euler steps,
        committed); returns the step outputs."""
        outputs: list[StepOutput] = []
        self.run_chunks(ChunkPolicy(step_fn, on_chunk_end=lambda run: outputs.extend(run.outputs)), [chunk_index])
        return outputs

    def run(self, step_fn: StepFn | None = None, chunks: Sequence[int] | None = None) -> Tensor:
        """Run ``chunks`` (default: all, in order) with ``step_fn`` without gradients and return the running
        latents [1, C, T, H, W]."""
        return self.run_chunks(ChunkPolicy(step_fn), chunks)


def record_rollout(
    teacher,
    text_kv: TextKV,
    inputs: RolloutInputs,
    config: RolloutConfig = RolloutConfig(),
    device: torch.device | str | None = None,
    record_device: torch.device | str = "cpu",
    record_dtype: torch.dtype | None = None,
) -> tuple[ARRollout, TrajectoryRecorder]:
    """Full F-F-F-F rollout with every chunk recorded (the dataset builder and the trajectory conformance check).

    Returns the finished ``ARRollout`` (``.latents``, ``.sigmas``, ``.timesteps``) and its ``TrajectoryRecorder``
    (floating tensors cast to ``record_dtype`` when given, e.g. bf16 storage).
    """
    recorder = TrajectoryRecorder(device=record_device, dtype=record_dtype)
    rollout = ARRollout(teacher, text_kv, inputs, config, recorder, device)
    rollout.run()
    return rollout, recorder
