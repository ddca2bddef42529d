"""The start and the end every recipe's `main()` shares, written once: `run_recipe(args, recipe)` runs

    plan = recipe.plan(args)                     # 1. the inputs, checked before anything is created; the meta
    start = plan_run(args, meta=plan.meta, ...)  #    run directory named from the flags: fresh / continue / finished
    if (code := early_exit(settings, start)) is not None:
        return code                              #    --check_only, --print_run_dir, or nothing left to do
    with distributed_run(settings, start) as env:    # process group, run directory, the start line, seeds
        launch.data = recipe.data(launch)        # 2. the batches (and what the build needs from the data)
        launch.parts = recipe.build(launch)      # 3. models, roles, step, validation (RecipeParts)
        resume_roles(...)                        #    a resumed / continued run's roles and data position
        launch.config = recipe.summarize(launch) # 4. train_config.json and the summary block
        run_training(settings, ...)              # 5. the shared loop under the metrics logger
        recipe.after(launch)                     # 6. what follows the loop (an export, the next command)
    return 0

where `settings` are the run's flags as a `RunSettings`. Each entry script names its steps in one `Recipe(...)`
beside its `main()`, in the order they run; the steps take the `Launch` (the flags, the plan, the run start, the
process group, the precision policy and what the earlier steps returned).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

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
from predictor_training.runtime.flags import settings_from_flags
from predictor_training.runtime.io import CreatedPaths
from predictor_training.runtime.logger import MetricsLogger
from predictor_training.runtime.loop import BatchStream, Validation, train_loop
from predictor_training.runtime.precision import PrecisionPolicy, precision_policy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role
from predictor_training.runtime.run_directory import (
    RunLock,
    RunLockedError,
    RunStart,
    plan_run,
    report_check,
    report_run_start,
    run_name,
)


@dataclass(frozen=True)
class RunSettings:
    """The flags the launch and the loop read (`add_run_args`, `add_tracker_args`, the optimisation group's length
    and accumulation, --val_every), named as the flags."""

    backend: str
    seed: int
    check_only: bool
    print_run_dir: bool
    tracker: str
    swanlab_project: str
    swanlab_mode: str | None
    experiment_name: str | None
    max_steps: int
    grad_accum: int
    ckpt_every: int
    keep_last: int
    log_every: int
    no_progress: bool
    val_every: int

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> RunSettings:
        """A recipe's flags; a recipe without --print_run_dir or --val_every has them off."""
        return settings_from_flags(cls, args, print_run_dir=getattr(args, "print_run_dir", False),
                                   val_every=getattr(args, "val_every", 0))


@dataclass(frozen=True)
class RunPlan:
    """What a recipe's `plan` step returns, before anything is created. meta: what the run's checkpoints record (a
    checkpoint to resume or continue must match it); resume_meta: what resume and the loop's checkpoints use when
    it is stricter (default: meta); naming: the run name from the flags (`run_directory.run_name` or
    `method_run_name`); subset: the run name's data tag; inputs: (what, folder) of input folders the flags do not
    name, which the run directory may not lie in; checked: what the checks resolved for the later steps (e.g. the
    Teacher source)."""

    meta: dict
    naming: Callable = run_name
    subset: str = ""
    inputs: Sequence[tuple[str, Path]] = ()
    checked: object = None
    resume_meta: dict | None = None


@dataclass
class Launch:
    """One launch as `run_recipe` fills it in; the argument of every recipe step after `plan`. data: what the data
    step returned (its `.batches` feed the loop); parts: the build's `RecipeParts`; config: the run config;
    run_state: the loop's state (as resumed in `summarize`, as the loop left it in `after`)."""

    args: argparse.Namespace
    plan: RunPlan
    start: RunStart
    env: DistEnv
    policy: PrecisionPolicy
    data: object = None
    parts: RecipeParts | None = None
    config: dict | None = None
    run_state: RunState | None = None


