"""Offline (teacher-forcing) Predictor training on stored pairs: the pair step and the run shared by v4 and disca.

One item is one pair (anchor step j -> target step k) of one chunk (`PairDataset`). The step, per micro-batch:

    context   = frozen projector(stored pre-features of the source layers)      v4 only, no_grad
    pred_h, pred_v = Predictor(x_k | cond, h_j [, h_k of chunk c-1], context)   BF16 autocast ("fp32master")
    loss      = 1.0 * mse(pred_v, v_teacher) + 0.1 * mse(pred_h, h_teacher)     FP32
    loss.backward()                                                             under maybe_no_sync(not sync)

Variants (SPEC §3.2, notes §4): v4 reads pre-features and the previous chunk's hidden (chunk 0 has neither, so
chunks 1-7), and batches are bucketed by the number of context frames; disca reads neither and uses a plain
DistributedSampler, on chunks 1-7 by default like the user's recipe (`--include_chunk0` adds chunk 0).
`run_offline_training(args, variant)` wires the shared pieces and calls the one training loop (`loop.train_loop`).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from predictor_training.checkpoint import RunState, load_training_state
from predictor_training.data.pair_dataset import PairDataset, collate_pairs, config_field, read_dataset_config
from predictor_training.data.samplers import BucketBatchSampler
from predictor_training.distributed import (
    DistEnv,
    cleanup_distributed,
    init_distributed,
    log0,
    maybe_no_sync,
    seed_everything,
    wrap_ddp,
)
from predictor_training.logger import MetricsLogger
from predictor_training.loop import ResumableBatches, train_loop
from predictor_training.losses import predictor_loss
from predictor_training.predictor import Predictor, build_predictor, text_kv_from_stacked
from predictor_training.training_setup import (
    BatchLayout,
    PrecisionPolicy,
    build_optimizer_and_schedule,
    checkpoint_meta,
    environment_summary,
    experiment_name,
    format_pairs,
    load_teacher,
    log_block,
    precision_policy,
    prepare_run_dir,
    run_config,
    startup_summary,
    write_train_config,
)

OFFLINE_VARIANTS = ("v4", "disca")
VELOCITY_WEIGHT = 1.0
HIDDEN_WEIGHT = 0.1


# ---------------------------------------------------------------------------------------------------------------
# 1. Data
# ---------------------------------------------------------------------------------------------------------------
def build_pair_dataset(args: argparse.Namespace, variant: str) -> PairDataset:
    """The split's pairs: v4 with pre-features and previous-chunk hidden; disca with neither (chunk 0 only with
    --include_chunk0)."""
    uses_context = variant == "v4"
    return PairDataset(
        args.dataset_root,
        split=args.split,
        pairs=args.pairs,
        with_prefeatures=uses_context,
        with_prev_chunk_hidden=uses_context,
        source_layers=tuple(args.source_blocks),
        verify=args.verify_dataset,
        include_chunk0=None if uses_context else args.include_chunk0,
    )


def build_pair_batches(dataset: PairDataset, args: argparse.Namespace, env: DistEnv, variant: str) -> ResumableBatches:
    """Resumable micro-batches of this rank: v4 buckets by n_ctx (one context length per batch); disca draws from a
    plain DistributedSampler. Both drop incomplete batches, so every rank sees the same number per epoch."""
    common = dict(
        dataset=dataset,
        collate_fn=collate_pairs,
        num_workers=args.num_workers,
        pin_memory=env.device.type == "cuda",
        seed=args.seed,
    )
    if variant == "v4":
        sampler = BucketBatchSampler(
            dataset.n_ctx_list(), args.batch_size, num_replicas=env.world_size, rank=env.rank, seed=args.seed,
            drop_last=True,
        )
        return ResumableBatches(sampler, batch_size=None, **common)
    if len(dataset) < args.batch_size * env.world_size:
        raise ValueError(
            f"{len(dataset)} pairs cannot fill one batch of {args.batch_size} on each of {env.world_size} ranks; "
            "lower --batch_size"
        )
    sampler = DistributedSampler(
        dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=args.seed, drop_last=True
    )
    return ResumableBatches(sampler, batch_size=args.batch_size, drop_last=True, **common)


def move_batch(batch: dict, device: torch.device) -> dict:
    """Tensors (and the pre-feature dict) of a collated batch onto `device`; other values unchanged."""
    non_blocking = device.type == "cuda"
    moved = {}
    for name, value in batch.items():
        if isinstance(value, Tensor):
            moved[name] = value.to(device, non_blocking=non_blocking)
        elif isinstance(value, dict):
            moved[name] = {key: tensor.to(device, non_blocking=non_blocking) for key, tensor in value.items()}
        else:
            moved[name] = value
    return moved


# ---------------------------------------------------------------------------------------------------------------
# 2. The pair step
# ---------------------------------------------------------------------------------------------------------------
def predict_pairs(
    batch: dict, *, model: nn.Module, predictor: Predictor, policy: PrecisionPolicy, context_timestep: float
) -> tuple[Tensor, Tensor]:
    """Forward of one collated batch (already on the device) -> (pred_hidden [B, N, D] fp32, pred_velocity
    [B, C, T, H, W]).

    model: the DDP wrapper (or the Predictor itself); predictor: the unwrapped Predictor (its frozen context
    projector runs outside DDP under no_grad: the context is a label-side input, never trained).
    """
    noisy_input = batch["noisy_input"]  # [B, 2C+1, T, H, W]
    batch_size, _, frames, height, width = noisy_input.shape
    timestep = batch["timestep"][:, None].expand(batch_size, frames)  # one timestep per item -> [B, T]
    text_kv = text_kv_from_stacked(batch["text_k"], batch["text_v"], batch["text_mask"])
    with policy.autocast():
        context, prev_chunk_hidden = None, None
        if predictor.variant == "v4":
            n_ctx = batch["n_ctx"]
            ctx_timestep = torch.full((batch_size, n_ctx), context_timestep, device=noisy_input.device)
            context = predictor.context_from_prefeatures(
                batch["ctx_prefeatures"], ctx_timestep, batch["ctx_action"], batch["ctx_viewmats"], batch["ctx_Ks"],
                height=height, width=width,
            )
            prev_chunk_hidden = batch["prev_chunk_hidden"]
        return model(
            noisy_input, batch["anchor_hidden"], timestep, batch["action"], batch["viewmats"], batch["Ks"], text_kv,
            context=context, prev_chunk_hidden=prev_chunk_hidden,
        )


def pair_step(
    batch: dict,
    *,
    sync: bool,
    model: nn.Module,
    predictor: Predictor,
    policy: PrecisionPolicy,
    context_timestep: float,
) -> dict[str, float]:
    """One micro-batch: forward, FP32 loss, backward (all-reduce only when `sync`). Returns detached floats
    {"loss", "hidden_mse", "velocity_mse"} for `train_loop`."""
    batch = move_batch(batch, policy.device)
    with maybe_no_sync(model, enabled=not sync):
        pred_hidden, pred_velocity = predict_pairs(
            batch, model=model, predictor=predictor, policy=policy, context_timestep=context_timestep
        )
        loss, metrics = predictor_loss(
            pred_hidden, pred_velocity, batch["target_hidden"], batch["target_velocity"],
            hidden_weight=HIDDEN_WEIGHT, velocity_weight=VELOCITY_WEIGHT,
        )
        loss.backward()
    return {name: float(value) for name, value in metrics.items()}


# ---------------------------------------------------------------------------------------------------------------
# 3. The run
# ---------------------------------------------------------------------------------------------------------------
def run_offline_training(args: argparse.Namespace, variant: str) -> RunState:
    """Train a `variant` Predictor on the stored pairs of `args.dataset_root` with the flags of the entry scripts.
    Every rank calls it (under torchrun or as plain python). Returns the final RunState."""
    if variant not in OFFLINE_VARIANTS:
        raise ValueError(f"run_offline_training: variant={variant!r}; expected one of {OFFLINE_VARIANTS}")
    env = init_distributed(args.backend)
    metrics_logger = None
    try:
        # 1. Run directory, RNG, precision, data.
        run_dir = prepare_run_dir(args.output_dir, args.resume, env)
        seed_everything(args.seed, rank=env.rank)
        policy = precision_policy(args.precision, env.device)
        dataset = build_pair_dataset(args, variant)
        context_timestep = float(config_field(read_dataset_config(args.dataset_root), "context_timestep",
                                              args.dataset_root))
        batches = build_pair_batches(dataset, args, env, variant)

        # 2. Teacher -> Predictor. The Predictor shares the few frozen Teacher modules it runs; dropping our
        #    reference to the Teacher frees every other block.
        teacher = load_teacher(args, env.device)
        torch.manual_seed(args.seed)  # the same fusion/head initialisation on every rank
        predictor = build_predictor(teacher, variant, args.source_blocks, args.gradient_checkpointing)
        teacher_layers = teacher.num_layers
        del teacher
        seed_everything(args.seed, rank=env.rank)
        optimizer, lr_schedule = build_optimizer_and_schedule(predictor, args)

        # 3. Config, resume.
        layout = BatchLayout(args.batch_size, env.world_size, args.grad_accum)
        meta = checkpoint_meta(variant, args.source_blocks, args.precision)
        config = run_config(
            args, variant=variant, env=env, layout=layout, num_pairs=len(dataset),
            num_trajectories=len(dataset.trajectories), micro_batches_per_epoch=batches.batches_per_epoch(),
            predictor=predictor.predictor_config(), teacher_double_blocks=teacher_layers,
            context_timestep=context_timestep, environment=environment_summary(),
        )
        run_state = RunState()
        if args.resume is not None:
            run_state = load_training_state(args.resume, model=predictor, optimizer=optimizer,
                                            lr_schedule=lr_schedule, expect=meta)
            batches.load_state_dict(run_state.data)
            log0(f"resumed from {args.resume} at step {run_state.global_step} (epoch {run_state.epoch})")
        write_train_config(run_dir, config, env)
        stop_step = args.max_steps if args.stop_at_step == -1 else args.stop_at_step
        optimizer_steps_per_epoch = batches.batches_per_epoch() // args.grad_accum
        log_block(startup_summary(
            title=f"offline Predictor training ({variant})",
            optimizer=optimizer, layout=layout, max_steps=args.max_steps, stop_step=stop_step,
            resume_step=run_state.global_step,
            extra={
                "run dir": str(run_dir),
                "variant": f"{variant}, source blocks {list(args.source_blocks)}, pairs {format_pairs(args.pairs)}",
                "precision": policy.describe(),
                "data": f"{args.dataset_root} split {args.split}: {len(dataset.trajectories)} trajectories -> "
                        f"{len(dataset)} pairs; {batches.batches_per_epoch()} micro-batches per rank per epoch "
                        f"(~{optimizer_steps_per_epoch} optimizer steps)",
                "schedule": f"lr fusion {args.fusion_lr:g}, blocks {args.blocks_lr:g}; warmup "
                            f"{args.scheduler_warmup_steps}, block warmup {args.block_warmup_steps}, cosine to 0",
                "checkpoints": f"every {args.ckpt_every} steps, keep {args.keep_last}",
                "tracker": args.tracker,
            },
        ))

        # 4. Train.
        model = wrap_ddp(predictor, env)
        metrics_logger = MetricsLogger(run_dir, env, tracker=args.tracker, project=args.swanlab_project,
                                       experiment=experiment_name(args, run_dir), config=config,
                                       swanlab_mode=args.swanlab_mode)
        step_fn = partial(pair_step, model=model, predictor=predictor, policy=policy,
                          context_timestep=context_timestep)
        return train_loop(
            ddp_model=model, raw_model=predictor, optimizer=optimizer, lr_schedule=lr_schedule, batches=batches,
            step_fn=step_fn, run_dir=run_dir, env=env, run_state=run_state, max_steps=args.max_steps,
            grad_accum=args.grad_accum, grad_clip=args.grad_clip, ckpt_every=args.ckpt_every,
            keep_last=args.keep_last, log_every=args.log_every, metrics_logger=metrics_logger, config=config,
            meta=meta, progress=not args.no_progress, stop_at_step=stop_step,
        )
    finally:
        if metrics_logger is not None:
            metrics_logger.close()
        cleanup_distributed()


def add_offline_args(parser: argparse.ArgumentParser, variant: str) -> None:
    """Flags only the offline recipes have (disca: --include_chunk0)."""
    if variant == "disca":
        parser.add_argument_group("disca").add_argument(
            "--include_chunk0", action="store_true",
            help="also train on chunk 0 (the user's recipe used chunks 1-7: 400 trajectories x 7 x 3 = 8400 pairs)",
        )
