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

import torch
from torch import Tensor, nn

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, resolve_teacher_source
from predictor_training.data.pair_dataset import v4_pair_batches, v4_pair_dataset
from predictor_training.data.provenance import run_provenance
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset, open_trajectory_table, trajectory_batches
from predictor_training.eval.validation import predictor_validation
from predictor_training.methods.adversarial import (DISCRIMINATOR, PREDICTOR, Adversary, adversarial_metrics,
                                                    build_discriminator, build_discriminator_role, context_summary)
from predictor_training.predictor.loss import predictor_loss
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.pair_step import move_batch, predict_pairs_with_context
from predictor_training.predictor.self_rollout import (ChunkGraph, SelfRolloutSettings, train_trajectory,
                                                       trajectory_for_row)
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.recipes.flags import add_plan_args, check_plan
from predictor_training.rollout.schedule import DEFAULT_REPLACE_STEPS, StepPlan
from predictor_training.runtime.checkpoint import check_weights_file, checkpoint_meta, load_model_weights
from predictor_training.runtime.distributed import DistEnv, log0, maybe_no_sync, seed_everything, wrap_ddp
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import (
    CLIP_OR_OFF, UNIT_INTERVAL, add_run_args, add_tracker_args, at_least, check_args, parse_recipe_args, positive,
)
from predictor_training.recipes.flags import (
    add_data_args, add_loss_args, add_optimization_args, add_predictor_args, add_teacher_args, add_validation_args,
    format_pairs,
)
from predictor_training.runtime.launch import distributed_run, early_exit, resume_roles, run_training
from predictor_training.runtime.logger import log_summary, recipe_summary_rows
from predictor_training.runtime.optim import build_optimizer_and_schedule
from predictor_training.runtime.precision import PrecisionPolicy, precision_policy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import (RunStart, environment_summary, format_lr, plan_run,
                                                      recorded_init_meta, run_config, write_train_config)
from predictor_training.teacher.source import TeacherSource, check_source_blocks, describe_teacher, load_teacher

VARIANT = "v4"
DATA_MODES = ("offline", "rollout")
OFFLINE_PLAN = StepPlan.from_steps(DEFAULT_REPLACE_STEPS)  # what --data offline is validated at (it trains every step)

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


