"""DisCa-style adversarial training of the v4 Predictor: its regression loss plus a conditional discriminator on
hidden tokens (train.md § 4.4).

Two roles, one loop (predictor_training/loop.py), one checkpoint holding both:

* "predictor": the v4 Predictor exactly as in train_predictor_v4.py (same build, AdamW groups fusion + blocks, warmup +
  cosine schedule, DDP). Per micro-batch:
      pred_h, pred_v = Predictor(...)                                              (BF16 autocast under fp32master)
      loss = velocity_weight mse(pred_v, v_T) + hidden_weight mse(pred_h, h_T)   the v4 regression, FP32
             + w(s) * L_G,   L_G = -mean D(pred_h | t, ctx)                       D's parameters frozen
  w(s) = adv_weight * min(1, s / adv_warmup_steps), s = the Predictor updates done so far (0 at the first step).
  With w(s) = 0 the generator term is not built at all.
* "discriminator": `HiddenDiscriminator` (predictor_training/adversarial.py) with its own AdamW and cosine schedule
  over its own updates, due every --discriminator_every steps:
      L_D = mean relu(1 - D(h_T | t, ctx)) + mean relu(1 + D(sg(pred_h) | t, ctx))     hinge
            + r1_weight / 2 * r1_every * E |dD(h_T)/dh_T|^2      lazy R1 on real, on every r1_every-th D update
  Real = the Teacher's final hidden of the step, fake = the Predictor's (detached); the condition is the step's
  timestep and a context summary (the mean over context tokens of the raw V of the later source block, heads
  concatenated: [B, D]; the same context K/V the Predictor attends to).
  D's gradients are averaged over ranks by the loop (grad_sync "all_reduce") instead of a DDP wrapper: D runs three
  forwards per update (real, fake, and R1's input-gradient pass with create_graph), which DDP's reducer does not
  support. The Predictor's adversarial term uses D only through `functional_call` with detached parameters.

Neither loss reaches the other role's parameters; the loop also refuses gradients on a role that is not due.

--data offline: stored Teacher pairs, the batches of train_predictor_v4.py (`pair_dataset.v4_pair_batches`).
  The discriminator is initialised from its own random stream (seed, DISCRIMINATOR_STREAM) and draws nothing
  during training, so with --adv_weight 0 the Predictor's weights and losses equal train_predictor_v4.py's bit
  for bit (tests/test_fvtools_adversarial.py).
--data rollout: on-policy, as train_predictor_v4_rollout.py (predictor_training/self_rollout.py): one trajectory per
  rank per step, chunk 0 F-F-F-F, chunks 1.. under --replace_steps; every Predictor step gives a fake (its predicted
  hidden) and a real (the Teacher's hidden on the same state the Predictor visited). The generator term is added
  to each chunk's loss before that chunk's backward; D trains on all of the trajectory's pairs after it.
  Needs --init_from (an offline v4 checkpoint).

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
import math
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from predictor_training.adversarial import (
    HiddenDiscriminator,
    adversarial_weight,
    discriminator_loss,
    generator_loss,
    r1_penalty,
)
from predictor_training.ar_rollout import RolloutConfig
from predictor_training.checkpoint import RunState, checkpoint_meta, load_model_weights, load_training_state
from predictor_training.data.dataset_config import (
    DATASET_CONFIG_NAME,
    config_field,
    read_dataset_config,
    recorded_sample_table,
)
from predictor_training.data.pair_dataset import v4_pair_batches
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.distributed import (
    DistEnv,
    cleanup_distributed,
    init_distributed,
    log0,
    maybe_no_sync,
    seed_everything,
    wrap_ddp,
)
from predictor_training.eval.methods import Schedule, parse_replace_steps
from predictor_training.flags import (
    add_data_args,
    add_loss_args,
    add_optimization_args,
    add_predictor_args,
    add_run_args,
    add_teacher_args,
    add_tracker_args,
    check_args,
    format_pairs,
    parse_recipe_args,
)
from predictor_training.logger import MetricsLogger, log_summary, recipe_summary_rows
from predictor_training.loop import one_item_per_rank_batches, train_loop
from predictor_training.losses import predictor_loss
from predictor_training.optim import WarmupCosineSchedule, build_optimizer, build_optimizer_and_schedule
from predictor_training.pair_step import move_batch, predict_pairs_with_context
from predictor_training.precision import precision_policy
from predictor_training.predictor import build_predictor
from predictor_training.random_streams import stream_seed
from predictor_training.roles import Role
from predictor_training.run_directory import (
    environment_summary,
    format_lr,
    plan_run,
    report_run_start,
    run_config,
    write_train_config,
)
from predictor_training.scheduler import FlowMatchEulerScheduler
from predictor_training.self_rollout import ChunkGraph, SelfRolloutSettings, train_trajectory, trajectory_for_row
from predictor_training.teacher import ContextKV
from predictor_training.teacher.source import describe_teacher, load_teacher, resolve_teacher_source

VARIANT = "v4"
PREDICTOR, DISCRIMINATOR = "predictor", "discriminator"  # the roles
DISCRIMINATOR_STREAM = 0xD15C  # the discriminator's initialisation stream: stream_seed(seed, DISCRIMINATOR_STREAM)
DATA_MODES = ("offline", "rollout")

# The CPU demo on the demo world: blocks 1,10 of its 12-block Teacher (as 1,52 of the real 54); fp32, no tracker;
# fine-tuning of the offline v4 demo Predictor (--init_from, given by the launcher), as DisCa adds its
# discriminator to a Predictor trained by regression. Discriminator LR 1e-3: at 1e-4 it stays at chance (accuracy 0.5)
# for all 120 steps of the demo.
PRESETS = {
    "demo": ["--experiment", "predictor_v4_adversarial_demo", "--source_blocks", "1,10", "--precision", "fp32",
             "--max_steps", "120", "--scheduler_warmup_steps", "10", "--block_warmup_steps", "10",
             "--batch_size", "8", "--adv_weight", "0.01", "--adv_warmup_steps", "20", "--discriminator_lr", "1e-3",
             "--r1_every", "4",
             "--ckpt_every", "40", "--tracker", "none", "--num_workers", "0"],
}


def parse_args(argv=None) -> argparse.Namespace:
    """The adversarial recipe: every default below is the recipe (train.md § 4.4); the Predictor's are the v4
    offline recipe's."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    data.add_argument("--replace_steps", type=parse_replace_steps, default=(1, 2, 3),
                      help="--data rollout: the steps the Predictor runs in every trained chunk (1,2,3 = F-P-P-P, "
                           "default; as the eval's --replace_steps)")
    data.add_argument("--sample_table", type=Path, default=None,
                      help="--data rollout: sample table (JSONL) of the trajectories to roll out; default: the table "
                           "of --split recorded in the dataset's dataset_config.json")
    add_teacher_args(parser)
    add_predictor_args(parser, source_blocks="1,52", gradient_checkpointing=True)
    add_optimization_args(parser, fusion_lr=1e-4, blocks_lr=1e-5, max_steps=2000, scheduler_warmup_steps=100,
                          block_warmup_steps=100, batch_size=16, grad_accum=1, weight_decay=0.01,
                          adam_beta1=0.9, adam_beta2=0.95, grad_clip=1.0)
    add_loss_args(parser, velocity_weight=1.0, hidden_weight=0.1)
    adversarial = parser.add_argument_group("adversarial")
    adversarial.add_argument("--adv_weight", type=float, default=0.01,
                             help="weight of the Predictor's adversarial loss -mean D(pred_hidden) after the warm-up; "
                                  "0 = the v4 regression recipe exactly (the discriminator still trains and is "
                                  "logged) (default %(default)g)")
    adversarial.add_argument("--adv_warmup_steps", type=int, default=100,
                             help="Predictor updates over which the adversarial weight rises linearly from 0 to "
                                  "--adv_weight; 0 = full weight from the first step (default %(default)s)")
    adversarial.add_argument("--discriminator_lr", type=float, default=1e-4,
                             help="peak LR of the discriminator's AdamW (cosine to 0 over its own updates, no "
                                  "warmup) (default %(default)g)")
    adversarial.add_argument("--discriminator_every", type=int, default=1,
                             help="update the discriminator every N loop steps (the Predictor updates every step) "
                                  "(default %(default)s)")
    adversarial.add_argument("--discriminator_width", type=int, default=256,
                             help="width of the discriminator's token layers (default %(default)s)")
    adversarial.add_argument("--discriminator_adam_beta1", type=float, default=0.0,
                             help="discriminator AdamW beta1 (default %(default)g)")
    adversarial.add_argument("--discriminator_adam_beta2", type=float, default=0.99,
                             help="discriminator AdamW beta2 (default %(default)g)")
    adversarial.add_argument("--discriminator_weight_decay", type=float, default=0.0,
                             help="discriminator AdamW weight decay (default %(default)g)")
    adversarial.add_argument("--discriminator_grad_clip", type=float, default=1.0,
                             help="global gradient-norm clip of the discriminator; -1 = measure only "
                                  "(default %(default)g)")
    adversarial.add_argument("--r1_weight", type=float, default=1.0,
                             help="gamma of the R1 penalty gamma/2 E|dD(real)/d real|^2 on the Teacher hiddens; "
                                  "0 = none (default %(default)g)")
    adversarial.add_argument("--r1_every", type=int, default=16,
                             help="lazy R1: applied on every N-th discriminator update (the first included), "
                                  "weighted by N (default %(default)s)")
    add_run_args(parser, experiment="predictor_v4_adversarial", precision="fp32master", ckpt_every=100,
                 keep_last=20, log_every=1, seed=0)
    add_tracker_args(parser, tracker="swanlab", project="hy-predictor")
    args = parse_recipe_args(parser, argv, PRESETS)
    check_args(parser, args)
    # Rules only this recipe has.
    problems = []
    if not args.adv_weight >= 0:
        problems.append(f"--adv_weight={args.adv_weight!r}: expected >= 0")
    if not args.adv_warmup_steps >= 0:
        problems.append(f"--adv_warmup_steps={args.adv_warmup_steps!r}: expected >= 0")
    if not args.discriminator_lr > 0:
        problems.append(f"--discriminator_lr={args.discriminator_lr!r}: expected > 0")
    if not 1 <= args.discriminator_every <= args.max_steps:
        problems.append(f"--discriminator_every={args.discriminator_every!r}: expected in [1, max_steps="
                        f"{args.max_steps}]")
    if not args.discriminator_width >= 1:
        problems.append(f"--discriminator_width={args.discriminator_width!r}: expected >= 1")
    for flag in ("discriminator_adam_beta1", "discriminator_adam_beta2"):
        if not 0 <= getattr(args, flag) < 1:
            problems.append(f"--{flag}={getattr(args, flag)!r}: expected in [0, 1)")
    if not args.discriminator_weight_decay >= 0:
        problems.append(f"--discriminator_weight_decay={args.discriminator_weight_decay!r}: expected >= 0")
    if not (args.discriminator_grad_clip == -1 or args.discriminator_grad_clip > 0):
        problems.append(f"--discriminator_grad_clip={args.discriminator_grad_clip!r}: expected > 0, or -1")
    if not args.r1_weight >= 0:
        problems.append(f"--r1_weight={args.r1_weight!r}: expected >= 0")
    if not args.r1_every >= 1:
        problems.append(f"--r1_every={args.r1_every!r}: expected >= 1")
    if args.data == "rollout":
        if not args.replace_steps:
            problems.append("--replace_steps is empty: a rollout run trains the Predictor on at least one step")
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
    return args


