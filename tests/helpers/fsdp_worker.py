"""torchrun worker of tests/runtime/test_fsdp.py and tests/runtime/test_sharded_checkpoint.py: full-parameter FSDP2
training of a tiny WorldPlayTransformer on gloo.

    torchrun --standalone --nproc_per_node 2 tests/helpers/fsdp_worker.py fresh  OUT   # full run, cut run (+ checks)
    torchrun --standalone --nproc_per_node 2 tests/helpers/fsdp_worker.py resume OUT   # resume the cut run to the end
    torchrun --standalone --nproc_per_node 1 tests/helpers/fsdp_worker.py reload OUT   # the 2-rank checkpoint on 1 rank
    torchrun --standalone --nproc_per_node 2 tests/helpers/fsdp_worker.py loop   OUT   # an FSDP role in train_loop
    KILL_AT=writing:2 torchrun ... tests/helpers/fsdp_worker.py killed RUN          # the loop, SIGKILLed inside save 2
    torchrun --standalone --nproc_per_node N tests/helpers/fsdp_worker.py reshard SRC DST  # a sharded folder on N ranks
    python tests/helpers/fsdp_worker.py serve    # what the tests launch with: these phases' ranks forked (section 7)

The phases fresh/resume/reload use a loop written here (the FSDP helpers on their own): per step, GRAD_ACCUM
micro-batches, each a no-grad text and context prefill then a flow-matching loss through `chunk_step`
(x_sigma = (1 - sigma) x0 + sigma noise, target velocity noise - x0, one sigma per chunk), backward without a
gradient reduce-scatter except on the last micro-batch, `clip_grad_norm_` over the DTensor gradients, AdamW. Every
random number comes from a generator seeded by (step, micro-batch, rank), so a resume needs no RNG state.
Rank 0 writes what the test compares into OUT as torch files.

The phase loop trains the same model as one FSDP role ("teacher", grad_sync "none") through the shared
`predictor_training.runtime.loop.train_loop` and its checkpoints: LOOP_STEPS steps uninterrupted (OUT/full), and stopped at
LOOP_CUT then resumed with `load_training_state` into a model of another init (OUT/cut); plus the refusals (an FSDP
role with grad_sync "ddp" / "all_reduce" or an EMA, a NaN in one rank's shard, inference weights from the shards, an
FSDP checkpoint into an unsharded role), recorded in OUT/loop.pt.

The phase killed runs that loop with a checkpoint after every step (sharded: `runtime/sharded_checkpoint.py`),
resuming from RUN/training_latest.pt when it exists, and SIGKILLs one rank inside a chosen save (env KILL_AT =
`<point>:<save number of this launch>`): `writing` (rank 1, as DCP's writes start: a partial shard file in the
staging folder, no .metadata), `staged` (rank 0, the staging folder complete, nothing published), `rotated` (rank 0, inside
`publish_sharded_folder`: the current folder moved to training_prev.dcp, killed at the rename of the new one), `published` (rank 0, the new folder in
place, training_latest.pt not yet replaced). torchrun then tears the launch down, as a kill -9 of the job would.
The phase reshard loads a sharded folder into a model sharded over this launch's ranks (DCP reshards) with
`load_sharded_roles` and writes it again (DST), so the test can compare the two folders' full states.
"""

from __future__ import annotations

import gc
import math
import os
import signal
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from predictor_training.runtime.checkpoint import RunState, load_training_state
from predictor_training.runtime.inference_weights import save_inference_weights
from predictor_training.runtime.checkpoint import save_training_state as save_loop_training_state
from predictor_training.runtime.distributed import cleanup_distributed, init_distributed
from predictor_training.runtime.fsdp import full_state_dicts, gradient_sync, is_fsdp, load_full_state_dicts, shard_model
from predictor_training.runtime.logger import MetricsLogger
from predictor_training.data.batches import ResumableBatches
from predictor_training.runtime.loop import train_loop
from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer
from predictor_training.runtime.roles import EMA, Role
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_

