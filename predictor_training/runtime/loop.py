"""The one training loop every recipe uses (offline v4/disca pairs, on-policy rollout, the fvtools methods).

Its batches come from a resumable stream (`predictor_training.data.batches.ResumableBatches` or anything with its
`__next__`, `state_dict`, `load_state_dict` and `batches_per_epoch`).

The loop steps one or more trainable roles (`predictor_training.runtime.roles.Role`: module, optimizer, LR schedule,
cadence `every`, clip, gradient sync, optional EMA). A recipe supplies `step_fn(micro_batch, *, sync, due) ->
dict[str, float]` that runs forward AND backward itself for the roles in `due` (several backwards are fine, e.g. one
per rollout chunk) and returns detached python floats, including the total under "loss". The loop owns the rest:

    for each step s:
        due = roles with s % every == 0
        zero_grad(set_to_none) of every role                          # 1
        grad_accum x: next micro-batch, step_fn(..., due)              # 2 (sync=True only on the last micro-batch)
        refuse gradients on a role that is not due (naming it)
        due roles: grads /= grad_accum (all-reduced for grad_sync="all_reduce"); metrics: mean over micro-batches,
        then over ranks; clip_grad_norm_ per role                    # 3
        refuse NaN/Inf (NonFiniteError, nothing stepped or written), extra_step_check
        due roles: optimizer.step(); lr_schedule.step(); EMA update   # 4
        log one record (every step); checkpoint on the interval and on the last step   # 5
            (on several ranks a checkpoint first checks that every replicated role's weights agree over ranks)

`step_fn` must wrap the forward and backward of non-final micro-batches of a DDP role in
`maybe_no_sync(role.module, enabled=not sync)`, so DDP all-reduces once per step. It backpropagates its micro-batch
loss unscaled: the loop divides the accumulated gradients by `grad_accum`. With one role the log keeps the
single-model keys (`grad_norm`, `lr/<group>`); with several it writes `grad_norm/<role>`, `lr/<role>/<group>` and
`updates/<role>`. The console: the progress bar carries the loss, LR and seconds of every step, and the full record
is printed as one row every `log_every` steps; `train_log.jsonl` has every step.
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

from predictor_training.runtime.checkpoint import TRAINING_STATE_NAME, RunState, save_training_state
from predictor_training.runtime.checkpoint_checks import NonFiniteError
from predictor_training.runtime.inference_weights import (
    inference_weights_name,
    prune_checkpoints,
    save_inference_weights,
)
from predictor_training.runtime.distributed import DistEnv, all_gather_objects, log0
from predictor_training.runtime.precision import synchronize
from predictor_training.runtime.roles import EMA, Role
from predictor_training.runtime.io import atomic_write, write_json_atomic
from predictor_training.runtime.logger import TRAIN_LOG_NAME, MetricsLogger

class BatchStream(Protocol):
    """What the loop needs of its data: the next micro-batch, a resumable position, and the epoch length that every
    rank must agree on (`predictor_training.data.batches.ResumableBatches`)."""

    def __next__(self): ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def batches_per_epoch(self) -> int: ...


class Validation(Protocol):
    """Held-out figures of the trained roles at a step (`predictor_training.eval.validation`): a collective that
    returns the same {name: float} on every rank, and may leave a picture of the step for the tracker."""

    best_metric: str  # the figure best.json ranks by, higher is better

    def __call__(self, step: int) -> dict[str, float]: ...
    def image(self, step: int) -> Path | None: ...


BEST_NAME = "best.json"


__all__ = ["train_loop", "NonFiniteError", "RunState", "peak_memory_gib"]


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    """("memory/cuda_max_allocated_gib", torch.cuda.max_memory_allocated) on CUDA, else
    ("memory/cpu_peak_rss_gib", the process's peak resident set size from getrusage)."""
    if device.type == "cuda":
        return "memory/cuda_max_allocated_gib", torch.cuda.max_memory_allocated(device) / 2**30
    return "memory/cpu_peak_rss_gib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


def _check_step_metrics(metrics, step: int) -> dict[str, float]:
    if not isinstance(metrics, dict) or "loss" not in metrics:
        raise TypeError(f"step {step}: step_fn must return a dict of floats with the total under 'loss', got {metrics!r}")
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"step {step}: step_fn metric {key!r} is {type(value).__name__}; return detached python floats")
    return metrics


