"""torchrun worker of tests/test_fsdp.py: full-parameter FSDP2 training of a tiny WorldPlayTransformer on gloo.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py fresh  OUT   # full run, cut run (+ checks)
    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py resume OUT   # resume the cut run to the end
    torchrun --standalone --nproc_per_node 1 tests/fsdp_worker.py reload OUT   # the 2-rank checkpoint on 1 rank

The loop (written here on purpose; the shared `train_loop` is being generalised elsewhere): per step, GRAD_ACCUM
micro-batches, each a no-grad text and context prefill then a flow-matching loss through `chunk_step`
(x_sigma = (1 - sigma) x0 + sigma noise, target velocity noise - x0, one sigma per chunk), backward without a
gradient reduce-scatter except on the last micro-batch, `clip_grad_norm_` over the DTensor gradients, AdamW. Every
random number comes from a generator seeded by (step, micro-batch, rank), so a resume needs no RNG state.
Rank 0 writes what the test compares into OUT as torch files.
"""

from __future__ import annotations

import gc
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from predictor_training.distributed import cleanup_distributed, init_distributed
from predictor_training.fsdp import full_state_dicts, gradient_sync, is_fsdp, load_full_state_dicts, shard_model
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_

STEPS = 4
CUT_AT = 2
GRAD_ACCUM = 2
MAX_GRAD_NORM = 0.5
LR = 1e-3
FRAMES, CONTEXT_FRAMES, HEIGHT, WIDTH = 2, 2, 2, 3
TEXT_LEN, BYT5_LEN, VISION_LEN = 4, 3, 2


# ---------------------------------------------------------------------------------------------------------------
# 1. Model and data
# ---------------------------------------------------------------------------------------------------------------
def build_model(seed: int, device: torch.device | str = "cpu") -> WorldPlayTransformer:
    """Tiny preset (2 double blocks) with the upstream zero-initialised layers randomised, so every path trains."""
    with torch.device(device):
        torch.manual_seed(seed)
        model = WorldPlayTransformer.from_preset("tiny")
    if device != "meta":
        randomize_zero_initialised_(model, torch.Generator().manual_seed(seed + 1), scale=0.5)
    return model.train()


def make_batch(model: WorldPlayTransformer, step: int, micro: int, rank: int) -> dict:
    """One rank's micro-batch of step `step`: text, context frames, one noised chunk and its target velocity."""
    generator = torch.Generator().manual_seed(100_000 + 1000 * step + 10 * micro + rank)
    config = model.config
    channels = config.in_channels

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    def camera(frames):
        rotation, _ = torch.linalg.qr(randn(frames, 3, 3))
        viewmats = torch.eye(4).repeat(frames, 1, 1)
        viewmats[:, :3, :3] = rotation
        viewmats[:, :3, 3] = randn(frames, 3)
        Ks = torch.eye(3).repeat(frames, 1, 1)
        Ks[:, 0, 0] = Ks[:, 1, 1] = 0.8
        Ks[:, :2, 2] = 0.5
        return viewmats[None], Ks[None]

    text = dict(
        text_states=randn(1, TEXT_LEN, config.text_states_dim), text_mask=torch.ones(1, TEXT_LEN, dtype=torch.int64),
        byt5_states=randn(1, BYT5_LEN, config.byt5_states_dim), byt5_mask=torch.ones(1, BYT5_LEN, dtype=torch.int64),
        vision_states=randn(1, VISION_LEN, config.vision_states_dim),
    )
    context_viewmats, context_Ks = camera(CONTEXT_FRAMES)
    context = dict(
        hidden_states=randn(1, 2 * channels + 1, CONTEXT_FRAMES, HEIGHT, WIDTH),
        timestep=torch.full((CONTEXT_FRAMES,), 14.0),
        action=torch.randint(0, 81, (1, CONTEXT_FRAMES), generator=generator).float(),
        viewmats=context_viewmats, Ks=context_Ks,
    )
    clean, noise = randn(1, channels, FRAMES, HEIGHT, WIDTH), randn(1, channels, FRAMES, HEIGHT, WIDTH)
    sigma = torch.rand((), generator=generator)
    condition = randn(1, channels, FRAMES, HEIGHT, WIDTH)
    mask = torch.zeros(1, 1, FRAMES, HEIGHT, WIDTH)
    viewmats, Ks = camera(FRAMES)
    chunk = dict(
        hidden_states=torch.cat([(1 - sigma) * clean + sigma * noise, condition, mask], dim=1),
        timestep=torch.full((FRAMES,), 1000.0) * sigma,
        action=torch.randint(0, 81, (1, FRAMES), generator=generator).float(), viewmats=viewmats, Ks=Ks,
    )
    return {"text": text, "context": context, "chunk": chunk, "target": noise - clean}