def run_tag(args: argparse.Namespace) -> str:
    """The run-name part after the blocks: data mode (+ rollout schedule), adversarial weight, discriminator LR,
    e.g. "offline_adv0.01_dlr1e-4" or "rolloutfppp_adv0.01_dlr1e-4"."""
    data = args.data if args.data == "offline" else f"rollout{Schedule(args.replace_steps).letters().lower()}"
    return f"{data}_adv{args.adv_weight:g}_dlr{format_lr(args.discriminator_lr)}"


# ---------------------------------------------------------------------------------------------------------------
# The adversarial pieces every step uses
# ---------------------------------------------------------------------------------------------------------------
def context_summary(context: ContextKV) -> Tensor:
    """The discriminator's context condition [B, D]: the mean over context tokens of the raw V of the last layer of
    `context` (the later source block), heads concatenated; detached, FP32. context: ContextKV whose layers hold
    [B, heads, S, head_dim]."""
    values = context.layers[-1].rope_v.detach().float()
    return values.mean(dim=2).flatten(1)


def hidden_monitors(pred_hidden: Tensor, target_hidden: Tensor) -> dict[str, float]:
    """Std of the Predictor's hidden against the Teacher's (a flat output shows as hidden_std_ratio -> 0)."""
    with torch.no_grad():
        ours, theirs = float(pred_hidden.detach().float().std()), float(target_hidden.detach().float().std())
    return {"monitor/hidden_std": ours, "monitor/teacher_hidden_std": theirs,
            "monitor/hidden_std_ratio": ours / max(theirs, 1e-12)}


