"""Where the time of one offline training step goes: data, forward, backward, optimizer, and the loop's overhead.

    python benchmarks/bench_offline_step.py                                   # tiny dataset in a temporary folder
    python benchmarks/bench_offline_step.py --dataset_root demo_data/dataset --source_blocks 1,2   # the CPU demo data
    python benchmarks/bench_offline_step.py --variant disca --precision fp32master --batch_size 16   # on a GPU

Two passes over the same configuration, each on freshly built components (Predictor, AdamW, schedule, batches):

1. instrumented: the pair step written out phase by phase, with a device sync after each phase:
   data (next batch + copy to the device), forward (context projection, Predictor, FP32 loss), backward,
   optimizer (clip, AdamW, schedule, zero_grad);
2. the real loop: `train_loop` with `pair_step.pair_step`, timed by the loop itself (`time/step_s` of
   train_log.jsonl, which also covers the metric all-reduce, the finite checks and the logging).

Reported: the median of each phase over the timed steps (after --warmup untimed steps), and the overhead ratio
loop step / (forward + backward + optimizer) and loop step / (data + forward + backward + optimizer). A ratio near 1
means the loop adds little around the compute. Nothing is written outside a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

import train_predictor_v4
from predictor_training.data.pair_dataset import disca_pair_batches, v4_pair_batches
from predictor_training.data.synthetic import write_tiny_teacher_dataset
from predictor_training.recipes.offline import finish_offline_args
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.distributed import cleanup_distributed, init_distributed, seed_everything
from predictor_training.runtime.logger import MetricsLogger
from predictor_training.runtime.loop import train_loop
from predictor_training.predictor.loss import predictor_loss
from predictor_training.runtime.optim import BLOCKS_GROUP, FUSION_GROUP, TwoGroupLRSchedule, build_optimizer
from predictor_training.predictor.pair_step import move_batch, pair_step, predict_pairs
from predictor_training.runtime.precision import precision_policy, synchronize
from predictor_training.predictor.model import build_predictor
from predictor_training.runtime.roles import Role
from predictor_training.teacher.source import load_teacher
from predictor_training.data.dataset_config import resolve_teacher_source

PHASES = ("data", "forward", "backward", "optimizer")
# The two variants' data, as their scripts build it (disca at its default, chunks 1-7).
DATA = {"v4": v4_pair_batches, "disca": partial(disca_pair_batches, include_chunk0=False)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset_root", type=Path, default=None,
                        help="dataset to read; default: the package's tiny dataset (data/synthetic.py "
                             "write_tiny_teacher_dataset: a 2-block tiny Teacher) written to a temporary folder")
    parser.add_argument("--variant", choices=sorted(DATA), default="v4", help="Predictor variant")
    parser.add_argument("--source_blocks", type=str, default="0,1", help="source blocks 'a,b' (demo data: 1,2)")
    parser.add_argument("--precision", choices=("fp32", "fp32master"), default="fp32", help="precision mode")
    parser.add_argument("--batch_size", type=int, default=4, help="micro-batch")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per pass")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    parser.add_argument("--no_gradient_checkpointing", dest="gradient_checkpointing", action="store_false",
                        help="time without the non-reentrant checkpointing of the two blocks (on in the recipe)")
    parser.add_argument("--json_out", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.warmup < 1:
        parser.error(f"--steps={args.steps} must be >= 3 and --warmup={args.warmup} >= 1")
    return args


def training_args(bench: argparse.Namespace, dataset_root: Path, run_dir: Path) -> argparse.Namespace:
    """The offline recipe's own flags for this configuration (so the benchmark times the recipe's real wiring)."""
    total = bench.warmup + bench.steps
    argv = ["--dataset_root", str(dataset_root), "--output_dir", str(run_dir), "--source_blocks", bench.source_blocks,
            "--precision", bench.precision, "--batch_size", str(bench.batch_size), "--max_steps", str(total),
            "--scheduler_warmup_steps", "1", "--block_warmup_steps", "-1", "--ckpt_every", "-1", "--num_workers", "0",
            "--tracker", "none", "--no_progress", "--log_every", "1"]
    if not bench.gradient_checkpointing:
        argv.append("--no-gradient_checkpointing")
    # train_predictor_v4.py's own parser: the recipe's values wherever the flags above set none (the learning rates
    # and loss weights change no step's time), and the benchmark's own run bookkeeping (name, kept checkpoints,
    # tracker project, validation videos; no step reads them).
    parser = train_predictor_v4.build_parser()
    parser.set_defaults(experiment=f"bench_offline_step_{bench.variant}", keep_last=1, swanlab_project="bench",
                        val_videos=1)
    args = finish_offline_args(parser, argv, {})
    args.variant = bench.variant
    return args


@dataclass
class Components:
    predictor: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: object
    batches: object
    policy: object
    context_timestep: float


def build_components(args: argparse.Namespace, env) -> Components:
    """The recipe's own data, Teacher, Predictor, AdamW and schedule for these flags."""
    seed_everything(args.seed, rank=0)
    _, batches, context_timestep = DATA[args.variant](
        args.dataset_root, split=args.split, pairs=args.pairs, source_layers=args.source_blocks,
        batch_size=args.batch_size, seed=args.seed, num_workers=args.num_workers, verify=args.verify_dataset, env=env)
    policy = precision_policy(args.precision, env.device)
    teacher = load_teacher(resolve_teacher_source(args.teacher, args.action_ckpt, args.dataset_root), env.device,
                           policy.frozen_dtype)
    predictor = build_predictor(teacher, args.variant, args.source_blocks, args.gradient_checkpointing)
    optimizer = build_optimizer(predictor.trainable_parameter_groups(),
                                {FUSION_GROUP: args.fusion_lr, BLOCKS_GROUP: args.blocks_lr},
                                betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay)
    lr_schedule = TwoGroupLRSchedule(optimizer, warmup_steps=args.scheduler_warmup_steps, max_steps=args.max_steps,
                                     block_warmup_steps=args.block_warmup_steps)
    return Components(predictor, optimizer, lr_schedule, batches, policy, context_timestep)


