"""DisCa-style adversarial training of the v4 Predictor: its regression loss plus a conditional discriminator on
hidden tokens (docs/methods/adversarial.md).

Two roles, one loop (predictor_training/runtime/loop.py), one checkpoint holding both:

* "predictor": the v4 Predictor exactly as in train_predictor_v4.py (same build, AdamW groups fusion + blocks, warmup +
  cosine schedule, DDP). Per micro-batch:
      pred_h, pred_v = Predictor(...)                                              (BF16 autocast under fp32master)
      loss = velocity_weight mse(pred_v, v_T) + hidden_weight mse(pred_h, h_T)   the v4 regression, FP32
             + w(s) * L_G,   L_G = -mean D(st(pred_h) | t, ctx)                   D's parameters frozen
  w(s) = adv_weight * min(1, s / adv_warmup_steps), s = the Predictor updates done so far (0 at the first step).
  With w(s) = 0 the generator term is not built at all.
* "discriminator": `HiddenDiscriminator` (predictor_training/methods/adversarial.py, with its role and `Adversary`)
  with its own AdamW and cosine schedule over its own updates, due every --discriminator_every steps:
      L_D = mean relu(1 - D(h_T | t, ctx)) + mean relu(1 + D(sg(pred_h) | t, ctx))     hinge
            + r1_weight / 2 * r1_every * E |dD(h_T)/dh_T|^2      lazy R1 on real, on every r1_every-th D update
  Real = the Teacher's final hidden of the step, fake = the Predictor's (detached); D sees the fake as st(pred_h):
  rounded to the real's dtype (BF16 data or Teacher output: the real's grid), straight-through (identity backward),
  in both losses, so precision alone cannot tell them apart (`adversarial.on_real_grid`). The condition is the step's
  timestep and a context summary (the mean over context tokens of the raw V of the later source block, heads
  concatenated: [B, D]; the same context K/V the Predictor attends to). D's gradients are averaged over ranks by
  the loop, without a DDP wrapper (`build_discriminator_role` says why). The Predictor's adversarial term uses D only
  through `functional_call` with detached parameters.

Neither loss reaches the other role's parameters; the loop also refuses gradients on a role that is not due.

--data offline: stored Teacher pairs, the batches of train_predictor_v4.py (`pair_dataset.v4_pair_batches`).
  The discriminator is initialised from its own random stream (seed, DISCRIMINATOR_STREAM) and draws nothing
  during training, so with --adv_weight 0 the Predictor's weights and losses equal train_predictor_v4.py's bit
  for bit (tests/recipes/test_train_adversarial.py).
--data rollout: on-policy, as train_predictor_v4_rollout.py (`trajectory_dataset.trajectory_batches`, then
  predictor/self_rollout.py): one trajectory per rank per step, chunk 0 F-F-F-F, chunks 1.. under --replace_steps;
  every Predictor step gives a fake (its predicted hidden) and a real (the Teacher's hidden on the same state the
  Predictor visited). The generator term is added to each chunk's loss before that chunk's backward; D trains on
  all of the trajectory's pairs after it. Needs --init_from (an offline v4 checkpoint).

Health monitors in train_log.jsonl: discriminator/{loss, accuracy, real_logit_mean, fake_logit_mean, r1,
r1_applied}, adversarial/{weight, generator_loss}, monitor/{hidden_std, teacher_hidden_std, hidden_std_ratio}
(a flat Predictor output shows as hidden_std_ratio -> 0). The discriminator's metrics are measured on every step
(without gradients where it is not due).

Tiny CPU run (the offline demo checkpoint comes from `bash tools/launch_predictor_v4_training.sh`):

    python fvtools/train_adversarial.py --preset demo --dataset_root demo_data/dataset \\
        --init_from checkpoints/<offline v4 demo run>/training_latest.pt

Launchers (8 GPUs; with no GPU and no DATASET_ROOT the CPU demo):

    DATASET_ROOT=/data/predictor_v4 bash tools/launch_fvtools_adversarial.sh
    INIT_FROM=RUN/training_latest.pt DATASET_ROOT=/data/predictor_v4 \\
        bash tools/launch_fvtools_adversarial.sh --data rollout
    bash tools/launch_fvtools_adversarial.sh      # no GPU, no DATASET_ROOT: the CPU demo
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, resolve_teacher_source
from predictor_training.data.pair_dataset import v4_pair_batches, v4_pair_dataset
from predictor_training.data.provenance import run_provenance
from predictor_training.data.trajectory_dataset import open_trajectory_table, trajectory_batches
from predictor_training.recipes.adversarial import VARIANT, build
from predictor_training.recipes.flags import add_plan_args, check_plan
from predictor_training.recipes.flags import (
    add_data_args, add_loss_args, add_optimization_args, add_predictor_args, add_teacher_args, add_validation_args,
    format_pairs,
)
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.checkpoint import check_weights_file, checkpoint_meta
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import (
    CLIP_OR_OFF, UNIT_INTERVAL, add_run_args, add_tracker_args, at_least, check_args, parse_recipe_args, positive,
)
from predictor_training.runtime.launch import Launch, Recipe, RunPlan, run_recipe
from predictor_training.runtime.logger import log_summary, recipe_summary_rows
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.run_directory import (environment_summary, format_lr, recorded_init_meta, run_config, write_train_config)
from predictor_training.teacher.source import check_source_blocks

DATA_MODES = ("offline", "rollout")

# The CPU demo on the demo world: blocks 1,10 of its 12-block Teacher (as 1,52 of the real 54); fp32, no tracker;
# fine-tuning of the offline v4 demo Predictor (--init_from, given by the launcher), as DisCa adds its
# discriminator to a Predictor trained by regression. Discriminator LR 1e-3: at 1e-4 it stays at chance (accuracy 0.5)
# for all 120 steps of the demo.
PRESETS = {
    "demo": ["--experiment", "predictor_v4_adversarial_demo", "--source_blocks", "1,10", "--precision", "fp32",
             "--max_steps", "120", "--scheduler_warmup_steps", "10", "--block_warmup_steps", "10",
             "--batch_size", "8", "--adv_weight", "0.01", "--adv_warmup_steps", "20", "--discriminator_lr", "1e-3",
             "--r1_every", "4", "--ckpt_every", "40", "--tracker", "none", "--num_workers", "0",
             "--val_every", "120", "--val_videos", "1"],
    # The recipe at the size the memory rehearsal plans for (tools/estimate_memory.py): its defaults.
    "real_size": ["--source_blocks", "1,52", "--precision", "fp32master", "--batch_size", "16",
                  "--gradient_checkpointing"],
}


def build_parser() -> argparse.ArgumentParser:
    """The adversarial recipe's flags: every default below is the recipe (docs/methods/adversarial.md); the
    Predictor's are the v4 offline recipe's."""
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_data_args(parser, pairs="0-1,1-2,2-3", num_workers=4)
    data = parser.add_argument_group("adversarial data")
    data.add_argument("--data", choices=DATA_MODES, default="offline",
                      help="offline: stored Teacher pairs (--pairs, --batch_size), as train_predictor_v4.py; rollout: "
                           "on-policy self-rollout, one trajectory per rank per step (--replace_steps, "
                           "--sample_table), as train_predictor_v4_rollout.py, needs --init_from (default %(default)s)")
    data.add_argument("--init_from", type=Path, default=None,
                      help="Predictor weights to start from: a v4 training_latest.pt (its 'predictor' role) or a "
                           "predictor_step_XXXXX.safetensors; optional with --data offline (default: a fresh "
                           "Predictor, as train_predictor_v4.py), required with --data rollout; not with --resume")
    add_plan_args(parser, group=data, reuse=False,
                  note=" (--data rollout; as the eval's --replace_steps)")
    data.add_argument("--sample_table", type=Path, default=None,
                      help="--data rollout: sample table (JSONL) of the trajectories to roll out; default: the table "
                           "of --split recorded in the dataset's dataset_config.json")
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52", gradient_checkpointing=True)
    add_optimization_args(parser, fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000, scheduler_warmup_steps=100,
                          block_warmup_steps=100, batch_size=16, grad_accum=1, weight_decay=0.01,
                          adam_beta1=0.9, adam_beta2=0.95, grad_clip=1.0)
    add_loss_args(parser, velocity_weight=1.0, hidden_weight=0.1)
    adv = parser.add_argument_group("adversarial")
    adv.add_argument("--adv_weight", default=0.01, type=at_least(float, 0),
                     help="weight of the Predictor's adversarial loss -mean D(pred_hidden) after the warm-up; 0 = "
                          "the v4 regression recipe exactly (the discriminator still trains and is logged) "
                          "(default %(default)g)")
    adv.add_argument("--adv_warmup_steps", default=100, type=at_least(int, 0),
                     help="Predictor updates over which the adversarial weight rises linearly from 0 to --adv_weight; "
                          "0 = full weight from the first step (default %(default)s)")
    adv.add_argument("--discriminator_lr", default=1e-4,
                     type=positive(),
                     help="peak LR of the discriminator's AdamW (cosine to 0 over its own updates, no warmup) "
                          "(default %(default)g)")
    adv.add_argument("--discriminator_every", default=1, type=at_least(int, 1),
                     help="update the discriminator every N loop steps, N <= --max_steps (the Predictor updates every "
                          "step) (default %(default)s)")
    adv.add_argument("--discriminator_width", default=256, type=at_least(int, 1),
                     help="width of the discriminator's token layers (default %(default)s)")
    for flag, default in (("--discriminator_adam_beta1", 0.0), ("--discriminator_adam_beta2", 0.99)):
        adv.add_argument(flag, default=default, type=UNIT_INTERVAL,
                         help=f"discriminator AdamW {flag[-5:]} (default %(default)g)")
    adv.add_argument("--discriminator_weight_decay", default=0.0,
                     type=at_least(float, 0),
                     help="discriminator AdamW weight decay (default %(default)g)")
    adv.add_argument("--discriminator_grad_clip", default=1.0,
                     type=CLIP_OR_OFF,
                     help="global gradient-norm clip of the discriminator; -1 = measure only (default %(default)g)")
    adv.add_argument("--r1_weight", default=1.0, type=at_least(float, 0),
                     help="gamma of the R1 penalty gamma/2 E|dD(real)/d real|^2 on the Teacher hiddens; 0 = none "
                          "(default %(default)g)")
    adv.add_argument("--r1_every", default=16, type=at_least(int, 1),
                     help="lazy R1: applied on every N-th discriminator update (the first included), weighted by N "
                          "(default %(default)s)")
    add_run_args(parser, experiment="predictor_v4_adversarial", precision="fp32master", ckpt_every=100,
                 keep_last=20, log_every=10, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-predictor")
    add_validation_args(parser, val_every=0, val_videos=4)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, --preset / --config applied, then the cross-flag checks (an error names the flag and exits 2)."""
    parser = build_parser()
    args = parse_recipe_args(parser, argv, PRESETS)
    check_args(parser, args, dataset_config_name=DATASET_CONFIG_NAME)
    check_adversarial_args(parser, args)
    if args.data == "rollout":  # the plan the Predictor trains
        check_plan(parser, args.plan)
    return args