def micro_batch_loss(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        text_kv = model.text_prefill(**batch["text"])
        context_kv, _ = model.context_prefill(**batch["context"], text_kv=text_kv)
    velocity = model.chunk_step(**batch["chunk"], text_kv=text_kv, context_kv=context_kv)
    return F.mse_loss(velocity, batch["target"])


# ---------------------------------------------------------------------------------------------------------------
# 2. The loop
# ---------------------------------------------------------------------------------------------------------------
def train_steps(model, optimizer, env, first_step: int, last_step: int) -> list[dict]:
    """Steps first_step..last_step (1-based); returns per step this rank's micro-batch losses and the grad norm."""
    records = []
    for step in range(first_step, last_step + 1):
        losses = []
        for micro in range(GRAD_ACCUM):
            with gradient_sync(model, enabled=micro == GRAD_ACCUM - 1):
                loss = micro_batch_loss(model, make_batch(model, step, micro, env.rank))
                (loss / GRAD_ACCUM).backward()
            losses.append(loss.item())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM))
        if not math.isfinite(grad_norm):
            raise RuntimeError(f"step {step}: grad norm {grad_norm}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"step": step, "losses": losses, "grad_norm": grad_norm})
    return records


def sharded(seed: int, env, device: str = "cpu"):
    model = shard_model(build_model(seed, device), env)
    assert is_fsdp(model) and is_fsdp(model.double_blocks[0])
    if device == "meta":
        model.to_empty(device=env.device)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01)