STEPS = 4
CUT_AT = 2
GRAD_ACCUM = 2
MAX_GRAD_NORM = 0.5
LR = 1e-3
FRAMES, CONTEXT_FRAMES, HEIGHT, WIDTH = 2, 2, 2, 3
TEXT_LEN, BYT5_LEN, VISION_LEN = 4, 3, 2
LOOP_STEPS = 4
LOOP_CUT = 2
LOOP_ROLE = "teacher"
LOOP_META = {"variant": "tiny_teacher", "source_blocks": [0, 1], "precision": "fp32master"}
LOOP_ITEMS = 8  # 4 micro-batches per rank and epoch: the 4 x GRAD_ACCUM steps cross an epoch boundary


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


def gathered(records):
    """Every rank's records (any picklable value), rank order."""
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


# ---------------------------------------------------------------------------------------------------------------
# 5. An FSDP role in the shared train_loop
# ---------------------------------------------------------------------------------------------------------------
class StepItems(torch.utils.data.Dataset):
    """Item i is the seed index of a micro-batch (`make_batch(model, i, 0, rank)`)."""

    def __len__(self):
        return LOOP_ITEMS

    def __getitem__(self, index):
        return index


def only_item(items: list[int]) -> int:
    return items[0]


def fsdp_role(seed: int, env, *, grad_sync: str = "none", ema: bool = False, shard: bool = True) -> Role:
    """The tiny model sharded (or not), AdamW in the recipes' two named groups, the warmup + cosine schedule."""
    model = build_model(seed)
    if shard:
        model = shard_model(model, env)
    blocks = list(model.double_blocks.parameters())
    block_ids = {id(param) for param in blocks}
    optimizer = build_optimizer({"fusion": [p for p in model.parameters() if id(p) not in block_ids], "blocks": blocks},
                                {"fusion": LR, "blocks": LR / 2}, betas=(0.9, 0.95), weight_decay=0.01)
    schedule = TwoGroupLRSchedule(optimizer, warmup_steps=1, max_steps=LOOP_STEPS, block_warmup_steps=None)
    return Role(LOOP_ROLE, model, optimizer, schedule, grad_clip=MAX_GRAD_NORM, grad_sync=grad_sync,
                ema=EMA(model, decay=0.9) if ema else None)


def loop_step(item: int, *, sync: bool, due, role: Role, env) -> dict[str, float]:
    """One micro-batch: no reduce-scatter except on the last one of the step (`sync`)."""
    assert due == {LOOP_ROLE}
    with gradient_sync(role.module, enabled=sync):
        loss = micro_batch_loss(role.module, make_batch(role.module, item, 0, env.rank))
        loss.backward()
    return {"loss": loss.item()}


def run_loop(run_dir: Path, env, *, seed: int = 0, stop_at_step: int | None = None, resume: Path | None = None,
             role: Role | None = None, ckpt_every: int = -1) -> Role:
    role = role or fsdp_role(seed, env)
    sampler = torch.utils.data.DistributedSampler(StepItems(), num_replicas=env.world_size, rank=env.rank,
                                                  shuffle=True, seed=3, drop_last=True)
    batches = ResumableBatches(sampler, StepItems(), only_item, batch_size=1, seed=3)
    run_state = RunState()
    if resume is not None:
        run_state = load_training_state(resume, roles=[role], expect=LOOP_META)
        batches.load_state_dict(run_state.data)
    with MetricsLogger(run_dir, env) as logger:
        train_loop(roles=[role], batches=batches, step_fn=partial(loop_step, role=role, env=env), run_dir=run_dir,
                   env=env, run_state=run_state, max_steps=LOOP_STEPS, stop_at_step=stop_at_step,
                   grad_accum=GRAD_ACCUM, ckpt_every=ckpt_every, keep_last=-1, metrics_logger=logger,
                   config={"model": "tiny"}, meta=LOOP_META, progress=False)
    return role


