"""The command-line machinery every recipe and tool shares: value parsers of single numbers, the run's own flag groups
(run directory, tracker, CPU threads, --check_only), presets and --config, settings from flags, and the rules of
single flags. The domain groups (data, Teacher, Predictor, optimisation, method model, loss, validation, schedule)
live in `recipes/flags.py`.

The recipe's numbers are NOT written here. Every `add_*_args` takes them as required keyword arguments, so each
entry script's `parse_args()` is the one place where its defaults are written (and `--help` shows them):

    parser = CommandParser(...)        # runtime/errors.py: a parser error is one line, exit 2
    add_run_args(parser, experiment="v4", precision="fp32master", ckpt_every=500, ...)
    args = parse_recipe_args(parser, argv, presets={"demo": [...]})   # + --preset, --config FILE.yaml
    check_args(parser, args)           # FLAG_RULES and cross-flag rules -> parser.error: one line, exit 2
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch
import yaml

from predictor_training.runtime.logger import SWANLAB_MODES, TRACKERS
from predictor_training.runtime.precision import PRECISIONS

BACKENDS = ("auto", "nccl", "gloo")
Settings = TypeVar("Settings")


# ---------------------------------------------------------------------------------------------------------------
# 1. Value parsers: single numbers in a range, and list-valued flags
# ---------------------------------------------------------------------------------------------------------------
def checked(kind: type, expected: str, ok: Callable) -> Callable[[str], object]:
    """An argparse `type=`: `kind(text)`, refused unless `ok(value)` (write `ok` so that NaN fails it). argparse
    names the flag: `argument --r1_every: expected >= 1, got 0`; a non-number reads `invalid int value: 'x'`."""
    def parse(text: str):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value" message names the type by it
    parse.ok, parse.expected = ok, expected  # tests/recipes/test_bad_input.py makes a refused value of each
    return parse


def at_least(kind: type, low: float, why: str = "") -> Callable[[str], object]:
    """`checked` for values >= `low`; `why` is appended to the expectation (" (advantages compare ...)")."""
    return checked(kind, f">= {low}{why}", lambda value: value >= low)


def positive(kind: type = float) -> Callable[[str], object]:
    """`checked` for values > 0."""
    return checked(kind, "> 0", lambda value: value > 0)


SEED_LIMIT = 2**31  # numpy takes seeds below 2**32; the rank offset of seed_everything stays below that
SEED = checked(int, "in [0, 2**31)", lambda value: 0 <= value < SEED_LIMIT)  # every seed flag
UNIT_INTERVAL = checked(float, "in [0, 1)", lambda value: 0 <= value < 1)  # Adam betas, EMA decays
CLIP_OR_OFF = checked(float, "> 0, or -1", lambda value: value == -1 or value > 0)  # gradient clips


# ---------------------------------------------------------------------------------------------------------------
# 2. The run's flag groups (the recipe's numbers come from the entry script; the domain groups: recipes/flags.py)
# ---------------------------------------------------------------------------------------------------------------
def add_run_args(
    parser: argparse.ArgumentParser,
    *,
    experiment: str,
    precision: str,
    ckpt_every: int,
    keep_last: int,
    log_every: int,
    seed: int,
) -> None:
    """Run name and directory, resume, checkpoint cadence, logging, seed, precision, backend."""
    group = parser.add_argument_group("run")
    group.add_argument("--experiment", type=str, default=experiment,
                       help="first part of the run name (default %(default)s); see docs/launchers.md § Run names")
    group.add_argument("--output_root", type=Path, default=Path("checkpoints"),
                       help="folder that receives the run directory <output_root>/<run name> (default %(default)s)")
    group.add_argument("--output_dir", type=Path, default=None,
                       help="use this run directory instead of <output_root>/<run name>")
    add_check_only_arg(group, what="the run name and directory and what a launch would do there (a fresh run, a "
                       "continue, a finished run)")
    group.add_argument("--allow_changed_settings", action="store_true",
                       help="continue the run saved in the run directory with other batch settings (--batch_size, "
                            "--grad_accum, --chunks_per_clip / --chunks_per_sample), e.g. half the batch and twice "
                            "the accumulation after running out of memory; each change and its step go to "
                            "train_config.json (derived.changed_settings). Without it such a launch is refused")
    group.add_argument("--print_run_dir", action="store_true",
                       help="print the run directory these flags give and whether it is new, unfinished or finished, "
                            "then exit (exit 0: start or continue; 3: already finished; 2: settings differ from the "
                            "run saved there). The launchers use it before starting torchrun")
    group.add_argument("--resume", type=Path, default=None,
                       help="training_latest.pt to resume from (model, optimizer, schedule, steps, data position, "
                            "RNG); a missing file is an error. Without it, a run directory that already holds an "
                            "unfinished run with the same settings is continued")
    group.add_argument("--ckpt_every", type=int, default=ckpt_every,
                       help="write <role>_step_XXXXX.safetensors (predictor_step_... in the Predictor recipes) + "
                            "training_latest.pt every N optimizer steps (and always at the last step); -1 = last step "
                            "only (default %(default)s)")
    group.add_argument("--keep_last", type=int, default=keep_last,
                       help="<role>_step_*.safetensors files kept per role (oldest pruned); -1 = keep all "
                            "(default %(default)s)")
    group.add_argument("--log_every", type=int, default=log_every,
                       help="print a step's full metrics row on the console every N steps (and at the last and every "
                            "validated step); the progress bar shows loss, LR and s/step every step, and "
                            "train_log.jsonl (and the tracker) records every step (default %(default)s)")
    group.add_argument("--seed", type=int, default=seed,
                       help="seed of the data order and the per-rank RNG streams (default %(default)s)")
    group.add_argument("--precision", choices=PRECISIONS, default=precision,
                       help="fp32master: BF16 frozen Teacher, FP32 trainable weights and AdamW state, BF16 autocast; "
                            "fp32: everything FP32 (CPU demo, exact tests) (default %(default)s)")
    group.add_argument("--backend", choices=BACKENDS, default="auto",
                       help="process-group backend: auto = nccl with CUDA, gloo without")
    group.add_argument("--no_progress", action="store_true", help="no tqdm progress bar")


def add_tracker_args(parser: argparse.ArgumentParser, *, tracker: str, project: str) -> None:
    """--tracker, --swanlab_project, --swanlab_mode, --experiment_name."""
    group = parser.add_argument_group("tracking")
    group.add_argument("--tracker", choices=TRACKERS, default=tracker,
                       help="swanlab: mirror train_log.jsonl to SwanLab from rank 0 (SWANLAB_API_KEY only from the "
                            "environment or SwanLab's login cache) (default %(default)s)")
    group.add_argument("--swanlab_project", type=str, default=project, help="SwanLab project (default %(default)s)")
    group.add_argument("--swanlab_mode", choices=SWANLAB_MODES, default=None,
                       help="SwanLab mode; default $SWANLAB_MODE, else cloud")
    group.add_argument("--experiment_name", type=str, default=None,
                       help="SwanLab experiment name; default: the run directory's name")


# ---------------------------------------------------------------------------------------------------------------
# 3. Presets
# ---------------------------------------------------------------------------------------------------------------
def parse_recipe_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, presets: dict[str, list[str]]
) -> argparse.Namespace:
    """Parse `argv` after adding `--preset NAME` and `--config FILE.yaml`, with this precedence: the recipe's
    defaults < the preset < the config file < the command line.

    A preset is a list of command-line tokens. A config file maps flag names to values; it is turned into tokens
    too (`config_tokens`), so every value goes through the flag's own type and checks (`fusion_lr: 1e-4` is a float
    even though YAML reads it as a string) and an unknown or misspelled key is an error with a suggestion. Both are
    placed before `argv`, and argparse keeps the last value of a flag, so explicit flags always win.
    """
    listing = "; ".join(f"{name}: {' '.join(tokens)}" for name, tokens in presets.items())
    parser.add_argument("--preset", choices=sorted(presets), default=None,
                        help=f"start from other defaults for some flags ({listing})")
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML file of flag values ({flag_name: value}); unknown keys are errors; flags on the "
                             "command line win over it, it wins over --preset")
    argv = list(sys.argv[1:] if argv is None else argv)
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--preset", choices=sorted(presets), default=None)
    chooser.add_argument("--config", type=Path, default=None)
    chosen, _ = chooser.parse_known_args(argv)
    tokens = [] if chosen.preset is None else list(presets[chosen.preset])
    if chosen.config is not None:
        tokens += config_tokens(parser, chosen.config)
    return parser.parse_args(tokens + argv)


def config_tokens(parser: argparse.ArgumentParser, path: Path) -> list[str]:
    """The command-line tokens of a YAML config file of flag values (`parser.error` on a bad file or key)."""
    if not path.is_file():
        parser.error(f"--config {str(path)!r}: no such file")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as error:
        parser.error(f"--config {path}: not valid YAML ({error})")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values, got {type(values).__name__}")
    # argparse has no public listing of its options; `_actions` is the documented-in-practice way to read them.
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    tokens = []
    for key, value in values.items():
        if key in ("config", "help") or key not in actions:
            close = difflib.get_close_matches(str(key), actions, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            parser.error(f"--config {path}: unknown flag {key!r}{hint}")
        action, flag = actions[key], actions[key].option_strings[0]
        if action.nargs == 0:  # store_true / store_false / BooleanOptionalAction
            if not isinstance(value, bool):
                parser.error(f"--config {path}: {key}={value!r}; expected true or false")
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(flag if value else f"--no-{flag.removeprefix('--')}")
            elif value != action.default:
                tokens.append(flag)
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(item) for item in value)
        tokens += [flag, str(value)]
    return tokens


def settings_from_flags(cls: type[Settings], args: argparse.Namespace, **values) -> Settings:
    """The settings dataclass `cls` of a package builder from a recipe's flags: each field takes the flag of its own
    name, unless `values` gives it (a value that is no flag, e.g. a resolved path). The one place a builder's named
    values are read off the namespace: `build_method_model(settings_from_flags(MethodSettings, args), ...)`."""
    return cls(**{field.name: values[field.name] if field.name in values else getattr(args, field.name)
                  for field in dataclasses.fields(cls)})


# ---------------------------------------------------------------------------------------------------------------
# 4. Cross-flag rules
# ---------------------------------------------------------------------------------------------------------------
# The rules of single flags, by name: (ok(value, flags), what was expected). `check_args` applies the rule of every
# flag a recipe has; `flags` holds all of the recipe's values (a rule may read another flag, e.g. max_steps), and
# "{name}" in the expectation is filled in from them. tests/recipes/test_bad_input.py makes a refused value of
# each.
FLAG_RULES: dict[str, tuple[Callable[[object, dict], bool], str]] = {
    "fusion_lr": (lambda value, flags: value > 0, "> 0"),
    "blocks_lr": (lambda value, flags: value > 0, "> 0"),
    "lr": (lambda value, flags: value > 0, "> 0"),
    "max_steps": (lambda value, flags: value >= 1, ">= 1"),
    "scheduler_warmup_steps": (lambda value, flags: 0 <= value < flags["max_steps"], "in [0, max_steps={max_steps})"),
    "warmup_steps": (lambda value, flags: 0 <= value < flags["max_steps"], "in [0, max_steps={max_steps})"),
    "block_warmup_steps": (lambda value, flags: value == -1 or 0 <= value < flags["max_steps"],
                           "-1 or in [0, max_steps={max_steps})"),
    "stop_at_step": (lambda value, flags: value == -1 or 1 <= value <= flags["max_steps"],
                     "-1 or in [1, max_steps={max_steps}]"),
    "batch_size": (lambda value, flags: value >= 1, ">= 1"),
    "grad_accum": (lambda value, flags: value >= 1, ">= 1"),
    "weight_decay": (lambda value, flags: value >= 0, ">= 0"),
    "adam_beta1": (lambda value, flags: 0 <= value < 1, "in [0, 1)"),
    "adam_beta2": (lambda value, flags: 0 <= value < 1, "in [0, 1)"),
    "grad_clip": (lambda value, flags: value == -1 or value > 0, "> 0, or -1 for no clipping"),
    "velocity_weight": (lambda value, flags: value >= 0, ">= 0"),
    "hidden_weight": (lambda value, flags: value >= 0, ">= 0"),
    "revisit_weight": (lambda value, flags: value >= 0, ">= 0"),
    "ckpt_every": (lambda value, flags: value == -1 or value >= 1, ">= 1, or -1 for the last step only"),
    "keep_last": (lambda value, flags: value == -1 or value >= 1, ">= 1, or -1 to keep all"),
    "log_every": (lambda value, flags: value >= 1, ">= 1"),
    "val_every": (lambda value, flags: value >= 0, ">= 0"),
    "val_videos": (lambda value, flags: value >= 1, ">= 1"),
    "val_vae": (lambda value, flags: value is None or (value / "config.json").is_file(),
                "a VAE folder with config.json (validation decodes the videos)"),
    "val_ground_truth": (lambda value, flags: value is None or value.is_dir(), "an existing folder"),
    "seed": (lambda value, flags: 0 <= value < SEED_LIMIT, "in [0, 2**31)"),
    "num_workers": (lambda value, flags: value >= 0, ">= 0"),
    "resume": (lambda value, flags: value is None or value.is_file(),
               "an existing training_latest.pt (refusing to start from scratch instead)"),
    "dataset_root": (lambda value, flags: (value / flags["dataset_config_name"]).is_file(),
                     "a dataset folder with {dataset_config_name}"),
    "action_ckpt": (lambda value, flags: value is None or value.is_file(), "an existing file"),
    "teacher": (lambda value, flags: value is None or (value / "config.json").is_file(), "a folder with config.json"),
    "lora_rank": (lambda value, flags: value >= 1, ">= 1"),
    "lora_alpha": (lambda value, flags: value > 0, "> 0"),
    "sigma_shift": (lambda value, flags: value > 0, "> 0"),
    "logit_std": (lambda value, flags: value > 0, "> 0"),
}


HELD_OUT_PREFIX = "holdout"  # the held-out splits: make_sample_table's holdout25 / holdout50, the demo world's holdout


def is_held_out_split(split: str) -> bool:
    """Whether `split` names held-out data, which no recipe trains on (`HELD_OUT_PREFIX`)."""
    return str(split).startswith(HELD_OUT_PREFIX)


def check_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, dataset_config_name: str | None = None
) -> None:
    """Rules spanning the groups above; every problem names the flag, its value and what was expected, and goes
    through `parser.error` (one line, exit 2). Flags a recipe does not have are skipped by name (`FLAG_RULES`).
    `dataset_config_name`: the file that marks a built dataset in --dataset_root (e.g. `data.dataset_config.
    DATASET_CONFIG_NAME`); a recipe with --dataset_root must name it."""
    present = vars(args)
    if "dataset_root" in present and dataset_config_name is None:
        raise ValueError("check_args: this recipe has --dataset_root; pass dataset_config_name (the file that marks "
                         "its dataset)")
    flags = {**present, "dataset_config_name": dataset_config_name}
    problems = [f"--{name}={present[name]!r}: expected {expected.format(**flags)}"
                for name, (ok, expected) in FLAG_RULES.items() if name in present and not ok(present[name], flags)]
    if "backend" in present:
        check_cuda_flag(parser, "--backend", args.backend)
    if "split" in present and is_held_out_split(args.split):
        problems.append(f"--split={args.split!r}: a held-out split (its name starts with {HELD_OUT_PREFIX!r}); "
                        "expected a split to train on, e.g. 'train' (held-out splits are scored by the eval and "
                        "--val_split: a model trained on one would report in-sample figures as held-out)")
    if present.get("velocity_weight") == 0 and present.get("hidden_weight") == 0:
        problems.append("--velocity_weight=0 and --hidden_weight=0: nothing would be trained")
    if "sigma_min" in present and not 0 <= args.sigma_min < args.sigma_max <= 1:
        problems.append(f"--sigma_min={args.sigma_min!r} --sigma_max={args.sigma_max!r}: expected 0 <= min < max <= 1")
    if problems:
        parser.error("; ".join(problems))


def check_cuda_flag(parser: argparse.ArgumentParser, flag: str, value: str) -> None:
    """A flag that asks for CUDA (`--device cuda`, `--backend nccl`) on a machine where torch sees no CUDA device is
    refused when the flags are parsed (one line naming it), not when the first tensor meets the device."""
    if value in ("cuda", "nccl") and not torch.cuda.is_available():
        parser.error(f"{flag} {value}: no CUDA device is visible to torch on this machine; expected {flag} "
                     f"{'cpu' if value == 'cuda' else 'gloo'} or auto")
def add_check_only_arg(parser, *, what: str) -> None:
    """--check_only of every entry script (recipes, tools, the benchmarks the docs show): run the checks a real run
    makes before it creates anything, print `what` it would write (`report_check_only`), exit 0 having created
    nothing. A refusal is the real run's own: one line, exit 2. tests/test_doc_commands.py runs every command of
    the docs with it."""
    parser.add_argument("--check_only", action="store_true",
                        help="check every flag and input as the real run would before it creates anything (each "
                             "input path's kind, the files it reads first), print " + what + ", and exit 0 "
                             "having created nothing; a refusal is the real run's own (one line, exit 2)")


def report_check_only(*lines: str) -> int:
    """--check_only's report: `check only: <line>` for each line (what the command would write or do) on stdout, as
    the recipes' (`run_directory.report_check`); returns exit code 0."""
    for line in lines:
        print(f"check only: {line}", flush=True)
    return 0


def add_threads_arg(parser: argparse.ArgumentParser) -> None:
    """--threads of a CPU tool (`runtime.cpu_threads.set_cpu_threads` applies it)."""
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for this process's tensors (default: OMP_NUM_THREADS when set, else the "
                             "cores free to this process - its CPU affinity less the load of other jobs - split "
                             "over the ranks on this host; the choice is printed at start)")
