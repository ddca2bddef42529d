"""The run directory: its name (computed from the flags that ran), whether a launch starts, continues or has
nothing left to do, and `train_config.json`.

Run names (docs/launchers.md § Run names):

    <experiment>_blocks<a>-<b>_[<subset>_]<precision>_<N>gpu|cpu_flr<fusion_lr>_blr<blocks_lr>_schedsteps<max_steps>
        _swarmup<scheduler_warmup_steps>_bwarmup<block_warmup_steps|none>_<tracker|notracker>

A second launch of the same command finds its own directory again: a finished run says so and does nothing, an
interrupted one continues from its `training_latest.pt`, and a directory whose saved settings differ is refused
(`RunConflictError`, one line naming the differing flags) unless the only differences are the batch settings
(`CHANGEABLE_FLAGS`) and `--allow_changed_settings` asks for them: the run then continues with the new ones, and
`derived.changed_settings` of its config records each change and its step. While a run trains, it holds
`run.lock` in its directory (`RunLock`): a second launch of a live run is refused with the PIDs holding it, before
it writes anything.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from predictor_training.runtime.checkpoint import (
    PREVIOUS_TRAINING_STATE_NAME,
    TRAINING_STATE_NAME,
    DamagedTrainingStateError,
    read_training_summary,
)
from predictor_training.runtime.cpu_threads import cpu_kind
from predictor_training.runtime.distributed import resolve_backend
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import write_json_atomic
from predictor_training.runtime.io import redact_secrets

TRAIN_CONFIG_NAME = "train_config.json"

# Flags that steer one invocation but do not change what the run computes: a continued run may change them.
RUN_CONTROL_FLAGS = frozenset({
    "resume", "stop_at_step", "output_dir", "output_root", "print_run_dir", "no_progress", "num_workers",
    "verify_dataset", "backend", "ckpt_every", "keep_last", "log_every", "swanlab_mode", "experiment_name",
    "preset", "config", "val_every", "val_split", "val_videos", "val_vae", "val_ground_truth",
    "no_action_ckpt",  # an assertion about --teacher; --action_ckpt itself is compared
    "check_only", "allow_changed_settings",
})
# Flags a run may continue with changed, on purpose (--allow_changed_settings): how a step's batch is split into
# micro-batches, not the model, the schedule or the data order. A smaller --batch_size with a larger --grad_accum
# keeps the global batch (after an out-of-memory crash, docs/troubleshooting.md).
CHANGEABLE_FLAGS = ("batch_size", "grad_accum", "chunks_per_clip", "chunks_per_sample")
# Folders a run reads; its run directory may not lie in one of them.
INPUT_FOLDER_FLAGS = ("dataset_root", "cache_root", "teacher", "samples_dir", "val_vae", "val_ground_truth")


class RunConflictError(UserInputError):
    """The run directory holds a run whose saved settings differ from this launch's."""


# ---------------------------------------------------------------------------------------------------------------
# 1. The name
# ---------------------------------------------------------------------------------------------------------------
def format_lr(value: float) -> str:
    """A learning rate as it is written in run names: 1e-4 -> "1e-4", 5e-4 -> "5e-4", 2.5e-05 -> "2.5e-5"."""
    mantissa, exponent = f"{value:.6e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"


def subset_tag(subset_cases: int | list[str] | None, subset_seed: int) -> str:
    """The run-name part of a case subset: 8 cases with seed 20260721 -> "overfit8_seed20260721"; explicit case
    ids -> "cases<count>"; no subset -> ""."""
    if subset_cases is None:
        return ""
    if isinstance(subset_cases, int):
        return f"overfit{subset_cases}_seed{subset_seed}"
    return f"cases{len(subset_cases)}"


def device_tag(world_size: int, device_type: str) -> str:
    """Total processes and their kind: "8gpu", "2cpu"."""
    return f"{world_size}{'gpu' if device_type == 'cuda' else 'cpu'}"


