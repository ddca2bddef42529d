"""Rank-0 metrics: `train_log.jsonl` (one JSON record per logged step) and optional SwanLab; atomic file writes.

Secrets: `SWANLAB_API_KEY` is only ever read by SwanLab itself from the process environment (or its own login
cache). This module never passes, prints or writes it, and `redact_secrets` strips it (and any secret-looking key)
from every config dict before that dict goes to SwanLab or a checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from predictor_training.runtime.io import SWANLAB_KEY_ENV, redact_secrets, write_text_atomic
from predictor_training.runtime.distributed import DistEnv, log0

SWANLAB_MODE_ENV = "SWANLAB_MODE"
SWANLAB_MODES = ("cloud", "offline", "local", "disabled")
TRACKERS = ("none", "swanlab")
TRAIN_LOG_NAME = "train_log.jsonl"
DISCARDED_LOG_NAME = "train_log.discarded.jsonl"


# ------------------------------------------------------------------------------------------------ metrics logger
def resolve_swanlab_mode(swanlab_mode: str | None) -> str:
    """`--swanlab_mode` if given, else `$SWANLAB_MODE`, else "cloud"; returns SwanLab's name for it."""
    if swanlab_mode is not None:
        mode, source = swanlab_mode, "--swanlab_mode"
    elif SWANLAB_MODE_ENV in os.environ:
        mode, source = os.environ[SWANLAB_MODE_ENV], f"${SWANLAB_MODE_ENV}"
    else:
        mode, source = "cloud", "default"
    if mode not in SWANLAB_MODES:
        raise ValueError(f"SwanLab mode {mode!r} (from {source}) is not one of {SWANLAB_MODES}")
    return "online" if mode == "cloud" else mode


class MetricsLogger:
    """Appends one JSON record per logged step to `run_dir/train_log.jsonl` and mirrors it to SwanLab.

    Rank 0 only: on every other rank each method returns immediately, so the loop needs no rank checks.
    tracker: "none" (jsonl only) or "swanlab" (logdir `run_dir/swanlab`, mode from `swanlab_mode`/$SWANLAB_MODE:
    cloud|offline|local|disabled).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        env: DistEnv,
        tracker: str = "none",
        project: str | None = None,
        experiment: str | None = None,
        config: dict | None = None,
        swanlab_mode: str | None = None,
    ):
        if tracker not in TRACKERS:
            raise ValueError(f"MetricsLogger: tracker={tracker!r}; expected one of {TRACKERS}")
        self.active = env.is_main
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir / TRAIN_LOG_NAME
        self._file = None
        self._swanlab_run = None
        if not self.active:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.log_path, "a", encoding="utf-8")
        if tracker == "swanlab":
            self._swanlab_run = self._start_swanlab(project, experiment, config, swanlab_mode)

    def _start_swanlab(self, project, experiment, config, swanlab_mode):
        if not project or not experiment:
            raise ValueError(f"MetricsLogger: tracker='swanlab' needs project and experiment (got {project!r}, {experiment!r})")
        import swanlab

        mode = resolve_swanlab_mode(swanlab_mode)
        key_source = "environment" if os.environ.get(SWANLAB_KEY_ENV) else "SwanLab login cache"
        log0(f"SwanLab: project={project} experiment={experiment} mode={mode} (API key from the {key_source})")
        return swanlab.init(
            project=project,
            name=experiment,
            config=redact_secrets(config or {}),
            mode=mode,
            log_dir=str(self.run_dir / "swanlab"),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append `{"step": step, **metrics}` (flushed) and send `metrics` to SwanLab at `step`."""
        if not self.active:
            return
        record = {"step": int(step), **metrics}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._swanlab_run is not None:
            self._swanlab_run.log(dict(metrics), step=int(step))

    def log_image(self, step: int, name: str, path: Path) -> None:
        """Send the image file `path` to SwanLab under `name` at `step` (the file itself stays in the run dir)."""
        if self.active and self._swanlab_run is not None:
            import swanlab

            self._swanlab_run.log({name: swanlab.Image(str(path))}, step=int(step))

    def discard_after(self, step: int) -> int:
        """On resume: move records with `step` > `step` (from an abandoned run past the checkpoint) out of
        `train_log.jsonl` into `train_log.discarded.jsonl`, so each step appears once. Returns how many moved."""
        if not self.active:
            return 0
        self._file.close()
        kept, moved = [], []
        for line in self.log_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                (moved if json.loads(line)["step"] > step else kept).append(line)
        if moved:
            with open(self.run_dir / DISCARDED_LOG_NAME, "a", encoding="utf-8") as handle:
                handle.write("\n".join(moved) + "\n")
            text = "".join(line + "\n" for line in kept)
            write_text_atomic(self.log_path, text)
        self._file = open(self.log_path, "a", encoding="utf-8")
        return len(moved)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._swanlab_run is not None:
            self._swanlab_run.finish()
            self._swanlab_run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------------ startup summary
def log_summary(title: str, rows: dict[str, str]) -> None:
    """The block printed once before the first step (rank 0): a title, then one aligned `label  text` line per
    row (trainable parameters, batch, steps, data, precision, schedule, ...)."""
    width = max(len(label) for label in rows)
    log0(f"==== {title} ====")
    for label, text in rows.items():
        log0(f"  {label.ljust(width)}  {text}")


def recipe_summary_rows(args, *, run_dir, precision: str, optimizer, first_step: int, stop_step: int) -> dict[str, str]:
    """The summary rows every Predictor recipe prints (run dir, trainable parameters, precision, steps, schedule,
    loss, checkpoints); a recipe adds its own (model, data, batch)."""
    counts = {group["name"]: sum(p.numel() for p in group["params"]) for group in optimizer.param_groups}
    return {
        "run dir": str(run_dir),
        "trainable": " | ".join(f"{name} {count:,}" for name, count in counts.items())
                     + f" | total {sum(counts.values()):,}",
        "precision": precision,
        "steps": f"{first_step}..{stop_step} of a {args.max_steps}-step schedule",
        "schedule": f"lr fusion {args.fusion_lr:g}, blocks {args.blocks_lr:g}; warmup {args.scheduler_warmup_steps}, "
                    f"block warmup {args.block_warmup_steps}, cosine to 0",
        "loss": f"{args.velocity_weight:g} mse_v + {args.hidden_weight:g} mse_h",
        "checkpoints": f"every {args.ckpt_every} steps, keep {args.keep_last}; tracker {args.tracker}",
    }


def method_summary_rows(args, *, run_dir, precision: str, trained: str, first_step: int,
                        stop_step: int) -> dict[str, str]:
    """The summary rows every generic method (fvtools/) prints; `trained` describes the model
    (`MethodModel.describe()`); a method adds its own (data, batch, loss)."""
    return {
        "run dir": str(run_dir),
        "trainable": trained,
        "precision": precision,
        "steps": f"{first_step}..{stop_step} of a {args.max_steps}-step schedule",
        "schedule": f"lr {args.lr:g}, warmup {args.warmup_steps}, cosine to 0; AdamW betas ({args.adam_beta1:g}, "
                    f"{args.adam_beta2:g}), weight decay {args.weight_decay:g}, clip {args.grad_clip:g}",
        "checkpoints": f"every {args.ckpt_every} steps, keep {args.keep_last}; tracker {args.tracker}",
    }
