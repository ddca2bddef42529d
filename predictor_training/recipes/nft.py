"""The nft recipe's step and build (`fvtools/train_nft.py` holds its flags, presets, cross-flag checks, summary and
`main()`; docs/methods/nft.md): the policy with its old policy and reference (`methods/nft.py`), the rewards of
decoded samples (`methods/rewards.py`) and `NftStep`, the loop's step function of one group per micro-batch, with the
validation and the held-out evaluation after training (`evaluate`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.eval.validation import reward_validation
from predictor_training.methods.flow_matching import add_noise
from predictor_training.methods.method_model import MethodSettings, build_method_model
from predictor_training.methods.monitors import collapse_monitors
from predictor_training.methods.nft import (
    OldPolicy,
    PolicyModels,
    TrainSigmas,
    evaluate_against_reference,
    gathered,
    group_advantages,
    group_statistics,
    nft_objective,
    old_policy_decay,
    sampler_sigma_grid,
    training_sigmas,
)
from predictor_training.methods.rewards import TOTAL, RewardScorer, VideoRewards, parse_reward_weights
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.teacher_forcing import TeacherForcedClip, clip_text_kv, draw_training_chunks
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv, log0
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.io import write_json_atomic
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.random_streams import ALL_RANKS, stream_generator, stream_seed
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher
from predictor_training.video.vae_decoder import VaeDecoder

METHOD = "nft"
ROLE = "policy"
# Stream ids after (seed, micro-step, rank): what each draw of a step uses.
NOISE_STREAM, MEMORY_STREAM, TRAIN_STREAM, EVAL_STREAM = 1, 2, 3, 4
EVAL_NAME = "nft_eval.json"


class NftStep:
    """`step_fn` of the loop: sample a group with the old policy, score it, train the policy on it.

    Draws: the samples' noise and memory points from (seed, micro-step, rank, stream, sample); the training chunks'
    noise and sigmas from (seed, micro-step, rank, TRAIN_STREAM); whether chunk 0 is trained from (seed,
    micro-step, ALL_RANKS). `objective`: each trained chunk's loss, `nft_objective`'s signature and result."""

    def __init__(self, models: PolicyModels, rewards: VideoRewards, args, env: DistEnv, run_state: RunState,
                 autocast_dtype, *, draw_chunks=draw_training_chunks, objective=nft_objective):
        self.models = models
        self.rewards = rewards
        self.args = args
        self.env = env
        self.run_state = run_state
        self.draw_chunks = draw_chunks
        self.objective = objective
        self.sample_config = RolloutConfig(num_steps=args.sample_steps, shift=args.sample_shift,
                                           state_dtype=torch.float32, autocast_dtype=autocast_dtype)
        self.clip_config = RolloutConfig(state_dtype=torch.float32, autocast_dtype=autocast_dtype)
        self.sigma_grid = sampler_sigma_grid(args.sample_steps, args.sample_shift)  # [sample_steps]
        self.train_sigmas = settings_from_flags(TrainSigmas, args)

    def counters(self) -> tuple[int, int, int]:
        return self.args.seed, self.run_state.micro_step, self.env.rank

    def rollout_inputs(self, item: dict, sample: int, counters: tuple[int, ...] | None = None) -> RolloutInputs:
        """The noise [1, C, T, H, W] and memory points of sample `sample` of this micro-step (a pure function of
        the counters, default (seed, micro-step, rank): regenerated identically on resume)."""
        counters = self.counters() if counters is None else counters
        channels, num_latents, height, width = item["latents"].shape
        noise = torch.randn((1, channels, num_latents, height, width),
                            generator=stream_generator(*counters, NOISE_STREAM, sample))
        return RolloutInputs.from_clip(item, noise, self.memory_seed(sample, counters))

    def memory_seed(self, sample: int, counters: tuple[int, ...] | None = None) -> int:
        return stream_seed(*(self.counters() if counters is None else counters), MEMORY_STREAM, sample)

    @torch.no_grad()
    def sample(self, item: dict, role: str, samples: range, counters: tuple[int, ...] | None = None
               ) -> torch.Tensor:
        """AR rollouts of `role` ("old", "policy", "reference") from the given samples' noise -> [n, C, T, H, W]."""
        device = self.env.device
        with self.models.running(role) as model:
            text_kv = clip_text_kv(model, item, device, self.sample_config.autocast_dtype, grad=False)
            return torch.cat([ARRollout(model, text_kv, self.rollout_inputs(item, index, counters),
                                        self.sample_config, device=device).run().float().cpu()
                              for index in samples])

    def eval_rollout(self, item: dict, role: str, clip_index: int) -> torch.Tensor:
        """One rollout of `role` for held-out clip `clip_index`, from the noise of stream (seed, EVAL_STREAM, clip)."""
        return self.sample(item, role, range(1), (self.args.seed, EVAL_STREAM, clip_index))

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        if due != {ROLE}:
            raise ValueError(f"nft trains the role {ROLE!r} every step; the loop says {sorted(due)}")
        args, K = self.args, self.args.samples_per_group
        step = self.run_state.global_step + 1
        # 1. K samples of this clip from the old policy, their rewards, and the advantages of every rank's group.
        samples = self.sample(item, "old", range(K))
        scores = self.rewards(samples, item)
        names = list(scores)
        table = gathered(torch.stack([scores[name] for name in names]), self.env)  # [world, rewards + 1, K]
        advantages_all = group_advantages(table[:, names.index(TOTAL)].double(),  # [world, K]
                                          std=args.advantage_std).float()
        advantages = advantages_all[self.env.rank]
        metrics = group_statistics(table, names, advantages_all)
        metrics.update({"old_policy/decay": old_policy_decay(args.old_decay_schedule, step, args.old_decay),
                        "samples/checksum": float(samples.double().sum())})
        # 2. The training pass: chunks of each sample noised at one sigma each, three velocities, one backward each.
        metrics.update(self.train_on(item, samples, advantages))
        # 3. Monitors: the current policy against the reference from sample 0's noise.
        if step == 1 or step % args.monitor_every == 0 or step == args.max_steps:
            policy_video, reference_video = (self.sample(item, role, range(1)) for role in ("policy", "reference"))
            metrics.update(collapse_monitors(policy_video, reference_video))
            both = self.rewards(torch.cat([policy_video, reference_video]), item)[TOTAL]
            metrics.update({"monitor/reward": float(both[0]), "monitor/reference_reward": float(both[1])})
        return metrics

    def train_on(self, item: dict, samples: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        """NFT + KL backward on `--chunks_per_sample` chunks of each sample [K, C, T, H, W] with its advantage [K]."""
        args, device = self.args, self.env.device
        generator = stream_generator(*self.counters(), TRAIN_STREAM)
        shared = stream_generator(args.seed, self.run_state.micro_step, ALL_RANKS)
        trains_text = self.models.method_model.trains_text_stream
        nft_terms, kl_terms, sigmas_seen = [], [], []
        for index in range(samples.shape[0]):
            clips = {}
            # One clip per model; in lora mode the three share the model (and text K/V: the adapters leave the
            # text stream alone), and the adapter is switched around each call.
            for role in ("policy",) if self.models.adapters is not None else ("policy", "old", "reference"):
                with self.models.running(role) as model:
                    clips[role] = TeacherForcedClip(
                        model, samples[index:index + 1], item, self.clip_config, device,
                        memory_seed=self.memory_seed(index), text_grad=trains_text and role == "policy",
                        context_grad=args.context_grad and role == "policy")
            if self.models.adapters is not None:
                clips["old"] = clips["reference"] = clips["policy"]
            chunks = self.draw_chunks(clips["policy"].num_chunks, args.chunks_per_sample, generator, shared)
            sigmas = training_sigmas(self.train_sigmas, self.sigma_grid, len(chunks), generator)
            for chunk_index, sigma in zip(chunks, sigmas.tolist()):
                x0 = clips["policy"].chunk_latents(chunk_index)
                noise = torch.randn(x0.shape, generator=generator).to(device)
                sigma_frames = torch.full((x0.shape[2],), sigma, dtype=torch.float32)
                noisy = add_noise(x0, noise, sigma_frames[None].to(device))
                with torch.no_grad():
                    with self.models.running("old"):
                        v_old = clips["old"].predict_velocity(chunk_index, noisy, sigma_frames)
                    with self.models.running("reference"):
                        v_reference = clips["reference"].predict_velocity(chunk_index, noisy, sigma_frames)
                with self.models.running("policy"):
                    v_policy = clips["policy"].predict_velocity(chunk_index, noisy, sigma_frames)
                    loss, nft, kl = self.objective(v_policy, v_old, v_reference, noisy, x0,
                                                   torch.tensor([sigma], device=device),
                                                   advantages[index:index + 1].to(device), beta=args.beta,
                                                   clip=args.adv_clip, kl_weight=args.kl_weight)
                    (loss / (samples.shape[0] * len(chunks))).backward()
                nft_terms.append(nft.item())
                kl_terms.append(kl.item())
                sigmas_seen.append(sigma)
        nft_mean, kl_mean = sum(nft_terms) / len(nft_terms), sum(kl_terms) / len(kl_terms)
        return {"loss": nft_mean + args.kl_weight * kl_mean, "loss/nft": nft_mean, "kl": kl_mean,
                "sigma/mean": sum(sigmas_seen) / len(sigmas_seen)}


def video_rewards(args: argparse.Namespace, vae_folder: Path, device: torch.device) -> VideoRewards:
    """The recipe's rewards: the samples decoded by the VAE in `vae_folder` (FP32, untiled) and scored by --rewards
    (sampled-frame rewards on --reward_frames frames) against --reference_video (--ground_truth)."""
    decoder = VaeDecoder.from_folder(vae_folder, device, torch.float32, tiling=False)
    scorer = RewardScorer(parse_reward_weights(args.rewards), sampled_frames=args.reward_frames)
    return VideoRewards(scorer, decoder, args.reference_video, args.ground_truth)


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, vae_folder: Path,
          run_dir: Path | None = None, load_teacher=load_teacher, draw_chunks=draw_training_chunks,
          make_rewards=video_rewards, objective=nft_objective) -> RecipeParts:
    """Steps 3-4: the policy (a LoRA on the Teacher, or every parameter; `build_method_model`) with its AdamW and
    schedule, its old policy (the role's EMA slot) and the reference (`PolicyModels`); the rewards of samples
    decoded by the VAE in `vae_folder` (the entry script's step 2); the NFT step and the validation. Seams:
    `load_teacher` (the Teacher folder's loader), `draw_chunks` (which chunks of a sample train), `make_rewards`
    (`(args, vae_folder, device) -> rewards`: the decoder and the reward functions), `objective` (each trained chunk's
    loss)."""
    # 3. The policy, its old policy and the reference.
    source = TeacherSource(args.teacher, args.action_ckpt, "--teacher", None)
    method_model = build_method_model(source, settings_from_flags(MethodSettings, args), env, policy, role_name=ROLE,
                                      load_teacher=load_teacher)
    log0(describe_teacher(source, method_model.model))
    models = PolicyModels(method_model)
    method_model.role.ema = OldPolicy(models.old_module, args.old_decay_schedule, args.old_decay)
    # 4. Rewards: the decoder, the scorer, the reference videos; the step and the validation.
    rewards = make_rewards(args, vae_folder, env.device)
    run_state = RunState()
    step_fn = NftStep(models, rewards, args, env, run_state, policy.autocast_dtype, draw_chunks=draw_chunks,
                      objective=objective)
    validation = reward_validation(every=args.val_every, dataset_root=args.dataset_root, split=args.eval_split,
                                   videos=args.val_videos, seed=args.seed, step_fn=step_fn, vae=vae_folder, env=env,
                                   run_dir=run_dir)
    return RecipeParts(roles=[method_model.role], step_fn=step_fn, models=list(dict.fromkeys(models.modules.values())),
                       run_state=run_state, validation=validation, objects={"method_model": method_model})


def evaluate(args: argparse.Namespace, *, step_fn: NftStep, eval_dataset: VideoLatentDataset, env: DistEnv,
             run_dir: Path, step: int) -> None:
    """After training: the policy against the reference from the same noise on --eval_clips held-out clips
    (nft_eval.json)."""
    report = {**evaluate_against_reference(step_fn.eval_rollout, step_fn.rewards, eval_dataset, args.eval_clips, env),
              "split": args.eval_split, "step": step}
    if env.is_main:
        write_json_atomic(run_dir / EVAL_NAME, report)
    policy_total, reference_total = report["reward_policy"][TOTAL], report["reward_reference"][TOTAL]
    log0(f"policy vs reference on {len(report['clips'])} {args.eval_split} clips (same noise): reward "
         f"{policy_total:.5g} vs {reference_total:.5g}, policy higher on {report['policy_wins']}; "
         f"std ratio {report['monitors']['monitor/std_ratio']:.4f}, temporal ratio "
         f"{report['monitors']['monitor/temporal_ratio']:.4f} ({run_dir / EVAL_NAME})")