def check_adversarial_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules only this recipe has, across flags (`parser.error`, exit 2, with every problem found)."""
    problems = []
    if args.discriminator_every > args.max_steps:
        problems.append(f"--discriminator_every={args.discriminator_every!r}: expected in [1, max_steps="
                        f"{args.max_steps}]")
    if args.data == "rollout":
        if args.resume is None and args.init_from is None:
            problems.append("--data rollout needs --init_from (an offline v4 training_latest.pt or "
                            "predictor_step_XXXXX.safetensors): an untrained Predictor gives no latent gradients")
        if args.sample_table is not None and not args.sample_table.is_file():
            problems.append(f"--sample_table={str(args.sample_table)!r}: no such file")
    if args.resume is not None and args.init_from is not None:
        problems.append(f"--init_from={str(args.init_from)!r} with --resume: the model comes from the resumed "
                        "checkpoint; drop --init_from")
    if args.init_from is not None:
        if args.init_from.suffix not in (".pt", ".safetensors"):
            problems.append(f"--init_from={str(args.init_from)!r}: expected a .pt training state or .safetensors")
        elif not args.init_from.is_file():
            problems.append(f"--init_from={str(args.init_from)!r}: no such file")
    if problems:
        parser.error("; ".join(problems))


def run_tag(args: argparse.Namespace) -> str:
    """The run-name part after the blocks: data mode (+ rollout schedule), adversarial weight, discriminator LR,
    e.g. "offline_adv0.01_dlr1e-4" or "rolloutfppp_adv0.01_dlr1e-4"."""
    data = args.data if args.data == "offline" else f"rollout{args.plan.tag}"
    return f"{data}_adv{args.adv_weight:g}_dlr{format_lr(args.discriminator_lr)}"


@dataclass
class AdversarialData:
    """Step 2's data: the items (pairs or trajectories) and this rank's batches; --data offline: the dataset's context
    timestep; --data rollout: the dataset's AR loop. `text` and `per_rank` describe it for the summary."""

    dataset: object
    batches: object
    context_timestep: float | None
    rollout_config: RolloutConfig | None
    text: str
    per_rank: str


