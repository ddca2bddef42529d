"""The df_sft recipe's step and build (`fvtools/train_df_sft.py` holds its flags, presets, cross-flag checks, data,
summary and `main()`; docs/methods/df_sft.md): the trained model (a LoRA on the Teacher, or every parameter;
`build_method_model`), `DiffusionForcingStep`, the loop's step function of one clip per micro-batch, and the
validation (the model's own AR rollout on held-out clips).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.eval.validation import ClipRolloutValidation, own_rollout
from predictor_training.methods.flow_matching import add_noise, chunk_sigmas, sample_sigmas, velocity_target
from predictor_training.methods.method_model import MethodModel, MethodSettings, build_method_model
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.teacher_forcing import NoisyContext, TeacherForcedClip, draw_training_chunks
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv, log0
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.fsdp import gradient_sync
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.random_streams import ALL_RANKS, stream_generator, stream_seed
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher

METHOD = "df_sft"
ROLE = "student"


def build_validation(args, env: DistEnv, method_model: MethodModel, rollout_config: RolloutConfig,
                     run_dir: Path) -> ClipRolloutValidation | None:
    """The model's own AR rollout (the distilled 4-step schedule) on the first --val_videos clips of --val_split,
    against each clip's decoded latents (None with --val_every 0)."""
    if args.val_every <= 0:
        return None
    dataset = VideoLatentDataset(args.dataset_root, args.val_split)
    model = method_model.model
    return ClipRolloutValidation(
        generate=own_rollout(model, rollout_config, env.device, rollout_config.autocast_dtype), dataset=dataset,
        num_videos=args.val_videos, vae=args.val_vae, env=env, run_dir=run_dir, seed=args.seed,
        chunk_latents=rollout_config.chunk_latents, collective=method_model.role.is_fsdp, modules=[model],
        split=args.val_split)


