"""On-policy self-rollout of one trajectory under a schedule (F-P-P-P by default; docs/rollout.md): what runs, and where
gradients stop.

The schedule is `SelfRolloutSettings.plan` (a `StepPlan`, the flags' `--replace_steps` / `--reuse_steps` as the
eval's): the Predictor runs its P steps of every trained chunk, the Teacher every other step. Step 0 is always Full. A Full step k >= 1 inside a trained
chunk is a Teacher step on the detached student latent: its velocity advances the latent (no graph), its hidden is
the next anchor, and gradients stop there. An R step repeats the previous step's velocity (the eval's
velocity reuse; F-R-R-P = reuse 1, 2 and the Predictor at 3): no model call, no label, the anchor unchanged.
Below, F-P-P-P (--replace_steps 1,2,3).

One trajectory of T latents = T / 4 chunks. Chunk 0 is the Teacher's F-F-F-F (no gradients): it seeds the
self-generated history and gives the previous-chunk hidden of steps 1, 2, 3 for chunk 1. Every later chunk c is
F-P-P-P and trained:

    context    = select_aligned_memory_frames on the camera path, latents read from the DETACHED self history
    ctx K/V    = Teacher context prefill on them (exact K/V of every layer, no graph)
    h0, v0     = Teacher step 0 on x0 (the chunk's noise);  x1 = FlowMatchEulerScheduler.step(v0, t0, x0)
    for k = 1, 2, 3:
        target_h, target_v = Teacher step k on x_k.detach()             (no graph; a stop-gradient label)
        pred_h, pred_v     = Predictor(x_k, anchor, prev_chunk_hidden[k], ctx K/V + text K/V of its source layers)
                             anchor = h0 (k = 1), pred_h1 (k = 2), pred_h2 (k = 3)
        loss_k             = velocity_weight * mse(pred_v, target_v) + hidden_weight * mse(pred_h, target_h)  (FP32)
        x_{k+1}            = differentiable_euler_step(x_k, pred_v, sigmas, k)
    chunk_loss = mean_k loss_k;   (chunk_loss / number_of_trained_chunks).backward()   right away
    history[c] = x4.detach();     prev_chunk_hidden[k] = pred_h_k.detach()

Gradient paths inside a chunk (one graph over the three Predictor calls):
    hidden anchor:  pred_h1 -> Predictor step 2 -> pred_h2 -> Predictor step 3
    latent:         pred_v1 -> x2 -> Predictor step 2 -> pred_v2 -> x3 -> Predictor step 3
Across chunks nothing flows: each chunk's graph is freed by its own backward.

DDP: ``train_trajectory`` runs each trained chunk's three Predictor forwards AND its backward inside
``no_sync()``, except the last chunk, whose backward all-reduces the gradients accumulated over all chunks once.

What runs at each step and where the graph stops is the rollout layer's ``TrainingPolicy``
(predictor_training/rollout/ar_rollout.py); this module gives it the Predictor step. ``train_trajectory`` (the
training composition) runs the whole trajectory as ONE ``ARRollout.run_chunks`` call, its per-chunk hook doing the
backward and the bookkeeping between chunks; the DMD2 generator (``methods/chunk_generators.CompositeRollout``)
runs the same policy with the critic in that hook. Pieces are public so tests can check each claim:
``SelfRolloutTrajectory`` (``run_chunk_zero``, ``run_trained_chunk`` -> ``ChunkGraph``, ``commit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.policy import ChunkContext, ChunkRun, StepCall, StepOutput, TrainingPolicy
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, StepPlan
from predictor_training.runtime.distributed import maybe_no_sync, unwrap_model
from predictor_training.predictor.loss import predictor_loss
from predictor_training.runtime.precision import autocast
from predictor_training.teacher import TextKV

# ---- settings and inputs ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SelfRolloutSettings:
    """Loss weights and Predictor precision of the rollout.

    velocity_weight / hidden_weight: per-step loss = velocity_weight * mse_v + hidden_weight * mse_h (the recipe's
    --velocity_weight / --hidden_weight). predictor_autocast_dtype: autocast of the Predictor forwards (bf16 in the
    real recipe; None = off). The Teacher's own autocast is ``RolloutConfig.autocast_dtype``. plan: what fills
    each step of every trained chunk (`StepPlan.from_steps`, the flags' one check): P the Predictor, R velocity reuse
    as the eval's (the fewer-step sampler's skipped steps: no model call, no label), F the Teacher. revisit_weight: adds revisit_weight * mse(v_pred, v_return) at the latents whose camera the
    trajectory saw before (`SelfRolloutTrajectory.revisit_target`; the recipe's --revisit_weight).
    """

    velocity_weight: float
    hidden_weight: float
    predictor_autocast_dtype: torch.dtype | None = None
    plan: StepPlan = StepPlan.from_steps(DEFAULT_REPLACE_STEPS)  # F-P-P-P; F-R-R-P = from_steps((3,), (1, 2))
    revisit_weight: float = 0.0  # the return term's weight (`revisit_target`); 0 = off


# ---- what one trained chunk produces ---------------------------------------------------------------------------
@dataclass
class PredictorStep:
    """One Predictor step k of a trained chunk (all on the rollout device).

    timestep [4] float32: the step's timestep (1000 sigma_k) of every frame. latent [1, C, 4, H, W]: x_k, the student latent entering step k (with graph for k >= 2).
    teacher_input [1, 2C+1, 4, H, W]: what the Teacher target was computed on (detached x_k | cond).
    anchor / prev_chunk_hidden / pred_hidden / target_hidden [1, N, D]; pred_velocity / target_velocity
    [1, C, 4, H, W]. loss: scalar with graph; metrics: detached scalars (loss, hidden_mse, velocity_mse).
    """

    step_index: int
    timestep: Tensor
    latent: Tensor
    teacher_input: Tensor
    anchor: Tensor
    prev_chunk_hidden: Tensor
    target_hidden: Tensor
    target_velocity: Tensor
    pred_hidden: Tensor
    pred_velocity: Tensor
    loss: Tensor
    metrics: dict[str, Tensor]


@dataclass
class ChunkGraph:
    """A trained chunk before its backward.

    run: the rollout's `ChunkRun` of the chunk (context: indices, prefill input, exact K/V; the step outputs;
    final_latent [1, C, 4, H, W]: x_n with graph); full_hidden / full_velocity: Teacher step 0 (h0, v0); steps: the
    Predictor steps; loss: chunk loss (mean of the step losses) with graph; tracked_latents: {k: x_k} whose ``.grad``
    is retained (a Predictor step's input made by the Predictor step before it); full_outputs: the Full Teacher
    steps of the chunk (step 0 first).
    """

    run: ChunkRun
    full_hidden: Tensor
    full_velocity: Tensor
    steps: list[PredictorStep]
    loss: Tensor
    tracked_latents: dict[int, Tensor] = field(default_factory=dict)
    full_outputs: list[StepOutput] = field(default_factory=list)  # the chunk's Full Teacher steps, in order

    @property
    def chunk_index(self) -> int:
        return self.run.chunk_index

    @property
    def context(self) -> ChunkContext:
        return self.run.context

    @property
    def final_latent(self) -> Tensor:
        return self.run.final_latent

    def pred_hidden_by_step(self) -> dict[int, Tensor]:
        return {step.step_index: step.pred_hidden for step in self.steps}

    def release_context(self) -> None:
        """Drop the chunk's context K/V of every Teacher layer (and the prefill input) once the Teacher steps are
        done (exact context: the commit needs none): the Predictor's backward needs only its two source layers,
        which its graph holds.
        At 20 context frames that is 52 of 54 layers' K/V, ~25 GiB at the real config, no longer alive during the
        chunk's backward. The indices stay (num_frames)."""
        self.run.context = ChunkContext(indices=list(self.run.context.indices))


# ---- one trajectory --------------------------------------------------------------------------------------------
class SelfRolloutTrajectory:
    """The state of one self-rollout trajectory: the history buffer and the previous-chunk hiddens.

    teacher: the frozen WorldPlayTransformer; predictor: the v4 Predictor, plain or DDP-wrapped (it is called as
    given, so DDP sees every forward); text_kv: all layers, [1, heads, L, d]; inputs / rollout_config: as for
    ``ARRollout``, whose running latents are the self-generated history (chunk c's slot holds its noise until the
    chunk is committed, then its detached final latent).

    Driven by `train_trajectory` (one `ARRollout.run_chunks` call with `policy`), or piece by piece:
    ``run_chunk_zero()``, then for c = 1..num_chunks-1: ``graph = run_trained_chunk(c)``, backward, ``commit(graph)``.
    """

    def __init__(
        self,
        teacher,
        predictor: nn.Module,
        text_kv: TextKV,
        inputs: RolloutInputs,
        rollout_config: RolloutConfig = RolloutConfig(),
        *,
        settings: SelfRolloutSettings,
        device: torch.device | str | None = None,
        revisit_pairs: dict[int, int] | None = None,
    ):
        raw_predictor = unwrap_model(predictor)
        if raw_predictor.variant != "v4":
            raise ValueError(f"self-rollout training needs the v4 Predictor (context + previous-chunk hidden), "
                             f"got variant {raw_predictor.variant!r}")
        if rollout_config.num_steps < 2:
            raise ValueError(f"F-P-P-P needs at least 2 denoising steps, got num_steps={rollout_config.num_steps}")
        if settings.plan.num_steps != rollout_config.num_steps or not settings.plan.predictor_steps:
            raise ValueError(f"plan {settings.plan.text}: expected a Predictor step among the rollout's "
                             f"{rollout_config.num_steps} steps")
        self.rollout = ARRollout(teacher, text_kv, inputs, rollout_config, recorder=None, device=device)
        if self.rollout.num_chunks < 2:
            raise ValueError(f"{inputs.num_latents} latents make {self.rollout.num_chunks} chunk(s); self-rollout "
                             "training needs chunk 0 plus at least one trained chunk")
        self.teacher = teacher
        self.predictor = predictor
        self.settings = settings
        self.source_blocks = tuple(raw_predictor.source_blocks)
        self.predictor_text_kv = self.rollout.text_kv.select(self.source_blocks)
        self.prev_chunk_hidden: dict[int, Tensor] | None = None
        self.next_chunk = 0
        # x_k made by the Predictor step before it keeps its .grad (the latent path of BPTT must be alive)
        steps = settings.plan.predictor_steps
        self.tracked_steps = {k + 1 for k in steps if k + 1 in steps}
        # the Predictor steps (and tracked latents) of the chunk being run, taken by `chunk_graph`
        self.pending_steps: list[PredictorStep] = []
        self.pending_tracked: dict[int, Tensor] = {}
        # {latent: the earliest latent with its camera} (`world.revisits`), read by the return term
        self.revisit_pairs = dict(revisit_pairs or {})

    # ---- sizes ------------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.rollout.device

    @property
    def num_chunks(self) -> int:
        return self.rollout.num_chunks

    @property
    def trained_chunks(self) -> list[int]:
        return list(range(1, self.num_chunks))

    @property
    def predictor_steps(self) -> list[int]:
        return list(self.settings.plan.predictor_steps)

    def policy(self, *, trained_scope: Callable[[int], ContextManager] | None = None,
               on_chunk_end: Callable[[ChunkRun], None] | None = None,
               on_commit: Callable[[ChunkRun], None] | None = None) -> TrainingPolicy:
        """The rollout's `TrainingPolicy` of this schedule (chunk 0 F-F-F-F without gradients; Predictor steps
        at its P steps, velocity reuse at its R steps, Full elsewhere) with the Predictor step as its student;
        trained_scope / on_chunk_end / on_commit: as `TrainingPolicy`."""
        return TrainingPolicy(self.settings.plan, self.predictor_step,
                              trained_scope=trained_scope, on_chunk_end=on_chunk_end, on_commit=on_commit)

    # ---- chunk 0 -----------------------------------------------------------------------------------------------
    def run_chunk_zero(self) -> list[StepOutput]:
        """F-F-F-F of chunk 0 under no_grad (the ARRollout loop): writes its final latent into the history and keeps
        the Full hidden of steps 1..n-1 as chunk 1's previous-chunk hidden. Returns the Teacher's step outputs."""
        if self.next_chunk != 0:
            raise RuntimeError(f"run_chunk_zero must come first; the trajectory is at chunk {self.next_chunk}")
        outputs = self.rollout.run_chunk(0)
        self.seed_history(outputs)
        return outputs

    def seed_history(self, outputs: Sequence[StepOutput]) -> None:
        """Chunk 0's Teacher outputs give chunk 1 its previous-chunk hidden of every Predictor step."""
        self.prev_chunk_hidden = {k: outputs[k].final_hidden for k in self.predictor_steps}
        self.next_chunk = 1

    # ---- chunks 1.. --------------------------------------------------------------------------------------------
    def predictor_step(self, call: StepCall, teacher_input: Tensor, target: StepOutput) -> StepOutput:
        """The Predictor's step k of a trained chunk (the policy's student): anchored on the previous step's hidden
        and this step k's previous-chunk hidden, trained against the Teacher's label `target` on `teacher_input`
        (the detached student latent | cond [1, 2C+1, 4, H, W]); its output keeps the graph."""
        k = call.step_index
        if k in self.tracked_steps and call.latent.requires_grad:
            call.latent.retain_grad()  # for the latent_grad_l1_min check: the BPTT path through x_k must be alive
            self.pending_tracked[k] = call.latent
        anchor, prev_hidden = call.previous.final_hidden, self.prev_chunk_hidden[k]
        with autocast(self.device, self.settings.predictor_autocast_dtype):
            pred_hidden, pred_velocity = self.predictor(
                call.model_input, anchor, call.timestep[None], call.action, call.viewmats, call.Ks,
                self.predictor_text_kv, context=call.context.kv.select(self.source_blocks),
                prev_chunk_hidden=prev_hidden, rope_start=call.rope_start,
            )
        loss, metrics = predictor_loss(pred_hidden, pred_velocity, target.final_hidden, target.velocity,
                                       hidden_weight=self.settings.hidden_weight,
                                       velocity_weight=self.settings.velocity_weight)
        if self.settings.revisit_weight > 0:
            slots, return_velocity = self.revisit_target(call)
            revisit_mse = (F.mse_loss(pred_velocity.float()[:, :, slots], return_velocity) if slots
                           else pred_velocity.new_zeros((), dtype=torch.float32))
            loss = loss + self.settings.revisit_weight * revisit_mse
            metrics = {**metrics, "loss": loss.detach(), "revisit_mse": revisit_mse.detach()}
        self.pending_steps.append(PredictorStep(
            step_index=k, timestep=call.timestep, latent=call.latent, teacher_input=teacher_input, anchor=anchor,
            prev_chunk_hidden=prev_hidden, target_hidden=target.final_hidden, target_velocity=target.velocity,
            pred_hidden=pred_hidden, pred_velocity=pred_velocity, loss=loss, metrics=metrics,
        ))
        return StepOutput(velocity=pred_velocity, final_hidden=pred_hidden)

    def revisit_target(self, call: StepCall) -> tuple[list[int], Tensor | None]:
        """The return term's target at Predictor step ``call``: (the chunk's slots j whose latent revisits a camera
        first seen in an already committed chunk, the velocity [1, C, len(slots), H, W] float32 that would take
        x_k there onto that first visit's committed latent: (x_k - x_first) / sigma_k, since the step's x0 estimate
        is x_k - sigma_k v). Both x_k and x_first are detached: a label, as the Teacher's. ([], None) when the chunk
        has no such latent. The rollout's velocity loss compares a chunk with the Teacher's chunk on the same path
        only; this term compares it with the trajectory's own earlier visit."""
        frames = self.rollout.chunk_frames(call.chunk_index)
        pairs = [(latent - frames.start, first) for latent, first in sorted(self.revisit_pairs.items())
                 if frames.start <= latent < frames.stop and first < frames.start]
        if not pairs:
            return [], None
        slots = [slot for slot, _ in pairs]
        sigma = call.timestep[slots].float().view(1, 1, -1, 1, 1) / 1000.0
        latent = call.latent.detach().float()[:, :, slots]
        first = self.rollout.latents[:, :, [first for _, first in pairs]].detach().float()
        return slots, (latent - first) / sigma

    def chunk_graph(self, run: ChunkRun) -> ChunkGraph:
        """The `ChunkGraph` of a trained chunk the policy just ran (takes the Predictor steps it recorded)."""
        steps, tracked = self.pending_steps, self.pending_tracked
        self.pending_steps, self.pending_tracked = [], {}
        full = run.outputs[0]
        return ChunkGraph(
            run=run, full_hidden=full.final_hidden, full_velocity=full.velocity, steps=steps,
            loss=torch.stack([step.loss for step in steps]).mean(), tracked_latents=tracked,
            full_outputs=[full] + [output for output in run.outputs if output.graph_stops],
        )

    def run_trained_chunk(self, chunk_index: int) -> ChunkGraph:
        """Forward of trained chunk ``chunk_index`` (module docstring) through the rollout's one chunk loop
        (`ARRollout.denoise_chunk` with the policy's step: the context from the detached self-generated history,
        exact K/V of every layer without a graph, then the steps); the caller runs the backward and commits."""
        if chunk_index != self.next_chunk or chunk_index == 0:
            raise RuntimeError(f"run_trained_chunk({chunk_index}) called, but the next chunk to run is "
                               f"{self.next_chunk}")
        return self.chunk_graph(self.rollout.denoise_chunk(chunk_index, self.policy().trained_step))

    def hand_on(self, graph: ChunkGraph) -> None:
        """The predicted hiddens of a finished chunk, detached, become the next chunk's previous-chunk hidden:
        gradients of a later chunk must not reach this chunk, whose graph is freed by its own backward (and whose
        loss already accounted for these values)."""
        if graph.chunk_index != self.next_chunk:
            raise RuntimeError(f"commit of chunk {graph.chunk_index}, but the trajectory is at chunk {self.next_chunk}")
        self.prev_chunk_hidden = {k: hidden.detach() for k, hidden in graph.pred_hidden_by_step().items()}
        self.next_chunk += 1

    def commit(self, graph: ChunkGraph) -> None:
        """Move a finished chunk into the trajectory state, cut from its graph: the final latent (next chunks'
        history, hence their context) is detached into the rollout (`ARRollout.commit_chunk`; cached context modes
        store this chunk's per-frame K/V now) and the predicted hiddens are handed on (`hand_on`)."""
        self.hand_on(graph)
        self.rollout.commit_chunk(graph.run)


def trajectory_for_row(item: dict, case: dict, *, teacher: nn.Module, predictor: nn.Module, config: RolloutConfig,
                       settings: SelfRolloutSettings, device: torch.device,
                       revisit_pairs: dict[int, int] | None = None) -> SelfRolloutTrajectory:
    """The self-rollout of one sample-table row (`TrajectoryTableDataset` item: seed, viewmats, Ks, action) of
    `case` (its stored text K/V of every layer and image condition): the row's seed gives the noise and memory
    points, exactly as the dataset builder and the eval run it. revisit_pairs: {latent: first latent with its
    camera} of the row's pose, for the return term (`SelfRolloutSettings.revisit_weight`)."""
    text_kv = TextKV.from_layer_stack(case["text_k"], case["text_v"], device, teacher.dtype)
    inputs = RolloutInputs.from_seed(item["seed"], case["image_cond"].to(torch.float32), item["viewmats"],
                                     item["Ks"], item["action"], state_dtype=config.state_dtype)
    return SelfRolloutTrajectory(teacher, predictor, text_kv, inputs, config, settings=settings, device=device,
                                 revisit_pairs=revisit_pairs)


# ---- the training composition ----------------------------------------------------------------------------------
def latent_grad_l1(graph: ChunkGraph) -> dict[int, float]:
    """{k: sum |d loss / d x_k|} of the tracked latents after the chunk's backward (0.0 where no grad arrived)."""
    return {k: 0.0 if latent.grad is None else float(latent.grad.detach().float().abs().sum())
            for k, latent in graph.tracked_latents.items()}


def train_trajectory(trajectory: SelfRolloutTrajectory, *, sync: bool = True,
                     chunk_hook: Callable[[ChunkGraph], Tensor | None] | None = None) -> dict[str, float]:
    """The whole trajectory as one `ARRollout.run_chunks` call with the trajectory's `policy`: chunk 0 (no grad),
    then each trained chunk: forward, ``(chunk_loss / n_trained).backward()`` in the policy's per-chunk hook, commit.

    sync: whether this trajectory's backward may all-reduce (the loop's flag; False while accumulating several
    trajectories). The three Predictor forwards and the backward of every chunk but the last run under
    ``no_sync()``; the last chunk's backward all-reduces once. Gradients are left in ``.grad`` for the caller's
    clip/optimizer step. chunk_hook(graph): called with each trained chunk's graph before its backward; a tensor it
    returns (a scalar with graph, e.g. the adversarial recipe's weighted generator loss on the chunk's predicted
    hiddens) is added to that chunk's loss for the backward, None adds nothing; the metrics below stay the
    regression loss's. Returns detached python floats:

    loss (the trajectory loss = mean chunk loss), hidden_mse, velocity_mse, step{k}/{loss,hidden_mse,velocity_mse}
    (means over the trained chunks), chunk{c}/loss, latent_grad_l1_min (min over chunks and k of sum |grad x_k|;
    only when the schedule has two consecutive Predictor steps) and context_frames_mean.
    """
    if trajectory.next_chunk != 0:
        raise RuntimeError(f"train_trajectory needs a fresh trajectory; it is at chunk {trajectory.next_chunk}")
    trained = trajectory.trained_chunks
    # Each chunk's backward adds its share, so the gradients equal those of the trajectory-mean loss.
    divisor = len(trained)
    per_step: dict[int, dict[str, list[float]]] = {k: {} for k in trajectory.predictor_steps}
    chunk_losses: dict[int, float] = {}
    grad_l1: list[float] = []
    context_frames: list[int] = []
    # With the exact context the commit needs no K/V, so the context K/V of the Teacher's other layers are released
    # before the backward (the cached context modes store this chunk's K/V at the commit, attending to the whole
    # context: they keep it).
    release_context = trajectory.rollout.config.context_mode == "exact"

    def trained_scope(chunk_index: int):
        # the Predictor forwards AND the backward of every chunk but the last accumulate without all-reducing
        return maybe_no_sync(trajectory.predictor, enabled=not (sync and chunk_index == trained[-1]))

    def end_chunk(run: ChunkRun) -> None:
        """Between a chunk's last step and its commit: chunk 0 seeds the history (no parameter is touched); a
        trained chunk is freed by its own backward."""
        if run.chunk_index == 0:
            trajectory.seed_history(run.outputs)
            return
        graph = trajectory.chunk_graph(run)
        extra = None if chunk_hook is None else chunk_hook(graph)
        context_frames.append(len(graph.context.indices))
        if release_context:
            graph.release_context()
        ((graph.loss if extra is None else graph.loss + extra) / divisor).backward()
        del extra
        chunk_losses[run.chunk_index] = float(graph.loss.detach())
        for step in graph.steps:
            for name, value in step.metrics.items():
                per_step[step.step_index].setdefault(name, []).append(float(value))
        grad_l1.extend(latent_grad_l1(graph).values())
        trajectory.hand_on(graph)

    trajectory.rollout.run_chunks(trajectory.policy(trained_scope=trained_scope, on_chunk_end=end_chunk))
    # 3. Metrics.
    metrics: dict[str, float] = {"loss": sum(chunk_losses.values()) / divisor}
    for name in ("hidden_mse", "velocity_mse"):
        metrics[name] = _mean([value for step in per_step.values() for value in step[name]])
    for k, values in per_step.items():
        for name, series in values.items():
            metrics[f"step{k}/{name}"] = _mean(series)
    for chunk_index, value in chunk_losses.items():
        metrics[f"chunk{chunk_index}/loss"] = value
    if grad_l1:  # a schedule without two consecutive Predictor steps has no Predictor-made latent to check
        metrics["latent_grad_l1_min"] = min(grad_l1)
    metrics["context_frames_mean"] = _mean(context_frames)
    return metrics


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
