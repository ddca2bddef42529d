"""The dmd2 recipe's step and build (`fvtools/train_dmd2.py` holds its flags, presets, cross-flag checks, summary and
`main()`; docs/methods/dmd2.md): the frozen Teacher, the generator (the F-P-P-P composite's Predictor or a few-step
student), the real and fake scores (methods/dmd2_models.py) and `DistributionMatchingStep`, the loop's step function
of one clip per micro-batch, with the generator's validation.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch

from predictor_training.eval.validation import generator_validation
from predictor_training.methods.chunk_generators import ChunkSample, CompositeRollout, StudentRollout, teacher_chunks
from predictor_training.methods.dmd2 import critic_loss, dmd_generator_loss, dmd_gradient
from predictor_training.methods.dmd2_models import (
    FAKE,
    PredictorGeneratorSettings,
    ScoreSettings,
    build_predictor_role,
    build_scores,
    build_student,
)
from predictor_training.methods.flow_matching import add_noise, sample_sigmas
from predictor_training.methods.method_model import MethodSettings
from predictor_training.methods.monitors import collapse_monitors
from predictor_training.methods.score_models import ScoreModel
from predictor_training.predictor.self_rollout import SelfRolloutSettings
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.scheduler import flow_match_sigmas
from predictor_training.rollout.teacher_forcing import draw_training_chunks
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv, log0
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.random_streams import ALL_RANKS, stream_generator, stream_seed
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.teacher.adapters import load_lora
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher

METHOD = "dmd2"


def uniform_exit_steps(num_chunks: int, student_steps: int, shared_generator: torch.Generator) -> list[int]:
    """`--exit_step uniform`: each chunk's exit step, uniform over the student's steps, drawn from
    `shared_generator` (the same on every rank, so every rank runs the same steps)."""
    return torch.randint(0, student_steps, (num_chunks,), generator=shared_generator).tolist()


class DistributionMatchingStep:
    """`step_fn` of the loop: one clip per call; per generated chunk one sample shared by the critic and (when due)
    the generator, one critic backward and one generator backward.

    Draws: noise and sigmas from (seed, micro-step, rank); exit steps and whether chunk 0 is trained from
    (seed, micro-step, ALL_RANKS). `trace`: set to a list to record, per chunk, the generator's sample as it handed
    it over (`generator_sample`, its `.grad` retained: what the generator's loss sent into it), the sample the scores
    saw and the critic's input (tests check that the critic trains on the generator's own sample)."""

    def __init__(self, *, args, env: DistEnv, run_state: RunState, rollout_config: RolloutConfig, teacher,
                 real: ScoreModel, fake: ScoreModel, generator_role: Role, student: ScoreModel | None,
                 draw_chunks=draw_training_chunks, draw_exit_steps=uniform_exit_steps, mark=None):
        self.args, self.env, self.run_state, self.config = args, env, run_state, rollout_config
        self.teacher, self.real, self.fake = teacher, real, fake
        self.generator_role, self.student = generator_role, student
        self.draw_chunks = draw_chunks
        self.draw_exit_steps = draw_exit_steps
        self.mark = mark or (lambda part: None)  # names the part of the step that runs next (a memory rehearsal)
        self.settings = SelfRolloutSettings(velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight,
                                            predictor_autocast_dtype=rollout_config.autocast_dtype,
                                            plan=args.plan)
        self.student_sigmas = flow_match_sigmas(args.student_steps, args.student_shift)
        self.trace: list[dict] | None = None

    def start_generator(self, item, noise, data, memory_seed, generator, shared):
        """The generator on this clip (`chunk_generators`); a student's chunks and exit steps are drawn here."""
        args = self.args
        if args.generator == "predictor":
            return CompositeRollout(self.teacher, self.generator_role.module, item, noise, memory_seed, self.config,
                                    self.settings, self.env.device, data if args.rollout == "data" else None,
                                    recompute_context=args.recompute_context)
        num_chunks = noise.shape[2] // self.config.chunk_latents
        chunks = (list(range(num_chunks)) if args.rollout == "self" else
                  self.draw_chunks(num_chunks, args.chunks_per_clip, generator, shared))
        exit_steps = ([args.student_steps - 1] * num_chunks if args.exit_step == "last" else
                      self.draw_exit_steps(num_chunks, args.student_steps, shared))
        history = noise.clone() if args.rollout == "self" else data
        anchor_target = ScoreModel(self.teacher, None, "teacher")  # the Teacher's x0 estimate at the same state
        teacher_clip = (anchor_target.clip(history, item, self.config, self.env.device, memory_seed=memory_seed)
                        if args.anchor_weight > 0 else None)
        return StudentRollout(self.student, item, noise, history, memory_seed, self.config, self.env.device,
                              sigmas=self.student_sigmas, exit_steps=exit_steps, chunks=chunks,
                              self_history=args.rollout == "self", context_grad=args.context_grad,
                              recompute_context=args.recompute_context, teacher_clip=teacher_clip,
                              renoise=generator if args.student_sampler == "renoise" else None)

    def draw_score_inputs(self, sample: torch.Tensor, generator: torch.Generator):
        """(sigma [4] per frame, noise [1, C, 4, H, W], x_sigma) of one score evaluation of `sample` (detached)."""
        args = self.args
        sigma = sample_sigmas(args.score_sigma_sampler, 1, generator, sigma_min=args.score_sigma_min,
                              sigma_max=args.score_sigma_max, shift=args.score_sigma_shift)
        sigma_frames = sigma.expand(sample.shape[2]).contiguous()
        noise = torch.randn(sample.shape, generator=generator).to(sample.device)
        return sigma_frames, noise, add_noise(sample, noise, sigma_frames[None].to(sample.device))

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        args, env = self.args, self.env
        if FAKE not in due:
            raise ValueError(f"dmd2 trains the role {FAKE!r} every step; the loop says {sorted(due)}")
        generator_due = self.generator_role.name in due
        # 1. This micro-step's streams, the clip's noise, the generator and the scores on the clip.
        counters = (args.seed, self.run_state.micro_step, env.rank)
        generator = stream_generator(*counters)
        shared = stream_generator(args.seed, self.run_state.micro_step, ALL_RANKS)
        memory_seed = stream_seed(*counters, 1)
        data = item["latents"][None].float().to(env.device)
        noise = torch.randn(data.shape, generator=generator).to(env.device)
        self.mark("the generator's start (text K/V, chunk 0), the scores' clips")
        with torch.set_grad_enabled(generator_due):
            rollout = self.start_generator(item, noise, data, memory_seed, generator, shared)
        history = data if args.rollout == "data" else noise.clone()
        real_clip = self.real.clip(history, item, self.config, env.device, memory_seed=memory_seed)
        fake_clip = self.fake.clip(history, item, self.config, env.device, memory_seed=memory_seed)
        # 2. Chunk by chunk (the generator's loop): one sample, the critic's backward, the generator's backward when
        #    due, then the commit.
        chunks = rollout.chunks
        totals: dict[str, list[float]] = {}
        samples = []

        def score_chunk(chunk: ChunkSample) -> None:
            """Between a chunk's sample and its commit: the critic on the sample, the generator's loss when due."""
            chunk_index = chunk.chunk_index
            if self.trace is not None and chunk.sample.requires_grad:
                chunk.sample.retain_grad()  # what the generator's loss sends into its sample
            detached = chunk.sample.detach().float()
            if args.rollout == "self":  # the scores' context is the generator's own history
                real_clip.copy_history(rollout.history, chunk_index)
                fake_clip.copy_history(rollout.history, chunk_index)
            # Critic: flow matching of the fake score on this very sample.
            self.mark("critic: fake score forward + backward")
            critic_sigma, critic_noise, critic_input = self.draw_score_inputs(detached, generator)
            score_sigma, score_noise, score_input = self.draw_score_inputs(detached, generator)
            with torch.enable_grad():
                velocity = fake_clip.velocity(chunk_index, critic_input, critic_sigma)
                loss_critic = critic_loss(velocity, critic_noise, detached)
                (loss_critic / len(chunks)).backward()
            metrics = {"critic_loss": float(loss_critic.detach()), "critic/sigma": float(critic_sigma[0]),
                       **chunk.metrics}
            if chunk.anchor is not None:
                metrics["anchor_loss"] = float(chunk.anchor.detach())
            # Generator: the DMD gradient of the same sample, plus the anchor.
            if generator_due:
                with torch.no_grad():
                    self.mark(f"{self.real.label} x0 (no grad)")
                    x0_real = real_clip.x0(chunk_index, score_input, score_sigma)
                    self.mark(f"{self.fake.label} x0 (no grad)")
                    x0_fake = fake_clip.x0(chunk_index, score_input, score_sigma)
                gradient = dmd_gradient(x0_fake, x0_real, detached)
                self.mark("generator loss")
                loss_dmd = dmd_generator_loss(chunk.sample, gradient)
                self.mark("generator backward")
                total = loss_dmd
                if chunk.anchor is not None and args.anchor_weight > 0:
                    total = total + args.anchor_weight * chunk.anchor
                if args.truth_weight > 0:
                    truth = data[:, :, self.config.chunk_frames(chunk_index)]
                    loss_truth = torch.mean((chunk.sample - truth) ** 2)
                    total = total + args.truth_weight * loss_truth
                    metrics["truth_loss"] = float(loss_truth.detach())
                (total / len(chunks)).backward()
                metrics.update({"generator_loss": float(total.detach()), "dmd_loss": float(loss_dmd.detach()),
                                "dmd/grad_rms": float(gradient.pow(2).mean().sqrt()),
                                "dmd/sigma": float(score_sigma[0])})
            if self.trace is not None:
                self.trace.append({"chunk": chunk_index, "generator_sample": chunk.sample, "sample": detached.clone(),
                                   "critic_input": critic_input.detach().clone(),
                                   "critic_sigma": critic_sigma.clone(), "critic_noise": critic_noise.clone()})
            samples.append(detached)
            for key, value in metrics.items():
                totals.setdefault(key, []).append(value)

        with torch.set_grad_enabled(generator_due):
            rollout.run(score_chunk, sync=sync, mark=self.mark)
        # 3. Chunk means; on monitor steps the collapse monitors against the Teacher's F-F-F-F of the same noise.
        result = {key: sum(values) / len(values) for key, values in totals.items()}
        result["loss"] = result["critic_loss"] + result.get("generator_loss", 0.0)
        if (self.run_state.global_step + 1) % args.monitor_every == 0:
            self.mark("monitor: the Teacher's F-F-F-F (no grad)")
            reference = teacher_chunks(self.teacher, item, noise, memory_seed, chunks, self.config, env.device,
                                       data if args.rollout == "data" else None)
            monitors = collapse_monitors(torch.cat(samples, dim=2), reference, self.config.chunk_latents)
            for key, value in monitors.items():  # per-chunk keys name the clip's chunk, not its position here
                match = re.fullmatch(r"monitor/chunk(\d+)/(\w+)", key)
                result[f"monitor/chunk{chunks[int(match[1])]}/{match[2]}" if match else key] = value
        return result


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, rollout_config: RolloutConfig,
          resuming: bool = False, run_dir: Path | None = None, load_teacher=load_teacher, load_lora=load_lora,
          draw_chunks=draw_training_chunks, draw_exit_steps=uniform_exit_steps, mark=None,
          wrap_score=None) -> RecipeParts:
    """Step 3: the frozen Teacher; the generator, built on the Teacher before any adapter is added to it (the
    Predictor from --init_from unless a training state is resumed: `resuming`; or the student); the real and fake
    scores; the DMD step on clips under `rollout_config` and the validation. Seams: `load_teacher` (the loader of a
    Teacher-shaped model folder: the Teacher, a model-folder real score, a full student or fake score),
    `load_lora` (the real score's adapter file), `draw_chunks` (which chunks of a clip a data-rollout student
    trains), `draw_exit_steps` (each chunk's exit step under --exit_step uniform: `uniform_exit_steps`), `mark`
    (called with the name of each part of the step as it starts: where a rehearsal's peak is), `wrap_score`
    (ScoreModel -> what the step calls as that score, with its `label` and `clip`: a test's recorder of the score
    calls; default the score itself)."""
    source = TeacherSource(args.teacher, args.action_ckpt, "--teacher", None)
    teacher = load_teacher(source, env.device, policy.frozen_dtype)
    log0(describe_teacher(source, teacher))
    student, student_model, init_meta, derived = None, None, None, {}
    if args.generator == "predictor":
        predictor, generator_role, init_meta = build_predictor_role(
            settings_from_flags(PredictorGeneratorSettings, args), teacher, env, resuming=resuming)
        derived["predictor"] = predictor.predictor_config()
        generator_model = predictor
    else:
        student, generator_role, student_model = build_student(
            settings_from_flags(MethodSettings, args), teacher, env, policy, teacher_folder=args.teacher,
            generator_every=args.generator_every, ema_decay=args.ema_decay, ema_start_step=args.ema_start_step,
            load_teacher=load_teacher)
        generator_model = student.model
    real, fake, fake_role = build_scores(settings_from_flags(ScoreSettings, args), teacher, env, policy,
                                         load_teacher=load_teacher, load_lora=load_lora)
    run_state = RunState()
    as_called = wrap_score or (lambda score: score)
    step_fn = DistributionMatchingStep(args=args, env=env, run_state=run_state, rollout_config=rollout_config,
                                       teacher=teacher, real=as_called(real), fake=as_called(fake),
                                       generator_role=generator_role, student=student, draw_chunks=draw_chunks,
                                       draw_exit_steps=draw_exit_steps, mark=mark)
    validation = generator_validation(
        every=args.val_every, dataset_root=args.dataset_root, split=args.val_split, videos=args.val_videos,
        vae=args.val_vae, seed=args.seed, teacher=teacher, generator_role=generator_role, student=student,
        plan=args.plan, student_steps=args.student_steps, student_shift=args.student_shift,
        rollout_config=rollout_config, env=env, run_dir=run_dir)
    return RecipeParts(
        roles=[generator_role, fake_role], step_fn=step_fn, run_state=run_state, validation=validation,
        models=list(dict.fromkeys([teacher, generator_model, real.model, fake.model])),
        derived={"init_meta": init_meta, "teacher_double_blocks": teacher.num_layers, **derived},
        objects={"generator_role": generator_role, "student_model": student_model})