def gathered(records: list[dict]) -> list[list[dict]]:
    """Every rank's records, rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, records)
    return out


def save_training_state(path: Path, model, optimizer, step: int, env) -> None:
    """What a rank-0 `training_latest.pt` holds for the model: full CPU model + optimizer state."""
    model_state, optimizer_state = full_state_dicts(model, optimizer)
    if env.is_main:
        torch.save({"model": model_state, "optimizer": optimizer_state, "step": step,
                    "world_size": env.world_size}, path)
    dist.barrier()


# ---------------------------------------------------------------------------------------------------------------
# 3. Checks that ride along with the fresh run
# ---------------------------------------------------------------------------------------------------------------
def clip_check(env) -> dict:
    """clip_grad_norm_ on DTensor grads: the returned norm is the norm of the full (gathered) gradient, and the
    clipped grads are the full grads scaled by max_norm / (norm + 1e-6)."""
    model, _ = sharded(seed=5, env=env)
    loss = micro_batch_loss(model, make_batch(model, 1, 0, env.rank))
    loss.backward()
    before = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if p.grad is not None}
    reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before.values()]))
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    after = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    scale = MAX_GRAD_NORM / (float(reference) + 1e-6)
    max_clip_error = max(float((after[name] - before[name] * scale).abs().max()) for name in before)
    return {"norm_type": type(total).__name__, "norm": float(total), "reference": float(reference),
            "max_clip_error": max_clip_error}


def no_grad_forward_check(env) -> bool:
    """After a no-grad forward (a prefill) every parameter is still a DTensor shard, the root's included (FSDP2's
    default keeps the root unsharded then, and an optimizer built at that point would hold stale tensors)."""
    model = shard_model(build_model(seed=7), env)
    with torch.no_grad():
        model.text_prefill(**make_batch(model, 1, 0, env.rank)["text"])
    return all(isinstance(parameter, DTensor) for parameter in model.parameters())


def checkpointing_check(env) -> dict:
    """Activation checkpointing under FSDP: same loss and bitwise the same full gradients."""
    results = []
    for enabled in (False, True):
        model, _ = sharded(seed=6, env=env)
        model.set_gradient_checkpointing(enabled)
        loss = micro_batch_loss(model, make_batch(model, 1, 0, env.rank))
        loss.backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    (loss_off, grads_off), (loss_on, grads_on) = results
    return {"loss_equal": bool(torch.equal(loss_off, loss_on)), "same_keys": sorted(grads_off) == sorted(grads_on),
            "grads_equal": all(torch.equal(grads_off[name], grads_on[name]) for name in grads_off),
            "num_grads": len(grads_off)}


# ---------------------------------------------------------------------------------------------------------------
# 4. Phases
# ---------------------------------------------------------------------------------------------------------------
def fresh(out: Path, env) -> None:
    model, optimizer = sharded(seed=0, env=env)
    full_records = gathered(train_steps(model, optimizer, env, 1, STEPS))
    save_training_state(out / "full_final.pt", model, optimizer, STEPS, env)
    model, optimizer = sharded(seed=0, env=env)
    cut_records = gathered(train_steps(model, optimizer, env, 1, CUT_AT))
    save_training_state(out / "training_latest.pt", model, optimizer, CUT_AT, env)
    checks = {"clip": clip_check(env), "checkpointing": checkpointing_check(env),
              "sharded_after_no_grad_forward": no_grad_forward_check(env)}
    if env.is_main:
        torch.save({"full": full_records, "cut": cut_records, "checks": checks}, out / "fresh.pt")


def resume(out: Path, env) -> None:
    """A new process group; the model is built on the meta device (another init than the run that saved) and
    materialised by loading: only rank 0 reads the file and broadcasts."""
    model, optimizer = sharded(seed=99, env=env, device="meta")
    payload = torch.load(out / "training_latest.pt", map_location="cpu", weights_only=True) if env.is_main else None
    load_full_state_dicts(model, optimizer, payload and payload["model"], payload and payload["optimizer"],
                          broadcast_from_rank0=True)
    step = CUT_AT if payload is None else payload["step"]
    records = gathered(train_steps(model, optimizer, env, step + 1, STEPS))
    save_training_state(out / "resumed_final.pt", model, optimizer, STEPS, env)
    if env.is_main:
        torch.save({"resumed": records}, out / "resume.pt")


def reload(out: Path, env) -> None:
    """Another world size: every rank reads the 2-rank checkpoint; the state read back must be the saved one, and
    the next step's losses on this rank's data must be those of the 2-rank run."""
    model, optimizer = sharded(seed=99, env=env)
    payload = torch.load(out / "training_latest.pt", map_location="cpu", weights_only=True)
    load_full_state_dicts(model, optimizer, payload["model"], payload["optimizer"])
    save_training_state(out / "reloaded.pt", model, optimizer, payload["step"], env)  # written before it trains on
    records = gathered(train_steps(model, optimizer, env, payload["step"] + 1, payload["step"] + 1))
    if env.is_main:
        torch.save({"world_size": env.world_size, "records": records}, out / "reload.pt")


def main(phase: str, out: str) -> None:
    env = init_distributed("gloo")
    try:
        {"fresh": fresh, "resume": resume, "reload": reload}[phase](Path(out), env)
        # Free the sharded models (FSDP state holds reference cycles) and line the ranks up while the process group
        # is alive: gloo work still referenced at interpreter shutdown can abort the process (SIGABRT,
        # "terminate called without an active exception") after everything was written.
        gc.collect()
        dist.barrier()
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main(*sys.argv[1:])