class DiffusionForcingStep:
    """`step_fn` of the loop: one clip per call, its chosen chunks each noised at its own sigma, one backward each.

    Every draw (which chunks, their sigmas, the noise, the memory-retrieval points of a video clip, the context's
    levels and noise under `--context_noise independent`) comes from generators seeded with (seed, micro-step, rank):
    a resumed run draws what the uninterrupted run drew, and ranks differ, except whether chunk 0 is trained, which
    all ranks draw alike (`draw_training_chunks`: FSDP needs the same calls). A Teacher sample's memory points are
    its own seed's (`memory_seed`).
    """

    def __init__(self, method_model: MethodModel, rollout_config: RolloutConfig, args, env: DistEnv,
                 run_state: RunState, *, draw_chunks=draw_training_chunks):
        self.method_model = method_model
        self.rollout_config = rollout_config
        self.args = args
        self.env = env
        self.run_state = run_state
        self.draw_chunks = draw_chunks

    def draw(self, num_chunks: int, generator: torch.Generator, shared: torch.Generator
             ) -> tuple[list[int], torch.Tensor]:
        """(chunk indices, ascending; their noise levels [k])."""
        chunks = self.draw_chunks(num_chunks, self.args.chunks_per_clip, generator, shared)
        count = len(chunks)
        sigmas = sample_sigmas(self.args.sigma_sampler, count, generator, sigma_min=self.args.sigma_min,
                               sigma_max=self.args.sigma_max, shift=self.args.sigma_shift,
                               logit_mean=self.args.logit_mean, logit_std=self.args.logit_std)
        return chunks, sigmas

    def memory_seed(self, item: dict, counters: tuple[int, int, int]) -> int:
        """The seed of the clip's memory-retrieval points. A Teacher sample: the seed its rollout drew them from
        (the row seed, `RolloutInputs.from_seed`), so the context is the one the Teacher's final latents were made
        with; a video clip (no rollout behind it): a fresh draw per micro-step."""
        if self.args.data == "teacher_samples":
            return int(item["seed"])
        return stream_seed(*counters, 1)

    def noisy_context(self, history: torch.Tensor, counters: tuple[int, int, int]) -> NoisyContext | None:
        """`--context_noise independent`: every chunk of the history at its own level (the trained chunks' sampler
        and bounds), with its own noise, both from the stream (seed, micro-step, rank, 2), so the trained chunks'
        own draws stay those of `clean`. None for `clean`."""
        if self.args.context_noise == "clean":
            return None
        generator = stream_generator(*counters, 2)
        chunk_latents = self.rollout_config.chunk_latents
        levels = sample_sigmas(self.args.sigma_sampler, history.shape[2] // chunk_latents, generator,
                               sigma_min=self.args.sigma_min, sigma_max=self.args.sigma_max,
                               shift=self.args.sigma_shift, logit_mean=self.args.logit_mean,
                               logit_std=self.args.logit_std)
        sigma = chunk_sigmas(levels[None], chunk_latents)  # [1, T]
        noise = torch.randn(history.shape, generator=generator).to(history.device)
        return NoisyContext(latents=add_noise(history, noise, sigma.to(history.device)), sigma=sigma[0])

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        if due != {ROLE}:
            raise ValueError(f"df_sft trains the role {ROLE!r} every step; the loop says {sorted(due)}")
        counters = (self.args.seed, self.run_state.micro_step, self.env.rank)
        generator = stream_generator(*counters)
        model = self.method_model.model
        history = item["latents"][None]
        clip = TeacherForcedClip(
            model, history, item, self.rollout_config, self.env.device,
            memory_seed=self.memory_seed(item, counters), text_grad=self.method_model.trains_text_stream,
            context_grad=self.args.context_grad, noisy_context=self.noisy_context(history.float(), counters),
        )
        shared = stream_generator(self.args.seed, self.run_state.micro_step, ALL_RANKS)
        chunks, sigmas = self.draw(clip.num_chunks, generator, shared)
        losses = []
        for position, (chunk_index, sigma) in enumerate(zip(chunks, sigmas.tolist())):
            x0 = clip.chunk_latents(chunk_index)
            noise = torch.randn(x0.shape, generator=generator).to(x0.device)
            sigma_frames = torch.full((x0.shape[2],), sigma, dtype=torch.float32)
            noisy = add_noise(x0, noise, sigma_frames[None].to(x0.device))
            last = position == len(chunks) - 1
            with gradient_sync(model, enabled=sync and last):
                velocity = clip.predict_velocity(chunk_index, noisy, sigma_frames)
                loss = torch.mean((velocity - velocity_target(x0, noise)) ** 2)
                (loss / len(chunks)).backward()
            losses.append(loss.item())
        return {"loss": sum(losses) / len(losses), "sigma/mean": float(sigmas.mean()),
                "sigma/spread": float(sigmas.max() - sigmas.min()), "chunks": float(len(chunks))}


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, rollout_config: RolloutConfig,
          run_dir: Path | None = None, load_teacher=load_teacher, draw_chunks=draw_training_chunks) -> RecipeParts:
    """Step 3: the trained model (a LoRA on the Teacher, or every parameter; `build_method_model`) with its AdamW and
    schedule, the diffusion-forcing step on clips under `rollout_config` (the entry script's step 2) and the
    validation. Seams: `load_teacher` (the Teacher folder's loader), `draw_chunks` (which chunks of a clip train)."""
    source = TeacherSource(args.teacher, args.action_ckpt, "--teacher", None)
    method_model = build_method_model(source, settings_from_flags(MethodSettings, args), env, policy, role_name=ROLE,
                                      load_teacher=load_teacher)
    log0(describe_teacher(source, method_model.model))
    run_state = RunState()
    step_fn = DiffusionForcingStep(method_model, rollout_config, args, env, run_state, draw_chunks=draw_chunks)
    return RecipeParts(roles=[method_model.role], step_fn=step_fn, models=[method_model.model], run_state=run_state,
                       validation=build_validation(args, env, method_model, rollout_config, run_dir),
                       objects={"method_model": method_model})