def run_name(flags: dict, *, world_size: int, device_type: str, subset: str = "") -> str:
    """The run directory's name from the run's flags (`plain_flags`: as train_config.json records them; `subset`:
    the recipe's `subset_tag`, or "")."""
    blocks = "-".join(str(block) for block in flags["source_blocks"])
    bwarmup = "none" if flags["block_warmup_steps"] == -1 else str(flags["block_warmup_steps"])
    tracker = "notracker" if flags["tracker"] == "none" else flags["tracker"]
    parts = [
        flags["experiment"], f"blocks{blocks}", *([subset] if subset else []), flags["precision"],
        device_tag(world_size, device_type), f"flr{format_lr(flags['fusion_lr'])}",
        f"blr{format_lr(flags['blocks_lr'])}", f"schedsteps{flags['max_steps']}",
        f"swarmup{flags['scheduler_warmup_steps']}", f"bwarmup{bwarmup}", tracker,
    ]
    return "_".join(parts)


def method_run_name(flags: dict, *, world_size: int, device_type: str, subset: str = "") -> str:
    """The run directory's name of a generic method (fvtools/) from its flags (`plain_flags`): what trains (a LoRA
    of rank r, or all parameters from the Teacher or from scratch), precision, world, LR, schedule length and
    warmup."""
    model = f"lora{flags['lora_rank']}" if flags["train"] == "lora" else f"full-{flags['init_weights']}"
    tracker = "notracker" if flags["tracker"] == "none" else flags["tracker"]
    parts = [
        flags["experiment"], model, *([subset] if subset else []), flags["precision"],
        device_tag(world_size, device_type), f"lr{format_lr(flags['lr'])}", f"steps{flags['max_steps']}",
        f"warmup{flags['warmup_steps']}", tracker,
    ]
    return "_".join(parts)