class Adversary:
    """The discriminator's side of a step, and the Predictor's adversarial weight.

    predictor_role / discriminator_role: this run's roles (their update counts drive the weight warm-up and the lazy
    R1 cadence, and are restored on resume). discriminator: the raw HiddenDiscriminator (no DDP wrapper).
    """

    def __init__(self, discriminator: HiddenDiscriminator, predictor_role: Role, discriminator_role: Role, *,
                 adv_weight: float, adv_warmup_steps: int, r1_weight: float, r1_every: int):
        self.discriminator = discriminator
        self.predictor_role = predictor_role
        self.discriminator_role = discriminator_role
        self.adv_weight = adv_weight
        self.adv_warmup_steps = adv_warmup_steps
        self.r1_weight = r1_weight
        self.r1_every = r1_every

    def check_due(self, due: frozenset[str]) -> None:
        if PREDICTOR not in due or not due <= {PREDICTOR, DISCRIMINATOR}:
            raise ValueError(f"the adversarial recipe trains {PREDICTOR!r} every step and {DISCRIMINATOR!r} on its "
                             f"cadence; the loop says {sorted(due)} are due")

    def weight(self) -> float:
        """The adversarial weight of this step: warm-up over the Predictor updates done so far."""
        return adversarial_weight(self.predictor_role.updates, self.adv_weight, self.adv_warmup_steps)

    def generator_term(self, pred_hidden: Tensor, timestep: Tensor, condition: Tensor) -> Tensor:
        """-mean D(pred_hidden | timestep, condition) with D's parameters frozen (gradient reaches the Predictor
        only). pred_hidden [B, N, D], timestep [B], condition [B, D]."""
        return generator_loss(self.discriminator, pred_hidden.float(), timestep.float(), condition)

    def discriminator_pass(self, real: Tensor, fake: Tensor, timestep: Tensor, condition: Tensor, *,
                           train: bool) -> dict[str, float]:
        """Hinge loss of D on real [B, N, D] vs detached fake [B, N, D] (+ lazy R1 on real): backward into D when
        `train` (D is due), else measured without gradients. Returns the discriminator/* metrics."""
        real, fake, timestep = real.detach().float(), fake.detach().float(), timestep.detach().float()
        if not train:
            with torch.no_grad():
                _, metrics = discriminator_loss(self.discriminator, real, fake, timestep, condition)
            return {**metrics, "discriminator/r1_applied": 0.0}
        loss, metrics = discriminator_loss(self.discriminator, real, fake, timestep, condition)
        # Lazy R1: on every r1_every-th update of D (counted from its first), weighted by r1_every.
        apply_r1 = self.r1_weight > 0 and self.discriminator_role.updates % self.r1_every == 0
        if apply_r1:
            penalty = r1_penalty(self.discriminator, real, timestep, condition)
            loss = loss + 0.5 * self.r1_weight * self.r1_every * penalty
            metrics["discriminator/r1"] = float(penalty.detach())
        loss.backward()
        return {**metrics, "discriminator/r1_applied": float(apply_r1)}


