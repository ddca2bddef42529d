"""The kd recipe's step and build (`fvtools/train_kd.py` holds its flags, presets, cross-flag checks, summary and
`main()`; docs/methods/kd.md): the student (a LoRA on the teacher, or every parameter; `build_method_model`),
`CausalKDStep`, the loop's step function of one cached ODE sample per micro-batch, on the cache states at the
student's noise levels (`student_state_indices`), the validation, and the student's distance to the teacher before
and after training (`StudentDistance`, kd_eval.json).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from predictor_training.data.ode_cache import OdeCacheDataset
from predictor_training.eval.validation import ClipRolloutValidation
from predictor_training.methods.flow_matching import x0_from_velocity
from predictor_training.methods.method_model import MethodModel, MethodSettings, build_method_model
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.scheduler import flow_match_sigmas
from predictor_training.rollout.teacher_forcing import TeacherForcedClip, clip_text_kv, draw_training_chunks
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv, log0
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.fsdp import gradient_sync
from predictor_training.runtime.io import write_json_atomic
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.random_streams import ALL_RANKS, stream_generator
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher

METHOD = "kd"
ROLE = "student"
EVAL_NAME = "kd_eval.json"


def build_validation(args, env: DistEnv, method_model: MethodModel, autocast_dtype, run_dir: Path
                     ) -> ClipRolloutValidation | None:
    """The student's own --student_steps rollout from each held-out sample's seed (the teacher's noise and memory
    points, as `few_step_distance`) on the first --val_videos samples of --val_split, decoded and scored against
    the teacher's stored final latents (val/psnr_vs_teacher, ...). None with --val_every 0."""
    if args.val_every <= 0:
        return None
    dataset = OdeCacheDataset(args.cache_root, args.val_split)
    model = method_model.model
    config = RolloutConfig(num_steps=args.student_steps, shift=args.student_shift, state_dtype=torch.float32,
                           autocast_dtype=autocast_dtype)

    def generate(item, noise, memory_seed):  # the sample's own seed, not the validation's draws
        text_kv = clip_text_kv(model, item, env.device, autocast_dtype, grad=False)
        inputs = RolloutInputs.from_seed(item["seed"], item["image_cond"].float(), item["viewmats"].double(),
                                         item["Ks"].double(), item["action"], device=env.device)
        return ARRollout(model, text_kv, inputs, config, device=env.device).run().float().cpu()

    return ClipRolloutValidation(
        generate=generate, dataset=dataset, num_videos=args.val_videos, vae=args.val_vae, env=env, run_dir=run_dir,
        seed=args.seed, chunk_latents=config.chunk_latents, collective=method_model.role.is_fsdp, modules=[model],
        truth=lambda item: item["final"][None].float(), truth_name="teacher", split=args.val_split)


def student_state_indices(steps: int, shift: float, stored_sigmas) -> list[int]:
    """For each of the student's noise levels, the index of the cache state at that level (ValueError naming the
    missing levels when the cache was built on another grid)."""
    indices, missing = [], []
    for sigma in flow_match_sigmas(steps, shift)[:-1].tolist():
        matches = [index for index, stored in enumerate(stored_sigmas) if abs(stored - sigma) < 1e-5]
        if matches:
            indices.append(matches[0])
        else:
            missing.append(round(sigma, 5))
    if missing:
        raise ValueError(f"noise levels {missing} are not among the cache's stored sigmas "
                         f"{[round(value, 5) for value in stored_sigmas]}; rebuild the cache with --store_grid "
                         f"{steps} --shift {shift:g}")
    return indices


class CausalKDStep:
    """`step_fn` of the loop: one cached sample per call; per chosen chunk, one student noise level, one backward.

    Draws (chunks, their noise levels) come from (seed, micro-step, rank); the memory-retrieval points are the
    cached sample's own (`make_retrieval_points(item["seed"])`, those of the teacher rollout that made its states
    and target), so the student's context is the one the teacher's target was made with."""

    def __init__(self, method_model: MethodModel, rollout_config: RolloutConfig, state_indices: list[int], args,
                 env: DistEnv, run_state: RunState, *, draw_chunks=draw_training_chunks):
        self.method_model = method_model
        self.rollout_config = rollout_config
        self.state_indices = state_indices
        self.args = args
        self.env = env
        self.run_state = run_state
        self.draw_chunks = draw_chunks

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        if due != {ROLE}:
            raise ValueError(f"kd trains the role {ROLE!r} every step; the loop says {sorted(due)}")
        counters = (self.args.seed, self.run_state.micro_step, self.env.rank)
        generator = stream_generator(*counters)
        model = self.method_model.model
        clip = TeacherForcedClip(
            model, item["final"][None], item, self.rollout_config, self.env.device,
            memory_seed=item["seed"], text_grad=self.method_model.trains_text_stream,
            context_grad=self.args.context_grad,
        )
        shared = stream_generator(self.args.seed, self.run_state.micro_step, ALL_RANKS)
        chunks = self.draw_chunks(clip.num_chunks, self.args.chunks_per_clip, generator, shared)
        levels = torch.randint(0, len(self.state_indices), (len(chunks),), generator=generator).tolist()
        losses, sigmas = [], []
        for position, (chunk_index, level) in enumerate(zip(chunks, levels)):
            state = self.state_indices[level]
            frames = clip.rollout.chunk_frames(chunk_index)
            noisy = item["states"][state][None, :, frames].float().to(self.env.device)
            sigma = float(item["sigmas"][state])
            sigma_frames = torch.full((noisy.shape[2],), sigma, dtype=torch.float32)
            target = clip.chunk_latents(chunk_index)
            with gradient_sync(model, enabled=sync and position == len(chunks) - 1):
                velocity = clip.predict_velocity(chunk_index, noisy, sigma_frames)
                estimate = x0_from_velocity(noisy, velocity, sigma_frames[None].to(noisy.device))
                loss = 0.5 * torch.mean((estimate - target) ** 2)
                (loss / len(chunks)).backward()
            losses.append(loss.item())
            sigmas.append(sigma)
        return {"loss": sum(losses) / len(chunks), "sigma/mean": sum(sigmas) / len(chunks), "chunks": float(len(chunks))}


