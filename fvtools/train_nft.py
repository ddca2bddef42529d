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

from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.data.provenance import run_provenance
from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_CONFIG_NAME, VideoLatentDataset
from predictor_training.methods.method_model import dry_run_report, export_method_model, method_meta
from predictor_training.methods.nft import ADVANTAGE_STDS, OLD_DECAY_SCHEDULES, TRAIN_SIGMAS, TrainSigmas, \
    check_train_sigmas, describe_train_sigmas, sampler_sigma_grid
from predictor_training.methods.rewards import REFERENCE_KINDS, RewardScorer, default_vae_folder, describe_rewards, \
    holds_vae, parse_reward_weights
from predictor_training.recipes.flags import (
    add_method_model_args, add_method_optimization_args, add_sigma_args, add_validation_args, check_action_ckpt,
)
from predictor_training.recipes.nft import METHOD, ROLE, build, evaluate
from predictor_training.rollout.scheduler import DISTILLED_SIGMA_FLOOR
from predictor_training.runtime.distributed import log0
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import (
    UNIT_INTERVAL, add_run_args, add_tracker_args, at_least, check_args, checked, parse_recipe_args, positive,
    settings_from_flags,
)
from predictor_training.runtime.launch import Launch, Recipe, RunPlan, run_recipe
from predictor_training.runtime.logger import log_summary, method_summary_rows
from predictor_training.runtime.provenance import with_provenance
from predictor_training.runtime.recipe import RecipeData, RecipeParts
from predictor_training.runtime.run_directory import environment_summary, launch_world, method_run_name, \
    run_config, write_train_config
from predictor_training.teacher.config import DISTILLED_SHIFT

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


def check_inputs(args: argparse.Namespace) -> RunPlan:
    """1. The clips, opened before anything is created (the launcher's dry run too); the run is named from the
    flags; its checkpoints record the group size, the old policy's decay and the rewards too."""
    VideoLatentDataset(args.dataset_root, args.split)
    return RunPlan(meta={**method_meta(METHOD, train=args.train, precision=args.precision, lora_rank=args.lora_rank),
                         "samples_per_group": args.samples_per_group, "old_decay_schedule": args.old_decay_schedule,
                         "rewards": args.rewards},
                   naming=method_run_name)


def load_data(launch: Launch) -> RecipeData:
    """2. Data: one clip (one group's condition) per rank per micro-batch; the clips scored after training; the
    VAE that decodes the samples (by default the one that encoded the dataset)."""
    args = launch.args
    dataset = VideoLatentDataset(args.dataset_root, args.split, verify=args.verify_dataset)
    return RecipeData(
        batches=one_item_per_rank_batches(dataset, launch.env, seed=args.seed, num_workers=args.num_workers),
        dataset=dataset,
        values={"eval_dataset": VideoLatentDataset(args.dataset_root, args.eval_split) if args.eval_clips else None,
                "vae_folder": args.vae if args.vae is not None else default_vae_folder(args.dataset_root)})


def build_run(launch: Launch) -> RecipeParts:
    """3-4. The policy (LoRA on the Teacher, or every parameter), its old policy and the reference; the rewards;
    the step and the validation (see build); the run's provenance. Resume then restores the role and the data
    position."""
    args, start = launch.args, launch.start
    parts = build(args, launch.env, launch.policy, vae_folder=launch.data.values["vae_folder"], run_dir=start.run_dir)
    parts.derived["provenance"] = run_provenance(start, launch.env, teacher=args.teacher,
                                                 action_ckpt=args.action_ckpt, parent=None,
                                                 data_root=args.dataset_root)
    return parts


def summarize(launch: Launch) -> dict:
    """5. The run's config (train_config.json on rank 0) and the summary block; returns the config."""
    args, start, env, policy, dataset, parts = (launch.args, launch.start, launch.env, launch.policy,
                                                launch.data.dataset, launch.parts)
    vae_folder = launch.data.values["vae_folder"]
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


def evaluate_and_export(launch: Launch) -> None:
    """After the loop: the policy against the reference from the same noise on held-out clips (--eval_clips), then
    the policy exported (a LoRA file or a Teacher folder)."""
    args, parts, step = launch.args, launch.parts, launch.run_state.global_step
    if launch.data.values["eval_dataset"] is not None:
        evaluate(args, step_fn=parts.step_fn, eval_dataset=launch.data.values["eval_dataset"], env=launch.env,
                 run_dir=launch.start.run_dir, step=step)
    exported = export_method_model(parts.objects["method_model"], launch.start.run_dir,
                                   with_provenance({**launch.plan.meta, "step": step}, launch.config), launch.env)
    log0(f"exported the trained {args.train} policy: {exported}")


@command
def main(argv=None) -> int:
    """--dry_run prints the parameter counts; otherwise the recipe's steps in order, the shared loop between
    summarize and the evaluation (`runtime/launch.run_recipe`)."""
    args = parse_args(argv)
    if args.dry_run is not None:
        print(dry_run_report(args.dry_run, {ROLE: args.train, "reference": "frozen"}, lora_rank=args.lora_rank))
        print("role old policy: frozen, the policy's size again: " + (
            "a second LoRA adapter on the shared base" if args.train == "lora" else
            "a second full copy (FP32, 4 bytes per parameter; one process only)"))
        return 0
    return run_recipe(args, Recipe(plan=check_inputs, data=load_data, build=build_run, summarize=summarize,
                                   after=evaluate_and_export))


if __name__ == "__main__":
    sys.exit(main())