# ---------------------------------------------------------------------------------------------------------------
# --data offline: the v4 pair step plus the adversarial terms
# ---------------------------------------------------------------------------------------------------------------
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
                context_timestep=self.context_timestep)
            loss, regression = predictor_loss(
                pred_hidden, pred_velocity, batch["target_hidden"], batch["target_velocity"],
                velocity_weight=self.velocity_weight, hidden_weight=self.hidden_weight)
            condition = context_summary(context)
            generator = None
            if weight > 0:
                generator = self.adversary.generator_term(pred_hidden, timestep, condition)
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
            "adversarial/weight": weight,
            "adversarial/generator_loss": (float(generator.detach()) if generator is not None
                                           else -metrics["discriminator/fake_logit_mean"]),
            **hidden_monitors(pred_hidden, batch["target_hidden"]),
        })
        return metrics


# ---------------------------------------------------------------------------------------------------------------
# --data rollout: the on-policy trajectory plus the adversarial terms
# ---------------------------------------------------------------------------------------------------------------
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
        scheduler = FlowMatchEulerScheduler(shift=rollout_config.shift)
        scheduler.set_timesteps(rollout_config.num_steps)
        self.timesteps = scheduler.timesteps.to(torch.float32)  # [num_steps], the Predictor step k's is [k]

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
                timestep = self.timesteps[step.step_index].reshape(1).to(self.env.device)
                reals.append(step.target_hidden.detach().float())
                fakes.append(step.pred_hidden.detach().float())
                timesteps.append(timestep)
                conditions.append(condition)
                if weight > 0:
                    terms.append(self.adversary.generator_term(step.pred_hidden, timestep, condition))
            if not terms:
                return None
            term = torch.stack(terms).mean()
            generator_terms.append(float(term.detach()))
            return weight * term

        metrics = train_trajectory(trajectory, sync=sync, chunk_hook=chunk_hook)
        if not math.isfinite(metrics.get("latent_grad_l1_min", 0.0)):
            metrics.pop("latent_grad_l1_min")  # no Predictor-made latent feeds a Predictor step in this schedule
        real, fake = torch.cat(reals), torch.cat(fakes)
        d_metrics = self.adversary.discriminator_pass(real, fake, torch.cat(timesteps), torch.cat(conditions),
                                                      train=DISCRIMINATOR in due)
        regression = metrics.pop("loss")
        generator = (sum(generator_terms) / len(generator_terms) if generator_terms
                     else -d_metrics["discriminator/fake_logit_mean"])
        metrics.update(d_metrics)
        metrics.update({
            "loss": regression + weight * generator if generator_terms else regression,
            "regression_loss": regression,
            "adversarial/weight": weight,
            "adversarial/generator_loss": generator,
            **hidden_monitors(fake, real),
        })
        return metrics


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    # 1. The run directory, named from the flags; a second launch continues it or finds it finished.
    start = plan_run(args, subset=run_tag(args))
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

        # 2. Data: the v4 offline batches, or one whole trajectory per rank per micro-batch.
        if args.data == "offline":
            dataset, batches, context_timestep = v4_pair_batches(
                args.dataset_root, split=args.split, pairs=args.pairs, source_layers=args.source_blocks,
                batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers,
                verify=args.verify_dataset, env=env)
            data_text = (f"{args.dataset_root} split {args.split}: {len(dataset.trajectories)} trajectories -> "
                         f"{len(dataset)} pairs ({format_pairs(args.pairs)}); {batches.batches_per_epoch()} "
                         "micro-batches per rank per epoch")
            per_rank = f"{args.batch_size} pairs"
        else:
            dataset_config = read_dataset_config(args.dataset_root)
            sample_table = args.sample_table or recorded_sample_table(args.dataset_root, args.split)
            dataset = TrajectoryTableDataset(
                sample_table, dataset_root=args.dataset_root,
                num_latents=int(config_field(dataset_config, "num_latents", args.dataset_root)),
                verify=args.verify_dataset)
            batches = one_item_per_rank_batches(dataset, env, seed=args.seed, num_workers=args.num_workers)
            rollout_config = RolloutConfig.from_dataset_config(
                dataset_config, str(Path(args.dataset_root) / DATASET_CONFIG_NAME),
                state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype)
            data_text = (f"{sample_table}: {len(dataset)} trajectories, chunks 1.. "
                         f"{'-'.join(Schedule(args.replace_steps).letters())}; {batches.batches_per_epoch()} per "
                         "rank per epoch")
            per_rank = "1 trajectory"

        # 3. Teacher -> Predictor, built as train_predictor_v4.py builds it (same seeding), then --init_from. The
        #    offline mode drops the Teacher (the Predictor shares the frozen modules it runs); the rollout keeps it
        #    for the online labels.
        teacher_source = resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root)
        teacher = load_teacher(teacher_source, env.device, policy.frozen_dtype)
        log0(describe_teacher(teacher_source, teacher))
        torch.manual_seed(args.seed)  # the same fusion/head initialisation on every rank
        predictor = build_predictor(teacher, VARIANT, args.source_blocks, args.gradient_checkpointing)
        teacher_layers = teacher.num_layers
        if args.data == "offline":
            del teacher
        seed_everything(args.seed, rank=env.rank)
        init_meta = None
        if start.resume_path is None and args.init_from is not None:
            init_meta = load_model_weights(args.init_from, predictor, role=PREDICTOR,
                                           expect={"variant": VARIANT, "source_blocks": list(args.source_blocks)})

        # 4. The discriminator, from its own random stream: the global RNG (the Predictor's, the data's) is left
        #    exactly as the v4 recipe leaves it. The same weights on every rank.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(args.seed, DISCRIMINATOR_STREAM))
            discriminator = HiddenDiscriminator(predictor.hidden_size, width=args.discriminator_width)
        discriminator = discriminator.to(env.device)

        # 5. Optimizers and schedules: the Predictor's as the v4 recipe's; the discriminator's AdamW with a cosine
        #    over its own updates.
        optimizer, lr_schedule = build_optimizer_and_schedule(predictor, args)
        d_optimizer = build_optimizer({DISCRIMINATOR: list(discriminator.parameters())},
                                      {DISCRIMINATOR: args.discriminator_lr},
                                      betas=(args.discriminator_adam_beta1, args.discriminator_adam_beta2),
                                      weight_decay=args.discriminator_weight_decay)
        d_schedule = WarmupCosineSchedule(d_optimizer, warmup_steps=0,
                                          max_steps=args.max_steps // args.discriminator_every)

        # 6. The roles: the DDP-wrapped Predictor every step; the discriminator on its cadence, its gradients
        #    averaged over ranks by the loop. Resume restores both and the data position.
        model = wrap_ddp(predictor, env)
        predictor_role = Role(PREDICTOR, predictor, optimizer, lr_schedule, module=model, grad_clip=args.grad_clip)
        discriminator_role = Role(DISCRIMINATOR, discriminator, d_optimizer, d_schedule,
                                  every=args.discriminator_every, grad_clip=args.discriminator_grad_clip,
                                  grad_sync="all_reduce")
        roles = [predictor_role, discriminator_role]
        meta = checkpoint_meta(VARIANT, args.source_blocks, args.precision, recipe=f"adversarial_{args.data}")
        run_state = RunState()
        if start.resume_path is not None:
            run_state = load_training_state(start.resume_path, roles=roles, expect=meta)
            batches.load_state_dict(run_state.data)
        adversary = Adversary(discriminator, predictor_role, discriminator_role, adv_weight=args.adv_weight,
                              adv_warmup_steps=args.adv_warmup_steps, r1_weight=args.r1_weight,
                              r1_every=args.r1_every)

        # 7. Config and summary.
        global_batch_items = (args.batch_size if args.data == "offline" else 1) * env.world_size * args.grad_accum
        config = run_config(
            args, run_name=start.run_name, variant=VARIANT, recipe=f"adversarial_{args.data}",
            world_size=env.world_size, device=str(env.device), backend=env.backend, global_batch=global_batch_items,
            num_items=len(dataset), micro_batches_per_epoch=batches.batches_per_epoch(), init_meta=init_meta,
            predictor=predictor.predictor_config(), teacher_double_blocks=teacher_layers,
            discriminator={"hidden_size": predictor.hidden_size, "width": args.discriminator_width,
                           "parameters": sum(p.numel() for p in discriminator.parameters())},
            environment=environment_summary(),
        )
        if env.is_main:
            write_train_config(start.run_dir, config)
        log_summary(f"DisCa-style adversarial Predictor training ({VARIANT}, {args.data})", {
            **recipe_summary_rows(args, run_dir=start.run_dir, precision=policy.describe(), optimizer=optimizer,
                                  first_step=run_state.global_step + 1, stop_step=start.stop_step),
            "init": (f"{start.resume_path} (training state)" if start.resume_path else
                     f"{args.init_from} (Predictor weights only)" if args.init_from else "fresh Predictor"),
            "adversarial": f"+ w * -mean D(pred_h), w -> {args.adv_weight:g} over {args.adv_warmup_steps} updates; "
                           f"D: hinge + R1 {args.r1_weight:g} every {args.r1_every} D updates, lr "
                           f"{args.discriminator_lr:g}, every {args.discriminator_every} steps, width "
                           f"{args.discriminator_width} ({config['derived']['discriminator']['parameters']:,} params)",
            "data": data_text,
            "batch": f"{per_rank} per rank x {env.world_size} ranks x {args.grad_accum} accumulation",
        })

        # 8. Train: the step of the data mode and the shared loop.
        if args.data == "offline":
            step_fn = AdversarialPairStep(model=model, predictor=predictor, policy=policy,
                                          context_timestep=context_timestep, adversary=adversary,
                                          velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight)
        else:
            settings = SelfRolloutSettings(velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight,
                                           predictor_autocast_dtype=policy.autocast_dtype,
                                           replace_steps=tuple(args.replace_steps))
            step_fn = AdversarialRolloutStep(model=model, teacher=teacher, dataset=dataset,
                                             rollout_config=rollout_config, settings=settings,
                                             adversary=adversary, source_blocks=args.source_blocks, env=env)
        with MetricsLogger(start.run_dir, env, tracker=args.tracker, project=args.swanlab_project,
                           experiment=args.experiment_name or start.run_name, config=config,
                           swanlab_mode=args.swanlab_mode) as metrics_logger:
            train_loop(
                roles=roles, batches=batches, step_fn=step_fn, run_dir=start.run_dir, env=env, run_state=run_state,
                max_steps=args.max_steps, stop_at_step=start.stop_step, grad_accum=args.grad_accum,
                ckpt_every=args.ckpt_every, keep_last=args.keep_last, log_every=args.log_every,
                metrics_logger=metrics_logger, config=config, meta=meta, progress=not args.no_progress,
            )
        return 0
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
