"""DMD2 distribution matching, with Self-Forcing rollouts, for an AR few-step generator (docs/methods/dmd2.md).

Roles. The *generator* (trained every `--generator_every` loop steps) makes one clip's chunks; the *fake score*
(a critic, trained every step) learns the distribution of those chunks by flow matching; the *real score* (frozen)
is a flow-matching model of the data. Generators (`--generator`):

    predictor  the F-P-P-P composite the user runs: per chunk a Teacher step 0, then the v4 Predictor's steps
               (`--replace_steps`); chunk 0 is the Teacher's F-F-F-F. Starts from a trained Predictor (`--init_from`,
               e.g. the rollout recipe's training_latest.pt); graph through the Predictor steps (self_rollout.py).
    student    a few-step AR student (`--student_steps` at `--student_shift`): a LoRA on the Teacher or every
               parameter of a Teacher-shaped model (`--train`); its sample of a chunk is its x0 estimate
               `x - sigma v` at an exit step drawn per chunk (`--exit_step`), the steps before it without a graph.

Rollout (`--rollout`): `self` (Self-Forcing) generates every chunk on the generator's own, detached history; the
scores see that same history as context. `data` (teacher forcing) gives the generator and the scores the clip's
data latents as history. Either way the scores see the generator's chunk x̂ as the chunk's clean latents, noised at
a sigma drawn inside [--score_sigma_min, --score_sigma_max] (resampled, never clamped), with the chunk's camera,
action and text and the history's context, exactly as the AR loop builds them (methods/score_models.py).

Per chunk, from ONE generator sample x̂ (FastVideo draws a second rollout for the critic; we do not):

    critic        L_fake = mean((v_fake(x_s') - (n' - sg(x̂)))^2)                       every step
    generator     g = (x0_fake - x0_real) / mean|x̂ - x0_real|;  L_G = 0.5 mse(x̂, sg(x̂ - g))   when due
                  + --anchor_weight x the regression anchor to the Teacher (predictor: the composite's own
                  velocity_weight mse_v + hidden_weight mse_h against the Teacher's steps; student: mse of its x0
                  estimate against the Teacher's at the same state)
                  + --truth_weight x mse(x̂, the clip's own latents of the chunk)

The Predictor's sample is its chunk's final latent with the graph of its Predictor steps; when the schedule ends
on Full steps (F-P-P-F) those Teacher steps are re-run with a graph to their input latent (chunk_generators.py), so
the DMD gradient reaches the Predictor through the frozen Teacher. The generator keeps an EMA of its weights
(`--ema_decay` 0.99 from `--ema_start_step` 200, as Self-Forcing), written next to its raw weights at the run's end.

one backward per chunk; noise and sigmas per rank, control flow (exit steps, which chunks) alike on every rank,
all from counter-based streams, so a resumed run repeats the uninterrupted one. Every `--monitor_every` steps the
Teacher's F-F-F-F rollout of the same noise is compared with the generated chunks (collapse monitors: std and
temporal-delta energy ratios, whole clip and per chunk). Held-out validation (`--val_every N`, off by default; the
demo every 30 steps): the generator's rollout (the composite through the eval's own step hook, or the student's own
rollout) of the first `--val_videos` clips of `--val_split` against the clip's decoded latents (val/*_vs_truth) and
the Teacher's F-F-F-F of the same noise (val/*_vs_teacher), with the collapse monitors as val/monitor/*.

Real score (`--real_score`): a df_sft run's exported model folder (or the run folder), or a LoRA file on
--teacher. `--real_score teacher` (the raw distilled Teacher, which was trained only at sigma in [0.625, 1]) needs
`--allow_raw_teacher_score` and --score_sigma_min >= 0.625. The fake score starts as a copy of the real score: a
LoRA adapter (`--fake_score_train lora`) or every parameter of a copy (`full`, tiny models only: not sharded). The
models and roles are built in predictor_training/methods/dmd2_models.py, the losses in methods/dmd2.py.

    python fvtools/train_dmd2.py --teacher TEACHER --dataset_root VIDEO_LATENTS --real_score DF_SFT_RUN/model \\
        --init_from ROLLOUT_RUN/training_latest.pt
    python fvtools/train_dmd2.py --dry_run worldplay_480p_i2v      # parameter counts at real size, no memory
    bash tools/launch_fvtools_dmd2.sh        # 8 GPUs; without GPU and data: the CPU demo
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from predictor_training.data.batches import one_item_per_rank_batches
from predictor_training.data.provenance import run_provenance
from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_CONFIG_NAME
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.eval.validation import resolve_video_val_inputs
from predictor_training.methods.dmd2_models import (FAKE, PREDICTOR_VARIANT, REAL, export_generator_ema,
                                                   resolve_real_score_flags)
from predictor_training.methods.flow_matching import SIGMA_SAMPLERS
from predictor_training.methods.method_model import dry_run_report, export_method_model
from predictor_training.recipes.dmd2 import METHOD, build
from predictor_training.recipes.flags import add_plan_args, check_plan
from predictor_training.recipes.flags import (
    add_loss_args, add_method_model_args, add_method_optimization_args, add_validation_args, check_action_ckpt,
    parse_source_blocks,
)
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.schedule import StepPlan
from predictor_training.rollout.scheduler import DISTILLED_SIGMA_FLOOR
from predictor_training.runtime.checkpoint import checkpoint_meta
from predictor_training.runtime.distributed import log0
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import (
    CLIP_OR_OFF, UNIT_INTERVAL, add_run_args, add_tracker_args, at_least, check_args, checked, parse_recipe_args,
    positive,
)
from predictor_training.runtime.launch import Launch, Recipe, RunPlan, run_recipe
from predictor_training.runtime.logger import log_summary
from predictor_training.runtime.provenance import with_provenance
from predictor_training.runtime.recipe import RecipeData, RecipeParts
from predictor_training.runtime.run_directory import (device_tag, environment_summary, format_lr, recorded_init_meta, run_config, write_train_config)
from predictor_training.teacher.config import DISTILLED_SHIFT

PRESETS = {
    # The CPU demo on the demo world: DMD2 on the F-P-P-P composite (blocks 1,10 of the 12-block world Teacher,
    # from the rollout demo's Predictor) with its anchor; the launcher passes the world Teacher as real score (a df_sft
    # model of the renders), fake score = a full copy of it; FP32, no tracker.
    # --no_action_ckpt: the demo world's Teacher (and a df_sft model/ export) holds its action weights.
    "demo": ["--experiment", "dmd2_demo", "--generator", "predictor", "--rollout", "self", "--source_blocks", "1,10",
             "--precision", "fp32", "--max_steps", "60", "--warmup_steps", "4", "--generator_every", "2",
             "--fusion_lr", "1e-4", "--blocks_lr", "1e-5", "--block_warmup_steps", "-1", "--fake_score_train", "full",
             "--fake_score_lr", "1e-4", "--monitor_every", "10", "--no-gradient_checkpointing", "--ckpt_every", "20",
             "--keep_last", "2", "--tracker", "none", "--num_workers", "0", "--val_every", "30",
             "--val_videos", "1", "--no_action_ckpt"],
    # The recipe at the size the memory rehearsal plans for (tools/estimate_memory.py): its defaults.
    "real_size": ["--generator", "predictor", "--source_blocks", "1,52", "--precision", "fp32master",
                  "--gradient_checkpointing"],
}


def parse_args(argv=None) -> argparse.Namespace:
    """The dmd2 recipe: every default below is the recipe (docs/methods/dmd2.md)."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = parser.add_argument_group("data")
    data.add_argument("--dataset_root", type=Path, default=None,
                      help="video-latent dataset (tools/build_video_latent_dataset.py: video_dataset_config.json): "
                           "the clips' conditioning, and their latents as history with --rollout data; required")
    data.add_argument("--split", type=str, default="train", help="manifest split to train on (default %(default)s)")
    data.add_argument("--chunks_per_clip", type=at_least(int, 1), default=4,
                      help="--generator student --rollout data: chunks of each clip trained per micro-batch "
                           "(default %(default)s; the self rollout and the Predictor composite run every chunk)")
    data.add_argument("--num_workers", type=int, default=2,
                      help="DataLoader worker processes per rank, 0 = main process (default %(default)s)")
    data.add_argument("--verify_dataset", action="store_true",
                      help="check size and sha256 of every dataset file before training")
    gen = parser.add_argument_group("generator")
    gen.add_argument("--generator", choices=("predictor", "student"), default="predictor",
                     help="predictor: the F-P-P-P composite (Teacher step 0 + the v4 Predictor's steps); student: a "
                          "few-step AR student, a LoRA on the Teacher or a full model (--train) (default %(default)s)")
    gen.add_argument("--rollout", choices=("self", "data"), default="self",
                     help="self: Self-Forcing, every chunk on the generator's own detached history (also the "
                          "scores' context); data: teacher forcing, the clip's data latents as history "
                          "(default %(default)s)")
    gen.add_argument("--generator_every", type=at_least(int, 1), default=5,
                     help="update the generator every N loop steps (the fake score every step); when not due, its "
                          "rollout runs without a graph and only the critic trains (default %(default)s)")
    gen.add_argument("--anchor_weight", type=at_least(float, 0), default=None,
                     help="weight of the regression anchor to the Teacher added to the generator loss (default: 1 "
                          "for --generator predictor, its composite's own Predictor-vs-Teacher loss; 0 for student, "
                          "where it is the mse of the student's x0 estimate against the Teacher's)")
    gen.add_argument("--truth_weight", type=at_least(float, 0), default=0.0,
                     help="weight of the mse of each generated chunk against the clip's own latents (the data's "
                          "truth, e.g. the rendered frames of the demo world) added to the generator loss: keeps "
                          "the conditional mean that distribution matching alone gives up (default %(default)g)")
    gen.add_argument("--init_from", type=Path, default=None,
                     help="--generator predictor: Predictor weights to start from (a v4 training_latest.pt, e.g. the "
                          "rollout recipe's, or a predictor_step_XXXXX.safetensors); required for a fresh run")
    gen.add_argument("--source_blocks", type=parse_source_blocks, default=parse_source_blocks("1,52"),
                     help="--generator predictor: the Predictor's two source blocks (default 1,52; must match "
                          "--init_from)")
    add_plan_args(parser, group=gen, reuse=False,
                  note=" (--generator predictor; the chunk's sample is its final latent, what the "
                  "user sees)")
    gen.add_argument("--fusion_lr", type=float, default=1e-5,
                     help="--generator predictor: peak LR of its fusion + head group (default %(default)g)")
    gen.add_argument("--blocks_lr", type=float, default=1e-6,
                     help="--generator predictor: peak LR of its two blocks (default %(default)g)")
    gen.add_argument("--block_warmup_steps", type=int, default=-1,
                     help="--generator predictor: generator updates with the blocks held at LR 0; -1 = none "
                          "(default %(default)s)")
    gen.add_argument("--student_steps", type=at_least(int, 1), default=4,
                     help="--generator student: denoising steps per chunk (default %(default)s)")
    gen.add_argument("--student_shift", type=positive(), default=DISTILLED_SHIFT,
                     help="--generator student: schedule shift (default %(default)g: the distilled 4-step one)")
    gen.add_argument("--exit_step", choices=("uniform", "last"), default="uniform",
                     help="--generator student: the step whose x0 estimate is the chunk's sample, drawn per chunk "
                          "alike on every rank: uniform over the steps, or the last (default %(default)s)")
    gen.add_argument("--student_sampler", choices=("euler", "renoise"), default="euler",
                     help="--generator student: how its training rollout moves between the steps before the exit "
                          "step: euler (along the velocity, the sampler it runs at inference) or renoise "
                          "(Self-Forcing's: the x0 estimate noised again to the next sigma with fresh noise from the "
                          "step's stream); inference and validation always run Euler steps (default %(default)s)")
    gen.add_argument("--recompute_context", action=argparse.BooleanOptionalAction, default=True,
                     help="release the generator chunk's no-grad context K/V once its sample is made and prefill "
                          "them again where its backward needs them (the same values; at the real config ~25 GiB of "
                          "a 20-frame context not held through the critic): the student without --context_grad "
                          "(one more context prefill per generator chunk); the predictor the layers it does not read "
                          "(an F-P-P-F trailing Full step's context prefilled again) (default %(default)s)")
    gen.add_argument("--ema_decay", default=0.99,
                     type=checked(float, "in [0, 1), or -1", lambda value: value == -1 or 0 <= value < 1),
                     help="EMA of the generator's trained weights (Self-Forcing's generator EMA): ema <- decay ema + "
                          "(1 - decay) param after each generator update, exported next to the raw weights "
                          "(predictor_ema_step_XXXXX.safetensors, or ema/ for a student); -1 = none "
                          "(default %(default)g)")
    gen.add_argument("--ema_start_step", type=at_least(int, 0), default=200,
                     help="loop steps before the EMA starts averaging (before, it copies the weights; counted in "
                          "generator updates as ema_start_step // generator_every) (default %(default)s)")
    add_loss_args(parser, velocity_weight=1.0, hidden_weight=0.1)  # the predictor's anchor
    scores = parser.add_argument_group("scores")
    scores.add_argument("--real_score", type=str, default=None,
                        help="frozen real score: a df_sft run's exported model folder (config.json), a df_sft run "
                             "folder (its model/ or its one lora_*.safetensors), a LoRA file on --teacher, or "
                             "'teacher' (the raw distilled Teacher: needs --allow_raw_teacher_score); required")
    scores.add_argument("--allow_raw_teacher_score", action="store_true",
                        help="allow --real_score teacher; its x - sigma v is a sample-like jump, not a posterior "
                             f"mean, and it is untrained below sigma {DISTILLED_SIGMA_FLOOR}")
    scores.add_argument("--fake_score_train", choices=("lora", "full"), default="lora",
                        help="fake score: a LoRA adapter (--lora_rank/--lora_alpha; from the real score's adapter "
                             "when that is a LoRA) on the real score's frozen base, or a full copy of the real score "
                             "(small models only: replicated, not sharded) (default %(default)s)")
    scores.add_argument("--fake_score_lr", type=positive(), default=1e-5,
                        help="fake score peak LR (default %(default)g)")
    scores.add_argument("--fake_score_adam_beta1", type=UNIT_INTERVAL, default=0.0,
                        help="fake score AdamW beta1 (default %(default)g, as DMD2)")
    scores.add_argument("--fake_score_adam_beta2", type=UNIT_INTERVAL, default=0.999,
                        help="fake score AdamW beta2 (default %(default)g)")
    scores.add_argument("--fake_score_grad_clip", type=CLIP_OR_OFF, default=1.0,
                        help="fake score gradient-norm clip, -1 = measure only (default %(default)g)")
    scores.add_argument("--score_sigma_sampler", choices=SIGMA_SAMPLERS, default="shifted",
                        help="distribution of the scores' and the critic's noise levels, drawn inside the bounds "
                             "(default %(default)s)")
    scores.add_argument("--score_sigma_min", type=float, default=0.02, help="lowest score sigma (default %(default)g)")
    scores.add_argument("--score_sigma_max", type=float, default=0.98, help="highest score sigma (default %(default)g)")
    scores.add_argument("--score_sigma_shift", type=positive(), default=DISTILLED_SHIFT,
                        help="shift of --score_sigma_sampler shifted (default %(default)g)")
    scores.add_argument("--monitor_every", type=at_least(int, 1), default=10,
                        help="every N loop steps, roll out the Teacher F-F-F-F on the same noise and log the "
                             "collapse monitors (default %(default)s)")
    add_method_model_args(parser, train="lora", init_weights="teacher", lora_rank=64, lora_alpha=64.0,
                          gradient_checkpointing=True, context_grad=False)
    add_method_optimization_args(parser, lr=1e-5, max_steps=2000, warmup_steps=100, grad_accum=1, weight_decay=0.01,
                                 adam_beta1=0.9, adam_beta2=0.999, grad_clip=1.0)
    add_run_args(parser, experiment=METHOD, precision="fp32master", ckpt_every=200, keep_last=5, log_every=10, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-fvtools")
    add_validation_args(parser, val_every=0, val_videos=2)
    # What the shared flags mean in this recipe (argparse has no public way to amend a help; _actions is read the
    # same way by flags.config_tokens).
    amended = {
        "lr": "--generator student: its peak LR (the Predictor uses --fusion_lr / --blocks_lr) (default %(default)g)",
        "warmup_steps": "linear warmup in loop steps; each role warms up for warmup_steps // its cadence updates "
                        "(default %(default)s)",
        "grad_clip": "the generator's gradient-norm clip, -1 = measure only (default %(default)g)",
        "adam_beta1": "the generator's AdamW beta1 (default %(default)g)",
        "adam_beta2": "the generator's AdamW beta2 (default %(default)g)",
        "train": "--generator student: lora (an adapter on the frozen Teacher) or full (every parameter of a "
                 "Teacher-shaped model, replicated with all-reduced gradients) (default %(default)s)",
        "lora_rank": "rank of the LoRA student and of a LoRA fake score on a model-folder real score "
                     "(default %(default)s)",
        "context_grad": "--generator student: back-propagate through its context prefill too (default %(default)s)",
        "gradient_checkpointing": "activation checkpointing of the trained models' blocks (Predictor, student, fake "
                                  "score) (default %(default)s)",
    }
    for action in parser._actions:
        if action.dest in amended:
            action.help = amended[action.dest]
    args = parse_recipe_args(parser, argv, PRESETS)
    if args.anchor_weight is None:
        args.anchor_weight = 1.0 if args.generator == "predictor" else 0.0
    if args.dry_run is not None:
        return args
    missing = [f"--{flag}" for flag in ("teacher", "dataset_root", "real_score") if getattr(args, flag) is None]
    if missing:
        parser.error(f"{' and '.join(missing)} missing (or pass --dry_run CONFIG)")
    check_args(parser, args, dataset_config_name=VIDEO_CONFIG_NAME)
    check_dmd2_args(parser, args)
    args.val_vae, args.val_split = resolve_video_val_inputs(
        parser, METHOD, val_every=args.val_every, val_vae=args.val_vae, val_split=args.val_split,
        val_ground_truth=args.val_ground_truth, dataset_root=args.dataset_root, split=args.split)
    check_action_ckpt(parser, args, reads_teacher_weights=True)  # the composite's Full steps and the scores' base
    return args


def check_dmd2_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag rules only this recipe has (parser.error naming the flags and the expected values); resolves
    --real_score into `args.real_score_kind` ("teacher" | "lora" | "model") and `args.real_score_path`."""
    updates, warmup = args.max_steps // args.generator_every, args.warmup_steps // args.generator_every
    if updates < 1:
        parser.error(f"--max_steps={args.max_steps} --generator_every={args.generator_every}: the generator would "
                     "never be updated")
    if warmup >= updates:
        parser.error(f"--warmup_steps={args.warmup_steps}: the generator's warmup ({warmup} updates) must be shorter "
                     f"than its {updates} updates")
    if not 0 <= args.score_sigma_min < args.score_sigma_max <= 1:
        parser.error(f"--score_sigma_min={args.score_sigma_min} --score_sigma_max={args.score_sigma_max}: expected "
                     "0 <= min < max <= 1")
    try:
        args.real_score_kind, args.real_score_path = resolve_real_score_flags(
            args.real_score, allow_raw_teacher_score=args.allow_raw_teacher_score,
            score_sigma_min=args.score_sigma_min, fake_score_train=args.fake_score_train)
    except ValueError as error:
        parser.error(str(error))
    # The generator (check_args has checked --fusion_lr and --blocks_lr > 0).
    if args.generator == "predictor":
        check_plan(parser, args.plan)
        if args.resume is None and args.init_from is None:
            parser.error("--generator predictor needs --init_from (a trained v4 Predictor: training_latest.pt or "
                         "predictor_step_XXXXX.safetensors)")
        if args.init_from is not None and not args.init_from.is_file():
            parser.error(f"--init_from={str(args.init_from)!r}: no such file")
    elif args.init_from is not None:
        parser.error("--init_from is for --generator predictor; a student starts from the Teacher (--train)")


def run_name(flags: dict, *, world_size: int, device_type: str, subset: str = "") -> str:
    """The run directory's name from the flags (`plain_flags`): generator (and what trains), rollout, cadence, fake
    score, LRs."""
    if flags["generator"] == "predictor":
        blocks = "-".join(str(block) for block in flags["source_blocks"])
        model = f"predictor-{StepPlan.from_flags(flags).tag}-blocks{blocks}"
        lrs = [f"flr{format_lr(flags['fusion_lr'])}", f"blr{format_lr(flags['blocks_lr'])}"]
    else:
        trained = f"lora{flags['lora_rank']}" if flags["train"] == "lora" else f"full-{flags['init_weights']}"
        model = f"student{flags['student_steps']}-{trained}"
        if flags.get("student_sampler", "euler") != "euler":
            model += f"-{flags['student_sampler']}"
        lrs = [f"lr{format_lr(flags['lr'])}"]
    tracker = "notracker" if flags["tracker"] == "none" else flags["tracker"]
    parts = [flags["experiment"], model, f"rollout-{flags['rollout']}", f"every{flags['generator_every']}",
             f"fake-{flags['fake_score_train']}", flags["precision"], device_tag(world_size, device_type), *lrs,
             f"fslr{format_lr(flags['fake_score_lr'])}", f"steps{flags['max_steps']}",
             f"warmup{flags['warmup_steps']}", tracker]
    return "_".join(parts)


def generator_meta(args: argparse.Namespace) -> dict:
    """The checkpoint meta of a dmd2 run: what its generator is and how it trains (a resume must match it)."""
    if args.generator == "predictor":
        return checkpoint_meta(PREDICTOR_VARIANT, args.source_blocks, args.precision,
                               recipe=f"dmd2_{args.plan.tag}", method=METHOD,
                               generator="predictor", rollout=args.rollout, fake_score=args.fake_score_train)
    return {"method": METHOD, "generator": "student", "train": args.train, "precision": args.precision,
            "lora_rank": args.lora_rank if args.train == "lora" else None, "rollout": args.rollout,
            "fake_score": args.fake_score_train, "student_steps": args.student_steps,
            **({"student_sampler": args.student_sampler} if args.student_sampler != "euler" else {})}


def check_inputs(args: argparse.Namespace) -> RunPlan:
    """1. The clips, opened before anything is created (the launcher's dry run too); the run is named from the
    flags (`run_name`)."""
    VideoLatentDataset(args.dataset_root, args.split)
    return RunPlan(meta=generator_meta(args), naming=run_name)


def load_data(launch: Launch) -> RecipeData:
    """2. Data: one clip per rank per micro-batch."""
    args = launch.args
    dataset = VideoLatentDataset(args.dataset_root, args.split, verify=args.verify_dataset)
    return RecipeData(batches=one_item_per_rank_batches(dataset, launch.env, seed=args.seed,
                                                        num_workers=args.num_workers), dataset=dataset)


def build_run(launch: Launch) -> RecipeParts:
    """3. The frozen Teacher; the generator; the real and fake scores; the step and the validation (see build);
    what --init_from recorded and the run's provenance. Resume (--resume, or the run directory's own unfinished
    run) then restores both roles."""
    args, start = launch.args, launch.start
    rollout_config = RolloutConfig(state_dtype=torch.float32, autocast_dtype=launch.policy.autocast_dtype)
    parts = build(args, launch.env, launch.policy, rollout_config=rollout_config,
                  resuming=start.resume_path is not None, run_dir=start.run_dir)
    if args.generator == "predictor":
        parts.derived["init_meta"] = recorded_init_meta(start, parts.derived["init_meta"])
    parts.derived["provenance"] = run_provenance(start, launch.env, teacher=args.teacher,
                                                 action_ckpt=args.action_ckpt, parent=args.init_from,
                                                 data_root=args.dataset_root)
    return parts


def summarize(launch: Launch) -> dict:
    """4. The run's config (train_config.json on rank 0) and the summary block; returns the config."""
    args, start, env, policy, dataset, parts = (launch.args, launch.start, launch.env, launch.policy,
                                                launch.data.dataset, launch.parts)
    generator_role, student_model = parts.objects["generator_role"], parts.objects["student_model"]
    if args.generator == "predictor":
        generator_text = (f"predictor: v4 blocks {list(args.source_blocks)}, chunk 0 F-F-F-F, chunks 1.. "
                          f"{args.plan.text}; from {args.init_from if start.resume_path is None else start.resume_path}")
    else:
        generator_text = f"{student_model.describe()}; {args.student_steps} steps at shift " \
                         f"{args.student_shift:g}, exit step {args.exit_step}, {args.student_sampler} rollout"
    trainable = {role.name: sum(param.numel() for param in role.parameters) for role in parts.roles}
    derived = dict(parts.derived)
    predictor = {"predictor": derived.pop("predictor")} if "predictor" in derived else {}
    config = run_config(
        args, run_name=start.run_name, method=METHOD, world_size=env.world_size, device=str(env.device),
        backend=env.backend, global_batch=env.world_size * args.grad_accum, num_clips=len(dataset),
        num_latents=dataset.num_latents, trainable_parameters=trainable, **derived, environment=environment_summary(),
        **start.recorded(),
        **predictor,
    )
    if env.is_main:
        write_train_config(start.run_dir, config)
    ema_text = ("no EMA" if generator_role.ema is None else
                f"EMA decay {args.ema_decay:g} from step {args.ema_start_step} (update "
                f"{generator_role.ema.start_update})")
    log_summary("DMD2" + (" + Self-Forcing" if args.rollout == "self" else " (teacher-forced)"), {
        "run dir": str(start.run_dir),
        "generator": f"{generator_text}; updated every {args.generator_every} steps; anchor weight "
                     f"{args.anchor_weight:g}; truth weight {args.truth_weight:g}; {ema_text}",
        "real score": f"{args.real_score} ({args.real_score_kind}), frozen",
        "fake score": f"{args.fake_score_train} copy of the real score, lr {args.fake_score_lr:g}, every step",
        "trainable": " | ".join(f"{name} {count:,}" for name, count in trainable.items()),
        "precision": policy.describe(),
        "steps": f"{parts.run_state.global_step + 1}..{start.stop_step} of {args.max_steps}",
        "scores": f"sigma {args.score_sigma_sampler} in [{args.score_sigma_min}, {args.score_sigma_max}]; "
                  f"monitors every {args.monitor_every} steps",
        "data": f"{args.dataset_root} (split {args.split}): {len(dataset)} clips of {dataset.num_latents} latents",
        "batch": f"1 clip per rank x {env.world_size} ranks x {args.grad_accum} accumulation",
        "checkpoints": f"every {args.ckpt_every} steps, keep {args.keep_last}; tracker {args.tracker}",
    })
    if parts.validation is not None:
        log0(f"validation every {args.val_every} steps: {parts.validation.describe()}")
    return config


def export(launch: Launch) -> None:
    """After training: a student is exported like the other methods' models (the Predictor's
    predictor_step_XXXXX.safetensors, written by the loop, is what tools/eval_predictor.py reads); the generator's
    EMA next to it."""
    args, parts, run_dir, run_state = launch.args, launch.parts, launch.start.run_dir, launch.run_state
    meta, config, env = launch.plan.meta, launch.config, launch.env
    generator_role, student_model = parts.objects["generator_role"], parts.objects["student_model"]
    if student_model is not None:
        exported = export_method_model(student_model, run_dir,
                                       with_provenance({**meta, "step": run_state.global_step}, config), env)
        log0(f"exported the trained {args.train} student: {exported}")
    if generator_role.ema is not None:
        exported = export_generator_ema(generator_role, run_dir, run_state.global_step, meta=meta, config=config,
                                        keep_last=args.keep_last, written=run_state.checkpoints, env=env,
                                        student_model=student_model)
        log0(f"exported the generator's EMA (decay {args.ema_decay:g}, {generator_role.ema.updates} updates): "
             f"{exported}")


@command
def main(argv=None) -> int:
    """--dry_run prints the parameter counts; otherwise the recipe's steps in order, the shared loop between
    summarize and export (`runtime/launch.run_recipe`)."""
    args = parse_args(argv)
    if args.dry_run is not None:
        generator = {"student": args.train} if args.generator == "student" else {"predictor": "predictor"}
        roles = {"teacher": "frozen", **generator, REAL: "frozen", FAKE: args.fake_score_train}
        print(dry_run_report(args.dry_run, roles, lora_rank=args.lora_rank, predictor_blocks=args.source_blocks))
        return 0
    return run_recipe(args, Recipe(plan=check_inputs, data=load_data, build=build_run, summarize=summarize,
                                   after=export))


if __name__ == "__main__":
    sys.exit(main())
