"""The start and the end every recipe's `main()` shares, as three named calls:

    start = plan_run(args, meta=meta)            # run directory named from the flags: fresh / continue / finished
    if (code := early_exit(args, start)) is not None:
        return code                              # --print_run_dir, or nothing left to do
    with distributed_run(args, start) as env:    # process group, run directory, the start line, seeds
        ...                                      # the recipe: data, models, roles, resume, config, step function
        run_state = run_training(args, start, env, roles=..., batches=..., step_fn=..., run_state=...,
                                 config=..., meta=...)   # the metrics logger around the shared loop
    return 0

`resume_roles` is the resume every recipe does the same way: load the training state into the roles and put the
batch stream back at its position.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Sequence

from predictor_training.runtime.checkpoint import TRAINING_STATE_NAME, RunState, load_training_state
from predictor_training.runtime.distributed import (
    DistEnv,
    all_gather_objects,
    cleanup_distributed,
    init_distributed,
    log0,
    process_group_active,
    seed_everything,
)
from predictor_training.runtime.errors import USER_ERROR_EXIT, UserInputError, describe_os_error
from predictor_training.runtime.io import CreatedPaths
from predictor_training.runtime.logger import MetricsLogger
from predictor_training.runtime.loop import BatchStream, Validation, train_loop
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import (
    RunLock,
    RunLockedError,
    RunStart,
    report_check,
    report_run_start,
)


def early_exit(args: argparse.Namespace, start: RunStart) -> int | None:
    """The exit code when this launch has nothing to train (--check_only, --print_run_dir; a finished run), else
    None."""
    if args.check_only:
        return report_check(start)
    if getattr(args, "print_run_dir", False):
        return report_run_start(start)
    if start.kind == "finished":
        log0(start.describe())
        return 0
    return None


@contextlib.contextmanager
def distributed_run(args: argparse.Namespace, start: RunStart) -> Iterator[DistEnv]:
    """Join the process group (--backend), make the run directory and take its lock (rank 0: one writer per run
    directory; a run alive elsewhere ends every rank with one line and exit code 2 before anything is written), log
    what this launch does and seed python / numpy / torch with `--seed` + rank. The lock and the process group are
    released however the block ends (and by the kernel when the process dies); a process group that existed before
    is joined and left as it was."""
    joined = process_group_active()
    env = init_distributed(args.backend)
    lock = RunLock(start.run_dir)
    created = CreatedPaths(start.run_dir).snapshot()
    try:
        refusal = None
        if env.is_main:
            try:
                start.run_dir.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            except RunLockedError as error:
                refusal = str(error)
            except OSError as error:  # e.g. a folder made read-only since the launcher's dry run
                refusal = describe_os_error(error)
                if refusal is None:
                    raise
        refusal = all_gather_objects(refusal)[0]
        if refusal is not None:
            if env.is_main:
                raise UserInputError(refusal)
            raise SystemExit(USER_ERROR_EXIT)  # rank 0 reports it
        pids = all_gather_objects(os.getpid())
        if env.is_main:
            lock.record_holders(f"PIDs {', '.join(map(str, pids))}; launcher PID {os.getppid()}")
        log0(start.describe())
        seed_everything(args.seed, rank=env.rank)
        yield env
    except (UserInputError, SystemExit) as error:
        # A refusal found after the directory was made (a Teacher whose weights do not fit, a damaged or non-finite
        # file met at the first steps) leaves the disk as it was, unless the run saved a training state by then.
        refused = isinstance(error, UserInputError) or error.code == USER_ERROR_EXIT
        if refused and env.is_main and TRAINING_STATE_NAME not in created.before and not (
                start.run_dir / TRAINING_STATE_NAME).exists():
            lock.release()
            created.remove()
        raise
    finally:
        lock.release()
        if not joined:
            cleanup_distributed()


def resume_roles(start: RunStart, roles: Sequence[Role], batches: BatchStream | None, meta: dict,
                 run_state: RunState | None = None) -> RunState:
    """A fresh `RunState`, or the saved one of a resumed / continued run: its roles' weights, optimizers and
    schedules restored (refusing a checkpoint whose `meta` differs) and `batches` put back at its position.
    `run_state`: the state a recipe's step already holds (`RecipeParts.run_state`), filled in place and returned."""
    run_state = RunState() if run_state is None else run_state
    if start.resume_path is None:
        return run_state
    saved = load_training_state(start.resume_path, roles=list(roles), expect=meta)
    run_state.__dict__.update(vars(saved))
    if batches is not None:
        run_state.data = rescaled_position(run_state.data, start.changed.get("batch_size"))
        batches.load_state_dict(run_state.data)
    return run_state


def rescaled_position(data: dict, batch_size_change: list | None) -> dict:
    """The batch stream's saved state for a run whose --batch_size changed ([saved, now]): its position in the
    epoch, counted in batches, becomes the same number of items in batches of the new size (rounded down, so at
    most a batch of items is seen twice); the epoch and its order are kept."""
    if batch_size_change is None or "position" not in data:
        return data
    saved, now = batch_size_change
    return {**data, "position": int(data["position"]) * int(saved) // int(now)}


def run_training(args: argparse.Namespace, start: RunStart, env: DistEnv, *, roles: Sequence[Role],
                 batches: BatchStream, step_fn, run_state: RunState, config: dict, meta: dict,
                 validation: Validation | None = None, **loop_options) -> RunState:
    """The shared loop under the run's metrics logger (train_log.jsonl; SwanLab on rank 0 with --tracker swanlab),
    with the loop flags every recipe has (--max_steps, --grad_accum, --ckpt_every, --keep_last, --log_every,
    --no_progress) and, given a `validation`, --val_every. `loop_options`: the loop's other keywords (e.g.
    `extra_step_check`). Returns the final state."""
    with MetricsLogger(start.run_dir, env, tracker=args.tracker, project=args.swanlab_project,
                       experiment=args.experiment_name or start.run_name, config=config,
                       swanlab_mode=args.swanlab_mode) as metrics_logger:
        return train_loop(
            roles=list(roles), batches=batches, step_fn=step_fn, run_dir=start.run_dir, env=env, run_state=run_state,
            max_steps=args.max_steps, stop_at_step=start.stop_step, grad_accum=args.grad_accum,
            ckpt_every=args.ckpt_every, keep_last=args.keep_last, log_every=args.log_every,
            metrics_logger=metrics_logger, config=config, meta=meta, progress=not args.no_progress,
            validation=validation, val_every=getattr(args, "val_every", 0), **loop_options,
        )
