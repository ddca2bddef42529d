"""The offline (teacher-forcing) step on stored pairs, shared by `train_predictor_v4.py` and
`train_predictor_disca.py`.

One item is one pair (anchor step j -> target step k) of one chunk (`PairDataset`). Per micro-batch:

    context   = frozen projector(stored pre-features of the source layers)      v4 only, no_grad
    pred_h, pred_v = Predictor(x_k | cond, h_j [, h_k of chunk c-1], context)   BF16 autocast ("fp32master")
    loss      = velocity_weight * mse(pred_v, v_teacher) + hidden_weight * mse(pred_h, h_teacher)     FP32
    loss.backward()                                                             under maybe_no_sync(not sync)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from predictor_training.runtime.distributed import maybe_no_sync
from predictor_training.predictor.loss import predictor_loss
from predictor_training.runtime.precision import PrecisionPolicy
from predictor_training.predictor.model import Predictor, text_kv_from_stacked
from predictor_training.teacher import ContextKV


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


def predict_pairs(
    batch: dict, *, model: nn.Module, predictor: Predictor, policy: PrecisionPolicy, context_timestep: float,
    release_prefeatures: bool = False,
) -> tuple[Tensor, Tensor]:
    """Forward of one collated batch (already on the device) -> (pred_hidden [B, N, D] fp32, pred_velocity
    [B, C, T, H, W]).

    model: the DDP wrapper (or the Predictor itself); predictor: the unwrapped Predictor (its frozen context
    projector runs outside DDP under no_grad: the context is a label-side input, never trained).
    """
    pred_hidden, pred_velocity, _ = predict_pairs_with_context(
        batch, model=model, predictor=predictor, policy=policy, context_timestep=context_timestep,
        release_prefeatures=release_prefeatures)
    return pred_hidden, pred_velocity


def predict_pairs_with_context(
    batch: dict, *, model: nn.Module, predictor: Predictor, policy: PrecisionPolicy, context_timestep: float,
    release_prefeatures: bool = False,
) -> tuple[Tensor, Tensor, ContextKV | None]:
    """`predict_pairs`, also returning the context K/V the Predictor saw (v4: one layer per source block, built
    by the frozen projector from the stored pre-features, no graph; disca: None). The adversarial recipe conditions
    its discriminator on it (fvtools/train_adversarial.py).

    release_prefeatures: remove "ctx_prefeatures" from `batch` once the context is built, so that the device copy
    of the pre-features (3.8 GiB at batch 16 and 20 context frames) is not alive through the forward and backward;
    for a caller that owns the dict (pair_step's moved batch)."""
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
            if release_prefeatures:
                del batch["ctx_prefeatures"]
            prev_chunk_hidden = batch["prev_chunk_hidden"]
        pred_hidden, pred_velocity = model(
            noisy_input, batch["anchor_hidden"], timestep, batch["action"], batch["viewmats"], batch["Ks"], text_kv,
            context=context, prev_chunk_hidden=prev_chunk_hidden,
        )
    return pred_hidden, pred_velocity, context


def pair_step(
    batch: dict,
    *,
    sync: bool,
    due: frozenset[str],
    model: nn.Module,
    predictor: Predictor,
    policy: PrecisionPolicy,
    context_timestep: float,
    velocity_weight: float,
    hidden_weight: float,
) -> dict[str, float]:
    """One micro-batch: forward, FP32 loss, backward (all-reduce only when `sync`). Returns detached floats
    {"loss", "hidden_mse", "velocity_mse"} for `train_loop`. `due` is the loop's set of roles due at this step:
    the offline recipes have one role, "predictor", due every step.

    Bind everything but the batch with `functools.partial` to get the loop's `step_fn(batch, *, sync)`."""
    if due != {"predictor"}:
        raise ValueError(f"pair_step trains the role 'predictor' every step; the loop says {sorted(due)} are due")
    batch = move_batch(batch, policy.device)  # a new dict: the pre-features may be released from it
    with maybe_no_sync(model, enabled=not sync):
        pred_hidden, pred_velocity = predict_pairs(
            batch, model=model, predictor=predictor, policy=policy, context_timestep=context_timestep,
            release_prefeatures=True,
        )
        loss, metrics = predictor_loss(
            pred_hidden, pred_velocity, batch["target_hidden"], batch["target_velocity"],
            velocity_weight=velocity_weight, hidden_weight=hidden_weight,
        )
        loss.backward()
    return {name: float(value) for name, value in metrics.items()}
