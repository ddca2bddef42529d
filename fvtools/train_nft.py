"""DiffusionNFT: reinforcement of the AR world model with named reward functions of decoded video (docs/methods/nft.md).

Roles. The policy trains (a LoRA on the Teacher, `--train lora`, or every parameter of a Teacher-shaped model,
`--train full`, one process only). The old policy samples: a second LoRA adapter (or a frozen copy of the model),
equal to the policy at the start and refreshed after every policy update by `old <- d old + (1 - d) policy`, with d
from `--old_decay_schedule` (`predictor_training.methods.nft.old_policy_decay`); it is saved in the checkpoint. The
reference is the frozen start (the Teacher without adapter, or a frozen copy of the initial weights).

One micro-batch = one group. Every rank takes one dataset clip (a (case, action) condition: first frame, cameras,
actions, text) and samples `--samples_per_group` K videos from it with the old policy's own AR rollout
(`--sample_steps` steps at `--sample_shift`, default the distilled 4-step shift-5 schedule), each from its own
noise and memory points drawn from the stream (seed, micro-step, rank, sample): a resume regenerates the same
samples. The samples are decoded (`--vae`, default the VAE that encoded the dataset) and scored by `--rewards
name:weight,...` (`predictor_training/methods/rewards.py`, which also says how to add one); the weighted sum is the
reward. Groups are never split across ranks: every rank's K rewards are all-gathered, the advantages
A = (r - mean_group) / (std + 1e-4) are computed on the whole [ranks x groups, K] table (identical on every rank),
with std the population std of the whole table (`--advantage_std global`, the reference's default) or of the
group's own K rewards (`group`), and the logged reward and advantage statistics are global.

Training pass. For each sample, `--chunks_per_sample` of its chunks are noised, one sigma per chunk,
x_t = (1 - sigma) x0 + sigma n. By default (`--train_sigmas sampler_grid`) the sigmas are the sampler's own noise
levels (the non-zero sigmas of --sample_steps at --sample_shift: 1, .9375, .8333, .625 by default), in a random order
per sample, as the reference trains at its sampler's timesteps; `--train_sigmas range` draws them from `--sigma_*`
instead, never below the distilled Teacher's lowest trained sigma (0.625) for a policy that starts from it unless
`--allow_sigma_below_teacher`. The policy, old policy and reference predict the velocity with the sample's own
history as context, exactly as in the AR loop (`predictor_training/rollout/teacher_forcing.py`). Loss per chunk:
`nft_objective` (predictor_training/methods/nft.py) = `nft_loss(v_policy, v_old, x_t, x0, sigma, A; --beta,
--adv_clip)` + `--kl_weight * mse(v_policy, v_reference)`, one backward per chunk. Every `--monitor_every` steps
(and at step 1 and --max_steps) the current policy and the reference roll out from the same noise: their collapse
monitors (`predictor_training.methods.monitors.collapse_monitors`) and rewards are logged under monitor/. After
training the same comparison runs on `--eval_clips` clips of `--eval_split` (nft_eval.json).

    python fvtools/train_nft.py --teacher /models/worldplay/transformer --dataset_root /data/video_latents \\
        --rewards reference_agreement:1,smoothness:0.1
    bash tools/launch_fvtools_nft.sh                 # 8 GPUs; without GPU and data: the CPU demo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.data.provenance import run_provenance
from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_CONFIG_NAME, VideoLatentDataset
from predictor_training.eval.validation import reward_validation
from predictor_training.methods.flow_matching import add_noise, add_sigma_args
from predictor_training.methods.method_model import MethodSettings, build_method_model, dry_run_report, \
    export_method_model, method_meta
from predictor_training.methods.monitors import collapse_monitors
from predictor_training.methods.nft import ADVANTAGE_STDS, OLD_DECAY_SCHEDULES, TRAIN_SIGMAS, OldPolicy, \
    PolicyModels, TrainSigmas, check_train_sigmas, describe_train_sigmas, evaluate_against_reference, gathered, \
    group_advantages, group_statistics, nft_objective, old_policy_decay, sampler_sigma_grid, training_sigmas
from predictor_training.methods.rewards import REFERENCE_KINDS, TOTAL, RewardScorer, VideoRewards, \
    default_vae_folder, describe_rewards, holds_vae, parse_reward_weights
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.scheduler import DISTILLED_SIGMA_FLOOR
from predictor_training.rollout.teacher_forcing import TeacherForcedClip, clip_text_kv, draw_training_chunks
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import DistEnv, log0
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import (
    UNIT_INTERVAL, add_run_args, add_tracker_args, at_least, check_args, checked, parse_recipe_args, positive,
    settings_from_flags,
)
from predictor_training.recipes.flags import (
    add_method_model_args, add_method_optimization_args, add_validation_args, check_action_ckpt,
)
from predictor_training.runtime.io import write_json_atomic
from predictor_training.runtime.launch import distributed_run, early_exit, resume_roles, run_training
from predictor_training.runtime.logger import log_summary, method_summary_rows
from predictor_training.runtime.precision import PrecisionPolicy, precision_policy
from predictor_training.runtime.provenance import with_provenance
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.random_streams import ALL_RANKS, stream_generator, stream_seed
from predictor_training.runtime.run_directory import RunStart, environment_summary, launch_world, method_run_name, \
    plan_run, run_config, write_train_config
from predictor_training.teacher.config import DISTILLED_SHIFT
from predictor_training.teacher.source import TeacherSource, describe_teacher, load_teacher
from predictor_training.video.vae_decoder import VaeDecoder

METHOD = "nft"
ROLE = "policy"
# Stream ids after (seed, micro-step, rank): what each draw of a step uses.
NOISE_STREAM, MEMORY_STREAM, TRAIN_STREAM, EVAL_STREAM = 1, 2, 3, 4
EVAL_NAME = "nft_eval.json"

PRESETS = {
    # The CPU demo: a rank-16 LoRA on the shipped world Teacher, 4 samples per group (one group per rank), rewarded
    # for agreeing with the rendered ground truth and for smooth motion; FP32, no tracker.
    # --no_action_ckpt: the demo world's Teacher (and a df_sft model/ export) holds its action weights.
    "demo": ["--experiment", "nft_demo", "--train", "lora", "--lora_rank", "16", "--lora_alpha", "16",
             "--precision", "fp32", "--lr", "1e-3", "--max_steps", "30", "--warmup_steps", "2",
             "--samples_per_group", "4", "--chunks_per_sample", "2", "--monitor_every", "10",
             "--rewards", "reference_agreement:1,smoothness:10", "--reference_video", "ground_truth",
             "--no-gradient_checkpointing", "--ckpt_every", "10", "--keep_last", "2", "--tracker", "none",
             "--num_workers", "0", "--val_every", "30", "--val_videos", "1", "--no_action_ckpt"],
    # The recipe at the size the memory rehearsal plans for (tools/estimate_memory.py): its defaults.
    "real_size": ["--train", "lora", "--precision", "fp32master", "--gradient_checkpointing"],
}


def reward_weights(text: str) -> str:
    """`type=` of --rewards: the text itself, once `parse_reward_weights` accepts it."""
    try:
        parse_reward_weights(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--rewards={text!r}: {error}") from None
    return text


def parse_args(argv=None) -> argparse.Namespace:
    """The nft recipe: every default below is the recipe (docs/methods/nft.md)."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_root", type=Path, default=None,
                      help="video-latent dataset (video_dataset_config.json): the conditions sampled from, and "
                           "the reference videos of --reference_video data_latents; required to train")
    data.add_argument("--split", type=str, default="train", help="manifest split to train on (default %(default)s)")
    data.add_argument("--num_workers", type=int, default=2,
                      help="DataLoader worker processes per rank, 0 = main process (default %(default)s)")
    data.add_argument("--verify_dataset", action="store_true",
                      help="check size and sha256 of every dataset file before training")
    data.add_argument("--eval_split", type=str, default="holdout",
                      help="split on which, after training, the policy and the reference roll out from the same "
                           "noise and are scored (nft_eval.json) (default %(default)s)")
    data.add_argument("--eval_clips", type=at_least(int, 0), default=8,
                      help="clips of --eval_split scored after training, 0 = none (default %(default)s)")
    sampling = parser.add_argument_group("sampling (the old policy's AR rollout)")
    sampling.add_argument("--samples_per_group", default=8,
                          type=at_least(int, 2, " (advantages compare the samples of one group)"),
                          help="K: videos sampled per clip (one group = one condition), >= 2 (default %(default)s)")
    sampling.add_argument("--sample_steps", type=at_least(int, 1), default=4,
                          help="denoising steps per chunk of the rollout (default %(default)s: the distilled schedule)")
    sampling.add_argument("--sample_shift", type=positive(), default=DISTILLED_SHIFT,
                          help="schedule shift of the rollout (default %(default)g)")
    rewards = parser.add_argument_group("rewards (predictor_training/methods/rewards.py)")
    rewards.add_argument("--rewards", type=reward_weights, default="reference_agreement:1,smoothness:0.1",
                         help="name:weight,... of registered rewards, summed into the reward (default "
                              f"%(default)s). Registered: {describe_rewards()}")
    rewards.add_argument("--reward_frames", type=at_least(int, 1), default=8,
                         help="frames a 'sampled_frames' reward reads, spread evenly (default %(default)s)")
    rewards.add_argument("--reference_video", choices=REFERENCE_KINDS, default="data_latents",
                         help="the reference of the reference rewards: the clip's own latents decoded by --vae "
                              "(data_latents), its rendered ground truth in --ground_truth, or none "
                              "(default %(default)s)")
    rewards.add_argument("--ground_truth", type=Path, default=None,
                         help="folder of ground-truth videos, <clip_id>/ (PNG frames) or <clip_id>.mp4, with the "
                              "decoded videos' frame count and size (--reference_video ground_truth)")
    rewards.add_argument("--vae", default=None,
                         type=checked(Path, "a VAE folder with config.json (or a folder with vae/config.json)",
                                      holds_vae),
                         help="VAE folder (AutoencoderKLHunyuanVideo15, or a pipeline folder with vae/) that "
                              "decodes the samples; default: the encoders folder recorded in the dataset's "
                              "video_dataset_config.json (the VAE that made the latents)")
    nft = parser.add_argument_group("NFT loss")
    nft.add_argument("--advantage_std", choices=ADVANTAGE_STDS, default="global",
                     help="divide the advantages r - mean_group by the std of every reward of the gathered "
                          "[ranks x groups, K] table (global, the DiffusionNFT default) or of the group's own K "
                          "rewards (group) (default %(default)s)")
    nft.add_argument("--beta", type=positive(), default=1.0,
                     help="beta of the positive/negative policies v+- (default %(default)g)")
    nft.add_argument("--adv_clip", type=positive(), default=5.0,
                     help="advantage clip c: r = clip(A / 2c + 1/2, 0, 1) (default %(default)g)")
    nft.add_argument("--kl_weight", type=at_least(float, 0), default=1e-4,
                     help="weight of mse(v_policy, v_reference), the KL term to the reference (default %(default)g)")
    nft.add_argument("--old_decay_schedule", choices=OLD_DECAY_SCHEDULES, default="ramp_slow",
                     help="decay d(u) of old <- d old + (1 - d) policy after the u-th update: zero (on-policy), "
                          "ramp_slow min(0.001u, 0.5), ramp_delayed 0 until u = 75 then min(0.0075(u - 75), 0.999), "
                          "constant --old_decay (default %(default)s)")
    nft.add_argument("--old_decay", default=0.0,
                     type=UNIT_INTERVAL,
                     help="the decay of --old_decay_schedule constant, in [0, 1) (default %(default)g)")
    nft.add_argument("--chunks_per_sample", type=at_least(int, 1), default=2,
                     help="chunks of each sample trained per step, each at its own noise level (default "
                          "%(default)s; the sample's chunk count caps it)")
    nft.add_argument("--monitor_every", type=at_least(int, 1), default=20,
                     help="every N steps (and at step 1 and --max_steps) roll out the policy and the reference from "
                          "the same noise and log their collapse monitors and rewards (default %(default)s)")
    nft.add_argument("--train_sigmas", choices=TRAIN_SIGMAS, default="sampler_grid",
                     help="noise levels of the trained chunks: the sampler's own (the non-zero sigmas of "
                          "--sample_steps at --sample_shift, a random order per sample), or range (--sigma_sampler "
                          "within --sigma_min/--sigma_max) (default %(default)s)")
    nft.add_argument("--allow_sigma_below_teacher", action="store_true",
                     help=f"allow --train_sigmas range with --sigma_min below {DISTILLED_SIGMA_FLOOR:g}, the "
                          "distilled Teacher's lowest trained sigma, for a policy that starts from the Teacher")
    add_sigma_args(parser, sampler="uniform", sigma_min=DISTILLED_SIGMA_FLOOR, sigma_max=1.0, shift=DISTILLED_SHIFT,
                   logit_mean=0.0, logit_std=1.0)
    add_method_model_args(parser, train="lora", init_weights="teacher", lora_rank=64, lora_alpha=64.0,
                          gradient_checkpointing=True, context_grad=True)
    add_method_optimization_args(parser, lr=3e-4, max_steps=1000, warmup_steps=20, grad_accum=1, weight_decay=0.0,
                                 adam_beta1=0.9, adam_beta2=0.999, grad_clip=1.0)
    add_run_args(parser, experiment=METHOD, precision="fp32master", ckpt_every=100, keep_last=5, log_every=10, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-fvtools")
    add_validation_args(parser, val_every=0, val_videos=2)
    args = parse_recipe_args(parser, argv, PRESETS)
    if args.dry_run is None:
        check_nft_args(parser, args)
    check_action_ckpt(parser, args,
                      reads_teacher_weights=not (args.train == "full" and args.init_weights == "scratch"))
    return args


def check_nft_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rules that span flags (each flag's own range is its `type=`); `parser.error` names flag, value, expectation."""
    missing = [f"--{flag}" for flag in ("teacher", "dataset_root") if getattr(args, flag) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} missing (or pass --dry_run CONFIG)")
    check_args(parser, args, dataset_config_name=VIDEO_CONFIG_NAME)
    if RewardScorer(parse_reward_weights(args.rewards)).needs_reference and args.reference_video == "none":
        parser.error(f"--rewards={args.rewards!r} compares with a reference video; --reference_video none has none")
    if args.reference_video == "ground_truth" and (args.ground_truth is None or not args.ground_truth.is_dir()):
        parser.error(f"--reference_video ground_truth: --ground_truth={args.ground_truth}: expected a folder of "
                     "ground-truth videos")
    check_train_sigmas(parser, settings_from_flags(TrainSigmas, args), train=args.train,
                       init_weights=args.init_weights, allow_sigma_below_teacher=args.allow_sigma_below_teacher)
    world_size, _ = launch_world(args.backend)
    if args.train == "full" and world_size > 1:
        parser.error(f"--train full on {world_size} ranks: the old policy and the reference are unsharded copies "
                     "of the model, which this recipe keeps on one process only; use --train lora")


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
    decoded by the VAE in `vae_folder` (main's step 2); the NFT step and the validation. Seams: `load_teacher` (the
    Teacher folder's loader), `draw_chunks` (which chunks of a sample train), `make_rewards` (`(args, vae_folder,
    device) -> rewards`: the decoder and the reward functions), `objective` (each trained chunk's loss)."""
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


def summarize(args: argparse.Namespace, *, start: RunStart, env: DistEnv, policy: PrecisionPolicy,
              dataset: VideoLatentDataset, vae_folder: Path, parts: RecipeParts) -> dict:
    """Step 5: the run's config (train_config.json on rank 0) and the summary block; returns the config."""
    method_model = parts.objects["method_model"]
    config = run_config(
        args, run_name=start.run_name, method=METHOD, world_size=env.world_size, device=str(env.device),
        backend=env.backend, global_batch=env.world_size * args.grad_accum, num_clips=len(dataset),
        num_latents=dataset.num_latents, trainable_parameters=method_model.trainable_parameter_count(),
        vae=str(vae_folder), provenance=parts.derived["provenance"], environment=environment_summary(),
        **start.recorded(),
    )
    if env.is_main:
        write_train_config(start.run_dir, config)
    train_sigmas = describe_train_sigmas(settings_from_flags(TrainSigmas, args),
                                         sampler_sigma_grid(args.sample_steps, args.sample_shift))
    log_summary("DiffusionNFT", {
        **method_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(),
                              trained=method_model.describe(), first_step=parts.run_state.global_step + 1,
                              stop_step=start.stop_step),
        "data": f"{args.dataset_root} (split {args.split}): {len(dataset)} clips of {dataset.num_latents} "
                f"latents",
        "sampling": f"old policy ({args.old_decay_schedule}), {args.samples_per_group} samples per group, "
                    f"{args.sample_steps} steps at shift {args.sample_shift:g}; 1 group per rank x "
                    f"{env.world_size} ranks x {args.grad_accum} accumulation",
        "rewards": f"{args.rewards} (reference: {args.reference_video}; decoded by {vae_folder})",
        "loss": f"nft (beta {args.beta:g}, adv clip {args.adv_clip:g}, advantages / {args.advantage_std} "
                f"std) + {args.kl_weight:g} mse(v, v_ref); {args.chunks_per_sample} chunks per sample, "
                f"sigma {train_sigmas}",
    })
    return config


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


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run is not None:
        print(dry_run_report(args.dry_run, {ROLE: args.train, "reference": "frozen"}, lora_rank=args.lora_rank))
        print("role old policy: frozen, the policy's size again: " + (
            "a second LoRA adapter on the shared base" if args.train == "lora" else
            "a second full copy (FP32, 4 bytes per parameter; one process only)"))
        return 0
    # 1. The run directory, named from the flags; a second launch continues it or finds it finished.
    VideoLatentDataset(args.dataset_root, args.split)  # opened before anything is created (the dry run's check too)
    meta = {**method_meta(METHOD, train=args.train, precision=args.precision, lora_rank=args.lora_rank),
            "samples_per_group": args.samples_per_group, "old_decay_schedule": args.old_decay_schedule,
            "rewards": args.rewards}
    start = plan_run(args, meta=meta, naming=method_run_name)
    if (code := early_exit(args, start)) is not None:
        return code
    with distributed_run(args, start) as env:
        policy = precision_policy(args.precision, env.device)
        # 2. Data: one clip (one group's condition) per rank per micro-batch; the clips scored after training; the
        #    VAE that decodes the samples (by default the one that encoded the dataset).
        dataset = VideoLatentDataset(args.dataset_root, args.split, verify=args.verify_dataset)
        batches = one_item_per_rank_batches(dataset, env, seed=args.seed, num_workers=args.num_workers)
        eval_dataset = VideoLatentDataset(args.dataset_root, args.eval_split) if args.eval_clips else None
        vae_folder = args.vae if args.vae is not None else default_vae_folder(args.dataset_root)
        # 3-4. The policy (LoRA on the Teacher, or every parameter), its old policy and the reference; the rewards;
        #      the step and the validation (see build). Resume restores the role and the data position.
        parts = build(args, env, policy, vae_folder=vae_folder, run_dir=start.run_dir)
        run_state = resume_roles(start, parts.roles, batches, meta, parts.run_state)
        parts.derived["provenance"] = run_provenance(start, env, teacher=args.teacher, action_ckpt=args.action_ckpt,
                                                     parent=None, data_root=args.dataset_root)
        # 5. Config and summary.
        config = summarize(args, start=start, env=env, policy=policy, dataset=dataset, vae_folder=vae_folder,
                           parts=parts)
        # 6. Train; then the policy against the reference from the same noise on held-out clips; then export the
        #    policy (a LoRA file or a Teacher folder).
        run_state = run_training(args, start, env, roles=parts.roles, batches=batches, step_fn=parts.step_fn,
                                 run_state=run_state, config=config, meta=meta, validation=parts.validation)
        if eval_dataset is not None:
            evaluate(args, step_fn=parts.step_fn, eval_dataset=eval_dataset, env=env, run_dir=start.run_dir,
                     step=run_state.global_step)
        exported = export_method_model(parts.objects["method_model"], start.run_dir,
                                       with_provenance({**meta, "step": run_state.global_step}, config), env)
        log0(f"exported the trained {args.train} policy: {exported}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
