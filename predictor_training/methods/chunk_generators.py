"""Generators of DMD-style methods: one clip's chunks, one sample per chunk, made chunk by chunk so that each chunk
can be scored and back-propagated before the next one is made (graphs never span chunks).

Both generators have the same interface: `chunks` (the clip's chunk indices they make, ascending), `history`
[1, C, T, H, W] (their running latents: what later chunks see as context) and `run(score_chunk, sync=, mark=)`:
the chunks in order, each one's `ChunkSample` (with a graph where grad is enabled) handed to `score_chunk` (the
caller's per-chunk work: the critic and the generator's backward) before the chunk, detached, becomes history.
sync: DDP reduces the generator's gradients only in the last chunk's backward; mark(part): called with the name of
each part as it starts (a memory rehearsal's peak attribution).

    CompositeRollout  the F-P-P-P composite of the Teacher and the v4 Predictor: the self-rollout trainer's policy
                      (`SelfRolloutTrajectory.policy`) on the rollout's one chunk loop (`ARRollout.run_chunks`),
                      `score_chunk` in its per-chunk hook; a schedule whose last step is Full (F-P-P-F) re-runs that
                      Teacher step with a graph to its input, so the sample's gradient reaches the Predictor
                      (`CompositeRollout.differentiable_sample`)
    StudentRollout    a few-step AR student, a `ScoreModel` run on its own history (Self-Forcing) or on data; its
                      chunk is no step schedule of the rollout (its own sigmas, an exit step, the context prefilled
                      per call), so it runs its chunks itself

`teacher_chunks` is the reference they are compared with (collapse monitors): the Teacher's F-F-F-F of the same
noise, memory points and history (one `ARRollout.run_chunks` call).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from predictor_training.teacher.adapters import adapter
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.policy import ChunkPolicy, ChunkRun, TrainingPolicy
from predictor_training.runtime.distributed import maybe_no_sync
from predictor_training.methods.flow_matching import x0_from_velocity
from predictor_training.rollout.scheduler import differentiable_euler_step
from predictor_training.methods.score_models import ScoreClip, ScoreModel
from predictor_training.predictor.self_rollout import ChunkGraph, SelfRolloutSettings, SelfRolloutTrajectory
from predictor_training.rollout.teacher_forcing import clip_text_kv


def _unmarked(part: str) -> None:
    pass


@dataclass
class ChunkSample:
    """A generated chunk: sample x̂ [1, C, 4, H, W] (float32, with a graph when the generator is due), anchor: the
    regression anchor to the Teacher (scalar, or None), metrics: detached floats."""

    chunk_index: int
    sample: torch.Tensor
    anchor: torch.Tensor | None
    metrics: dict[str, float] = field(default_factory=dict)


class CompositeRollout:
    """The F-P-P-P composite on one clip (`SelfRolloutTrajectory`): chunk 0 is the Teacher's F-F-F-F (run here),
    chunks 1.. are Teacher step 0 + Predictor steps (run by `run`), each chunk's sample its final latent, the anchor
    its Predictor-vs-Teacher loss. With `data` [1, C, T, H, W] every chunk is then replaced by the data in the
    history (teacher forcing).

    The sample must carry the generator's graph (DMD back-propagates its loss into the sample). The trajectory cuts
    the graph at every Full step k >= 1 (it advances the detached latent: its Teacher call is a label), so when the
    schedule ends on Full steps (F-P-P-F) its final latent has no graph. `differentiable_sample` then recomputes
    those trailing steps from the last Predictor step's output, x_{j+1} = x_j + (sigma_{j+1} - sigma_j) v_T(x_j),
    with grad to x_j through the frozen Teacher (its parameters get none): the same values, now differentiable.

    recompute_context (exact context): the chunk's context K/V are not held through `score_chunk`: those of every
    Teacher layer are released once the sample is made (`ChunkGraph.release_context`, as `train_trajectory` does
    before its backward: the Predictor's backward needs only its two source layers' K/V, which its graph holds, and
    the commit needs none; at 20 context frames 52 of 54 layers' K/V, ~25 GiB at the real config), and trailing
    Full steps read them through `ARRollout.recomputed_context` (prefilled again in the generator's backward).
    False: held until the commit (the same values)."""

    def __init__(self, teacher, predictor, item, noise, memory_seed: int, config: RolloutConfig,
                 settings: SelfRolloutSettings, device, data: torch.Tensor | None, *, recompute_context: bool = True):
        self.teacher, self.predictor, self.data = teacher, predictor, data
        # cached context modes store a chunk's K/V at its commit, attending to its whole context: they keep it
        self.recompute_context = recompute_context and config.context_mode == "exact"
        with adapter(teacher, None):
            text_kv = clip_text_kv(teacher, item, device, config.autocast_dtype, grad=False)
            inputs = RolloutInputs.from_clip(item, noise, memory_seed)
            self.trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, inputs, config, settings=settings,
                                                    device=device)
            self.chunks = self.trajectory.trained_chunks
            self.trajectory.rollout.run_chunks(self.policy(), [0])

    @property
    def history(self) -> torch.Tensor:
        return self.trajectory.rollout.latents

    def policy(self, score_chunk: Callable[[ChunkSample], None] | None = None, *, sync: bool = True,
               mark: Callable[[str], None] = _unmarked) -> TrainingPolicy:
        """The trajectory's `TrainingPolicy` with this generator's per-chunk work: chunk 0 seeds the history; a
        trained chunk's sample goes to `score_chunk`, then its hiddens are handed on; after each commit the data
        replace the chunk (teacher forcing). A trained chunk runs under DDP `no_sync` unless it is the last one and
        `sync`."""
        trained = self.chunks

        def trained_scope(chunk_index: int):
            mark(f"generator forward, chunk {chunk_index}")
            return maybe_no_sync(self.predictor, enabled=not (sync and chunk_index == trained[-1]))

        def end_chunk(run: ChunkRun) -> None:
            if run.chunk_index == 0:
                self.trajectory.seed_history(run.outputs)
                return
            graph = self.trajectory.chunk_graph(run)
            score_chunk(self.chunk_sample(graph))
            mark("commit")
            self.trajectory.hand_on(graph)

        return self.trajectory.policy(trained_scope=trained_scope, on_chunk_end=end_chunk, on_commit=self._write_data)

    def run(self, score_chunk: Callable[[ChunkSample], None], *, sync: bool = True,
            mark: Callable[[str], None] = _unmarked) -> None:
        """Chunks 1.. through the rollout's one chunk loop (`ARRollout.run_chunks` with `policy`), each sample
        handed to `score_chunk` before its commit (grad mode: the caller's)."""
        with adapter(self.teacher, None):
            self.trajectory.rollout.run_chunks(self.policy(score_chunk, sync=sync, mark=mark), self.chunks)

    def _write_data(self, run: ChunkRun) -> None:
        if self.data is not None:
            frames = self.trajectory.rollout.chunk_frames(run.chunk_index)
            self.trajectory.rollout.write_chunk(run.chunk_index, self.data[:, :, frames])

    def chunk_sample(self, graph: ChunkGraph) -> ChunkSample:
        """A trained chunk's `ChunkSample`: `differentiable_sample`, the anchor `graph.loss` and its mean
        velocity / hidden mse over the Predictor steps; with `recompute_context` the context K/V of every Teacher
        layer released (the class docstring)."""
        sample = self.differentiable_sample(graph)
        if self.recompute_context:
            graph.release_context()
        steps = graph.steps
        metrics = {f"anchor/{name}": sum(float(step.metrics[name]) for step in steps) / len(steps)
                   for name in ("velocity_mse", "hidden_mse")}
        return ChunkSample(graph.chunk_index, sample, graph.loss, metrics)

    def trailing_full_steps(self) -> list[int]:
        """The Full steps after the schedule's last Predictor step ([3] for F-P-P-F, [] for F-P-P-P)."""
        rollout = self.trajectory.rollout
        return list(range(max(self.trajectory.predictor_steps) + 1, rollout.config.num_steps))

    def differentiable_sample(self, graph: ChunkGraph) -> torch.Tensor:
        """The chunk's final latent [1, C, 4, H, W] (float32) with a graph to the Predictor where grad is enabled.

        F-P-P-P (last step a Predictor step): the trajectory's own final latent. A trailing Full step j: recomputed
        from the last Predictor step k, x_{k+1} = Euler(x_k, pred_v_k), then x_{j+1} = Euler(x_j, v_T(x_j)) with the
        Teacher on x_j *with* its graph (the trajectory ran the same call on x_j.detach()): identical values, and
        dL/dx_j = (I + (sigma_{j+1} - sigma_j) dv_T/dx_j)^T dL/dx_{j+1} reaches the Predictor. The Teacher is frozen
        (requires_grad False), so only the latent path takes gradients. Call with the base Teacher active.
        With `recompute_context` the trailing steps read the context through `ARRollout.recomputed_context`:
        released after their forward, prefilled again (no grad, the same values) when the generator's backward
        recomputes their block checkpoints, so that no layer's context K/V is held through the critic."""
        trailing = self.trailing_full_steps()
        if not trailing or not torch.is_grad_enabled():
            return graph.final_latent.float()
        rollout = self.trajectory.rollout
        # 1. The last Predictor step's output, with its graph (the trajectory computed it, then cut it at step j).
        last = graph.steps[-1]
        latent = differentiable_euler_step(last.latent, last.pred_velocity, rollout.sigmas, last.step_index)
        latent = latent.to(rollout.config.state_dtype)
        # 2. The trailing Full steps, differentiable in their input latent: the rollout's chunk loop from step j on.
        context = graph.context
        recomputed = self.recompute_context and context.kv is not None
        if recomputed:
            context = dataclasses.replace(context, kv=rollout.recomputed_context(context))
        run = rollout.denoise_chunk(graph.chunk_index, lambda call: call.run_teacher(), context=context,
                                    latent=latent, first_step=trailing[0])
        if recomputed:
            context.kv.release()
        return run.final_latent.float()


class StudentRollout:
    """A few-step student on one clip: chunk c from the noise at sigma_0 through the steps before its exit step
    without a graph, then its x0 estimate at the exit step (with a graph when due) is the chunk's sample, written
    (detached) into the history with --rollout self. anchor: mse against the Teacher's x0 estimate at the same
    state (only when `teacher_clip` is given). recompute_context: the sample's no-grad context K/V are released
    after its forward and prefilled again in the generator's backward (not held through the critic).

    renoise: how the steps before the exit move from sigma_k to sigma_{k+1}. None: Euler steps along the velocity
    (the sampler the model runs with at inference). A torch.Generator: Self-Forcing's training rollout, the x0
    estimate noised again with fresh noise from that generator, x_{k+1} = (1 - sigma_{k+1}) x0_k + sigma_{k+1} n."""

    def __init__(self, student: ScoreModel, item, noise, history, memory_seed: int, config: RolloutConfig, device,
                 *, sigmas: torch.Tensor, exit_steps: list[int], chunks: list[int], self_history: bool,
                 context_grad: bool, teacher_clip: ScoreClip | None, recompute_context: bool = False,
                 renoise: torch.Generator | None = None):
        self.clip = student.clip(history, item, config, device, memory_seed=memory_seed, context_grad=context_grad,
                                 recompute_context=recompute_context)
        self.noise, self.sigmas, self.exit_steps = noise, sigmas, exit_steps
        self.chunks, self.self_history, self.teacher_clip = chunks, self_history, teacher_clip
        self.renoise = renoise

    @property
    def history(self) -> torch.Tensor:
        return self.clip.history

    def run(self, score_chunk: Callable[[ChunkSample], None], *, sync: bool = True,
            mark: Callable[[str], None] = _unmarked) -> None:
        """`chunks` in order: each one's sample handed to `score_chunk`, then (Self-Forcing) written, detached,
        into the history. sync: unused (the loop all-reduces the student's gradients)."""
        for chunk_index in self.chunks:
            mark(f"generator forward, chunk {chunk_index}")
            chunk = self.chunk_sample(chunk_index)
            score_chunk(chunk)
            mark("commit")
            if self.self_history:
                self.clip.write_chunk(chunk_index, chunk.sample)
            del chunk  # not alive through the next chunk's forward

    def chunk_sample(self, chunk_index: int) -> ChunkSample:
        """Chunk `chunk_index`'s sample: its x0 estimate at its exit step (with a graph where grad is enabled)."""
        frames = self.clip.forced.rollout.chunk_frames(chunk_index)
        latent = self.noise[:, :, frames].to(self.clip.history.device).float()
        exit_step = self.exit_steps[chunk_index]
        size = latent.shape[2]
        with torch.no_grad():
            for step in range(exit_step):
                velocity = self.clip.velocity(chunk_index, latent, self.sigmas[step].expand(size))
                if self.renoise is None:
                    latent = differentiable_euler_step(latent, velocity, self.sigmas, step)
                else:
                    x0 = x0_from_velocity(latent, velocity, self.sigmas[step].expand(size)[None].to(latent.device))
                    fresh = torch.randn(latent.shape, generator=self.renoise).to(latent.device)
                    following = float(self.sigmas[step + 1])
                    latent = (1.0 - following) * x0 + following * fresh
        sigma = self.sigmas[exit_step].expand(size)
        velocity = self.clip.velocity(chunk_index, latent, sigma)
        sample = x0_from_velocity(latent, velocity, sigma[None].to(latent.device))
        anchor = None
        if self.teacher_clip is not None:
            with torch.no_grad():
                self.teacher_clip.copy_history(self.clip.history, chunk_index)
                target = self.teacher_clip.x0(chunk_index, latent, sigma)
            anchor = torch.mean((sample - target) ** 2)
        return ChunkSample(chunk_index, sample, anchor, {"exit_step": float(exit_step)})


@torch.no_grad()
def teacher_chunks(teacher, item, noise: torch.Tensor, memory_seed: int, chunks: list[int], config: RolloutConfig,
                   device, data: torch.Tensor | None = None) -> torch.Tensor:
    """The Teacher's F-F-F-F latents of `chunks` [1, C, 4 len(chunks), H, W] (float32) for the clip `item`, the noise
    [1, C, T, H, W] and the memory points of `memory_seed`: on its own history, or on `data` [1, C, T, H, W] (each
    chunk replaced by the data once made: teacher forcing)."""
    with adapter(teacher, None):
        text_kv = clip_text_kv(teacher, item, device, config.autocast_dtype, grad=False)
        inputs = RolloutInputs.from_clip(item, noise, memory_seed)
        rollout = ARRollout(teacher, text_kv, inputs, config, device=device)
        outputs = []

        def after_commit(run: ChunkRun) -> None:
            frames = rollout.chunk_frames(run.chunk_index)
            if run.chunk_index in chunks:
                outputs.append(rollout.latents[:, :, frames].float().clone())
            if data is not None:
                rollout.write_chunk(run.chunk_index, data[:, :, frames])

        rollout.run_chunks(ChunkPolicy(on_commit=after_commit), range(max(chunks) + 1))
    return torch.cat(outputs, dim=2)