def instrumented_pass(args: argparse.Namespace, env, total_steps: int) -> dict[str, list[float]]:
    """Seconds per phase for each step."""
    parts = build_components(args, env)
    device = env.device
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    params = [param for group in parts.optimizer.param_groups for param in group["params"]]
    for _ in range(total_steps):
        start = time.perf_counter()
        batch = move_batch(next(parts.batches), device)
        synchronize(device)
        loaded = time.perf_counter()
        pred_hidden, pred_velocity = predict_pairs(batch, model=parts.predictor, predictor=parts.predictor,
                                                   policy=parts.policy, context_timestep=parts.context_timestep)
        loss, _ = predictor_loss(pred_hidden, pred_velocity, batch["target_hidden"], batch["target_velocity"],
                                 velocity_weight=args.velocity_weight, hidden_weight=args.hidden_weight)
        synchronize(device)
        forwarded = time.perf_counter()
        loss.backward()
        synchronize(device)
        backwarded = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        parts.optimizer.step()
        parts.lr_schedule.step()
        parts.optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        stepped = time.perf_counter()
        for phase, seconds in zip(PHASES, (loaded - start, forwarded - loaded, backwarded - forwarded,
                                           stepped - backwarded)):
            times[phase].append(seconds)
    return times


def loop_pass(args: argparse.Namespace, env) -> list[float]:
    """`time/step_s` of every step of a real `train_loop` run."""
    parts = build_components(args, env)
    run_dir = Path(args.output_dir)
    step_fn = partial(pair_step, model=parts.predictor, predictor=parts.predictor, policy=parts.policy,
                      context_timestep=parts.context_timestep, velocity_weight=args.velocity_weight,
                      hidden_weight=args.hidden_weight)
    role = Role("predictor", parts.predictor, parts.optimizer, parts.lr_schedule, grad_clip=args.grad_clip)
    with MetricsLogger(run_dir, env) as metrics_logger:
        train_loop(roles=[role], batches=parts.batches, step_fn=step_fn, run_dir=run_dir, env=env,
                   run_state=RunState(), max_steps=args.max_steps, grad_accum=1, ckpt_every=-1, keep_last=1,
                   log_every=1, metrics_logger=metrics_logger, config={},
                   meta={"variant": args.variant, "source_blocks": list(args.source_blocks),
                         "precision": args.precision}, progress=False)
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return [record["time/step_s"] for record in records]


def main(argv=None) -> dict:
    bench = parse_args(argv)
    env = init_distributed("auto")
    try:
        with tempfile.TemporaryDirectory(prefix="bench_offline_step_") as scratch:
            scratch = Path(scratch)
            dataset_root = bench.dataset_root or write_tiny_teacher_dataset(scratch / "tiny")
            args = training_args(bench, dataset_root, scratch / "run")
            total = bench.warmup + bench.steps
            phases = instrumented_pass(args, env, total)
            loop_steps = loop_pass(args, env)
    finally:
        cleanup_distributed()

    median = {phase: statistics.median(values[bench.warmup:]) for phase, values in phases.items()}
    compute = median["forward"] + median["backward"] + median["optimizer"]
    loop_step = statistics.median(loop_steps[bench.warmup:])
    figures = {
        "config": {"dataset_root": str(bench.dataset_root or "tiny (temporary)"), "variant": bench.variant,
                   "source_blocks": bench.source_blocks, "precision": bench.precision,
                   "batch_size": bench.batch_size, "device": str(env.device), "threads": torch.get_num_threads(),
                   "timed_steps": bench.steps, "gradient_checkpointing": bench.gradient_checkpointing},
        "median_s": {**median, "compute": compute, "data+compute": compute + median["data"], "loop_step": loop_step},
        "overhead_ratio_vs_compute": loop_step / compute,
        "overhead_ratio_vs_data_plus_compute": loop_step / (compute + median["data"]),
    }
    print(f"config: {figures['config']}")
    for name, seconds in figures["median_s"].items():
        print(f"  {name:<13} {seconds * 1000:9.2f} ms")
    print(f"  loop step / (forward+backward+optimizer)      = {figures['overhead_ratio_vs_compute']:.3f}")
    print(f"  loop step / (data+forward+backward+optimizer) = {figures['overhead_ratio_vs_data_plus_compute']:.3f}")
    if bench.json_out is not None:
        bench.json_out.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
