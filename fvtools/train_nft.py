"""DiffusionNFT: reinforcement of the AR world model with named reward functions of decoded video (train.md § 4.5).

Roles. The policy trains (a LoRA on the Teacher, `--train lora`, or every parameter of a Teacher-shaped model,
`--train full`, one process only). The old policy samples: a second LoRA adapter (or a frozen copy of the model),
equal to the policy at the start and refreshed after every policy update by `old <- d old + (1 - d) policy`, with d
from `--old_decay_schedule` (`predictor_training.diffusion_nft.old_policy_decay`); it is saved in the checkpoint. The
reference is the frozen start (the Teacher without adapter, or a frozen copy of the initial weights).

One micro-batch = one group. Every rank takes one dataset clip (a (case, action) condition: first frame, cameras,
actions, text) and samples `--samples_per_group` K videos from it with the old policy's own AR rollout
(`--sample_steps` steps at `--sample_shift`, default the distilled 4-step shift-5 schedule), each from its own
noise and memory points drawn from the stream (seed, micro-step, rank, sample): a resume regenerates the same
samples. The samples are decoded (`--vae`, default the VAE that encoded the dataset) and scored by `--rewards
name:weight,...` (`predictor_training/rewards.py`, which also says how to add one); the weighted sum is the reward.
Groups are never split across ranks: every rank's K rewards are all-gathered, the group-normalised advantages
A = (r - mean_group) / (std_group + 1e-4) are computed on the whole [ranks x groups, K] table (identical on every
rank), and the logged reward and advantage statistics are global.

Training pass. For each sample, `--chunks_per_sample` of its chunks are noised, one sigma per chunk (`--sigma_*`),
x_t = (1 - sigma) x0 + sigma n, and the policy, old policy and reference predict the velocity with the sample's
own history as context, exactly as in the AR loop (`predictor_training/teacher_forcing.py`). Loss per chunk:
`nft_loss(v_policy, v_old, x_t, x0, sigma, A; --beta, --adv_clip)` (predictor_training/diffusion_nft.py) +
`--kl_weight * mse(v_policy, v_reference)`, one backward per chunk. Every `--monitor_every` steps (and at step 1
and --max_steps) the current policy and the reference roll out from the same noise: their collapse monitors
(`generation_monitors.collapse_monitors`) and rewards are logged under monitor/. After training the same
comparison runs on `--eval_clips` clips of `--eval_split` (nft_eval.json).

    python fvtools/train_nft.py --teacher /models/worldplay/transformer --dataset_root /data/video_latents \\
        --rewards reference_agreement:1,smoothness:0.1
    bash tools/launch_fvtools_nft.sh                 # 8 GPUs; without GPU and data: the CPU demo
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from predictor_training.adapters import AdapterWeights, adapter, copy_lora
from predictor_training.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.atomic_io import write_json_atomic
from predictor_training.checkpoint import RunState, load_training_state
from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_CONFIG_NAME
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.diffusion_nft import OLD_DECAY_SCHEDULES, OldPolicy, group_advantages, nft_loss, \
    old_policy_decay
from predictor_training.distributed import DistEnv, all_gather_objects, cleanup_distributed, init_distributed, log0, \
    seed_everything
from predictor_training.eval.runtime import VaeDecoder
from predictor_training.flags import (
    add_method_model_args,
    add_method_optimization_args,
    add_run_args,
    add_sigma_args,
    add_tracker_args,
    check_args,
    parse_recipe_args,
)
from predictor_training.flow_matching import add_noise, sample_sigmas
from predictor_training.generation_monitors import collapse_monitors
from predictor_training.logger import MetricsLogger, log_summary, method_summary_rows
from predictor_training.loop import one_item_per_rank_batches, train_loop
from predictor_training.method_model import MethodModel, build_method_model, dry_run_report, export_method_model, \
    method_meta
from predictor_training.precision import precision_policy
from predictor_training.random_streams import ALL_RANKS, stream_generator, stream_seed
from predictor_training.rewards import REFERENCE_KINDS, TOTAL, RewardScorer, VideoRewards, describe_rewards, \
    parse_reward_weights
from predictor_training.run_directory import environment_summary, launch_world, method_run_name, plan_run, \
    report_run_start, run_config, write_train_config
from predictor_training.teacher.source import TeacherSource, describe_teacher
from predictor_training.teacher_forcing import TeacherForcedClip, clip_text_kv, draw_training_chunks

METHOD = "nft"
ROLE = "policy"
OLD_ADAPTER = "old_policy"
# Stream ids after (seed, micro-step, rank): what each draw of a step uses.
NOISE_STREAM, MEMORY_STREAM, TRAIN_STREAM, EVAL_STREAM = 1, 2, 3, 4
EVAL_NAME = "nft_eval.json"

PRESETS = {
    # The CPU demo: a rank-16 LoRA on the shipped world Teacher, 4 samples per group (one group per rank), rewarded
    # for agreeing with the rendered ground truth and for smooth motion; FP32, no tracker.
    "demo": ["--experiment", "nft_demo", "--train", "lora", "--lora_rank", "16", "--lora_alpha", "16",
             "--precision", "fp32", "--lr", "1e-3", "--max_steps", "30", "--warmup_steps", "2",
             "--samples_per_group", "4", "--chunks_per_sample", "2", "--monitor_every", "10",
             "--rewards", "reference_agreement:1,smoothness:10", "--reference_video", "ground_truth",
             "--no-gradient_checkpointing", "--ckpt_every", "10", "--keep_last", "2", "--tracker", "none",
             "--num_workers", "0"],
}


def parse_args(argv=None) -> argparse.Namespace:
    """The nft recipe: every default below is the recipe (train.md § 4.5)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    data.add_argument("--eval_clips", type=int, default=8,
                      help="clips of --eval_split scored after training, 0 = none (default %(default)s)")
    sampling = parser.add_argument_group("sampling (the old policy's AR rollout)")
    sampling.add_argument("--samples_per_group", type=int, default=8,
                          help="K: videos sampled per clip (one group = one condition), >= 2 (default %(default)s)")
    sampling.add_argument("--sample_steps", type=int, default=4,
                          help="denoising steps per chunk of the rollout (default %(default)s: the distilled schedule)")
    sampling.add_argument("--sample_shift", type=float, default=5.0,
                          help="schedule shift of the rollout (default %(default)g)")
    rewards = parser.add_argument_group("rewards (predictor_training/rewards.py)")
    rewards.add_argument("--rewards", type=str, default="reference_agreement:1,smoothness:0.1",
                         help="name:weight,... of registered rewards, summed into the reward (default "
                              f"%(default)s). Registered: {describe_rewards()}")
    rewards.add_argument("--reward_frames", type=int, default=8,
                         help="frames a 'sampled_frames' reward reads, spread evenly (default %(default)s)")
    rewards.add_argument("--reference_video", choices=REFERENCE_KINDS, default="data_latents",
                         help="the reference of the reference rewards: the clip's own latents decoded by --vae "
                              "(data_latents), its rendered ground truth in --ground_truth, or none "
                              "(default %(default)s)")
    rewards.add_argument("--ground_truth", type=Path, default=None,
                         help="folder of ground-truth videos, <clip_id>/ (PNG frames) or <clip_id>.mp4, with the "
                              "decoded videos' frame count and size (--reference_video ground_truth)")
    rewards.add_argument("--vae", type=Path, default=None,
                         help="VAE folder (AutoencoderKLHunyuanVideo15, or a pipeline folder with vae/) that "
                              "decodes the samples; default: the encoders folder recorded in the dataset's "
                              "video_dataset_config.json (the VAE that made the latents)")
    nft = parser.add_argument_group("NFT loss")
    nft.add_argument("--beta", type=float, default=1.0,
                     help="beta of the positive/negative policies v+- (default %(default)g)")
    nft.add_argument("--adv_clip", type=float, default=5.0,
                     help="advantage clip c: r = clip(A / 2c + 1/2, 0, 1) (default %(default)g)")
    nft.add_argument("--kl_weight", type=float, default=1e-4,
                     help="weight of mse(v_policy, v_reference), the KL term to the reference (default %(default)g)")
    nft.add_argument("--old_decay_schedule", choices=OLD_DECAY_SCHEDULES, default="ramp_slow",
                     help="decay d(u) of old <- d old + (1 - d) policy after the u-th update: zero (on-policy), "
                          "ramp_slow min(0.001u, 0.5), ramp_delayed 0 until u = 75 then min(0.0075(u - 75), 0.999), "
                          "constant --old_decay (default %(default)s)")
    nft.add_argument("--old_decay", type=float, default=0.0,
                     help="the decay of --old_decay_schedule constant, in [0, 1) (default %(default)g)")
    nft.add_argument("--chunks_per_sample", type=int, default=2,
                     help="chunks of each sample trained per step, each at its own noise level (default "
                          "%(default)s; the sample's chunk count caps it)")
    nft.add_argument("--monitor_every", type=int, default=20,
                     help="every N steps (and at step 1 and --max_steps) roll out the policy and the reference from "
                          "the same noise and log their collapse monitors and rewards (default %(default)s)")
    add_sigma_args(parser, sampler="uniform", sigma_min=0.2, sigma_max=1.0, shift=5.0, logit_mean=0.0, logit_std=1.0)
    add_method_model_args(parser, train="lora", init_weights="teacher", lora_rank=64, lora_alpha=64.0,
                          gradient_checkpointing=True, context_grad=True)
    add_method_optimization_args(parser, lr=3e-4, max_steps=1000, warmup_steps=20, grad_accum=1, weight_decay=0.0,
                                 adam_beta1=0.9, adam_beta2=0.999, grad_clip=1.0)
    add_run_args(parser, experiment=METHOD, precision="fp32master", ckpt_every=100, keep_last=5, log_every=1, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-fvtools")
    args = parse_recipe_args(parser, argv, PRESETS)
    if args.dry_run is not None:
        return args
    missing = [f"--{flag}" for flag in ("teacher", "dataset_root") if getattr(args, flag) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} missing (or pass --dry_run CONFIG)")
    check_args(parser, args, dataset_config_name=VIDEO_CONFIG_NAME)
    # Rules only this recipe has.
    if args.samples_per_group < 2:
        parser.error(f"--samples_per_group={args.samples_per_group}: expected >= 2 (advantages compare the samples "
                     "of one group)")
    if args.eval_clips < 0:
        parser.error(f"--eval_clips={args.eval_clips}: expected >= 0")
    for flag in ("sample_steps", "reward_frames", "chunks_per_sample", "monitor_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag}={getattr(args, flag)}: expected >= 1")
    for flag in ("sample_shift", "beta", "adv_clip"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag}={getattr(args, flag)}: expected > 0")
    if not args.kl_weight >= 0:
        parser.error(f"--kl_weight={args.kl_weight}: expected >= 0")
    if not 0 <= args.old_decay < 1:
        parser.error(f"--old_decay={args.old_decay}: expected in [0, 1)")
    try:
        weights = parse_reward_weights(args.rewards)
    except ValueError as error:
        parser.error(f"--rewards={args.rewards!r}: {error}")
    if RewardScorer(weights).needs_reference and args.reference_video == "none":
        parser.error(f"--rewards={args.rewards!r} compares with a reference video; --reference_video none has none")
    if args.reference_video == "ground_truth" and (args.ground_truth is None or not args.ground_truth.is_dir()):
        parser.error(f"--reference_video ground_truth: --ground_truth={args.ground_truth}: expected a folder of "
                     "ground-truth videos")
    if args.vae is not None and not ((args.vae / "config.json").is_file() or (args.vae / "vae/config.json").is_file()):
        parser.error(f"--vae={args.vae}: expected a VAE folder with config.json (or a folder with vae/config.json)")
    world_size, _ = launch_world(args.backend)
    if args.train == "full" and world_size > 1:
        parser.error(f"--train full on {world_size} ranks: the old policy and the reference are unsharded copies "
                     "of the model, which this recipe keeps on one process only; use --train lora")
    return args


def default_vae_folder(dataset_root: Path) -> Path:
    """The encoders folder a video-latent dataset records (its VAE made the latents)."""
    config_path = dataset_root / VIDEO_CONFIG_NAME
    folder = Path(json.loads(config_path.read_text(encoding="utf-8"))["encoders"]["folder"])
    if not ((folder / "config.json").is_file() or (folder / "vae" / "config.json").is_file()):
        raise FileNotFoundError(f"{config_path} records the encoders folder {folder}, which holds no VAE; pass --vae")
    return folder


class PolicyModels:
    """The policy, the old policy and the reference on one method model.

    lora: one frozen base with the adapters "policy" (trained) and "old_policy" (frozen, a copy of the policy's
    start); the reference is the base with no adapter. full: the trained model plus two frozen copies of its
    initial weights (old policy, reference). `running(name)` yields the model to call for "policy", "old" or
    "reference" (switching the adapter for its duration in lora mode)."""

    def __init__(self, method_model: MethodModel):
        self.method_model = method_model
        model = method_model.model
        if method_model.mode == "lora":
            copy_lora(model, method_model.adapter, OLD_ADAPTER, trainable=False)
            self.old_module = AdapterWeights(model, OLD_ADAPTER)
            self.modules = {"policy": model, "old": model, "reference": model}
            self.adapters = {"policy": method_model.adapter, "old": OLD_ADAPTER, "reference": None}
        else:
            old, reference = (copy.deepcopy(model).requires_grad_(False) for _ in range(2))
            self.old_module = old
            self.modules = {"policy": model, "old": old, "reference": reference}
            self.adapters = None

    @contextlib.contextmanager
    def running(self, name: str):
        model = self.modules[name]
        if self.adapters is None:
            yield model
        else:
            with adapter(model, self.adapters[name]):
                yield model


def gathered(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """values [...] of every rank stacked in rank order -> [world, ...] (all_gather; [1, ...] on one process)."""
    if not env.distributed:
        return values[None]
    local = values.to(env.device)
    parts = [torch.empty_like(local) for _ in range(env.world_size)]
    dist.all_gather(parts, local)
    return torch.stack(parts).cpu()


class NftStep:
    """`step_fn` of the loop: sample a group with the old policy, score it, train the policy on it.

    Draws: the samples' noise and memory points from (seed, micro-step, rank, stream, sample); the training chunks'
    noise and sigmas from (seed, micro-step, rank, TRAIN_STREAM); whether chunk 0 is trained from (seed,
    micro-step, ALL_RANKS)."""

    def __init__(self, models: PolicyModels, rewards: VideoRewards, args, env: DistEnv, run_state: RunState,
                 autocast_dtype):
        self.models = models
        self.rewards = rewards
        self.args = args
        self.env = env
        self.run_state = run_state
        self.sample_config = RolloutConfig(num_steps=args.sample_steps, shift=args.sample_shift,
                                           state_dtype=torch.float32, autocast_dtype=autocast_dtype)
        self.clip_config = RolloutConfig(state_dtype=torch.float32, autocast_dtype=autocast_dtype)

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
        advantages_all = group_advantages(table[:, names.index(TOTAL)].double()).float()  # [world, K]
        advantages = advantages_all[self.env.rank]
        metrics = {}
        for index, name in enumerate(names):
            metrics[f"reward/{name}/mean"] = float(table[:, index].mean())
            metrics[f"reward/{name}/std"] = float(table[:, index].std(unbiased=False))
        flat_groups = (table[:, names.index(TOTAL)].std(dim=1, unbiased=False) == 0).float().mean()
        metrics.update({"advantage/abs_mean": float(advantages_all.abs().mean()),
                        "advantage/abs_max": float(advantages_all.abs().max()),
                        "advantage/std": float(advantages_all.std(unbiased=False)),
                        "advantage/flat_groups": float(flat_groups),
                        "old_policy/decay": old_policy_decay(args.old_decay_schedule,
                                                             self.run_state.global_step + 1, args.old_decay),
                        "samples/checksum": float(samples.double().sum())})
        # 2. The training pass: chunks of each sample noised at one sigma each, three velocities, one backward each.
        metrics.update(self.train_on(item, samples, advantages))
        # 3. Monitors: the current policy against the reference from sample 0's noise.
        if step == 1 or step % args.monitor_every == 0 or step == args.max_steps:
            policy_video, reference_video = self.sample(item, "policy", range(1)), self.sample(item, "reference",
                                                                                               range(1))
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
            chunks = draw_training_chunks(clips["policy"].num_chunks, args.chunks_per_sample, generator, shared)
            sigmas = sample_sigmas(args.sigma_sampler, len(chunks), generator, sigma_min=args.sigma_min,
                                   sigma_max=args.sigma_max, shift=args.sigma_shift, logit_mean=args.logit_mean,
                                   logit_std=args.logit_std)
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
                    nft = nft_loss(v_policy, v_old, noisy, x0, torch.tensor([sigma], device=device),
                                   advantages[index:index + 1].to(device), beta=args.beta, clip=args.adv_clip)
                    kl = torch.mean((v_policy - v_reference) ** 2)
                    ((nft + args.kl_weight * kl) / (samples.shape[0] * len(chunks))).backward()
                nft_terms.append(nft.item())
                kl_terms.append(kl.item())
                sigmas_seen.append(sigma)
        nft_mean, kl_mean = sum(nft_terms) / len(nft_terms), sum(kl_terms) / len(kl_terms)
        return {"loss": nft_mean + args.kl_weight * kl_mean, "loss/nft": nft_mean, "kl": kl_mean,
                "sigma/mean": sum(sigmas_seen) / len(sigmas_seen)}


@torch.no_grad()
def evaluate_against_reference(step_fn: NftStep, dataset: VideoLatentDataset, count: int, env: DistEnv) -> dict:
    """The policy and the reference each roll out once from the same noise (stream (seed, EVAL_STREAM, clip)) on
    the first `count` clips of `dataset`, split over the ranks (the LoRA/one-process models run no collectives):
    every reward's mean for both, and the collapse monitors of the policy's latents against the reference's."""
    mine = range(env.rank, min(count, len(dataset)), env.world_size)
    rows = []
    for index in mine:
        item = dataset[index]
        counters = (step_fn.args.seed, EVAL_STREAM, index)
        pair = torch.cat([step_fn.sample(item, role, range(1), counters) for role in ("policy", "reference")])
        scores = step_fn.rewards(pair, item)
        rows.append({"clip_id": item["clip_id"], "latents": pair,
                     "rewards": {name: [float(value) for value in values] for name, values in scores.items()}})
    rows = [row for part in all_gather_objects(rows) for row in part]
    names = list(rows[0]["rewards"])
    report = {"clips": [row["clip_id"] for row in rows], "reward_policy": {}, "reward_reference": {}}
    for name in names:
        report["reward_policy"][name] = sum(row["rewards"][name][0] for row in rows) / len(rows)
        report["reward_reference"][name] = sum(row["rewards"][name][1] for row in rows) / len(rows)
    policy_latents = torch.cat([row["latents"][:1] for row in rows])
    reference_latents = torch.cat([row["latents"][1:] for row in rows])
    report["monitors"] = collapse_monitors(policy_latents, reference_latents)
    report["policy_wins"] = sum(row["rewards"][TOTAL][0] > row["rewards"][TOTAL][1] for row in rows)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run is not None:
        print(dry_run_report(args.dry_run, {ROLE: args.train, "reference": "frozen"}, lora_rank=args.lora_rank))
        print("role old policy: frozen, the policy's size again: " + (
            "a second LoRA adapter on the shared base" if args.train == "lora" else
            "a second full copy (FP32, 4 bytes per parameter; one process only)"))
        return 0
    # 1. The run directory, named from the flags; a second launch continues it or finds it finished.
    start = plan_run(args, naming=method_run_name)
    if args.print_run_dir:
        return report_run_start(start)
    if start.kind == "finished":
        log0(start.describe())
        return 0
    env = init_distributed(args.backend)
    try:
        if env.is_main:
            start.run_dir.mkdir(parents=True, exist_ok=True)
        log0(start.describe())
        seed_everything(args.seed, rank=env.rank)
        policy = precision_policy(args.precision, env.device)

        # 2. Data: one clip (one group's condition) per rank per micro-batch; the clips scored after training.
        dataset = VideoLatentDataset(args.dataset_root, args.split, verify=args.verify_dataset)
        batches = one_item_per_rank_batches(dataset, env, seed=args.seed, num_workers=args.num_workers)
        eval_dataset = VideoLatentDataset(args.dataset_root, args.eval_split) if args.eval_clips else None

        # 3. The policy (LoRA on the Teacher, or every parameter), its old policy (the role's EMA slot) and the
        #    reference.
        source = TeacherSource(args.teacher, args.action_ckpt, "--teacher", None)
        method_model = build_method_model(source, args, env, policy, role_name=ROLE)
        log0(describe_teacher(source, method_model.model))
        models = PolicyModels(method_model)
        method_model.role.ema = OldPolicy(models.old_module, args.old_decay_schedule, args.old_decay)

        # 4. Rewards: the decoder, the scorer, the reference videos.
        vae_folder = args.vae if args.vae is not None else default_vae_folder(args.dataset_root)
        decoder = VaeDecoder.from_folder(vae_folder, env.device, torch.float32, tiling=False)
        scorer = RewardScorer(parse_reward_weights(args.rewards), sampled_frames=args.reward_frames)
        rewards = VideoRewards(scorer, decoder, args.reference_video, args.ground_truth)

        meta = {**method_meta(METHOD, args), "samples_per_group": args.samples_per_group,
                "old_decay_schedule": args.old_decay_schedule, "rewards": args.rewards}
        run_state = RunState()
        if start.resume_path is not None:
            run_state = load_training_state(start.resume_path, roles=[method_model.role], expect=meta)
            batches.load_state_dict(run_state.data)

        # 5. Config and summary.
        config = run_config(
            args, run_name=start.run_name, method=METHOD, world_size=env.world_size, device=str(env.device),
            backend=env.backend, global_batch=env.world_size * args.grad_accum, num_clips=len(dataset),
            num_latents=dataset.num_latents, trainable_parameters=method_model.trainable_parameter_count(),
            vae=str(vae_folder), environment=environment_summary(),
        )
        if env.is_main:
            write_train_config(start.run_dir, config)
        log_summary("DiffusionNFT", {
            **method_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(),
                                  trained=method_model.describe(), first_step=run_state.global_step + 1,
                                  stop_step=start.stop_step),
            "data": f"{args.dataset_root} (split {args.split}): {len(dataset)} clips of {dataset.num_latents} "
                    f"latents",
            "sampling": f"old policy ({args.old_decay_schedule}), {args.samples_per_group} samples per group, "
                        f"{args.sample_steps} steps at shift {args.sample_shift:g}; 1 group per rank x "
                        f"{env.world_size} ranks x {args.grad_accum} accumulation",
            "rewards": f"{args.rewards} (reference: {args.reference_video}; decoded by {vae_folder})",
            "loss": f"nft (beta {args.beta:g}, adv clip {args.adv_clip:g}) + {args.kl_weight:g} mse(v, v_ref); "
                    f"{args.chunks_per_sample} chunks per sample, sigma {args.sigma_sampler} in "
                    f"[{args.sigma_min}, {args.sigma_max}]",
        })

        # 6. Train, then export the policy (a LoRA file or a Teacher folder).
        step_fn = NftStep(models, rewards, args, env, run_state, policy.autocast_dtype)
        with MetricsLogger(start.run_dir, env, tracker=args.tracker, project=args.swanlab_project,
                           experiment=args.experiment_name or start.run_name, config=config,
                           swanlab_mode=args.swanlab_mode) as metrics_logger:
            run_state = train_loop(
                roles=[method_model.role], batches=batches, step_fn=step_fn, run_dir=start.run_dir, env=env,
                run_state=run_state, max_steps=args.max_steps, stop_at_step=start.stop_step,
                grad_accum=args.grad_accum, ckpt_every=args.ckpt_every, keep_last=args.keep_last,
                log_every=args.log_every, metrics_logger=metrics_logger, config=config, meta=meta,
                progress=not args.no_progress,
            )
        if eval_dataset is not None:
            report = {**evaluate_against_reference(step_fn, eval_dataset, args.eval_clips, env),
                      "split": args.eval_split, "step": run_state.global_step}
            if env.is_main:
                write_json_atomic(start.run_dir / EVAL_NAME, report)
            policy_total, reference_total = report["reward_policy"][TOTAL], report["reward_reference"][TOTAL]
            log0(f"policy vs reference on {len(report['clips'])} {args.eval_split} clips (same noise): reward "
                 f"{policy_total:.5g} vs {reference_total:.5g}, policy higher on {report['policy_wins']}; "
                 f"std ratio {report['monitors']['monitor/std_ratio']:.4f}, temporal ratio "
                 f"{report['monitors']['monitor/temporal_ratio']:.4f} ({start.run_dir / EVAL_NAME})")
        exported = export_method_model(method_model, start.run_dir, {**meta, "step": run_state.global_step}, env)
        log0(f"exported the trained {args.train} policy: {exported}")
        return 0
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