@dataclass(frozen=True)
class Recipe:
    """A recipe's steps, in the order `run_recipe` runs them (see the module docstring)."""

    plan: Callable[[argparse.Namespace], RunPlan]
    data: Callable[[Launch], object]
    build: Callable[[Launch], RecipeParts]
    summarize: Callable[[Launch], dict]
    after: Callable[[Launch], None] | None = None


def run_recipe(args: argparse.Namespace, recipe: Recipe) -> int:
    """Launch `recipe` with its parsed flags `args`; the exit code (see the module docstring)."""
    settings = RunSettings.from_flags(args)
    plan = recipe.plan(args)
    start = plan_run(args, meta=plan.meta, subset=plan.subset, naming=plan.naming, inputs=plan.inputs)
    if (code := early_exit(settings, start)) is not None:
        return code
    meta = plan.meta if plan.resume_meta is None else plan.resume_meta
    with distributed_run(settings, start) as env:
        launch = Launch(args, plan, start, env, precision_policy(args.precision, env.device))
        launch.data = recipe.data(launch)
        launch.parts = parts = recipe.build(launch)
        launch.run_state = resume_roles(start, parts.roles, launch.data.batches, meta, parts.run_state)
        launch.config = recipe.summarize(launch)
        launch.run_state = run_training(settings, start, env, roles=parts.roles, batches=launch.data.batches,
                                        step_fn=parts.step_fn, run_state=launch.run_state, config=launch.config,
                                        meta=meta, validation=parts.validation, **parts.loop_options)
        if recipe.after is not None:
            recipe.after(launch)
    return 0


def early_exit(settings: RunSettings, start: RunStart) -> int | None:
    """The exit code when this launch has nothing to train (--check_only, --print_run_dir; a finished run), else
    None."""
    if settings.check_only:
        return report_check(start)
    if settings.print_run_dir:
        return report_run_start(start)
    if start.kind == "finished":
        log0(start.describe())
        return 0
    return None


@contextlib.contextmanager
def distributed_run(settings: RunSettings, start: RunStart) -> Iterator[DistEnv]:
    """Join the process group (--backend), make the run directory and take its lock (rank 0: one writer per run
    directory; a run alive elsewhere ends every rank with one line and exit code 2 before anything is written), log
    what this launch does and seed python / numpy / torch with `--seed` + rank. The lock and the process group are
    released however the block ends (and by the kernel when the process dies); a process group that existed before
    is joined and left as it was."""
    joined = process_group_active()
    env = init_distributed(settings.backend)
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
        seed_everything(settings.seed, rank=env.rank)
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


def run_training(settings: RunSettings, start: RunStart, env: DistEnv, *, roles: Sequence[Role],
                 batches: BatchStream, step_fn, run_state: RunState, config: dict, meta: dict,
                 validation: Validation | None = None, **loop_options) -> RunState:
    """The shared loop under the run's metrics logger (train_log.jsonl; SwanLab on rank 0 with --tracker swanlab),
    with the loop flags every recipe has (--max_steps, --grad_accum, --ckpt_every, --keep_last, --log_every,
    --no_progress) and, given a `validation`, --val_every. `loop_options`: the loop's other keywords (e.g.
    `extra_step_check`). Returns the final state."""
    with MetricsLogger(start.run_dir, env, tracker=settings.tracker, project=settings.swanlab_project,
                       experiment=settings.experiment_name or start.run_name, config=config,
                       swanlab_mode=settings.swanlab_mode) as metrics_logger:
        return train_loop(
            roles=list(roles), batches=batches, step_fn=step_fn, run_dir=start.run_dir, env=env, run_state=run_state,
            max_steps=settings.max_steps, stop_at_step=start.stop_step, grad_accum=settings.grad_accum,
            ckpt_every=settings.ckpt_every, keep_last=settings.keep_last, log_every=settings.log_every,
            metrics_logger=metrics_logger, config=config, meta=meta, progress=not settings.no_progress,
            validation=validation, val_every=settings.val_every, **loop_options,
        )