def _mean_metrics(per_micro: list[dict[str, float]], env: DistEnv, step: int) -> dict[str, float]:
    """Mean over micro-batches, then over ranks (every rank must return the same keys)."""
    keys = sorted(per_micro[0])
    for metrics in per_micro[1:]:
        if sorted(metrics) != keys:
            raise ValueError(f"step {step}: step_fn returned keys {sorted(metrics)} after {keys}")
    values = torch.tensor([[m[k] for k in keys] for m in per_micro], dtype=torch.float64).mean(dim=0)
    if env.distributed:
        values = values.to(env.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values = values.cpu() / env.world_size
    return {key: float(value) for key, value in zip(keys, values.tolist())}


def grad_norm_and_clip(params: list[nn.Parameter], grad_clip: float, step: int, role: str) -> float:
    grads = [param.grad for param in params if param.grad is not None]
    if not grads:
        raise RuntimeError(f"step {step}: role {role!r} is due but no parameter has a gradient; did step_fn call "
                           "backward() for it?")
    if grad_clip == -1:
        return float(torch.nn.utils.get_total_norm(grads))
    return float(torch.nn.utils.clip_grad_norm_(params, grad_clip))


def _validate_loop_args(*, roles, batches, run_state, max_steps, stop_step, grad_accum) -> None:
    """Wiring checks (the flag values themselves are checked when the recipe parses its flags)."""
    if not roles:
        raise ValueError("train_loop: no roles to train")
    if not run_state.global_step <= stop_step <= max_steps:
        raise ValueError(f"train_loop: stop_at_step={stop_step}; expected in [{run_state.global_step}, "
                         f"max_steps={max_steps}]")
    if grad_accum < 1:
        raise ValueError(f"train_loop: grad_accum={grad_accum}; expected >= 1")
    names = [role.name for role in roles]
    if len(set(names)) != len(names):
        raise ValueError(f"train_loop: role names {names} are not distinct")
    for role in roles:
        module = role.module
        if role.is_fsdp:
            # FSDP reduce-scatters the gradients in backward: no DDP wrapper, no second sync by the loop.
            if module is not role.raw_module:
                raise ValueError(f"train_loop: role {role.name!r}: raw_module is FSDP-sharded, so module must be "
                                 "raw_module itself (no DistributedDataParallel wrapper)")
            if role.grad_sync != "none":
                raise ValueError(f"train_loop: role {role.name!r}: raw_module is FSDP-sharded, which reduce-scatters "
                                 f"the gradients in backward; grad_sync must be 'none', not {role.grad_sync!r}")
        elif module is not role.raw_module and not (
                isinstance(module, DistributedDataParallel) and module.module is role.raw_module):
            raise ValueError(f"train_loop: role {role.name!r}: module must be raw_module or a DistributedDataParallel "
                             "wrapping raw_module")
        model_param_ids = {id(param) for param in role.raw_module.parameters()}
        if any(id(param) not in model_param_ids for param in role.parameters):
            raise ValueError(f"train_loop: role {role.name!r}: the optimizer holds parameters that are not in its "
                             "module")
        expected_updates = role.updates_in(max_steps)
        if role.lr_schedule.max_steps != expected_updates:
            raise ValueError(f"train_loop: role {role.name!r} updates every {role.every} steps, so its schedule must "
                             f"last {expected_updates} updates, not {role.lr_schedule.max_steps}")
        done = role.updates_in(run_state.global_step)
        if role.updates != done:
            raise ValueError(
                f"train_loop: role {role.name!r} is at update {role.updates} but step {run_state.global_step} "
                f"implies {done}; load both from the same checkpoint"
            )
    if run_state.global_step > 0 and batches.state_dict() != run_state.data:
        raise ValueError(
            f"train_loop: batches are at {batches.state_dict()} but run_state.data={run_state.data}; "
            "call batches.load_state_dict(run_state.data) after load_training_state"
        )


# ------------------------------------------------------------------------------------------------ the loop
def train_loop(
    *,
    roles: Sequence[Role],
    batches: BatchStream,
    step_fn: Callable[..., dict[str, float]],
    run_dir: str | Path,
    env: DistEnv,
    run_state: RunState,
    max_steps: int,
    grad_accum: int,
    ckpt_every: int = 100,
    keep_last: int = 20,
    log_every: int = 10,
    metrics_logger: MetricsLogger,
    config: dict,
    meta: dict,
    progress: bool = True,
    extra_step_check: Callable[[int, dict[str, float]], None] | None = None,
    stop_at_step: int | None = None,
    validation: Validation | None = None,
    val_every: int = 0,
) -> RunState:
    """Run loop steps `run_state.global_step + 1 .. stop_at_step (default max_steps)`; returns the final RunState.

    max_steps: the run's length in loop steps (each role's schedule lasts its own `role.updates_in(max_steps)`
    updates). stop_at_step: end this run earlier (e.g. stop a 2000-step schedule at 600), with a checkpoint at that
    step. ckpt_every: `<role>_step_XXXXX.safetensors` per role (inference weights, `meta` + step in its metadata)
    and `training_latest.pt` (every role) every N steps and always at the last step; -1 = last step only.
    keep_last: how many safetensors to keep per role (-1 all). log_every: the console prints a step's full record
    every N steps (and at the last and every validated step); train_log.jsonl and the tracker get every step, and the
    progress bar shows the loss, LR and s/step of every step. extra_step_check(step, metrics): called before the
    optimizer steps; raise to refuse the step - on every rank alike, so no rank is left waiting in a collective.
    Every rank must call this function.
    """
    run_dir = Path(run_dir)
    stop_step = max_steps if stop_at_step is None else stop_at_step
    _validate_loop_args(roles=roles, batches=batches, run_state=run_state, max_steps=max_steps, stop_step=stop_step,
                        grad_accum=grad_accum)
    single = len(roles) == 1
    start_step = run_state.global_step
    discarded = metrics_logger.discard_after(start_step)
    # Unequal epoch lengths would leave one rank waiting in an all-reduce forever.
    per_rank_batches = all_gather_objects(batches.batches_per_epoch())
    if len(set(per_rank_batches)) != 1:
        raise ValueError(f"train_loop: ranks have different numbers of micro-batches per epoch: {per_rank_batches}")
    if discarded:
        log0(f"train_loop: moved {discarded} log records past step {start_step} to the discarded log")
    if start_step == stop_step:
        log0(f"train_loop: already at step {stop_step}; nothing to do")
        return run_state
    # A training state records its step's files before they are written and pruned: a resume finishes that pruning
    # (and applies this launch's --keep_last), so the record equals an uninterrupted run's.
    for role in roles:
        for name in weight_names(role):
            prune_recorded(run_dir, keep_last, name, run_state, env)

    bar = tqdm(total=stop_step, initial=start_step, desc="train", disable=not (progress and env.is_main), dynamic_ncols=True)
    try:
        for step in range(start_step + 1, stop_step + 1):
            step_start = time.perf_counter()
            due = [role for role in roles if role.is_due(step)]
            due_names = frozenset(role.name for role in due)
            # 1. Fresh gradients.
            for role in roles:
                role.zero_grad()
            # 2. Accumulate micro-batches; only the last one all-reduces.
            data_time = 0.0
            per_micro = []
            for micro in range(grad_accum):
                data_start = time.perf_counter()
                micro_batch = next(batches)
                data_time += time.perf_counter() - data_start
                metrics = step_fn(micro_batch, sync=micro == grad_accum - 1, due=due_names)
                per_micro.append(_check_step_metrics(metrics, step))
                run_state.micro_step += 1
            for role in roles:
                if role.name not in due_names and role.parameters_with_grad():
                    raise RuntimeError(
                        f"step {step}: role {role.name!r} is not due (every {role.every}) but holds gradients, e.g. "
                        f"{role.parameters_with_grad()[:3]}; detach its outputs or turn its requires_grad off "
                        "where it is not being trained"
                    )
            for role in due:
                if grad_accum > 1:
                    for param in role.parameters:
                        if param.grad is not None:
                            param.grad.div_(grad_accum)
                if role.grad_sync == "all_reduce":
                    role.all_reduce_grads()
            metrics = _mean_metrics(per_micro, env, step)
            # 3. Clip, then refuse anything non-finite before touching the weights.
            grad_norms = {role.name: grad_norm_and_clip(role.parameters, role.grad_clip, step, role.name)
                          for role in due}
            bad_terms = [key for key, value in metrics.items() if not math.isfinite(value)]
            bad_terms += ["grad_norm" if single else f"grad_norm/{name}" for name, norm in grad_norms.items()
                          if not math.isfinite(norm)]
            if bad_terms:
                raise NonFiniteError(
                    f"step {step}: non-finite {bad_terms} (metrics {metrics}, grad norms {grad_norms}); "
                    "no optimizer was stepped and no checkpoint was written"
                )
            if extra_step_check is not None:
                extra_step_check(step, metrics)
            # 4. Update the due roles with the LRs of this step.
            lrs = {}
            for role in due:
                prefix = "lr" if single else f"lr/{role.name}"
                lrs.update({f"{prefix}/{group['name']}": group["lr"] for group in role.optimizer.param_groups})
                role.step()
            run_state.global_step = step
            run_state.data = batches.state_dict()
            run_state.epoch = batches.epoch
            synchronize(env.device)  # so step time includes the queued GPU work
            step_time = time.perf_counter() - step_start
            # 5. Validate (every val_every steps and at the run's last step); log the step's record to
            #    train_log.jsonl and the tracker (every step); the console shows the figures that matter on the bar
            #    every step and the full record every log_every steps (and at the last and every validated step).
            figures = {}
            if validation is not None and val_every > 0 and (step % val_every == 0 or step == max_steps):
                figures = validation(step)
            memory_key, memory_gib = peak_memory_gib(env.device)
            if single:
                norms = {"grad_norm": grad_norms[roles[0].name]} if grad_norms else {}
            else:
                norms = {f"grad_norm/{name}": norm for name, norm in grad_norms.items()}
                norms.update({f"updates/{role.name}": float(role.updates) for role in roles})
            record = {**metrics, **norms, **lrs, "epoch": run_state.epoch, "time/step_s": step_time,
                      "time/data_s": data_time, memory_key: memory_gib, **figures}
            metrics_logger.log(step, record)
            if figures:
                image = validation.image(step)
                if image is not None:
                    metrics_logger.log_image(step, "val/contact_sheet", image)
                if env.is_main:
                    write_best(Path(run_dir), validation.best_metric, roles)
                    plot_validation_curve(Path(run_dir))
            if env.is_main and (step % log_every == 0 or step == stop_step or figures):
                bar.write(console_row(step, stop_step, metrics=metrics, norms=norms, lrs=lrs, step_time=step_time,
                                      data_time=data_time, memory=(memory_key, memory_gib), figures=figures))
            bar.set_postfix_str(bar_figures(metrics["loss"], lrs, step_time), refresh=False)
            bar.update(1)
            if (ckpt_every != -1 and step % ckpt_every == 0) or step == stop_step:
                _write_checkpoints(run_dir, step, roles=roles, run_state=run_state, config=config, meta=meta, env=env,
                                   keep_last=keep_last)
    finally:
        bar.close()
    return run_state


def bar_figures(loss: float, lrs: dict[str, float], step_time: float) -> str:
    """What the progress bar shows beside the step count every step: the loss, the step's first learning rate (the
    fusion group's in the Predictor recipes) and the seconds the step took."""
    lr_text = f" lr {next(iter(lrs.values())):.2e}" if lrs else ""
    return f"loss {loss:.4g}{lr_text} {step_time:.2f}s/step"


def console_row(step: int, stop_step: int, *, metrics: dict[str, float], norms: dict[str, float],
                lrs: dict[str, float], step_time: float, data_time: float, memory: tuple[str, float],
                figures: dict[str, float]) -> str:
    """The full record of a step as one console line (printed every --log_every steps; train_log.jsonl holds every
    step's): step | every metric | grad norms | LRs | times | peak memory [| validation figures]."""
    terms = " ".join(f"{key} {value:.6g}" for key, value in metrics.items())
    norm_text = " ".join(f"{key} {value:.4g}" for key, value in norms.items())
    lr_text = " ".join(f"{key} {value:.3e}" for key, value in lrs.items())
    memory_key, memory_gib = memory
    row = (f"step {step}/{stop_step} | {terms} | {norm_text} | {lr_text} | step {step_time:.3f}s data "
           f"{data_time:.3f}s | {memory_key} {memory_gib:.2f}")
    if figures:
        row += " | " + " ".join(f"{key} {value:.4g}" for key, value in figures.items())
    return row


def write_best(run_dir: Path, metric: str, roles: Sequence[Role]) -> None:
    """best.json: the logged step with the highest `metric` so far (read back from train_log.jsonl, so a resumed run
    agrees with an uninterrupted one) and the inference weights of that step; no checkpoint is deleted for it."""
    rows = [json.loads(line) for line in (run_dir / TRAIN_LOG_NAME).read_text().splitlines() if line.strip()]
    scored = [row for row in rows if metric in row]
    best = max(scored, key=lambda row: (row[metric], -row["step"]))
    write_json_atomic(run_dir / BEST_NAME, {
        "metric": metric, "step": best["step"], "value": best[metric],
        "weights": [inference_weights_name(best["step"], role.name) for role in roles],
    })


VAL_CURVE_NAME = "val_curve.png"


def plot_validation_curve(run_dir: Path) -> None:
    """val_curve.png: every logged val/psnr* figure against the step, next to the training loss (read back from
    train_log.jsonl, so it always shows the whole run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / TRAIN_LOG_NAME).read_text().splitlines() if line.strip()]
    names = sorted({key for row in rows for key in row if key.startswith("val/psnr")})
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        points = [(row["step"], row[name]) for row in rows if name in row]
        left.plot(*zip(*points), marker="o", label=name.removeprefix("val/"))
    left.set(xlabel="step", ylabel="PSNR (dB)", title="held-out validation")
    left.legend(fontsize=8)
    right.plot([row["step"] for row in rows], [row["loss"] for row in rows], linewidth=0.8)
    right.set(xlabel="step", ylabel="loss", title="training loss", yscale="log")
    figure.tight_layout()
    atomic_write(run_dir / VAL_CURVE_NAME, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
    plt.close(figure)


def role_fingerprints(roles: Sequence[Role]) -> dict[str, list[float]]:
    """Per replicated (non-FSDP) role, [sum, sum of squares] of each trained parameter in float64: equal on every
    rank exactly when the replicas agree (the same tensors reduced in the same order give the same bits)."""
    fingerprints = {}
    with torch.no_grad():
        for role in roles:
            if role.is_fsdp:
                continue
            values = [torch.stack([param.detach().double().sum(), param.detach().double().pow(2).sum()])
                      for param in role.parameters]
            fingerprints[role.name] = torch.stack(values).flatten().cpu().tolist()
    return fingerprints


def replica_mismatches(per_rank: Sequence[dict[str, list[float]]]) -> dict[str, list[int]]:
    """{role: ranks whose fingerprint differs from rank 0's} for the roles that disagree."""
    return {name: [rank for rank, other in enumerate(per_rank) if other[name] != reference]
            for name, reference in per_rank[0].items()
            if any(other[name] != reference for other in per_rank[1:])}


def check_replicas_agree(roles: Sequence[Role], step: int) -> None:
    """Collective: raise on every rank when a replicated role's weights differ between ranks (a role whose
    gradients were not synchronised, or that started from different weights, silently trains several models).
    FSDP roles are sharded, not replicated, and are skipped."""
    mismatches = replica_mismatches(all_gather_objects(role_fingerprints(roles)))
    if mismatches:
        described = "; ".join(f"{name!r} on rank(s) {ranks}" for name, ranks in mismatches.items())
        raise RuntimeError(f"step {step}: the replicas of a role differ from rank 0's: {described}. Its gradients are "
                           "not synchronised over ranks (check the role's grad_sync) or its ranks started from "
                           "different weights; nothing was written")


def _write_checkpoints(run_dir: Path, step: int, *, roles, run_state, config, meta, env, keep_last: int) -> None:
    if env.world_size > 1:
        check_replicas_agree(roles, step)
    # The inference files of this step join the run's record before the training state is saved, so that a resume
    # knows every file its run wrote; --keep_last prunes only recorded files (on every rank alike, deleting on 0).
    names = [inference_weights_name(step, name) for role in roles for name in weight_names(role)]
    run_state.checkpoints = [name for name in run_state.checkpoints if name not in names] + names
    # The training state goes first: it is a collective and checks finiteness on every rank together. On rank 0 it
    # returns each FSDP-sharded role's model gathered one tensor at a time in BF16 (the checkpoint itself is
    # sharded); that role's inference weights are written from it.
    full_states = save_training_state(run_dir / TRAINING_STATE_NAME, roles=roles, run_state=run_state, config=config,
                                      meta=meta)
    if env.is_main:
        written = []
        for role in roles:
            inference_path = run_dir / inference_weights_name(step, role.name)
            weights = full_states[role.name] if role.is_fsdp else role.raw_module
            save_inference_weights(inference_path, weights, metadata={**meta, "role": role.name, "step": step},
                                   config=config)
            pruned = prune_recorded(run_dir, keep_last, role.name, run_state, env)
            written.append(inference_path.name + (f" (pruned {len(pruned)})" if pruned else ""))
            if isinstance(role.ema, EMA):  # its inference weights beside the raw ones: <role>_ema_step_XXXXX
                ema = role.ema
                ema_path = run_dir / inference_weights_name(step, f"{role.name}_ema")
                save_inference_weights(ema_path, ema.state_dict_of(role.raw_module), config=config, metadata={
                    **meta, "role": role.name, "step": step,
                    "ema": {"decay": ema.decay, "start_update": ema.start_update, "updates": ema.updates}})
                prune_recorded(run_dir, keep_last, f"{role.name}_ema", run_state, env)
                written.append(ema_path.name)
        log0(f"checkpoint step {step}: {TRAINING_STATE_NAME}, {', '.join(written)}")
    else:
        for role in roles:
            for name in weight_names(role):
                prune_recorded(run_dir, keep_last, name, run_state, env)


def weight_names(role: Role) -> tuple[str, ...]:
    """The names a role's inference files carry: `<role>` and, with an EMA, `<role>_ema`."""
    return (role.name, *([f"{role.name}_ema"] if isinstance(role.ema, EMA) else []))


def prune_recorded(run_dir: Path, keep_last: int, role: str, run_state: RunState, env: DistEnv) -> list[Path]:
    """`--keep_last` over the files of `role` this run recorded (deleted on rank 0; every rank drops them from its
    record, so the record is the same everywhere)."""
    pruned = prune_checkpoints(run_dir, keep_last, role, run_state.checkpoints, delete=env.is_main)
    gone = {path.name for path in pruned}
    run_state.checkpoints = [name for name in run_state.checkpoints if name not in gone]
    return pruned