def build_data(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy) -> AdversarialData:
    """Step 2: the v4 offline batches (`pair_dataset.v4_pair_batches`, as train_predictor_v4.py), or one whole
    trajectory per rank per micro-batch (`trajectory_dataset.trajectory_batches`, as the rollout recipe)."""
    if args.data == "offline":
        dataset, batches, context_timestep = v4_pair_batches(
            args.dataset_root, split=args.split, pairs=args.pairs, source_layers=args.source_blocks,
            batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers, verify=args.verify_dataset,
            env=env)
        text = (f"{args.dataset_root} split {args.split}: {len(dataset.trajectories)} trajectories -> "
                f"{len(dataset)} pairs ({format_pairs(args.pairs)}); {batches.batches_per_epoch()} "
                "micro-batches per rank per epoch")
        return AdversarialData(dataset, batches, context_timestep, None, text, f"{args.batch_size} pairs")
    data = trajectory_batches(args.dataset_root, args.split, env, sample_table=args.sample_table, seed=args.seed,
                              num_workers=args.num_workers, verify=args.verify_dataset,
                              state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype)
    text = (f"{data.sample_table}: {len(data.dataset)} trajectories, chunks 1.. "
            f"{args.plan.text}; {data.batches.batches_per_epoch()} per rank per "
            "epoch")
    return AdversarialData(data.dataset, data.batches, None, data.rollout_config, text, "1 trajectory")