def error_text(function) -> str | None:
    """`type: message` of what `function()` raises (None if it returns)."""
    try:
        function()
    except Exception as error:  # noqa: BLE001 - the test compares the type and the message
        return f"{type(error).__name__}: {error}"
    return None


def loop(out: Path, env) -> None:
    # 1. Uninterrupted; stopped at LOOP_CUT, then resumed into a model of another init.
    run_loop(out / "full", env)
    run_loop(out / "cut", env, stop_at_step=LOOP_CUT)
    resumed = run_loop(out / "cut", env, seed=99, resume=out / "cut" / "training_latest.pt")
    checks = {}
    # 2. Refusals. The loop validates before any collective, so every rank raises alike.
    for grad_sync in ("ddp", "all_reduce"):
        checks[f"grad_sync_{grad_sync}"] = error_text(
            lambda: run_loop(out / f"refused_{grad_sync}", env, role=fsdp_role(1, env, grad_sync=grad_sync)))
    checks["ema"] = error_text(lambda: fsdp_role(1, env, ema=True))
    checks["inference_from_shards"] = error_text(
        lambda: save_inference_weights(out / "shards.safetensors", resumed.raw_module))
    checks["fsdp_state_into_plain_role"] = error_text(lambda: load_training_state(
        out / "full" / "training_latest.pt", roles=[fsdp_role(2, env, shard=False)], expect=LOOP_META))
    # 3. A NaN in rank 1's shard only: every rank refuses the checkpoint together (none waits in the gather).
    nan_role = fsdp_role(1, env)
    nan_name = None
    if env.rank == 1:
        with torch.no_grad():
            nan_name, parameter = next((name, param) for name, param in nan_role.raw_module.named_parameters()
                                       if param.to_local().numel() > 0)
            parameter.to_local().view(-1)[0] = float("nan")
    checks["nan_in_one_shard"] = gathered(error_text(lambda: save_loop_training_state(
        out / "nan" / "training_latest.pt", roles=[nan_role], run_state=RunState(), config={}, meta=LOOP_META)))
    checks["nan_name"] = gathered(nan_name)[1]
    checks["nan_written"] = (out / "nan" / "training_latest.pt").exists()
    if env.is_main:
        torch.save(checks, out / "loop.pt")


