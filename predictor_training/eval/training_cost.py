"""What a trained model cost to train, beside what it scores: measured CPU core-hours on the machine that trained
it, and training FLOPs at the real config, summed over its lineage (docs/leaderboard.md § Training cost).

    cost = training_cost("checkpoints/<run>/training_latest.pt")   # a run directory, a training state, a role's
                                                                   # *_step_XXXXX.safetensors, a LoRA file or an
                                                                   # exported model/ folder
    cost["core_hours"], cost["flops"], cost["lineage_complete"], cost_columns(cost)

**Core-hours** (measured) of one run: the sum over its `train_log.jsonl` records of `time/step_s` (rank 0's wall
time of the optimizer step: data wait, forward, backward, optimizer; validation and checkpoint writes are outside it)
x the world size x the torch threads of each rank (train_config.json's environment: `torch_threads` since it is
recorded, else OMP_NUM_THREADS, else 1 with a note), / 3600. A shared machine's contention is in the figure: it is
what the run took there, not what a quiet machine would take.

**FLOPs at the real config** of one run: what its optimizer steps would compute on the real model (the
worldplay_480p_i2v Teacher, 54 blocks of width 2048; 30 x 52 latent tokens per frame, 1000 text tokens, 8 chunks of
4 latent frames) sample for sample: the recipe's measured cost of one item (a pair, a trajectory, a clip) at the real
config x the run's global batch (per-rank micro-batch x ranks x accumulation), for every step the weights took. The
per-item costs are looked up by the run's step key (`step_key`: the recipe and the flags that change what a step
computes) in `step_flops.json`, a committed table that `tools/measure_step_flops.py` measures: it runs the
recipe's own loop step under the memory rehearsal (recipes/rehearsal.py: the recipe's `build` at its `real_size`
preset, fake tensors) and counts every matmul and attention FLOP the step dispatches, forward, backward and the
checkpointed blocks' recompute (runtime/flop_count.py). A table, not a figure recorded by the run: the rehearsal
takes minutes at real size and sits above this layer, weights made before it existed (the shipped Predictor) have
none, and one measurement serves every run of the same key. A run whose key the table lacks has `flops` None and
says so, with the command that measures it. Random draws a step makes (which chunks KD trains, DMD2's exit steps)
and cadences (DMD2's generator every N steps, its monitor every M) are folded in exactly (`ITEM_MODELS`), so the
figure is the expectation over the draws and the exact count of the cadence.

**Lineage**: the runs whose training the weights carry, each counted up to the step its child started from -
`init_from` (the Predictor recipes', dmd2's and adversarial's --init_from: the Predictor it fine-tunes; the run
records the file's metadata as init_meta), `resume` (a --resume of another run's training state into this run
directory), `teacher` (the --teacher a student starts from: kd, dmd2 --generator student, df_sft, nft, when it is a
trained model) and `real_score` (dmd2's --real_score model or LoRA, a df_sft run's output). Models every compared
row shares (`shared`: the Teacher the rows serve) are counted by no row. A parent that is not on this machine makes `lineage_complete`
False and is listed under `missing` with its path and what the child recorded of it (step, recipe, checksums);
the totals then count what was found, a lower bound (`complete`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from predictor_training.methods.dmd2_models import EMA_FOLDER
from predictor_training.methods.method_model import WEIGHTS_NAME
from predictor_training.runtime.checkpoint import TRAINING_STATE_NAME, read_training_summary
from predictor_training.runtime.inference_weights import INFERENCE_FORMAT
from predictor_training.runtime.distributed import log0
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import open_safetensors
from predictor_training.runtime.logger import DISCARDED_LOG_NAME
from predictor_training.runtime.provenance import file_sha256, recorded_provenance, weights_sha256
from predictor_training.runtime.run_directory import TRAIN_CONFIG_NAME
from predictor_training.teacher.adapters import LORA_FILE_FORMAT
from predictor_training.teacher.flops import REAL_LATENT_GRID, REAL_TEXT_TOKENS

STEP_FLOPS_TABLE = Path(__file__).with_name("step_flops.json")
LOG_NAME = "train_log.jsonl"
REAL_CONFIG = {"teacher": "worldplay_480p_i2v", "latent_grid": list(REAL_LATENT_GRID), "text_tokens": REAL_TEXT_TOKENS,
               "chunks": 8}
MEASURE_COMMAND = "python tools/measure_step_flops.py --run {run} --write"
# Flags that runs written before the flag existed lack, at the value the code had then (their behaviour).
PREDATING_FLAGS = {"reuse_steps": [], "student_sampler": "euler", "recompute_context": False, "context_grad": False}
# The recipes whose trained model starts from the --teacher's weights (a LoRA on it, or all of its parameters).
STUDENT_RECIPES = ("kd", "df_sft", "nft")


# ---------------------------------------------------------------------------------------------------------------
# 1. The step key and the table
# ---------------------------------------------------------------------------------------------------------------
def recipe_of(config: dict) -> str:
    """The recipe a run config (train_config.json: {"flags", "derived"}) belongs to: v4, disca, rollout, or the
    method of fvtools/ (df_sft, kd, dmd2, adversarial, nft)."""
    derived = config["derived"]
    if "method" in derived:
        return str(derived["method"])
    if str(derived.get("recipe", "")).startswith("rollout_"):
        return "rollout"
    if derived.get("variant") in ("v4", "disca"):
        return str(derived["variant"])
    raise UserInputError(f"a run config naming no recipe (derived: {sorted(derived)}); expected the train_config.json "
                         "of a Predictor recipe or an fvtools method")


def _flag(flags: dict, name: str):
    if name in flags:
        return flags[name]
    if name in PREDATING_FLAGS:
        return PREDATING_FLAGS[name]
    raise UserInputError(f"the run config has no flag --{name}; expected the train_config.json of this toolkit")


def step_key(config: dict) -> dict:
    """The recipe and the flags that change what one of its loop steps computes at the real config (the
    `step_flops.json` key; the names are the recipe's own flags). What the real config fixes is not in it: sizes
    (the real Teacher, 8 chunks), precision and gradient checkpointing (the recipe's `real_size` preset). Draws and
    cadences are not either: the table's item model takes them from the run's flags (`ITEM_MODELS`)."""
    recipe, flags = recipe_of(config), config["flags"]
    if recipe in ("v4", "disca"):
        return {"recipe": recipe}
    if recipe == "rollout":
        return {"recipe": recipe, "replace_steps": list(_flag(flags, "replace_steps")),
                "reuse_steps": list(_flag(flags, "reuse_steps") or []), "context_mode": _flag(flags, "context_mode")}
    trained = {"train": _flag(flags, "train")}
    if trained["train"] == "lora":
        trained["lora_rank"] = int(_flag(flags, "lora_rank"))
    if recipe == "kd":
        return {"recipe": recipe, **trained, "student_steps": int(_flag(flags, "student_steps")),
                "context_grad": bool(_flag(flags, "context_grad"))}
    if recipe == "dmd2":
        key = {"recipe": recipe, "generator": _flag(flags, "generator"), "rollout": _flag(flags, "rollout"),
               "real_score": _flag(flags, "real_score_kind"), "fake_score_train": _flag(flags, "fake_score_train"),
               "anchor": float(_flag(flags, "anchor_weight")) > 0,
               "recompute_context": bool(_flag(flags, "recompute_context"))}
        if key["generator"] == "predictor":
            return {**key, "replace_steps": list(_flag(flags, "replace_steps"))}
        return {**key, **trained, "student_steps": int(_flag(flags, "student_steps")),
                "exit_step": _flag(flags, "exit_step"), "student_sampler": _flag(flags, "student_sampler"),
                "context_grad": bool(_flag(flags, "context_grad"))}
    raise UserInputError(f"no step key for recipe {recipe!r} yet (v4, disca, rollout, kd, dmd2 have one); its runs "
                         "carry core-hours but no FLOPs")


def key_text(key: dict) -> str:
    """A key in one line: `rollout replace_steps=3 reuse_steps=1,2 context_mode=exact`."""
    def value(item):
        return ",".join(map(str, item)) if isinstance(item, list) else str(item)
    return " ".join([key["recipe"], *(f"{name}={value(item)}" for name, item in key.items() if name != "recipe")])


def load_step_flops(path: Path = STEP_FLOPS_TABLE) -> list[dict]:
    """The table's entries ({"key", "item", "model", "parts", ...}; tools/measure_step_flops.py writes them)."""
    if not Path(path).is_file():
        return []
    return json.loads(Path(path).read_text(encoding="utf-8"))["entries"]


def find_entry(key: dict, entries: list[dict]) -> dict | None:
    return next((entry for entry in entries if entry["key"] == key), None)


# How each entry's measured parts make the FLOPs of one item (one rank's micro-batch of one pair, trajectory, clip)
# over loop steps (first, last]: a function of the parts, the run's flags and the steps.
def _per_item(parts: dict, flags: dict, first: int, last: int) -> float:
    """The step computes the same every time (v4 / disca: the mean over the context frames of chunks 1..7; the
    rollout: every trained chunk)."""
    return parts["item"] * (last - first)


def _chunk_draw(parts: dict, flags: dict, first: int, last: int) -> float:
    """kd: each micro-batch trains `--chunks_per_clip` of the clip's chunks, each chunk equally likely
    (`draw_training_chunks`): the per-sample part (its text K/V) plus that fraction of the cost of all chunks."""
    drawn = min(int(flags["chunks_per_clip"]), parts["chunks"])
    return (parts["fixed"] + drawn / parts["chunks"] * parts["all_chunks"]) * (last - first)


def _cadence(parts: dict, flags: dict, first: int, last: int) -> float:
    """dmd2: the critic every step, the generator on steps divisible by --generator_every, the collapse monitor on
    steps divisible by --monitor_every (exact counts over the steps); a student's figures are the means over its
    exit steps (uniform, or the last with --exit_step last)."""
    def count(every):
        return last // every - first // every
    return (parts["critic"] * (last - first) + parts["generator"] * count(int(flags["generator_every"]))
            + parts["monitor"] * count(int(flags["monitor_every"])))


ITEM_MODELS = {"per_item": _per_item, "chunk_draw": _chunk_draw, "cadence": _cadence}


def run_flops(entry: dict, config: dict, first: int, last: int) -> float:
    """FLOPs at the real config of the run's loop steps (first, last]: the entry's item model x the global batch."""
    flags, derived = config["flags"], config["derived"]
    return ITEM_MODELS[entry["model"]](entry["parts"], flags, first, last) * int(derived["global_batch"])


# ---------------------------------------------------------------------------------------------------------------
# 2. Trained weights and the run behind them
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Trained:
    """Weights at a step, and the run that trained them as far as this machine has it.

    path: what was named; run_dir: the run directory (train_config.json / train_log.jsonl) when it is here;
    config: the run config ({"flags", "derived"}: the run directory's, else the one the weights carry); step: the
    loop step the weights are at (None: unknown); metadata: what the weights file records of itself."""

    path: Path
    run_dir: Path | None
    config: dict | None
    step: int | None
    metadata: dict = field(default_factory=dict)


def _header(path: Path) -> dict:
    with open_safetensors(path) as handle:
        return handle.metadata() or {}


def _run_dir_of(folder: Path) -> Path | None:
    """The run behind weights in `folder`: the folder itself, or the run above a student's EMA export
    (`<run_dir>/ema/`)."""
    for candidate in (folder, folder.parent) if folder.name == EMA_FOLDER else (folder,):
        if (candidate / TRAIN_CONFIG_NAME).is_file() or (candidate / LOG_NAME).is_file():
            return candidate
    return None


def _run_config(run_dir: Path | None) -> dict | None:
    if run_dir is None or not (run_dir / TRAIN_CONFIG_NAME).is_file():
        return None
    return json.loads((run_dir / TRAIN_CONFIG_NAME).read_text(encoding="utf-8"))


def locate(path: str | Path) -> Trained:
    """The weights `path` names (a run directory, a training state .pt, an inference .safetensors, a LoRA file, a
    model folder) with their step and the run behind them. A path that is none of these raises UserInputError."""
    path = Path(path)
    if not path.exists():
        raise UserInputError(f"{path}: no such file or folder; expected a run directory or trained weights")
    if path.is_dir() and (path / WEIGHTS_NAME).is_file():  # an exported model folder (or a Teacher folder)
        header = _header(path / WEIGHTS_NAME)
        metadata = json.loads(header.get("metadata", "{}"))
        run_dir = _run_dir_of(path.parent)
        return Trained(path, run_dir, _run_config(run_dir), metadata.get("step"), metadata)
    if path.is_dir():
        run_dir = _run_dir_of(path)
        if run_dir is None:
            raise UserInputError(f"{path}: neither a run directory ({TRAIN_CONFIG_NAME}, {LOG_NAME}) nor a model "
                                 "folder; expected one of them or a weights file")
        state = path / TRAINING_STATE_NAME
        step = read_training_summary(state)["step"] if state.is_file() else _last_logged_step(run_dir)
        return Trained(path, run_dir, _run_config(run_dir), step)
    run_dir = _run_dir_of(path.parent)
    if path.suffix == ".pt":
        summary = read_training_summary(path)
        return Trained(path, run_dir, _run_config(run_dir) or summary["config"], summary["step"], summary["meta"])
    if path.suffix == ".safetensors":
        header = _header(path)
        if header.get("format") == INFERENCE_FORMAT:
            metadata = json.loads(header["meta"])
            return Trained(path, run_dir, _run_config(run_dir) or json.loads(header["config"]), metadata.get("step"),
                           metadata)
        if header.get("format") == LORA_FILE_FORMAT:
            metadata = json.loads(header.get("metadata", "{}"))
            return Trained(path, run_dir, _run_config(run_dir), metadata.get("step"), metadata)
        if path.name == WEIGHTS_NAME:
            return locate(path.parent)
    raise UserInputError(f"{path}: not a training state, inference weights, LoRA file or model folder of this "
                         "toolkit")


# ---------------------------------------------------------------------------------------------------------------
# 3. One run's own cost
# ---------------------------------------------------------------------------------------------------------------
def read_log(run_dir: Path) -> list[dict]:
    """The run's train_log.jsonl records (one per optimizer step; records a resume discarded are in
    train_log.discarded.jsonl and are not read)."""
    log = run_dir / LOG_NAME
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]


def _last_logged_step(run_dir: Path) -> int | None:
    records = read_log(run_dir)
    return max((int(record["step"]) for record in records), default=None)


def threads_per_rank(config: dict) -> tuple[int, str]:
    """(torch threads of each rank, where the figure comes from): environment.torch_threads (recorded since the
    training cost exists), else OMP_NUM_THREADS as the run saw it (torchrun sets 1 per rank), else 1 (assumed)."""
    environment = config["derived"].get("environment", {})
    if "torch_threads" in environment:
        return int(environment["torch_threads"]), "torch_threads recorded"
    omp = str(environment.get("omp_num_threads", "unset")).strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS recorded"
    return 1, "not recorded: 1 thread per rank assumed"


def own_cost(trained: Trained, first: int, entries: list[dict]) -> tuple[dict, list[dict]]:
    """(the cost of `trained`'s run over loop steps (first, trained.step], what is missing of it)."""
    config, last = trained.config, trained.step
    run = {"path": str(trained.path), "run_dir": None if trained.run_dir is None else str(trained.run_dir),
           "steps": [first, last], "notes": []}
    missing = []
    if config is None or last is None:
        run.update(recipe=None, core_hours=None, flops=None)
        run["notes"].append("no run config or step recorded with these weights")
        return run, missing
    derived = config["derived"]
    recipe = recipe_of(config)
    world_size = None if derived.get("world_size") is None else int(derived["world_size"])
    global_batch = None if derived.get("global_batch") is None else int(derived["global_batch"])
    run.update(recipe=recipe, world_size=world_size, global_batch=global_batch)
    # Measured core-hours: the run's records of steps first+1..last.
    if world_size is None:  # a run config written before the world size was recorded
        run.update(core_hours=None, logged_steps=0)
        run["notes"].append("its run config records no world size: its core-hours are unknown")
    elif trained.run_dir is None:
        run.update(core_hours=None, logged_steps=0)
        recorded = config["flags"].get("output_dir") or config["derived"].get("run_name")
        missing.append({"link": "run_log", "path": recorded, "needed_by": str(trained.path),
                        "what": f"the run directory that trained these weights ({LOG_NAME}): its core-hours"})
    else:
        records = [record for record in read_log(trained.run_dir) if first < int(record["step"]) <= last]
        threads, source = threads_per_rank(config)
        seconds = sum(float(record["time/step_s"]) for record in records)
        logged = {int(record["step"]) for record in records}
        run.update(threads_per_rank=threads, threads_source=source, logged_steps=len(logged), step_seconds=seconds,
                   core_hours=seconds * world_size * threads / 3600.0)
        if "not recorded" in source:
            run["notes"].append(f"threads per rank {source}")
        absent = (last - first) - len(logged)
        if absent > 0:
            missing.append({"link": "run_log", "path": str(trained.run_dir / LOG_NAME), "needed_by": str(trained.path),
                            "what": f"{absent} of steps {first + 1}..{last} have no record: their core-hours"})
        if (trained.run_dir / DISCARDED_LOG_NAME).is_file():
            run["notes"].append(f"{DISCARDED_LOG_NAME}: steps of an interrupted attempt, redone after a resume, "
                                "not counted")
    # FLOPs at the real config: the table's entry for the run's step key, times the recorded global batch.
    if global_batch is None:
        run.update(step_key=None, flops=None)
        run["notes"].append("its run config records no global batch: its FLOPs are unknown")
        return run, missing
    try:
        key = step_key(config)
    except UserInputError as error:
        run.update(step_key=None, flops=None)
        run["notes"].append(str(error))
        return run, missing
    entry = find_entry(key, entries)
    run["step_key"] = key
    if entry is None:
        run.update(flops=None, flops_per_step=None)
        where = trained.run_dir or trained.path
        run["notes"].append(f"no measured step cost for {key_text(key)} in {STEP_FLOPS_TABLE.name}; measure it: "
                            + MEASURE_COMMAND.format(run=where))
    else:
        flops = run_flops(entry, config, first, last)
        run.update(flops=flops, flops_per_step=flops / (last - first) if last > first else None)
    return run, missing


# ---------------------------------------------------------------------------------------------------------------
# 4. The lineage
# ---------------------------------------------------------------------------------------------------------------
def same_model(first: Path, second: Path) -> bool:
    """Whether two model folders (or files) hold the same weights: the same path, or weights files of equal size
    and sha256 (a copy of the Teacher elsewhere, e.g. the demo assets' own)."""
    first, second = Path(first), Path(second)
    if first.resolve() == second.resolve():
        return True
    files = [path / WEIGHTS_NAME if path.is_dir() else path for path in (first, second)]
    if not all(path.is_file() for path in files) or files[0].stat().st_size != files[1].stat().st_size:
        return False
    return file_sha256(files[0]) == file_sha256(files[1])


def is_shared(parent: dict, shared: Sequence[Path]) -> bool:
    """Whether a parent link names one of the `shared` models: the same weights at its recorded path, or, where that
    path does not resolve here (a path relative to where the run was launched), the sha256 its run's provenance
    recorded for it equal to a shared model's weights."""
    path = None if parent["path"] is None else Path(parent["path"])
    if path is not None and path.exists():
        return any(same_model(path, model) for model in shared)
    return parent.get("sha256") is not None and any(weights_sha256(model) == parent["sha256"] for model in shared)


def parent_links(trained: Trained) -> list[dict]:
    """The links of a run to the weights its training started from or used ({"link", "path", "recorded"}; the
    module docstring lists them), as its config records them."""
    config = trained.config
    if config is None:
        return []
    flags, derived, recipe = config["flags"], config["derived"], recipe_of(config)
    provenance = derived.get("provenance") or recorded_provenance(trained.metadata) or {}
    links = []
    init_meta = derived.get("init_meta")
    if flags.get("init_from") is not None or init_meta:
        links.append({"link": "init_from", "path": flags.get("init_from"), "recorded": init_meta,
                      "sha256": provenance.get("parent_sha256")})
    resume = flags.get("resume")
    if resume is not None and (trained.run_dir is None or Path(resume).resolve().parent != trained.run_dir.resolve()):
        links.append({"link": "resume", "path": resume, "recorded": None})
    is_student = recipe in STUDENT_RECIPES or (recipe == "dmd2" and flags.get("generator") == "student")
    starts_from_teacher = is_student and (flags.get("train") == "lora" or flags.get("init_weights") == "teacher")
    if starts_from_teacher and flags.get("teacher") is not None:
        links.append({"link": "teacher", "path": flags["teacher"], "recorded": None,
                      "sha256": provenance.get("teacher_sha256")})
    if recipe == "dmd2" and flags.get("real_score_kind") in ("model", "lora"):
        links.append({"link": "real_score", "path": flags.get("real_score_path") or flags.get("real_score"),
                      "recorded": None})
    return links


def _walk(trained: Trained, first: int, link: str, entries: list[dict], shared: list[Path], seen: set, runs: list,
          missing: list, notes: list) -> None:
    """Add `trained`'s run (steps first..its step) and, depth first, every parent's."""
    identity = (str(trained.run_dir.resolve()) if trained.run_dir else str(trained.path), trained.step)
    if identity in seen:
        return
    seen.add(identity)
    links = parent_links(trained)
    resumed = next((item for item in links if item["link"] == "resume"), None)
    if resumed is not None and Path(resumed["path"]).is_file():
        first = max(first, read_training_summary(Path(resumed["path"]))["step"])
    run, run_missing = own_cost(trained, first, entries)
    runs.append({"link": link, **run})
    missing.extend(run_missing)
    for parent in links:
        path = None if parent["path"] is None else Path(parent["path"])
        if is_shared(parent, shared):
            notes.append(f"{parent['link']} {parent['path']}: shared by every compared row (the Teacher they serve); "
                         "its training is counted by no row")
            continue
        if path is None or not path.exists():
            what = "the weights this run started from, and their training" + (
                "" if path is not None else " (their path is not recorded: a run continued with --resume records "
                "no --init_from, only its metadata)")
            missing.append({"link": parent["link"], "path": None if path is None else str(path),
                            "needed_by": str(trained.path), "recorded": parent["recorded"], "what": what})
            continue
        located = locate(path)
        if located.config is None and not located.metadata.get("method"):
            notes.append(f"{parent['link']} {path}: a base model (no training recorded with it); not counted")
            continue
        if located.run_dir is None and located.config is None:  # trained (its metadata says so), run not here
            missing.append({"link": parent["link"], "path": str(path), "needed_by": str(trained.path),
                            "recorded": located.metadata, "what": "the run that trained it"})
            continue
        _walk(located, 0, parent["link"], entries, shared, seen, runs, missing, notes)


def training_cost(path: str | Path, *, shared: Sequence[str | Path] = (), table: Path = STEP_FLOPS_TABLE) -> dict:
    """The training cost of the weights at `path` and their lineage (module docstring).

    shared: model folders (or files) whose training every compared row shares - the Teacher the leaderboard serves
    (and, where a real score is the model that Teacher was distilled from, that one): a link to one of them (a
    student's --teacher, a real score), or to a copy of it, is not counted. Returns
        {"path", "core_hours", "flops", "steps", "lineage_complete", "complete": {"core_hours", "flops"},
         "runs": [{"link": "self" | "init_from" | "resume" | "teacher" | "real_score", "path", "run_dir", "recipe",
                   "steps": [first, last], "world_size", "global_batch", "threads_per_rank", "threads_source",
                   "logged_steps", "step_seconds", "core_hours", "step_key", "flops", "flops_per_step", "notes"}],
         "missing": [{"link", "path", "needed_by", "recorded", "what"}], "notes", "real_config"}
    core_hours / flops: the sums over `runs` of the figures known (None when none is), lower bounds unless
    `complete` says otherwise; steps: the optimizer steps of the whole lineage."""
    entries = load_step_flops(table)
    runs, missing, notes = [], [], []
    _walk(locate(path), 0, "self", entries, [Path(model) for model in shared], set(), runs, missing, notes)
    core_hours = [run["core_hours"] for run in runs if run.get("core_hours") is not None]
    flops = [run["flops"] for run in runs if run.get("flops") is not None]
    lineage_complete = not any(item["link"] != "run_log" for item in missing)
    return {
        "path": str(path),
        "core_hours": math.fsum(core_hours) if core_hours else None,
        "flops": math.fsum(flops) if flops else None,
        "steps": sum(run["steps"][1] - run["steps"][0] for run in runs if run["steps"][1] is not None),
        "lineage_complete": lineage_complete,
        "complete": {"core_hours": not missing and len(core_hours) == len(runs),
                     "flops": lineage_complete and len(flops) == len(runs)},
        "runs": runs, "missing": missing, "notes": notes, "real_config": REAL_CONFIG,
    }


def unknown_cost(path: str | Path, reason: str) -> dict:
    """The record of weights whose training cost cannot be read (`training_cost` refused them: e.g. a run config
    of no known recipe): every figure None, `unknown` the reason."""
    return {"path": str(path), "core_hours": None, "flops": None, "steps": None, "lineage_complete": False,
            "complete": {"core_hours": False, "flops": False}, "runs": [], "missing": [], "notes": [reason],
            "unknown": reason, "real_config": REAL_CONFIG}


def cost_columns(cost: dict) -> dict[str, str]:
    """The leaderboard's three training-cost cells of a row: core-hours on the machine that trained it, FLOPs at
    the real config (each with "≥" when it is a lower bound, "?" when nothing is known) and the lineage."""
    def cell(value, complete, text):
        return "?" if value is None else ("" if complete else "≥ ") + text(value)
    missing = [item for item in cost["missing"] if item["link"] != "run_log"]
    return {
        "train core-h (demo CPU)": cell(cost["core_hours"], cost["complete"]["core_hours"], lambda v: f"{v:.3g}"),
        "train FLOPs (real config)": cell(cost["flops"], cost["complete"]["flops"], lambda v: f"{v:.3g}"),
        "lineage": "unknown" if cost.get("unknown") else
                   "complete" if cost["lineage_complete"] else f"incomplete ({len(missing)} missing)",
    }


def training_costs(trained: dict[str, Path], shared: Sequence[Path]) -> dict[str, dict]:
    """{label: `training_cost`} of each trained source {label: its weights path} (the leaderboard's --ckpt and
    --student), the models in `shared` (the Teacher every row serves) counted by none. Weights whose cost cannot
    be read (no known recipe in their run config) get an unknown cost with the reason, and a warning: the row is
    still scored."""
    costs = {}
    for label, path in trained.items():
        try:
            costs[label] = training_cost(path, shared=list(shared))
        except UserInputError as error:
            log0(f"WARNING: {label}: its training cost is unknown ({error})")
            costs[label] = unknown_cost(path, str(error))
    return costs