class AdversarialPairStep:
    """`step_fn` of the loop for --data offline: one micro-batch of stored pairs.

    The Predictor's forward and loss are `pair_step`'s (predict_pairs + predictor_loss); with weight 0 its backward
    is the same loss tensor's, so the Predictor trains exactly as train_predictor_v4.py."""

    def __init__(self, *, model: nn.Module, predictor, policy, context_timestep: float, adversary: Adversary,
                 velocity_weight: float, hidden_weight: float):
        self.model = model
        self.predictor = predictor
        self.policy = policy
        self.context_timestep = context_timestep
        self.adversary = adversary
        self.velocity_weight = velocity_weight
        self.hidden_weight = hidden_weight

    def __call__(self, batch: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        self.adversary.check_due(due)
        batch = move_batch(batch, self.policy.device)
        weight = self.adversary.weight()
        timestep = batch["timestep"]  # [B], the target step's
        # 1. The Predictor: regression (+ the adversarial term once its weight is above 0), one backward.
        with maybe_no_sync(self.model, enabled=not sync):
            pred_hidden, pred_velocity, context = predict_pairs_with_context(
                batch, model=self.model, predictor=self.predictor, policy=self.policy,
                context_timestep=self.context_timestep, release_prefeatures=True)  # `batch` is move_batch's copy
            loss, regression = predictor_loss(
                pred_hidden, pred_velocity, batch["target_hidden"], batch["target_velocity"],
                velocity_weight=self.velocity_weight, hidden_weight=self.hidden_weight)
            condition = context_summary(context)
            generator = None
            if weight > 0:
                generator = self.adversary.generator_term(pred_hidden, timestep, condition,
                                                          real_dtype=batch["target_hidden"].dtype)
                loss = loss + weight * generator
            loss.backward()
        # 2. The discriminator on the same real / (detached) fake hiddens.
        metrics = self.adversary.discriminator_pass(batch["target_hidden"], pred_hidden, timestep, condition,
                                                    train=DISCRIMINATOR in due)
        metrics.update({
            "loss": float(loss.detach()),
            "regression_loss": float(regression["loss"]),
            "hidden_mse": float(regression["hidden_mse"]),
            "velocity_mse": float(regression["velocity_mse"]),
            **adversarial_metrics(weight, None if generator is None else float(generator.detach()), metrics,
                                  pred_hidden, batch["target_hidden"]),
        })
        return metrics


class AdversarialRolloutStep:
    """`step_fn` of the loop for --data rollout: one trajectory (case, action) per call.

    `train_trajectory` runs chunk 0 and every trained chunk with its own backward; `chunk_hook` adds the weighted
    generator term of the chunk's Predictor steps (mean over them, as the chunk's regression loss) and keeps the
    chunk's (real, detached fake, timestep, context) for the discriminator, which trains on all of them after the
    trajectory."""

    def __init__(self, *, model: nn.Module, teacher, dataset: TrajectoryTableDataset, rollout_config: RolloutConfig,
                 settings: SelfRolloutSettings, adversary: Adversary, source_blocks, env: DistEnv):
        self.model = model
        self.teacher = teacher
        self.dataset = dataset
        self.rollout_config = rollout_config
        self.settings = settings
        self.adversary = adversary
        self.source_blocks = tuple(source_blocks)
        self.env = env

    def __call__(self, item: dict, *, sync: bool, due: frozenset[str]) -> dict[str, float]:
        self.adversary.check_due(due)
        weight = self.adversary.weight()
        trajectory = trajectory_for_row(item, self.dataset.load_case(item["case_id"]), teacher=self.teacher,
                                        predictor=self.model, config=self.rollout_config, settings=self.settings,
                                        device=self.env.device)
        reals, fakes, timesteps, conditions, generator_terms = [], [], [], [], []

        def chunk_hook(graph: ChunkGraph) -> Tensor | None:
            condition = context_summary(graph.context.kv.select(self.source_blocks))  # [1, D]
            terms = []
            for step in graph.steps:
                timestep = step.timestep[:1].to(self.env.device)  # the step's timestep (every frame has it)
                reals.append(step.target_hidden.detach())  # its own dtype: D sees the fake on its grid
                fakes.append(step.pred_hidden.detach().float())
                timesteps.append(timestep)
                conditions.append(condition)
                if weight > 0:
                    terms.append(self.adversary.generator_term(step.pred_hidden, timestep, condition,
                                                               real_dtype=step.target_hidden.dtype))
            if not terms:
                return None
            term = torch.stack(terms).mean()
            generator_terms.append(float(term.detach()))
            return weight * term

        metrics = train_trajectory(trajectory, sync=sync, chunk_hook=chunk_hook)
        real, fake = torch.cat(reals), torch.cat(fakes)
        d_metrics = self.adversary.discriminator_pass(real, fake, torch.cat(timesteps), torch.cat(conditions),
                                                      train=DISCRIMINATOR in due)
        regression = metrics.pop("loss")
        generator = sum(generator_terms) / len(generator_terms) if generator_terms else None
        metrics.update(d_metrics)
        metrics.update({
            "loss": regression + weight * generator if generator_terms else regression,
            "regression_loss": regression,
            **adversarial_metrics(weight, generator, d_metrics, fake, real),
        })
        return metrics


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


def build(args: argparse.Namespace, env: DistEnv, policy: PrecisionPolicy, *, teacher_source: TeacherSource,
          context_timestep: float | None = None, dataset: TrajectoryTableDataset | None = None,
          rollout_config: RolloutConfig | None = None, resuming: bool = False, run_dir: Path | None = None,
          load_teacher=load_teacher) -> RecipeParts:
    """Steps 3-4: the Teacher -> v4 Predictor, built as train_predictor_v4.py builds it (same seeding), then
    --init_from (unless a training state is resumed: `resuming`); the validation; the roles: the DDP-wrapped
    Predictor every step with the v4 recipe's AdamW and schedule, the discriminator on its cadence from its own random
    stream (the global RNG is left as the v4 recipe leaves it); the `Adversary` and the step of the data mode. The
    offline mode drops the Teacher (the Predictor shares the frozen modules it runs; `context_timestep` from main's
    data step); the rollout keeps it for the online labels (its `dataset` and `rollout_config`). Seams:
    `load_teacher`."""
    # 3. Teacher -> Predictor, the validation, --init_from.
    teacher = load_teacher(teacher_source, env.device, policy.frozen_dtype)
    log0(describe_teacher(teacher_source, teacher))
    torch.manual_seed(args.seed)  # the same fusion/head initialisation on every rank
    predictor = build_predictor(teacher, VARIANT, args.source_blocks, args.gradient_checkpointing)
    teacher_layers = teacher.num_layers
    validation = predictor_validation(  # held-out F-P-P-P (offline) or the rollout's schedule, vs F-F-F-F
        every=args.val_every, split=args.val_split, videos=args.val_videos, vae=args.val_vae,
        ground_truth=args.val_ground_truth, dataset_root=args.dataset_root, teacher=teacher, predictor=predictor,
        teacher_folder=teacher_source.folder, plan=args.plan if args.data == "rollout" else OFFLINE_PLAN,
        rollout_config=None, autocast_dtype=policy.autocast_dtype, env=env, run_dir=run_dir)
    if args.data == "offline":
        del teacher
    seed_everything(args.seed, rank=env.rank)
    init_meta = None
    if not resuming and args.init_from is not None:
        init_meta = load_model_weights(args.init_from, predictor, role=PREDICTOR,
                                       expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})
    # 4. The roles, the adversary and the step.
    discriminator = build_discriminator(predictor.hidden_size, width=args.discriminator_width, seed=args.seed,
                                        device=env.device)
    optimizer, lr_schedule = build_optimizer_and_schedule(
        predictor, fusion_lr=args.fusion_lr, blocks_lr=args.blocks_lr, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.weight_decay, warmup_steps=args.scheduler_warmup_steps, max_steps=args.max_steps,
        block_warmup_steps=args.block_warmup_steps)
    discriminator_role = build_discriminator_role(
        discriminator, lr=args.discriminator_lr, weight_decay=args.discriminator_weight_decay,
        betas=(args.discriminator_adam_beta1, args.discriminator_adam_beta2),
        grad_clip=args.discriminator_grad_clip, every=args.discriminator_every, max_steps=args.max_steps)
    model = wrap_ddp(predictor, env)
    predictor_role = Role(PREDICTOR, predictor, optimizer, lr_schedule, module=model, grad_clip=args.grad_clip)
    adversary = Adversary(predictor_role, discriminator_role, adv_weight=args.adv_weight,
                          adv_warmup_steps=args.adv_warmup_steps, r1_weight=args.r1_weight, r1_every=args.r1_every)
    if args.data == "offline":
        step_fn = AdversarialPairStep(model=model, predictor=predictor, policy=policy,
                                      context_timestep=context_timestep, adversary=adversary,
                                      velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight)
        models = [predictor, discriminator]
    else:
        settings = SelfRolloutSettings(velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight,
                                       predictor_autocast_dtype=policy.autocast_dtype,
                                       plan=args.plan)
        step_fn = AdversarialRolloutStep(model=model, teacher=teacher, dataset=dataset, rollout_config=rollout_config,
                                         settings=settings, adversary=adversary, source_blocks=args.source_blocks,
                                         env=env)
        models = [teacher, predictor, discriminator]
    discriminator_config = {"hidden_size": predictor.hidden_size, "width": args.discriminator_width,
                            "parameters": sum(p.numel() for p in discriminator.parameters())}
    return RecipeParts(roles=[predictor_role, discriminator_role], step_fn=step_fn, models=models,
                       validation=validation,
                       derived={"init_meta": init_meta, "predictor": predictor.predictor_config(),
                                "teacher_double_blocks": teacher_layers, "discriminator": discriminator_config})