# ---------------------------------------------------------------------------------------------------------------
# 6. Sharded checkpoints: kill -9 inside a save, and another world size
# ---------------------------------------------------------------------------------------------------------------
def _die(where: str) -> None:
    print(f"fsdp_worker: SIGKILL at {where} on rank {os.environ.get('RANK')}", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(point: str, save_number: int, env) -> None:
    """Patch the sharded save so that this launch's `save_number`-th save SIGKILLs a rank at `point`."""
    from predictor_training.runtime import checkpoint, sharded_checkpoint

    calls = {"save": 0}
    original_save, original_publish = sharded_checkpoint.dcp.save, checkpoint.publish_sharded_folder

    def dcp_save(state, *, checkpoint_id, **kwargs):
        calls["save"] += 1
        if point == "writing" and calls["save"] == save_number and env.rank == 1:
            # A shard file cut off halfway (DCP's own writes are not interruptible from here): the staging folder
            # holds a partial file and no .metadata, as after a kill inside DCP's write.
            os.makedirs(checkpoint_id, exist_ok=True)
            with open(Path(checkpoint_id) / f"__{env.rank}_0.distcp", "wb") as handle:
                handle.write(os.urandom(4096))
            _die(f"{point}:{save_number}")
        return original_save(state, checkpoint_id=checkpoint_id, **kwargs)

    def publish(state_path, keep_tokens):
        if calls["save"] != save_number:
            return original_publish(state_path, keep_tokens)
        if point == "staged":
            _die(f"{point}:{save_number}")
        if point == "rotated":  # the real function, killed at its rename of the staged folder
            real_replace = os.replace

            def replace(source, destination):
                if str(source).endswith(sharded_checkpoint.WRITING_SUFFIX):
                    _die(f"{point}:{save_number}")
                return real_replace(source, destination)

            sharded_checkpoint.os.replace = replace
        original_publish(state_path, keep_tokens)
        if point == "published":
            assert sharded_checkpoint.sharded_folder(state_path).is_dir()
            _die(f"{point}:{save_number}")

    sharded_checkpoint.dcp.save = dcp_save
    checkpoint.publish_sharded_folder = publish


def killed(out: Path, env) -> None:
    """The loop with a checkpoint every step, resumed from out/training_latest.pt when it exists; with KILL_AT set,
    one rank dies inside the chosen save of this launch."""
    kill_at = os.environ.get("KILL_AT")
    if kill_at:
        point, number = kill_at.split(":")
        arm_kill(point, int(number), env)
    latest = out / "training_latest.pt"
    run_loop(out, env, seed=99, resume=latest if latest.exists() else None, ckpt_every=1)


def reshard(source: Path, env, destination: str) -> None:
    """Load the sharded folder `source` into this launch's shards (another world size than it was written with),
    without the loop state, and write the role again as a sharded folder `destination`."""
    from predictor_training.runtime.fsdp import named_param_groups
    from predictor_training.runtime.sharded_checkpoint import load_sharded_roles, save_sharded_roles, publish_sharded_folder
    from predictor_training.runtime.checkpoint import read_training_state

    payload = read_training_state(source.with_suffix(".pt"))
    entry = payload["roles"][LOOP_ROLE]
    role = fsdp_role(seed=99, env=env)
    load_sharded_roles(source, [role], {LOOP_ROLE: {**entry["sharded"],
                                                     "param_groups": entry["optimizer"]["param_groups"]}})
    assert named_param_groups(role.raw_module, role.optimizer) == entry["optimizer"]["param_groups"]
    state_path = Path(destination) / "training_latest.pt"
    state_path.parent.mkdir(parents=True, exist_ok=True)
    entries = save_sharded_roles(state_path, [role])
    if env.is_main:
        publish_sharded_folder(state_path, set())
        # The same training state naming the new folder (so this folder can be resharded again).
        payload["roles"][LOOP_ROLE]["sharded"] = entries[LOOP_ROLE]
        torch.save(payload, state_path)
    dist.barrier()


def main(phase: str, out: str, *extra: str) -> None:
    env = init_distributed("gloo")
    try:
        if phase == "reshard":
            reshard(Path(out), env, *extra)
        else:
            {"fresh": fresh, "resume": resume, "reload": reload, "loop": loop, "killed": killed}[phase](Path(out), env)
        # Free the sharded models (FSDP state holds reference cycles) and line the ranks up while the process group
        # is alive: gloo work still referenced at interpreter shutdown can abort the process (SIGABRT,
        # "terminate called without an active exception") after everything was written.
        gc.collect()
        dist.barrier()
    finally:
        cleanup_distributed()


# ---------------------------------------------------------------------------------------------------------------
# 7. The tests' launcher: torchrun's job without its start-up (a fork server)
# ---------------------------------------------------------------------------------------------------------------
# A torchrun launch costs three fresh interpreters (the agent and two ranks), each importing torch, and the ranks
# also diffusers (the Teacher): 10-20 s of a 2-core machine before a step runs, more than the steps themselves.
# `python tests/helpers/fsdp_worker.py serve` imports all of it once; every launch then forks its ranks from that clean,
# idle process (no thread, no process group, nothing run), so each rank starts as a fresh torchrun worker would,
# with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), its own
# session, stdin from /dev/null, and runs `main` as the script would. As torchrun does, the first rank that fails
# (an exception, or the SIGKILL of KILL_AT) brings the others down (SIGKILL: a kill -9 of the job), and the launch
# fails. Requests and replies are JSON lines on stdin / stdout.
_REPLIES_FD = None  # the server's reply pipe, closed in the ranks


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_rank(args: list[str], rank: int, nproc: int, port: int, env: dict, log: Path) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never returns into the server's loop
        os.setsid()
        if _REPLIES_FD is not None:
            os.close(_REPLIES_FD)
        null, out = os.open(os.devnull, os.O_RDONLY), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.environ.pop("KILL_AT", None)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                           "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           **env})
        sys.argv = [__file__, *args]
        main(*args)
        code = 0
    except SystemExit as error:
        code = error.code if isinstance(error.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported through the rank's log and exit code
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _launch(request: dict, logs: Path) -> dict:
    """Fork request["nproc"] ranks of `main(*request["args"])`, wait for them; the first failure kills the rest."""
    import time

    nproc, timeout = int(request["nproc"]), float(request.get("timeout", 300))
    port = _free_port()
    paths = [logs / f"rank{rank}.log" for rank in range(nproc)]
    pids = [_start_rank(request["args"], rank, nproc, port, request.get("env", {}), path)
            for rank, path in enumerate(paths)]
    codes: list[int | None] = [None] * nproc
    first_failure, timed_out = None, False
    deadline = time.monotonic() + timeout
    while None in codes:
        progressed = False
        for rank, pid in enumerate(pids):
            if codes[rank] is not None:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = os.waitstatus_to_exitcode(status)  # -9: killed by SIGKILL
                progressed = True
                if codes[rank] != 0 and first_failure is None:
                    first_failure = {"rank": rank, "code": codes[rank]}
                    for other, other_pid in enumerate(pids):
                        if codes[other] is None:
                            os.kill(other_pid, signal.SIGKILL)
        if not timed_out and time.monotonic() > deadline:
            timed_out = True
            for rank, pid in enumerate(pids):
                if codes[rank] is None:
                    os.kill(pid, signal.SIGKILL)
        if not progressed:
            time.sleep(0.02)
    output = "".join(f"--- rank {rank} ---\n{path.read_text(errors='replace')[-6000:]}\n"
                     for rank, path in enumerate(paths))
    returncode = 0 if all(code == 0 for code in codes) and not timed_out else 1
    return {"returncode": returncode, "codes": codes, "first_failure": first_failure, "timed_out": timed_out,
            "output": output}


def serve() -> None:
    import json
    import tempfile
    import threading

    # fork() copies only the calling thread: the server must hold no other (OMP_NUM_THREADS=1 starts none).
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["1"]
    if threading.active_count() != 1 or len(tasks) != 1:
        raise RuntimeError(f"fsdp_worker serve: {len(tasks)} threads before forking ranks (set OMP_NUM_THREADS=1)")
    from predictor_training.runtime.distributed import exit_with_launcher

    exit_with_launcher()  # the server dies with the test process (and each rank with the server, by its own)
    global _REPLIES_FD
    replies = os.fdopen(os.dup(1), "w")
    _REPLIES_FD = replies.fileno()
    os.dup2(2, 1)  # stray prints go to stderr, not into the replies
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        with tempfile.TemporaryDirectory(prefix="fsdp_launch_") as logs:
            reply = _launch(json.loads(line), Path(logs))
        print(json.dumps(reply), file=replies, flush=True)
    sys.stderr.flush()
    os._exit(0)  # stdin closed: the tests are done (no interpreter teardown of torch: seconds)


class Launcher:
    """The test side of `serve`: `launch(*args, nproc=2, env={...})` -> the reply dict; `close()` ends the server
    (closing its stdin; a server whose test process died ends the same way, and its ranks with it)."""

    def __init__(self, repo_root: Path) -> None:
        import subprocess

        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve"], cwd=repo_root,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        self._reply()

    def _reply(self) -> dict:
        import json

        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"fsdp_worker serve ended (exit code {self.process.wait()})")
        return json.loads(line)

    def launch(self, *args, nproc: int = 2, env: dict | None = None, timeout: float = 300) -> dict:
        import json

        request = {"args": [str(arg) for arg in args], "nproc": nproc, "env": env or {}, "timeout": timeout}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(*sys.argv[1:])