def check_inputs(args: argparse.Namespace) -> RunPlan:
    """1. The inputs, checked before anything is created (in the launcher's --print_run_dir dry run too): the data,
    the source blocks against the Teacher, the --init_from weights; the run is named from the flags."""
    if args.data == "offline":
        v4_pair_dataset(args.dataset_root, split=args.split, pairs=args.pairs, source_layers=args.source_blocks,
                        check_tensors=False)
    else:
        open_trajectory_table(args.dataset_root, args.split, sample_table=args.sample_table)
    teacher_source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
    check_source_blocks(args.source_blocks, teacher_source)
    if args.resume is None and args.init_from is not None:
        check_weights_file(args.init_from, expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})
    return RunPlan(meta=checkpoint_meta(VARIANT, args.source_blocks, args.precision, recipe=f"adversarial_{args.data}"),
                   subset=run_tag(args), inputs=[(teacher_source.origin, teacher_source.folder)],
                   checked=teacher_source)


def load_data(launch: Launch) -> AdversarialData:
    """2. Data (see build_data)."""
    return build_data(launch.args, launch.env, launch.policy)


def build_run(launch: Launch) -> RecipeParts:
    """3-4. Teacher -> Predictor (then --init_from), the validation, the two roles, the step (see build); what
    --init_from recorded and the run's provenance. Resume (--resume, or the run directory's own unfinished run)
    then restores both roles and the data position."""
    args, start, data, teacher_source = launch.args, launch.start, launch.data, launch.plan.checked
    parts = build(args, launch.env, launch.policy, teacher_source=teacher_source,
                  context_timestep=data.context_timestep, dataset=data.dataset, rollout_config=data.rollout_config,
                  resuming=start.resume_path is not None, run_dir=start.run_dir)
    parts.derived["init_meta"] = recorded_init_meta(start, parts.derived["init_meta"])
    parts.derived["provenance"] = run_provenance(start, launch.env, teacher=teacher_source.folder,
                                                 action_ckpt=teacher_source.action_ckpt, parent=args.init_from,
                                                 data_root=args.dataset_root)
    return parts


def summarize(launch: Launch) -> dict:
    """5. The run's config (train_config.json on rank 0) and the summary block; returns the config."""
    args, start, env, policy, data, parts = (launch.args, launch.start, launch.env, launch.policy, launch.data,
                                             launch.parts)
    global_batch_items = (args.batch_size if args.data == "offline" else 1) * env.world_size * args.grad_accum
    config = run_config(
        args, run_name=start.run_name, variant=VARIANT, recipe=f"adversarial_{args.data}",
        world_size=env.world_size, device=str(env.device), backend=env.backend, global_batch=global_batch_items,
        num_items=len(data.dataset), micro_batches_per_epoch=data.batches.batches_per_epoch(), **parts.derived,
        environment=environment_summary(), **start.recorded(),
    )
    if env.is_main:
        write_train_config(start.run_dir, config)
    discriminator_params = parts.derived["discriminator"]["parameters"]
    log_summary(f"DisCa-style adversarial Predictor training ({VARIANT}, {args.data})", {
        **recipe_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(),
                              optimizer=parts.roles[0].optimizer, first_step=parts.run_state.global_step + 1,
                              stop_step=start.stop_step),
        "init": (f"{start.resume_path} (training state)" if start.resume_path else
                 f"{args.init_from} (Predictor weights only)" if args.init_from else "fresh Predictor"),
        "adversarial": f"+ w * -mean D(pred_h), w -> {args.adv_weight:g} over {args.adv_warmup_steps} updates; "
                       f"D: hinge + R1 {args.r1_weight:g} every {args.r1_every} D updates, lr "
                       f"{args.discriminator_lr:g}, every {args.discriminator_every} steps, width "
                       f"{args.discriminator_width} ({discriminator_params:,} params)",
        "data": data.text,
        "batch": f"{data.per_rank} per rank x {env.world_size} ranks x {args.grad_accum} accumulation",
    })
    return config


@command
def main(argv=None) -> int:
    """The recipe's steps in order; the step of the data mode and the shared loop run after summarize
    (`runtime/launch.run_recipe`)."""
    return run_recipe(parse_args(argv), Recipe(plan=check_inputs, data=load_data, build=build_run,
                                               summarize=summarize))


if __name__ == "__main__":
    sys.exit(main())
