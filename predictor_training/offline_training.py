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

from predictor_training.checkpoint import RunState
from predictor_training.data.pair_dataset import PairDataset, collate_pairs, config_field, read_dataset_config
from predictor_training.data.samplers import BucketBatchSampler
from predictor_training.distributed import (
    DistEnv,
    cleanup_distributed,
    init_distributed,
    maybe_no_sync,
    seed_everything,
)
from predictor_training.loop import ResumableBatches
from predictor_training.losses import predictor_loss
from predictor_training.predictor import Predictor, build_predictor, text_kv_from_stacked
from predictor_training.training_setup import (
    BatchLayout,
    PrecisionPolicy,
    build_optimizer_and_schedule,
    checkpoint_meta,
    environment_summary,
    format_pairs,
    load_teacher,
    resume_and_train,
    run_config,
    start_run,
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
    try:
        # 1. Run directory, RNG, precision, data.
        run_dir, policy = start_run(args, env)
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

        # 3. Config.
        layout = BatchLayout(args.batch_size, env.world_size, args.grad_accum)
        config = run_config(
            args, variant=variant, env=env, layout=layout, num_pairs=len(dataset),
            num_trajectories=len(dataset.trajectories), micro_batches_per_epoch=batches.batches_per_epoch(),
            predictor=predictor.predictor_config(), teacher_double_blocks=teacher_layers,
            context_timestep=context_timestep, environment=environment_summary(),
        )
        optimizer_steps_per_epoch = batches.batches_per_epoch() // args.grad_accum

        # 4. Resume, summary, train.
        return resume_and_train(
            args, env=env, run_dir=run_dir, policy=policy, predictor=predictor, optimizer=optimizer,
            lr_schedule=lr_schedule, batches=batches, layout=layout, config=config,
            meta=checkpoint_meta(variant, args.source_blocks, args.precision),
            title=f"offline Predictor training ({variant})",
            model_rows={"variant": f"{variant}, source blocks {list(args.source_blocks)}, "
                                   f"pairs {format_pairs(args.pairs)}"},
            data_row=f"{args.dataset_root} split {args.split}: {len(dataset.trajectories)} trajectories -> "
                     f"{len(dataset)} pairs; {batches.batches_per_epoch()} micro-batches per rank per epoch "
                     f"(~{optimizer_steps_per_epoch} optimizer steps)",
            make_step_fn=lambda model: partial(pair_step, model=model, predictor=predictor, policy=policy,
                                               context_timestep=context_timestep),
        )
    finally:
        cleanup_distributed()


def add_offline_args(parser: argparse.ArgumentParser, variant: str) -> None:
    """Flags only the offline recipes have (disca: --include_chunk0)."""
    if variant == "disca":
        parser.add_argument_group("disca").add_argument(
            "--include_chunk0", action="store_true",
            help="also train on chunk 0 (the user's recipe used chunks 1-7: 400 trajectories x 7 x 3 = 8400 pairs)",
        )