def summarize(args: argparse.Namespace, *, start: RunStart, env: DistEnv, policy: PrecisionPolicy,
              data: AdversarialData, parts: RecipeParts) -> dict:
    """Step 5: the run's config (train_config.json on rank 0) and the summary block; returns the config."""
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
    args = parse_args(argv)
    # 1. The inputs, checked before anything is created (in the launcher's --print_run_dir dry run too): the data,
    #    the source blocks against the Teacher, the --init_from weights. Then the run directory, named from the
    #    flags; a second launch continues it or finds it finished.
    if args.data == "offline":
        v4_pair_dataset(args.dataset_root, split=args.split, pairs=args.pairs, source_layers=args.source_blocks,
                        check_tensors=False)
    else:
        open_trajectory_table(args.dataset_root, args.split, sample_table=args.sample_table)
    teacher_source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
    check_source_blocks(args.source_blocks, teacher_source)
    if args.resume is None and args.init_from is not None:
        check_weights_file(args.init_from, expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})
    meta = checkpoint_meta(VARIANT, args.source_blocks, args.precision, recipe=f"adversarial_{args.data}")
    start = plan_run(args, meta=meta, subset=run_tag(args), inputs=[(teacher_source.origin, teacher_source.folder)])
    if (code := early_exit(args, start)) is not None:
        return code
    with distributed_run(args, start) as env:
        policy = precision_policy(args.precision, env.device)
        # 2. Data: the v4 offline batches, or one whole trajectory per rank per micro-batch (see build_data).
        data = build_data(args, env, policy)
        # 3-4. Teacher -> Predictor (then --init_from), the validation, the two roles, the step (see build). Resume
        #      (--resume, or the run directory's own unfinished run) restores both roles and the data position.
        parts = build(args, env, policy, teacher_source=teacher_source, context_timestep=data.context_timestep,
                      dataset=data.dataset, rollout_config=data.rollout_config,
                      resuming=start.resume_path is not None, run_dir=start.run_dir)
        parts.derived["init_meta"] = recorded_init_meta(start, parts.derived["init_meta"])
        parts.derived["provenance"] = run_provenance(start, env, teacher=teacher_source.folder,
                                                     action_ckpt=teacher_source.action_ckpt, parent=args.init_from,
                                                     data_root=args.dataset_root)
        run_state = resume_roles(start, parts.roles, data.batches, meta, parts.run_state)
        # 5. Config and summary.
        config = summarize(args, start=start, env=env, policy=policy, data=data, parts=parts)
        # 6. Train: the step of the data mode and the shared loop.
        run_training(args, start, env, roles=parts.roles, batches=data.batches, step_fn=parts.step_fn,
                     run_state=run_state, config=config, meta=meta, validation=parts.validation)
    return 0


if __name__ == "__main__":
    sys.exit(main())