@torch.no_grad()
def few_step_distance(model, dataset: OdeCacheDataset, count: int, *, steps: int, shift: float,
                      device: torch.device, autocast_dtype) -> dict:
    """The student's own `steps`-step AR rollout from each sample's seed (the teacher's noise and memory points)
    against the teacher's final latents: mean squared error overall and per chunk, over the first `count` samples.
    Every rank runs the same samples (a sharded model's forwards are collective)."""
    config = RolloutConfig(num_steps=steps, shift=shift, state_dtype=torch.float32, autocast_dtype=autocast_dtype)
    per_chunk = []
    for index in range(min(count, len(dataset))):
        item = dataset[index]
        text_kv = clip_text_kv(model, item, device, autocast_dtype, grad=False)
        inputs = RolloutInputs.from_seed(item["seed"], item["image_cond"].float(), item["viewmats"].double(),
                                         item["Ks"].double(), item["action"], device=device)
        latents = ARRollout(model, text_kv, inputs, config, device=device).run()[0].float().cpu()
        error = ((latents - item["final"].float()) ** 2).mean(dim=(0, 2, 3))  # [T]
        per_chunk.append(error.reshape(-1, config.chunk_latents).mean(dim=1))
    per_chunk = torch.stack(per_chunk).mean(dim=0)
    return {"mse": float(per_chunk.mean()), "mse_per_chunk": [round(float(value), 6) for value in per_chunk],
            "samples": min(count, len(dataset)), "steps": steps, "shift": shift}


class StudentDistance:
    """kd_eval.json: the student's own --student_steps rollout against the teacher's final latents on the first
    --eval_samples of --eval_split (`few_step_distance`), before training (a fresh run only: a continued run keeps
    its first measurement) and after it."""

    def __init__(self, args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy,
                 eval_dataset: OdeCacheDataset, run_dir: Path):
        self.args, self.env, self.path = args, env, run_dir / EVAL_NAME
        self.measure = partial(few_step_distance, dataset=eval_dataset, count=args.eval_samples,
                               steps=args.student_steps, shift=args.student_shift, device=env.device,
                               autocast_dtype=policy.autocast_dtype)
        self.report = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def before(self, model) -> None:
        if "before" not in self.report:
            self.report["before"] = self.measure(model)
            log0(f"student vs teacher on {self.args.eval_split}, before: mse {self.report['before']['mse']:.5f}")

    def after(self, model, step: int) -> None:
        report = self.report
        report["after"] = {**self.measure(model), "step": step}
        if self.env.is_main:
            write_json_atomic(self.path, report)
        log0(f"student vs teacher on {self.args.eval_split}: mse {report['before']['mse']:.5f} before, "
             f"{report['after']['mse']:.5f} after step {step} ({self.path})")


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, state_indices: list[int],
          run_dir: Path | None = None, load_teacher=load_teacher, draw_chunks=draw_training_chunks) -> RecipeParts:
    """Step 3: the student (a LoRA on the teacher, or every parameter; `build_method_model`) with its AdamW and
    schedule, the KD step on the cache states `state_indices` (the entry script's step 2: the student's noise levels)
    and the validation. Seams: `load_teacher` (the teacher folder's loader), `draw_chunks` (which chunks of a sample
    train)."""
    source = TeacherSource(args.teacher, args.action_ckpt, "--teacher", None)
    method_model = build_method_model(source, settings_from_flags(MethodSettings, args), env, policy, role_name=ROLE,
                                      load_teacher=load_teacher)
    log0(describe_teacher(source, method_model.model))
    rollout_config = RolloutConfig(state_dtype=torch.float32, autocast_dtype=policy.autocast_dtype)
    run_state = RunState()
    step_fn = CausalKDStep(method_model, rollout_config, state_indices, args, env, run_state, draw_chunks=draw_chunks)
    return RecipeParts(roles=[method_model.role], step_fn=step_fn, models=[method_model.model], run_state=run_state,
                       validation=build_validation(args, env, method_model, policy.autocast_dtype, run_dir),
                       objects={"method_model": method_model})
