"""kill -9 anywhere in a long command loses nothing: kill the whole process tree at random points, relaunch the same
command each time, and compare the final outputs bit for bit with an uninterrupted run.

    python benchmarks/fault_injection.py                       # every command, 3 random kills + 1 during a write
    python benchmarks/fault_injection.py --short               # CI: the offline v4 recipe, 1 random kill + 1 write
    python benchmarks/fault_injection.py --commands offline_v4 df_sft --kills 5 --seed 1 --work /tmp/fi

Commands (tiny inputs made first in --work: random demo assets, their dataset, a video-latent dataset; for the
commands that need them a finished 4-step offline v4 run, `offline_init/`, and an 8-step ODE cache of the demo
Teacher, `ode_cache/`):

    dataset_build   torchrun 2 ranks, tools/build_predictor_dataset.py --demo (shards + manifest)
    offline_v4      tools/launch_predictor_v4_training.sh (2 gloo ranks, 12 steps, a checkpoint every 3)
    disca           tools/launch_predictor_disca_training.sh (the same)
    rollout         tools/launch_predictor_v4_rollout_training.sh from offline_init/training_latest.pt (F-P-P-P,
                    2 gloo ranks, 6 steps, a checkpoint every 2)
    df_sft          tools/launch_fvtools_df_sft.sh (a LoRA, 2 gloo ranks, 8 steps, a checkpoint every 2)
    kd              tools/launch_fvtools_kd.sh on ode_cache/ (a LoRA, 2 gloo ranks, 8 steps, a checkpoint every 2;
                    kd_eval.json before / after)
    dmd2            tools/launch_fvtools_dmd2.sh: the F-P-P-P generator from offline_init's Predictor, the demo
                    Teacher as real score, a full fake score (FSDP2, sharded training_*.dcp/), 6 steps, generator
                    every 2, a checkpoint every 2
    adversarial     tools/launch_fvtools_adversarial.sh from offline_init/training_latest.pt (8 steps, every 2)
    nft             tools/launch_fvtools_nft.sh (a LoRA, 2 samples per group, 6 steps, a checkpoint every 2)
    eval            torchrun 2 ranks, tools/eval_predictor.py --demo on 4 train videos with offline_init's
                    Predictor (F-P-P-P; it resumes per video: videos/<key>.json; then the reports, one side-by-side)
    world           tools/build_demo_world.py --teacher_from kd, stages render, vae, encoders, encode, df_sft,
                    ode_cache, kd, each at its smallest (2 scenes of 77 frames, 20 latents; 4 steps of
                    each training stage, which checkpoint only at their end inside the build). Not the ship stage:
                    it replaces the package's shipped weights, and it is a copy, not a long run.

Each command first runs uninterrupted (its wall time T); its outputs are moved aside. Then the same command is
launched again in the same place and its whole process tree (the launcher, torchrun, every rank; found through
/proc, since torchrun gives each worker its own session) gets SIGKILL at a random time in (0, T), `--kills` times,
plus `--write_kills` times the moment a `*.tmp` file (a checkpoint or shard being written) appears; after the kills
the command runs to the end. Compared, bit for bit: every file of the uninterrupted run (weights, training states
as their loaded contents - a zip archive may differ in layout only -, train_config.json, shards, manifests, ODE
caches, eval tables, videos), and train_log.jsonl record by record without its wall-clock and memory fields, each
step exactly once. Compared without their wall-clock figures (seconds and the speedups measured from them, which
differ between any two runs): the eval's videos/<key>.json, aggregate.json / .csv, per_video.csv, timings.csv and
table.md, the world build's build_report.json (each stage's seconds, summed over the launches that worked on it)
and an ODE cache's COMPLETE marker (the seconds of the launch that completed it). Not compared: run.lock (PIDs),
torchrun.log and the world build's <stage>.log (consoles, appended by every launch), train_log.discarded.jsonl (the
records past a kill, by design).

Prints a table: command, kills (random / during a write: hit or not), outputs compared, differences. Exit code 1 on
any difference. This is a benchmark, not a test: it takes minutes per command (the tiny runs are short; most of the
time is Python and torch starting up, 4-6 launches per command; the world build about 25 min on loaded cores).
Measured (`--kills 3`, seed 0, 2 shared CPU cores, 21 min):

| command | kills | outputs compared | differences |
|---|---|---|---|
| dataset_build | 3 random (14.1, 24.2, 26.7 s of 33); 1 during a write | 22 | 0 |
| offline_v4 | 3 random (10.5, 15.4, 19.0 s of 37); 1 during a write | 8 | 0 |
| disca | 3 random (12.3, 18.2, 28.7 s of 38); 1 during a write | 8 | 0 |
| df_sft | 3 random (21.3, 24.3, 36.6 s of 42); 0 during a write, 1 missed | 9 | 0 |

The commands added on 2026-12-06 (`--kills 2`, seed 0, 2 CPU cores shared with a leaderboard eval, two trainings and
a test suite; benchmarks/results/2026-12-06-fault-injection.md has the commands and what was not measured):

| command | kills | outputs compared | differences |
|---|---|---|---|
| world | 2 random (178.4, 197.3 s of 244); 1 during a write | 207 | 0 (1 before COMPLETE's seconds were left out) |
| rollout | 2 random (at 0.73 and 0.81 of T); 1 during a write | 7 | 3, a bug now fixed (below) |
| kd | 2 random (at 0.28 and 0.43 of T); 1 during a write (hit or not: not recorded) | 10 | 0 |

After the fix (`--kills 1`, seed 0, the same loaded machine, about 15 min):

| command | kills | outputs compared | differences |
|---|---|---|---|
| rollout | 1 random (38.5 s of 48); 1 during a write | 7 | 0 |
| dmd2 | 1 random (33.2 s of 45); 1 during a write | 13 | 0 |
| adversarial | 1 random (15.6 s of 36); 1 during a write | 12 | 0 |
| nft | 1 random (15.5 s of 55); 1 during a write | 9 | 0 |
| eval | 1 random (37.3 s of 73); 1 during a write | 13 | 0 |

Its first run found the one difference it has seen: inference files of equal weights differed in the order of their
header's metadata (`runtime.io.save_safetensors` now sorts it). The rollout's run found the second: a relaunch that
continues a run from --init_from recorded `init_meta: null` in train_config.json and in every later checkpoint's
config (the weights come from the training state, so no --init_from file was read); rollout, adversarial and dmd2
now keep the resumed state's (`runtime.run_directory.recorded_init_meta`,
tests/recipes/test_train_adversarial.py::test_a_continued_run_still_records_the_weights_it_started_from).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from predictor_training.runtime.flags import add_check_only_arg, report_check_only

REPO_ROOT = Path(__file__).resolve().parents[1]
VOLATILE = {"run.lock", "torchrun.log", "train_log.discarded.jsonl"}
VOLATILE_SUFFIXES = (".tmp", ".log")  # a half-written file of a killed launch; a console (world build: <stage>.log)
# Files holding wall-clock figures besides their results (the eval's reports, one videos/<key>.json per video, the
# world build's report, an ODE cache's COMPLETE marker): compared without those figures (`wall_clock`).
WALL_CLOCK_FILES = {"aggregate.json", "aggregate.csv", "per_video.csv", "timings.csv", "table.md", "build_report.json",
                    "COMPLETE"}
LOG_SKIPPED_PREFIXES = ("time/", "memory/")
# The world build at its smallest: 2 scenes of 77 frames (20 latents: at least the VAE's longest window, 65 frames,
# and whole chunks of 4 latents), 4 steps of each training stage.
# No ship stage: it replaces the package's shipped weights (predictor_training/world/weights), a copy, not a long run.
WORLD_STAGES = ("render", "vae", "encoders", "encode", "df_sft", "ode_cache", "kd")
WORLD_FLAGS = ["--num_scenes", "2", "--paths_per_scene", "1", "--holdout_scenes", "1", "--holdout_paths", "0",
               "--num_frames", "77", "--vae_steps", "4", "--vae_warmup_steps", "1", "--vae_ckpt_every", "2",
               "--vae_block_out_channels", "8,8,8,8", "--vae_latent_channels", "4", "--df_sft_steps", "4",
               "--df_sft_warmup_steps", "1", "--df_sft_val_every", "0", "--kd_steps", "4", "--kd_warmup_steps", "1",
               "--teacher_steps", "4"]


# ---------------------------------------------------------------------------------------------------------------
# 1. The commands and their tiny inputs
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Command:
    name: str
    argv: list[str]
    output: Path  # the folder compared (a run directory, a dataset)
    env: dict = field(default_factory=dict)
    distributed: bool = True  # under torchrun, gets a free MASTER_PORT (a plain process refuses a partial torchrun env)


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def run_checked(argv: list, env: dict | None = None) -> None:
    result = subprocess.run([str(arg) for arg in argv], cwd=REPO_ROOT, env={**base_env(), **(env or {})},
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"setup failed: {' '.join(map(str, argv))}\n{result.stderr[-3000:]}")


def base_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "30"}


COMMANDS = ("dataset_build", "offline_v4", "disca", "rollout", "df_sft", "kd", "dmd2", "adversarial", "nft", "eval",
            "world")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
RUN_FLAGS = ["--precision", "fp32", "--keep_last", "-1", "--tracker", "none", "--num_workers", "0", "--no_progress",
             "--backend", "gloo"]


def offline_flags(steps: int, ckpt_every: int) -> list[str]:
    """The offline v4 recipe's flags at `steps` steps, a checkpoint every `ckpt_every` (offline_v4, disca,
    adversarial, offline_init)."""
    return ["--source_blocks", "1,2", "--max_steps", str(steps), "--scheduler_warmup_steps", "2",
            "--block_warmup_steps", "2", "--batch_size", "2", "--ckpt_every", str(ckpt_every), *RUN_FLAGS]


def make_inputs(work: Path, names: list[str]) -> dict[str, Path]:
    """Random demo assets (a demo-preset Teacher), their Predictor dataset and a video-latent dataset; for the
    commands in `names` that need them, a finished 4-step offline v4 run (the Predictor the rollout, adversarial,
    dmd2 and eval commands start from) and an 8-step ODE cache of the demo Teacher (kd's data)."""
    inputs = {"assets": work / "assets", "dataset": work / "dataset", "videos": work / "videos",
              "offline": work / "offline_init", "ode_cache": work / "ode_cache"}
    if names == ["world"]:  # it makes its own
        return inputs
    if not (inputs["assets"] / "demo_config.json").is_file():
        run_checked([sys.executable, "tools/make_demo_assets.py", "--kind", "random", "--out", inputs["assets"],
                     "--num_train", "2", "--num_holdout25", "1", "--num_holdout50", "1", "--threads", "1"])
    if not (inputs["dataset"] / "manifest.jsonl").is_file():
        run_checked([sys.executable, "tools/build_predictor_dataset.py", "--demo", inputs["assets"], "--out",
                     inputs["dataset"], "--threads", "1"])
    if not (inputs["videos"] / "manifest.jsonl").is_file():
        run_checked([sys.executable, "tools/build_video_latent_dataset.py", "--demo", work / "video_demo", "--out",
                     inputs["videos"], "--demo_clips", "3", "--demo_holdout", "1", "--device", "cpu"])
    if set(names) & {"rollout", "adversarial", "dmd2", "eval"}:
        # A finished run: launching it again exits 0 at once.
        run_checked(["bash", "tools/launch_predictor_v4_training.sh", inputs["offline"], *offline_flags(4, 4)],
                    {"NPROC_PER_NODE": "2", "DATASET_ROOT": str(inputs["dataset"]), "MASTER_PORT": free_port()})
    if "kd" in names and not (inputs["ode_cache"] / "COMPLETE").is_file():
        run_checked([sys.executable, "tools/build_ode_cache.py", "--teacher", inputs["assets"] / "teacher",
                     "--video_latents", inputs["videos"], "--splits", "train,holdout", "--steps", "8",
                     "--store_grid", "4", "--dtype", "float32", "--storage_dtype", "float32", "--out",
                     inputs["ode_cache"]])
    return inputs


def commands(work: Path, inputs: dict[str, Path]) -> dict[str, Command]:
    offline = offline_flags(12, 3)
    launcher_env = {"NPROC_PER_NODE": "2", "DATASET_ROOT": str(inputs["dataset"])}
    video_env = {"NPROC_PER_NODE": "2", "DATASET_ROOT": str(inputs["videos"])}
    teacher = inputs["assets"] / "teacher"
    init_state = inputs["offline"] / "training_latest.pt"
    init_weights = inputs["offline"] / "predictor_step_00004.safetensors"
    runs = work / "runs"
    return {
        "dataset_build": Command("dataset_build", [*TORCHRUN, "tools/build_predictor_dataset.py", "--demo",
                                                   inputs["assets"], "--out", work / "built", "--threads", "1"],
                                 work / "built"),
        "offline_v4": Command("offline_v4", ["bash", "tools/launch_predictor_v4_training.sh", runs / "v4",
                                             *offline], runs / "v4", launcher_env),
        "disca": Command("disca", ["bash", "tools/launch_predictor_disca_training.sh", runs / "disca", *offline],
                         runs / "disca", launcher_env),
        "rollout": Command("rollout", ["bash", "tools/launch_predictor_v4_rollout_training.sh", runs / "rollout",
                                       "--init_from", init_state, "--source_blocks", "1,2", "--max_steps", "6",
                                       "--scheduler_warmup_steps", "1", "--block_warmup_steps", "1",
                                       "--ckpt_every", "2", *RUN_FLAGS], runs / "rollout", launcher_env),
        "df_sft": Command("df_sft", ["bash", "tools/launch_fvtools_df_sft.sh", runs / "df_sft",
                                     "--teacher", teacher, "--no_action_ckpt", "--train", "lora", "--lora_rank", "4",
                                     "--max_steps", "8", "--warmup_steps", "1", "--ckpt_every", "2", *RUN_FLAGS],
                          runs / "df_sft", video_env),
        "kd": Command("kd", ["bash", "tools/launch_fvtools_kd.sh", runs / "kd", "--teacher", teacher,
                             "--no_action_ckpt", "--train", "lora", "--lora_rank", "4", "--max_steps", "8",
                             "--warmup_steps", "1", "--ckpt_every", "2", "--eval_samples", "1", *RUN_FLAGS], runs / "kd",
                      {"NPROC_PER_NODE": "2", "CACHE_ROOT": str(inputs["ode_cache"])}),
        "dmd2": Command("dmd2", ["bash", "tools/launch_fvtools_dmd2.sh", runs / "dmd2", "--teacher", teacher,
                                 "--no_action_ckpt", "--real_score", teacher, "--init_from", init_weights,
                                 "--source_blocks", "1,2", "--generator", "predictor", "--rollout", "self",
                                 "--fake_score_train", "full", "--max_steps", "6", "--warmup_steps", "0",
                                 "--generator_every", "2",
                                 "--monitor_every", "2", "--ckpt_every", "2", *RUN_FLAGS], runs / "dmd2", video_env),
        "adversarial": Command("adversarial", ["bash", "tools/launch_fvtools_adversarial.sh", runs / "adversarial",
                                               "--init_from", init_state, "--discriminator_width", "16",
                                               "--discriminator_lr", "1e-3", "--adv_warmup_steps", "0",
                                               "--r1_every", "2", *offline_flags(8, 2)],
                               runs / "adversarial", launcher_env),
        "nft": Command("nft", ["bash", "tools/launch_fvtools_nft.sh", runs / "nft", "--teacher", teacher,
                               "--no_action_ckpt", "--train", "lora", "--lora_rank", "4", "--lora_alpha", "4", "--lr",
                               "1e-2", "--max_steps", "6",
                               "--warmup_steps", "0", "--samples_per_group", "2", "--chunks_per_sample", "1",
                               "--monitor_every", "2", "--eval_clips", "1", "--no-gradient_checkpointing",
                               "--ckpt_every", "2", *RUN_FLAGS], runs / "nft", video_env),
        "eval": Command("eval", [*TORCHRUN, "tools/eval_predictor.py", "--demo", inputs["assets"], "--split",
                                 "train", "--max_videos", "4", "--ckpt", init_weights, "--replace_steps", "1,2,3",
                                 "--lpips_random_backbone", "--num_side_by_side", "1", "--warmup_chunks", "0",
                                 "--output_root", work / "eval", "--run_name", "fi", "--no_progress",
                                 "--backend", "gloo"], work / "eval" / "fi"),
        "world": Command("world", [sys.executable, "tools/build_demo_world.py", "--out", work / "world",
                                   "--teacher_from", "kd", "--stages", ",".join(WORLD_STAGES), *WORLD_FLAGS],
                         work / "world", distributed=False),
    }


# ---------------------------------------------------------------------------------------------------------------
# 2. Launch, kill the whole tree, relaunch
# ---------------------------------------------------------------------------------------------------------------
def children_by_parent() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        table.setdefault(parent, []).append(int(entry.name))
    return table


def process_tree(root: int) -> list[int]:
    table, tree, pending = children_by_parent(), [], [root]
    while pending:
        pid = pending.pop()
        tree.append(pid)
        pending += table.get(pid, [])
    return tree


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the process and every descendant at once (collected first), then wait until none is left."""
    tree = process_tree(process.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() and "Z" not in state(pid) for pid in tree[1:]):
        if time.monotonic() > deadline:
            raise SystemExit(f"processes {tree} survived SIGKILL")
        time.sleep(0.05)


def state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def launch(command: Command) -> subprocess.Popen:
    env = {**base_env(), **command.env, **({"MASTER_PORT": free_port()} if command.distributed else {})}
    return subprocess.Popen([str(arg) for arg in command.argv], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_to_end(command: Command) -> float:
    started = time.monotonic()
    process = launch(command)
    _, err = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"{command.name} failed ({process.returncode}):\n{err[-3000:]}")
    return time.monotonic() - started


def writing(folder: Path) -> bool:
    return folder.is_dir() and any(True for _ in folder.rglob("*.tmp"))


def interrupted_run(command: Command, kill_times: list[float], write_kills: int) -> tuple[int, int]:
    """Launch and kill at each of `kill_times` (seconds after the launch), then `write_kills` times when a temp file
    appears; then run to the end. Returns (write kills that hit a write, write kills whose launch finished first)."""
    for delay in kill_times:
        process = launch(command)
        try:
            process.wait(timeout=delay)  # it finished before the kill: the next launch finds it done
        except subprocess.TimeoutExpired:
            kill_tree(process)
    hit = missed = 0
    for _ in range(write_kills):
        process = launch(command)
        while process.poll() is None and not writing(command.output):
            time.sleep(0.001)
        if process.poll() is None:
            kill_tree(process)
            hit += 1
        else:
            missed += 1
    run_to_end(command)
    return hit, missed


# ---------------------------------------------------------------------------------------------------------------
# 3. Compare
# ---------------------------------------------------------------------------------------------------------------
def same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def wall_clock(name: str) -> bool:
    """A field or column of seconds, or a ratio of seconds: the eval's timings (`*_s`, `measured_*`, `speedup_*`,
    table.md's `... s/video`, `... s/call`, `speedup ...`), build_report.json's per-stage and COMPLETE's `seconds`."""
    return (name == "seconds" or name.endswith(("_s", "_s_per_call")) or name.startswith(("measured_", "speedup"))
            or " s/" in name)


def without_wall_clock(path: Path):
    """The contents of an eval or world-build report with its wall-clock fields dropped (None: not such a file)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" or path.name == "COMPLETE":
        def strip(value):
            if isinstance(value, dict):
                return {key: strip(item) for key, item in value.items() if not wall_clock(key)}
            return [strip(item) for item in value] if isinstance(value, list) else value
        return strip(json.loads(text))
    if path.suffix == ".csv":
        rows = list(csv.reader(io.StringIO(text)))
        keep = [index for index, name in enumerate(rows[0]) if not wall_clock(name)] if rows else []
        return [[row[index] for index in keep] for row in rows]
    # table.md: the columns of every markdown table whose header is wall-clock go; the other lines stay
    lines, keep = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            lines.append(line)
            keep = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if keep is None:
            keep = [index for index, name in enumerate(cells) if not wall_clock(name)]
        lines.append([cells[index] for index in keep if index < len(cells)])
    return lines


def reports_wall_clock(name: Path) -> bool:
    return name.name in WALL_CLOCK_FILES or (name.parent.name == "videos" and name.suffix == ".json")


def log_records(path: Path) -> list[dict]:
    return [{key: value for key, value in json.loads(line).items() if not key.startswith(LOG_SKIPPED_PREFIXES)}
            for line in path.read_text().splitlines() if line.strip()]


def compare_outputs(reference: Path, current: Path) -> tuple[int, list[str]]:
    """(files compared, one line per difference)."""
    problems, compared = [], 0
    names = {path.relative_to(reference) for path in reference.rglob("*") if path.is_file()}
    names |= {path.relative_to(current) for path in current.rglob("*") if path.is_file()}
    for name in sorted(names):
        if name.name in VOLATILE or name.suffix in VOLATILE_SUFFIXES:
            continue
        old, new = reference / name, current / name
        compared += 1
        if not old.is_file() or not new.is_file():
            problems.append(f"{name}: only in the {'uninterrupted' if old.is_file() else 'interrupted'} run")
        elif name.name == "train_log.jsonl":
            old_records, new_records = log_records(old), log_records(new)
            steps = [record.get("step") for record in new_records]
            if len(set(steps)) != len(steps):
                problems.append(f"{name}: steps logged twice")
            if old_records != new_records:
                problems.append(f"{name}: records differ (without time/ and memory/ fields)")
        elif old.read_bytes() != new.read_bytes():
            if name.suffix == ".pt" and same_value(torch.load(old, weights_only=True),
                                                   torch.load(new, weights_only=True)):
                continue
            if reports_wall_clock(name) and without_wall_clock(old) == without_wall_clock(new):
                continue
            problems.append(f"{name}: bytes differ" + (" (also without wall-clock fields)"
                                                       if reports_wall_clock(name) else ""))
    return compared, problems


# ---------------------------------------------------------------------------------------------------------------
# 4. Main
# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commands", nargs="+", default=None,
                        help="which commands (default: all; with --short: offline_v4)")
    parser.add_argument("--kills", type=int, default=None, help="random kills per command (default 3; --short 1)")
    parser.add_argument("--write_kills", type=int, default=1, help="kills the moment a *.tmp file appears")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill times")
    parser.add_argument("--short", action="store_true", help="the CI mode: offline_v4, 1 random kill + 1 write")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one, removed)")
    add_check_only_arg(parser, what="the commands it would run and kill")
    args = parser.parse_args(argv)
    names = args.commands or (["offline_v4"] if args.short else list(COMMANDS))
    unknown = sorted(set(names) - set(COMMANDS))
    if unknown:
        parser.error(f"--commands {' '.join(unknown)}: expected some of {', '.join(COMMANDS)}")
    kills = args.kills if args.kills is not None else (1 if args.short else 3)
    if args.check_only:
        if args.work is not None and args.work.exists() and not args.work.is_dir():
            parser.error(f"--work {args.work}: a file; expected a folder")
        return report_check_only(f"{', '.join(names)}: each run to the end, then again with {kills} random kill(s) "
                                 f"and {args.write_kills} during a write, in {args.work or 'a temporary folder'}")
    work = args.work or Path(tempfile.mkdtemp(prefix="fault_injection_"))
    work.mkdir(parents=True, exist_ok=True)
    generator = random.Random(args.seed)
    try:
        table = commands(work, make_inputs(work, names))
        rows, total = [], 0
        for name in names:
            command = table[name]
            shutil.rmtree(command.output, ignore_errors=True)
            seconds = run_to_end(command)
            reference = command.output.with_name(command.output.name + ".uninterrupted")
            shutil.rmtree(reference, ignore_errors=True)
            command.output.rename(reference)
            kill_times = sorted(generator.uniform(0.05, 0.95) * seconds for _ in range(kills))
            hit, missed = interrupted_run(command, kill_times, args.write_kills)
            compared, problems = compare_outputs(reference, command.output)
            total += len(problems)
            rows.append((name, f"{kills} random ({', '.join(f'{t:.1f}' for t in kill_times)} s of {seconds:.0f}); "
                               f"{hit} during a write" + (f", {missed} missed" if missed else ""),
                         compared, len(problems)))
            for problem in problems:
                print(f"DIFF {name}: {problem}", flush=True)
            print(f"[fault_injection] {' | '.join(map(str, rows[-1]))}", flush=True)  # a later failure keeps it
        print("\n| command | kills | outputs compared | differences |\n|---|---|---|---|")
        for name, kills_text, compared, differences in rows:
            print(f"| {name} | {kills_text} | {compared} | {differences} |")
        return 1 if total else 0
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