def launch_world(backend: str) -> tuple[int, str]:
    """(world size, device type) this process will train with, known before the process group exists: WORLD_SIZE
    from torchrun (or the launcher's dry run), else 1; "cuda" when a GPU is visible, unless --backend gloo (which
    trains on the CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return world_size, "cuda" if resolve_backend(backend) == "nccl" else "cpu"  # init_distributed's own rule


# ---------------------------------------------------------------------------------------------------------------
# 2. Start, continue, or nothing to do
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunStart:
    """What a launch does in `run_dir`.

    kind: "fresh" (no saved state), "resume" (--resume given), "continue" (the directory's own unfinished run with
    the same settings) or "finished" (it already reached `stop_step`). resume_path: the training state to load
    (None for "fresh"); saved_step: the step of that state (0 when fresh).
    """

    run_dir: Path
    run_name: str
    kind: str
    resume_path: Path | None
    saved_step: int
    stop_step: int
    # The batch settings this launch changes ({flag: [saved, now]}, --allow_changed_settings) and every change of
    # the run so far, this one included ([{"step", "flags"}]; what train_config.json records).
    changed: dict = field(default_factory=dict)
    changed_settings: tuple = ()

    def describe(self) -> str:
        """One line saying what this launch does."""
        stop_step = self.stop_step
        changes = "" if not self.changed else " with changed settings " + ", ".join(
            f"--{flag} {saved} -> {now}" for flag, (saved, now) in self.changed.items())
        if self.kind == "fresh":
            return f"new run in {self.run_dir}"
        if self.kind == "resume":
            return f"resuming from {self.resume_path} (step {self.saved_step}) into {self.run_dir}{changes}"
        if self.kind == "continue":
            return (f"continuing the interrupted run in {self.run_dir} from step {self.saved_step} to "
                    f"{stop_step}{changes}")
        return f"run {self.run_dir} already finished at step {self.saved_step}; nothing to do"

    def recorded(self) -> dict:
        """What the run's config records of its start besides the flags: `changed_settings` when the run's batch
        settings ever changed (a recipe passes `**start.recorded()` to `run_config`)."""
        return {"changed_settings": list(self.changed_settings)} if self.changed_settings else {}


def comparable_flags(flags: dict) -> dict:
    """The flags that decide what a run computes (everything but `RUN_CONTROL_FLAGS`)."""
    return {name: value for name, value in flags.items() if name not in RUN_CONTROL_FLAGS}


def saved_run_flags(run_dir: Path) -> tuple[dict, Path] | None:
    """(the comparable flags of the run that lives in `run_dir`, the file they come from): its training state's
    config, else (none, or a damaged one) its train_config.json; None for an empty or new directory."""
    saved_path = Path(run_dir) / TRAINING_STATE_NAME
    if saved_path.is_file():
        try:
            return comparable_flags(read_training_summary(saved_path)["config"]["flags"]), saved_path
        except DamagedTrainingStateError:
            pass
    config_path = Path(run_dir) / TRAIN_CONFIG_NAME
    if config_path.is_file():
        try:
            return comparable_flags(json.loads(config_path.read_text(encoding="utf-8"))["flags"]), config_path
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise UserInputError(f"{config_path}: not a train_config.json ({type(error).__name__}: {error}); "
                                 "expected the JSON the run wrote") from None
    return None


def check_resume_belongs(resume: Path, saved: dict, run_dir: Path) -> None:
    """A --resume writes into `run_dir`: the checkpoint must be one of that run's (a file in the directory, or the
    same flags as the run saved there), so that it never trains over, and replaces, another run's outputs. An
    empty or new directory takes any checkpoint (a branch)."""
    if Path(resume).resolve().parent == Path(run_dir).resolve():
        return
    own = saved_run_flags(run_dir)
    if own is None:
        return
    own_flags, own_file = own
    resumed_flags = comparable_flags(saved["config"]["flags"])
    differing = sorted(key for key in own_flags.keys() | resumed_flags.keys()
                       if own_flags.get(key) != resumed_flags.get(key))
    if differing:
        details = ", ".join(f"--{key} {resumed_flags.get(key)!r} there, {own_flags.get(key)!r} here"
                            for key in differing[:4]) + (", ..." if len(differing) > 4 else "")
        raise RunConflictError(f"--resume {resume}: belongs to another run than the one in {run_dir} ({details}; "
                               f"from {own_file}); expected a checkpoint of that run, or pass another --output_dir "
                               "to branch from it")


def check_output_folder(run_dir: Path, flags: dict, inputs: Sequence[tuple[str, Path]] = ()) -> None:
    """The run directory can be written and is no input folder (nor inside one: the `INPUT_FOLDER_FLAGS` among
    `flags` (`plain_flags`) and `inputs`, (what, folder) pairs such as a Teacher found in the dataset's config):
    refused before anything exists."""
    run_dir = Path(run_dir)
    flag = "--output_dir" if flags["output_dir"] is not None else "--output_root"
    resolved = run_dir.resolve()
    folders = [(f"--{name}", flags.get(name)) for name in INPUT_FOLDER_FLAGS] + list(inputs)
    for what, folder in folders:
        if folder is not None and Path(folder).is_dir() and resolved.is_relative_to(Path(folder).resolve()):
            raise UserInputError(f"{flag} {run_dir}: inside {what} {folder}; expected an output folder outside "
                                 "every input folder")
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserInputError(f"{flag} {run_dir}: {existing} is a file; expected a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserInputError(f"{flag} {run_dir}: {existing} is not writable by this user; expected a writable "
                             "folder")


WEIGHTS_FILE = re.compile(r"^.+_step_\d{5,}\.safetensors$")  # what `checkpoint.inference_weights_name` gives


def check_no_foreign_weights(run_dir: Path, flag: str) -> None:
    """A run starting in `run_dir` (it holds no training state, latest or previous, so no run of its own) would
    overwrite the step files already there: refused, naming them, before anything is created."""
    found = sorted(path.name for path in run_dir.glob("*_step_*.safetensors") if WEIGHTS_FILE.match(path.name)) if (
        run_dir.is_dir()) else []
    if found:
        raise UserInputError(f"{flag} {run_dir}: holds {found[0]} ({len(found)} step file(s)) but no "
                             f"{TRAINING_STATE_NAME}, so no run in it wrote them, and a new run would overwrite those "
                             "of its own steps; expected an empty folder or this run's own directory (move them away, "
                             "or pass another --output_dir)")


def plan_run(args: argparse.Namespace, *, meta: dict, subset: str = "", naming=run_name,
             inputs: Sequence[tuple[str, Path]] = ()) -> RunStart:
    """The first thing every recipe's `main()` does after parsing: name the run from its flags (`naming`, the
    Predictor recipes' `run_name` or the methods' `method_run_name`, called with the flags as `plain_flags` and the
    world it will train in), find its directory (--output_dir, else <--output_root>/<name>), and decide fresh /
    resume / continue / finished (reads only the saved state's small fields, memory-mapped, and checks its weights
    are finite). `meta`: what the run's checkpoints record (a checkpoint to resume or continue, saved with other
    values, is refused here, before anything is created); `inputs`: (what, folder) of input folders the flags do
    not name (e.g. the Teacher a dataset records), which the run directory may not lie in.

    A directory holding a run with other settings (`RunConflictError`, naming each differing flag), another run's
    checkpoint given to --resume, a damaged or mismatched one, or an output folder that cannot be used raise
    `UserInputError` (one line, exit code 2 through `errors.command`), in the launcher's --print_run_dir dry run
    too."""
    flags = plain_flags(args)
    world_size, device_type = launch_world(flags["backend"])
    name = naming(flags, world_size=world_size, device_type=device_type, subset=subset)
    run_dir = Path(flags["output_dir"]) if flags["output_dir"] is not None else Path(flags["output_root"]) / name
    check_output_folder(run_dir, flags, inputs)
    if not any((run_dir / name).is_file() for name in (TRAINING_STATE_NAME, PREVIOUS_TRAINING_STATE_NAME)):
        check_no_foreign_weights(run_dir, "--output_dir" if flags["output_dir"] is not None else "--output_root")
    stop_step = flags["max_steps"] if flags["stop_at_step"] == -1 else flags["stop_at_step"]
    if flags["resume"] is not None:
        resume = Path(flags["resume"])
        saved = read_training_summary(resume, expect=meta)
        check_resume_belongs(resume, saved, run_dir)
        changed, history = changed_batch_settings(saved, flags)
        return RunStart(run_dir, name, "resume", resume, saved["step"], stop_step, changed, history)
    saved_path = run_dir / TRAINING_STATE_NAME
    if not saved_path.is_file():
        return RunStart(run_dir, name, "fresh", None, 0, stop_step)
    saved = read_training_summary(saved_path, expect=meta)
    saved_flags = comparable_flags(saved["config"]["flags"])
    current_flags = comparable_flags(flags)
    differing = sorted(name for name in saved_flags.keys() | current_flags.keys()
                       if saved_flags.get(name) != current_flags.get(name))
    unchangeable = [name for name in differing if name not in CHANGEABLE_FLAGS]
    if unchangeable or (differing and not flags.get("allow_changed_settings")):
        details = ", ".join(f"--{name} saved {saved_flags.get(name)!r} now {current_flags.get(name)!r}"
                            for name in differing)
        way = ("; --allow_changed_settings continues it with other batch settings "
               f"(--{', --'.join(CHANGEABLE_FLAGS)}) only" if unchangeable else
               "; or pass --allow_changed_settings to continue it with these batch settings, recorded in its "
               "config")
        raise RunConflictError(f"{run_dir} holds a run with other settings ({details}); choose another "
                               f"--output_dir{way}")
    kind = "finished" if saved["step"] >= stop_step else "continue"
    changed, history = changed_batch_settings(saved, flags)
    return RunStart(run_dir, name, kind, saved_path, saved["step"], stop_step, changed, history)


def changed_batch_settings(saved: dict, flags: dict) -> tuple[dict, tuple]:
    """({flag: [saved, now]} of the `CHANGEABLE_FLAGS` this launch changes against the training state `saved`, the
    run's changes so far with this one appended as {"step", "flags"})."""
    saved_flags = saved["config"]["flags"]
    changed = {name: [saved_flags.get(name), flags.get(name)] for name in CHANGEABLE_FLAGS
               if name in flags and saved_flags.get(name) != flags.get(name)}
    history = list(saved["config"].get("derived", {}).get("changed_settings", []))
    if changed:
        history.append({"step": saved["step"], "flags": changed})
    return changed, tuple(history)


def recorded_init_meta(start: RunStart, loaded: dict | None) -> dict | None:
    """The --init_from metadata the run records (train_config.json, every checkpoint's config): `loaded`, read from
    the file this launch loaded, on a fresh start; on a resume or continue the weights come from the training state,
    so it is the metadata that state recorded: the run's start stays named whichever launch writes the config."""
    if start.resume_path is None:
        return loaded
    return read_training_summary(start.resume_path)["config"]["derived"].get("init_meta")


def report_check(start: RunStart) -> int:
    """For --check_only: the run name, its directory and what a launch would do there, on stdout; exit code 0
    (refusals, a run alive elsewhere included, raise before: one line, exit 2). Nothing is created."""
    holders = RunLock(start.run_dir).holders()
    if holders is not None:
        raise RunLockedError(f"run {start.run_dir} is already running ({holders}); wait for it, or stop those "
                             "processes first")
    print(f"check only: run name {start.run_name}")
    print(f"check only: run directory {start.run_dir}")
    print(f"check only: a launch would do this: {start.describe()}", flush=True)
    return 0


def report_run_start(start: RunStart) -> int:
    """For --print_run_dir: the run directory on stdout, what a launch would do on stderr; returns the exit code
    (0: start or continue; 3: already finished, so a launcher has nothing to start). A run alive in other processes
    raises RunLockedError (one line, exit code 2): a launcher must not start it again."""
    holders = RunLock(start.run_dir).holders()
    if holders is not None:
        raise RunLockedError(f"run {start.run_dir} is already running ({holders}); wait for it, or stop those "
                             "processes first")
    print(start.run_dir)
    print(start.describe(), file=sys.stderr)
    return 3 if start.kind == "finished" else 0


# ---------------------------------------------------------------------------------------------------------------
# 3. train_config.json
# ---------------------------------------------------------------------------------------------------------------
def _plain(value):
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


# Values a recipe derives from its flags into the namespace (`args.plan`, the StepPlan of --replace_steps /
# --reuse_steps: recipes/flags.py): recorded through the flags they come from, not again.
DERIVED_VALUES = ("plan",)


def plain_flags(args: argparse.Namespace) -> dict:
    """Every flag as plain JSON data (paths as strings, tuples as lists), secrets removed (`DERIVED_VALUES` left
    out)."""
    return redact_secrets(_plain({name: value for name, value in vars(args).items() if name not in DERIVED_VALUES}))


def run_config(args: argparse.Namespace, **derived) -> dict:
    """The run's config: {"flags": every flag, "derived": `derived` (run name, world size, global batch, ...)}.
    It goes to train_config.json, into every checkpoint and to the tracker."""
    return {"flags": plain_flags(args), "derived": redact_secrets(_plain(derived))}


def write_train_config(run_dir: Path, config: dict) -> None:
    """`run_dir/train_config.json`, atomically (rewritten on resume: it describes this invocation). Rank 0 only."""
    write_json_atomic(Path(run_dir) / TRAIN_CONFIG_NAME, config)


def environment_summary() -> dict:
    """torch version, CUDA devices, OMP threads, the torch intra-op threads of this rank (the training cost's
    core-hours: eval/training_cost.py) and the CPU kind (`cpu_threads.cpu_kind`: what decides the bits of CPU
    results, so a baseline comparison knows where a run was made), for train_config.json."""
    return {
        "torch": torch.__version__,
        "cuda_devices": str(torch.cuda.device_count() if torch.cuda.is_available() else 0),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "torch_threads": torch.get_num_threads(),
        "cpu_kind": cpu_kind(),
    }


# ---------------------------------------------------------------------------------------------------------------
# 4. One writer per run directory
# ---------------------------------------------------------------------------------------------------------------
RUN_LOCK_NAME = "run.lock"


class RunLockedError(UserInputError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """An exclusive `flock` on `<run_dir>/run.lock`, held for the life of the run.

    The kernel releases it when the holding process dies (kill -9 included), so a crash never leaves a stale lock.
    The file records who holds it (one line: the PIDs of the ranks on this host and of their launcher) for the
    refusal message of a second launch; it is rewritten only once the lock is held.
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / RUN_LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise `RunLockedError` naming the run and its holders; writes nothing on refusal."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown PIDs"
            os.close(fd)
            raise RunLockedError(f"run {self.path.parent} is already running ({holders}); wait for it, or stop "
                                 "those processes first") from None
        self._fd = fd

    def holders(self) -> str | None:
        """Who holds the lock now (the recorded PIDs), or None when nobody does; takes nothing."""
        if not self.path.is_file():
            return None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown PIDs"
        finally:
            os.close(fd)  # closing drops a lock taken above
        return None

    def record_holders(self, text: str) -> None:
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (text + "\n").encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
