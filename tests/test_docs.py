"""Docs that cannot drift from the code (issue 39): every command block of README.md, train.md, data.md and
docs/**/*.md is checked against the scripts it runs.

- Every script or launcher a command names exists.
- Every flag a command shows is an option of that script's parser (a launcher's flags: of the script it starts).
- Every environment variable set in front of a launcher is one it reads (its FLAG_VARIABLES, or the rendezvous ones).
- A launcher gets no more positionals than it has slots, each of the form its slot takes (a blocks spec only in
  SOURCE_BLOCKS, a training state file in RESUME, a folder in RUN_DIR).
- A line `# -> <run name>` right under a command is the run name that command makes: recomputed from the command
  (launcher presets and variables, positionals, flags, world size) with the script's own run-name function.
- Every run name written anywhere in the docs parses under its recipe's template and is recomputed exactly by the
  recipe's run-name function from the values it shows.
- docs/launchers.md's synopsis table names every launcher, its script and its positionals as the code has them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted([REPO_ROOT / "README.md", REPO_ROOT / "train.md", REPO_ROOT / "data.md",
                    *(REPO_ROOT / "docs").rglob("*.md")])
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
# Variables every launcher reads besides its flag variables (tools/_launch_common.sh), and a few every shell has.
LAUNCHER_ENVIRONMENT = {"NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "DEMO_ROOT", "PYTHON",
                        "SWANLAB_API_KEY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                        "TQDM_MININTERVAL", "PREDICTOR_DEBUG", "TORCH_HOME", "HF_TOKEN"}
TORCHRUN_VALUE_FLAGS = {"--nproc_per_node", "--nproc-per-node", "--nnodes", "--node_rank", "--node-rank",
                        "--master_addr", "--master-addr", "--master_port", "--master-port", "--rdzv_endpoint",
                        "--rdzv-endpoint", "--rdzv_backend", "--rdzv-backend", "--rdzv_id", "--rdzv-id", "--tee",
                        "--max_restarts", "--max-restarts"}
BLOCKS_SPEC = re.compile(r"^\s*\d+\s*,\s*\d+\s*$")


# ---------------------------------------------------------------------------------------------------------------
# 1. Reading the docs: command blocks, commands, run names
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Command:
    doc: Path
    line: int
    text: str
    env: dict[str, str]
    program: str                # "launcher" or "python"
    script: str                 # repository path of the launcher or the Python script
    args: list[str]
    torchrun_nproc: int | None = None
    expected_run: str | None = None  # from a `# -> <run name>` line right below

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO_ROOT)}:{self.line}: {self.text}"


def shell_blocks(path: Path) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every fenced block in a shell language."""
    blocks, current, start, language = [], None, 0, ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^\s*```(\S*)", line)
        if fence and current is None:
            current, start, language = [], number + 1, fence.group(1).lower()
        elif fence:
            if language in SHELL_LANGUAGES:
                blocks.append((start, current))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def logical_lines(start: int, lines: list[str]) -> list[tuple[int, str]]:
    """Lines joined over trailing backslashes, with the number of their first line."""
    joined, buffer, first = [], "", None
    for offset, line in enumerate(lines):
        if first is None:
            first = start + offset
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        joined.append((first, buffer + line))
        buffer, first = "", None
    if buffer:
        joined.append((first, buffer))
    return joined


def parse_command(doc: Path, number: int, text: str) -> Command | None:
    """The command a line runs, if it runs a launcher or a Python script of this repository."""
    stripped = text.strip()
    if stripped.startswith("$ "):
        stripped = stripped[2:]
    try:
        tokens = shlex.split(stripped, comments=True)
    except ValueError:
        return None
    # `[--per_frame]` is an optional flag; `[RUN_DIR]`, `[flags...]` are a synopsis' placeholders
    tokens = [token.strip("[]") if token.startswith("[--") else token for token in tokens
              if not (token.startswith("[") and token.endswith("]") and not token.startswith("[--"))]
    env = {}
    while tokens and (tokens[0] in ("...", "…") or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0])):
        token = tokens.pop(0)
        if "=" in token:
            name, value = token.split("=", 1)
            env[name] = value
    if not tokens:
        return None
    head, rest = tokens[0], tokens[1:]
    if head in ("bash", "sh") and rest and re.match(r"^(\./)?tools/launch_\w+\.sh$", rest[0]):
        return Command(doc, number, stripped, env, "launcher", rest[0].removeprefix("./"), rest[1:])
    nproc = None
    if head in ("python", "python3", "$PYTHON", "${PYTHON}") and rest[:2] == ["-m", "torch.distributed.run"]:
        head, rest = "torchrun", rest[2:]
    if head == "torchrun":
        script_at = next((i for i, token in enumerate(rest) if token.endswith(".py")), None)
        if script_at is None:
            return None
        launcher_flags = rest[:script_at]
        for i, token in enumerate(launcher_flags):
            if token.split("=")[0] in ("--nproc_per_node", "--nproc-per-node"):
                value = token.split("=", 1)[1] if "=" in token else launcher_flags[i + 1]
                nproc = int(value) if value.isdigit() else None
        return Command(doc, number, stripped, env, "python", rest[script_at].removeprefix("./"),
                       rest[script_at + 1:], torchrun_nproc=nproc)
    if head in ("python", "python3", "$PYTHON", "${PYTHON}") and rest and rest[0].endswith(".py"):
        return Command(doc, number, stripped, env, "python", rest[0].removeprefix("./"), rest[1:])
    return None


def doc_commands() -> list[Command]:
    commands = []
    for doc in DOC_FILES:
        for start, lines in shell_blocks(doc):
            previous = None
            for number, text in logical_lines(start, lines):
                marker = re.match(r"^\s*#\s*->\s*(\S+)\s*$", text)
                if marker and previous is not None:
                    previous.expected_run = marker.group(1)
                    continue
                command = parse_command(doc, number, text)
                if command is not None:
                    commands.append(command)
                previous = command if command is not None else (previous if not text.strip() else None)
    return commands


COMMANDS = doc_commands()


def command_id(command: Command) -> str:
    return f"{command.doc.relative_to(REPO_ROOT)}:{command.line}"


# ---------------------------------------------------------------------------------------------------------------
# 2. The code: each script's parser, each launcher's script, slots and variables
# ---------------------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def load_script(script: str):
    path = REPO_ROOT / script
    name = "docs_check_" + re.sub(r"\W", "_", script)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def script_parser(script: str) -> argparse.ArgumentParser:
    """The parser `script` builds for `--help` (the one with the most options, when a recipe first reads --preset)."""
    module = load_script(script)
    seen = []
    original = argparse.ArgumentParser.parse_known_args

    def recording(self, args=None, namespace=None):
        seen.append(self)
        return original(self, args, namespace)

    argparse.ArgumentParser.parse_known_args = recording
    saved_argv = sys.argv
    try:
        sys.argv = [script, "--help"]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            with contextlib.suppress(SystemExit):
                entry = getattr(module, "parse_args", None)
                if entry is None or next(iter(inspect.signature(entry).parameters)) != "argv":
                    entry = module.main  # parse_args(parser, argv) or none: main(argv) builds the parser
                entry(["--help"])
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv = saved_argv
    assert seen, f"{script}: no argparse parser ran for --help"
    return max(seen, key=lambda parser: len(parser._actions))


def options_of(script: str) -> set[str]:
    return {option for action in script_parser(script)._actions for option in action.option_strings}


@dataclass(frozen=True)
class Launcher:
    path: str
    script: str
    slots: tuple[str, ...]
    variables: frozenset[str]
    demo_preset: str | None      # what the launcher adds as --preset on the CPU demo
    real_preset: str | None      # ... and on a real run
    demo_needs_unset: str = "DATASET_ROOT"


@lru_cache(maxsize=None)
def launcher(path: str) -> Launcher:
    text = (REPO_ROOT / path).read_text()
    preset = re.search(r"RECIPE_PRESET=(\w+) exec bash .*?/(launch_\w+\.sh)", text)
    if preset:  # a preset launcher: everything else is its base launcher's
        base = launcher(f"tools/{preset.group(2)}")
        return Launcher(path, base.script, base.slots, base.variables, f"{preset.group(1)}_demo", preset.group(1))
    if "launch_offline_training" in text and "launch_offline_training()" not in text:
        script = re.search(r"launch_offline_training (\S+\.py)", text).group(1)
        slots = ("RUN_DIR", "SOURCE_BLOCKS", "RESUME")
    else:
        script = re.search(r"^SCRIPT=(\S+)", text, re.MULTILINE).group(1)
        slots = tuple(re.search(r'split_positional "([A-Z_ ]+)"', text).group(1).split())
    # The variables: the launcher's own lines between sourcing the common part and reading the positionals, run
    # after the common part (whose GPU probe is answered by a stand-in interpreter: no GPU).
    body = "" if "SCRIPT=" not in text else \
        text.split('_launch_common.sh"', 1)[1].split("split_positional", 1)[0].split("\n", 1)[1]
    with tempfile.TemporaryDirectory() as folder:
        fake_python = Path(folder) / "python"
        fake_python.write_text("#!/usr/bin/env bash\necho 0\n")
        fake_python.chmod(0o755)
        snippet = (f'source {REPO_ROOT / "tools" / "_launch_common.sh"}\n'
                   # nothing may start or be made from here: the launching functions do nothing
                   "launch_recipe() { :; }; run_torchrun() { :; }; plan_run() { :; }; ensure_demo_assets() { :; }\n"
                   "ensure_demo_dataset() { :; }; ensure_demo_video_latents() { :; }\n"
                   f'{body}\necho "${{FLAG_VARIABLES[@]}}"')
        result = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "PYTHON": str(fake_python)})
    assert result.returncode == 0, result.stderr
    variables = frozenset(result.stdout.split())
    demo_unset = "CACHE_ROOT" if 'CACHE_ROOT:-}" ]] && (( NUM_GPUS == 0 ))' in text else "DATASET_ROOT"
    return Launcher(path, script, slots, variables, "demo", None, demo_unset)


def launcher_paths() -> list[str]:
    return sorted(f"tools/{path.name}" for path in (REPO_ROOT / "tools").glob("launch_*.sh"))


# ---------------------------------------------------------------------------------------------------------------
# 3. Run names: recomputed with the recipe's own naming function
# ---------------------------------------------------------------------------------------------------------------
PREDICTOR_NAME = re.compile(
    r"^(?P<experiment>[a-z0-9_]+?)_blocks(?P<a>\d+)-(?P<b>\d+)(?:_(?P<tags>[a-z0-9_.+-]+?))?"
    r"_(?P<precision>fp32master|fp32)_(?P<world>\d+)(?P<device>gpu|cpu)_flr(?P<flr>[0-9.e+-]+)_blr(?P<blr>[0-9.e+-]+)"
    r"_schedsteps(?P<steps>\d+)_swarmup(?P<swarmup>\d+)_bwarmup(?P<bwarmup>\d+|none)_(?P<tracker>swanlab|notracker)$")
METHOD_NAME = re.compile(
    r"^(?P<experiment>[a-z0-9_]+?)_(?P<model>lora\d+|full-teacher|full-scratch)(?:_(?P<tags>[a-z0-9_.+-]+?))?"
    r"_(?P<precision>fp32master|fp32)_(?P<world>\d+)(?P<device>gpu|cpu)_lr(?P<lr>[0-9.e+-]+)_steps(?P<steps>\d+)"
    r"_warmup(?P<warmup>\d+)_(?P<tracker>swanlab|notracker)$")
DMD2_NAME = re.compile(
    r"^(?P<experiment>[a-z0-9_]+?)_(?:predictor-(?P<letters>[fp]{4})-blocks(?P<a>\d+)-(?P<b>\d+)"
    r"|student(?P<student_steps>\d+)-(?P<model>lora\d+|full-teacher|full-scratch))_rollout-(?P<rollout>self|data)"
    r"_every(?P<every>\d+)_fake-(?P<fake>lora|full)_(?P<precision>fp32master|fp32)_(?P<world>\d+)(?P<device>gpu|cpu)"
    r"(?:_flr(?P<flr>[0-9.e+-]+)_blr(?P<blr>[0-9.e+-]+)|_lr(?P<lr>[0-9.e+-]+))_fslr(?P<fslr>[0-9.e+-]+)"
    r"_steps(?P<steps>\d+)_warmup(?P<warmup>\d+)_(?P<tracker>swanlab|notracker)$")
# Anything in the docs that looks like a run name: a precision and a world-size part between other parts.
RUN_NAME_TOKEN = re.compile(r"[A-Za-z0-9_.+-]+_(?:fp32master|fp32)_\d+(?:gpu|cpu)_[A-Za-z0-9_.+-]*(?:swanlab|notracker)")
EVAL_SUFFIX = re.compile(r"_ckptstep\d+(?:\+\d+)*.*$")
LETTER_STEPS = {"fppp": "1,2,3", "fppf": "1,2", "fpfp": "1,3", "ffpp": "2,3", "fffp": "3", "ffpf": "2", "fpff": "1"}


def stub_inputs(tmp: Path) -> tuple[Path, Path]:
    """A folder that passes every input-folder check of the parsers, and a file for the file flags."""
    folder = tmp / "stub_folder"
    folder.mkdir(exist_ok=True)
    for name in ("config.json", "dataset_config.json", "video_dataset_config.json", "COMPLETE", "manifest.jsonl"):
        (folder / name).write_text("{}")
    # an ODE cache of every state of a 32-step shift-5 teacher (kd reads which noise levels it stored)
    grid = [index / 32 for index in range(32, 0, -1)]
    (folder / "ode_cache_config.json").write_text(json.dumps({"stored_sigmas": [5 * s / (1 + 4 * s) for s in grid]}))
    file = tmp / "stub_file.safetensors"
    file.write_bytes(b"")
    return folder, file


FILE_FLAGS = {"--resume", "--init_from", "--action_ckpt", "--sample_table", "--lpips_alexnet"}


def stubbed(script: str, argv: list[str], folder: Path, file: Path) -> list[str]:
    """argv with every path-valued flag pointed at the stubs (names depend on flag values, never on paths)."""
    path_flags = {option for action in script_parser(script)._actions if action.type is Path
                  for option in action.option_strings} | {"--real_score"}
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        flag, _, inline = token.partition("=")
        value = inline if inline else (argv[i + 1] if i + 1 < len(argv) else "")
        if flag in path_flags and flag != "--config" and value != "teacher":
            is_file = flag != "--real_score" and (flag in FILE_FLAGS or re.search(r"\.(pt|pth|safetensors|jsonl?)$", value))
            out += [flag, str(file if is_file else folder)]
            i += 1 if inline else 2
            continue
        out.append(token)
        i += 1
    return out


# The inputs each recipe needs before it names a run (stand-ins: a name never depends on a path).
INPUTS = {
    "train_predictor_v4.py": ["--dataset_root"],
    "train_predictor_disca.py": ["--dataset_root"],
    "train_predictor_v4_rollout.py": ["--dataset_root", "--init_from"],
    "fvtools/train_adversarial.py": ["--dataset_root"],
    "fvtools/train_df_sft.py": ["--teacher", "--dataset_root"],
    "fvtools/train_kd.py": ["--teacher", "--cache_root"],
    "fvtools/train_dmd2.py": ["--teacher", "--dataset_root", "--real_score", "--init_from"],
    "fvtools/train_nft.py": ["--teacher", "--dataset_root", "--ground_truth"],
}


def with_inputs(script: str, argv: list[str]) -> list[str]:
    """Stand-ins for the inputs argv does not give (dmd2's student takes no --init_from)."""
    missing = [flag for flag in INPUTS[script] if flag not in argv and not any(t.startswith(flag + "=") for t in argv)]
    if script == "fvtools/train_dmd2.py" and "student" in argv:
        missing = [flag for flag in missing if flag != "--init_from"]
    if script == "fvtools/train_adversarial.py" and "rollout" in argv and "--init_from" not in argv:
        missing.append("--init_from")
    if "--no_action_ckpt" in options_of(script) and not any(token.startswith(("--action_ckpt", "--no_action_ckpt"))
                                                             for token in argv):
        argv = ["--no_action_ckpt", *argv]  # the stand-in Teacher; the action checkpoint names no run
    return [token for flag in missing for token in (flag, "stub.safetensors" if flag == "--init_from" else "stub")] \
        + argv


def naming_of(script: str):
    """(naming function, subset-tag function) the script's main() passes to plan_run."""
    from predictor_training.runtime import run_directory

    module = load_script(script)
    if script == "fvtools/train_dmd2.py":
        return module.run_name, lambda args: ""
    if script in ("fvtools/train_df_sft.py", "fvtools/train_kd.py", "fvtools/train_nft.py"):
        return run_directory.method_run_name, lambda args: ""
    if script == "fvtools/train_adversarial.py":
        return run_directory.run_name, module.run_tag
    if script == "train_predictor_v4_rollout.py":
        return run_directory.run_name, module.run_tags
    if script in ("train_predictor_v4.py", "train_predictor_disca.py"):
        return run_directory.run_name, lambda args: ""
    raise AssertionError(f"{script}: no run-name function known to the doc check")


def compute_run_name(script: str, argv: list[str], world: int, device: str, tmp: Path) -> str:
    from predictor_training.runtime.run_directory import plain_flags

    folder, file = stub_inputs(tmp)
    module = load_script(script)
    argv = stubbed(script, with_inputs(script, argv), folder, file)
    if "--val_every" in options_of(script):
        argv += ["--val_every", "0"]  # validation needs a VAE and decides nothing of the name
    with contextlib.redirect_stderr(io.StringIO()) as stderr:
        try:
            args = module.parse_args(argv)
        except SystemExit:
            raise AssertionError(f"{script} {' '.join(argv)}: refused: {stderr.getvalue().strip()}") from None
    naming, tags = naming_of(script)
    return naming(plain_flags(args), world_size=world, device_type=device, subset=tags(args))


def recipe_of_name(name: str) -> tuple[str, list[str], int, str]:
    """(script, flags, world, device) that a run name shows, read back through its recipe's template."""
    match = DMD2_NAME.match(name)
    if match:
        g = match.groupdict()
        flags = [] if g["experiment"] in ("dmd2", "dmd2_demo") else ["--experiment", g["experiment"]]
        flags += ["--preset", "demo"] if g["experiment"] == "dmd2_demo" else []
        if g["letters"]:
            flags += ["--generator", "predictor", "--replace_steps", LETTER_STEPS[g["letters"]],
                      "--source_blocks", f"{g['a']},{g['b']}", "--fusion_lr", g["flr"], "--blocks_lr", g["blr"]]
        else:
            trained = g["model"]
            flags += ["--generator", "student", "--student_steps", g["student_steps"], "--lr", g["lr"]]
            flags += (["--train", "lora", "--lora_rank", trained[4:]] if trained.startswith("lora")
                      else ["--train", "full", "--init_weights", trained.split("-", 1)[1]])
        flags += ["--rollout", g["rollout"], "--generator_every", g["every"], "--fake_score_train", g["fake"],
                  "--precision", g["precision"], "--fake_score_lr", g["fslr"], "--max_steps", g["steps"],
                  "--warmup_steps", g["warmup"], "--tracker", "none" if g["tracker"] == "notracker" else g["tracker"]]
        return "fvtools/train_dmd2.py", flags, int(g["world"]), "cuda" if g["device"] == "gpu" else "cpu"
    match = METHOD_NAME.match(name)
    if match:
        g = match.groupdict()
        base = g["experiment"].removesuffix("_demo")
        script = {"df_sft": "fvtools/train_df_sft.py", "kd": "fvtools/train_kd.py",
                  "nft": "fvtools/train_nft.py"}.get(base, "fvtools/train_df_sft.py")
        flags = [] if g["experiment"] == base and base in ("df_sft", "kd", "nft") else ["--experiment", g["experiment"]]
        model = g["model"]
        flags += (["--train", "lora", "--lora_rank", model[4:]] if model.startswith("lora")
                  else ["--train", "full", "--init_weights", model.split("-", 1)[1]])
        flags += ["--precision", g["precision"], "--lr", g["lr"], "--max_steps", g["steps"], "--warmup_steps",
                  g["warmup"], "--tracker", "none" if g["tracker"] == "notracker" else g["tracker"]]
        return script, flags, int(g["world"]), "cuda" if g["device"] == "gpu" else "cpu"
    match = PREDICTOR_NAME.match(name)
    assert match, f"{name!r} is no run name of any recipe's template (run_directory.run_name / method_run_name / " \
                  "train_dmd2.run_name)"
    g = match.groupdict()
    experiment, tags = g["experiment"], g["tags"] or ""
    flags = ["--source_blocks", f"{g['a']},{g['b']}", "--precision", g["precision"], "--fusion_lr", g["flr"],
             "--blocks_lr", g["blr"], "--max_steps", g["steps"], "--scheduler_warmup_steps", g["swarmup"],
             "--block_warmup_steps", "-1" if g["bwarmup"] == "none" else g["bwarmup"],
             "--tracker", "none" if g["tracker"] == "notracker" else g["tracker"]]
    rollout = re.match(r"^predictor_v4_rollout_([fp]{4})(_demo)?$", experiment)
    if rollout:
        script = "train_predictor_v4_rollout.py"
        flags += ["--replace_steps", LETTER_STEPS[rollout.group(1)]]
        flags += ["--experiment", "predictor_v4_rollout_{schedule}_demo"] if rollout.group(2) else []
        context = re.search(r"(?:^|_)ctx(\w+?)(?:_|$)", tags)
        flags += ["--context_mode", context.group(1)] if context else []
        subset = re.search(r"overfit(\d+)_seed(\d+)", tags)
        flags += ["--subset_cases", subset.group(1), "--subset_seed", subset.group(2)] if subset else []
    elif experiment.startswith("predictor_v4_adversarial"):
        script = "fvtools/train_adversarial.py"
        adv = re.match(r"^(offline|rollout([fp]{4}))_adv([0-9.e+-]+)_dlr([0-9.e+-]+)$", tags)
        assert adv, f"{name!r}: adversarial tags {tags!r} do not read as <data>_adv<w>_dlr<lr>"
        flags += ["--data", "offline" if adv.group(1) == "offline" else "rollout", "--adv_weight", adv.group(3),
                  "--discriminator_lr", adv.group(4)]
        flags += ["--replace_steps", LETTER_STEPS[adv.group(2)]] if adv.group(2) else []
        flags += [] if experiment == "predictor_v4_adversarial" else ["--experiment", experiment]
    elif experiment.startswith("predictor_disca"):
        script = "train_predictor_disca.py"
        flags += [] if experiment == "predictor_disca" else ["--experiment", experiment]
    else:
        script = "train_predictor_v4.py"
        flags += [] if experiment == "predictor_v4_prefeature" else ["--experiment", experiment]
    return script, flags, int(g["world"]), "cuda" if g["device"] == "gpu" else "cpu"


def doc_run_names() -> list[tuple[str, str]]:
    """(where, name) of every run name written in the docs (eval suffixes dropped; abbreviated ones skipped)."""
    names = []
    for doc in DOC_FILES:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for token in RUN_NAME_TOKEN.findall(line):
                token = EVAL_SUFFIX.sub("", token.split("/")[-1])
                if "…" in token or "<" in token:
                    continue
                names.append((f"{doc.relative_to(REPO_ROOT)}:{number}", token))
    return names


RUN_NAMES = doc_run_names()


def launch_argv(command: Command) -> tuple[str, list[str], int, str]:
    """(script, argv, world, device) a launcher command starts, the way tools/_launch_common.sh builds it."""
    info = launcher(command.script)
    positional = []
    args = list(command.args)
    while args and len(positional) < len(info.slots) and not args[0].startswith("-"):
        positional.append(args.pop(0))
    demo = not command.env.get(info.demo_needs_unset)
    argv = []
    if demo:
        argv += ["--preset", info.demo_preset]
    elif info.real_preset:
        argv += ["--preset", info.real_preset]
    for name in sorted(info.variables):
        if command.env.get(name):
            argv += [f"--{name.lower()}", command.env[name]]
    for slot, value in zip(info.slots, positional):
        if value:
            argv += {"RUN_DIR": ["--output_dir", value], "SOURCE_BLOCKS": ["--source_blocks", value],
                     "RESUME": ["--resume", value]}[slot]
    argv += args
    per_node = int(command.env.get("NPROC_PER_NODE", 2 if demo else 8))
    world = per_node * int(command.env.get("NNODES", 1))
    return info.script, argv, world, "cpu" if demo else "cuda"


# ---------------------------------------------------------------------------------------------------------------
# 4. The checks
# ---------------------------------------------------------------------------------------------------------------
def test_the_docs_show_commands_and_run_names():
    assert len(COMMANDS) > 100 and len(RUN_NAMES) > 20, (len(COMMANDS), len(RUN_NAMES))
    assert sum(command.expected_run is not None for command in COMMANDS) >= 10


@pytest.mark.parametrize("command", COMMANDS, ids=command_id)
def test_every_flag_shown_is_a_flag_of_its_script(command):
    assert (REPO_ROOT / command.script).is_file(), f"{command.where()}\n{command.script} does not exist"
    script = launcher(command.script).script if command.program == "launcher" else command.script
    options = options_of(script)
    args = command.args
    if command.program == "launcher":
        info = launcher(command.script)
        unknown = sorted(name for name in command.env
                         if name not in info.variables and name not in LAUNCHER_ENVIRONMENT)
        assert not unknown, f"{command.where()}\n{command.script} reads no variable {unknown} " \
                            f"(its flag variables: {sorted(info.variables)})"
        positional = []
        while args and len(positional) < len(info.slots) and not args[0].startswith("-"):
            positional.append(args[0])
            args = args[1:]
        if args and not args[0].startswith("-"):
            raise AssertionError(f"{command.where()}\n{command.script} takes at most {len(info.slots)} positionals "
                                 f"({' '.join(info.slots)}); {args[0]!r} is one more")
        for slot, value in zip(info.slots, positional):
            if not value:
                continue
            if slot == "SOURCE_BLOCKS":
                assert BLOCKS_SPEC.match(value), f"{command.where()}\nSOURCE_BLOCKS slot holds {value!r}"
            else:
                assert not BLOCKS_SPEC.match(value), f"{command.where()}\n{slot} slot holds the blocks spec {value!r}"
            if slot == "RESUME":
                assert value.endswith(".pt"), f"{command.where()}\nRESUME slot holds {value!r}, not a training state"
            if slot == "RUN_DIR":
                assert not value.endswith((".pt", ".safetensors")), f"{command.where()}\nRUN_DIR slot holds a file"
    for token in args:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            assert flag in options, f"{command.where()}\n{flag} is not a flag of {script}"


LAUNCH_COMMANDS = [command for command in COMMANDS if command.expected_run is not None]


@pytest.mark.parametrize("command", LAUNCH_COMMANDS, ids=command_id)
def test_a_run_name_shown_under_a_command_is_the_one_it_makes(command, tmp_path):
    if command.program == "launcher":
        script, argv, world, device = launch_argv(command)
    else:
        script, argv = command.script, list(command.args)
        world = command.torchrun_nproc or 1
        device = "cpu" if "--preset" in argv and "demo" in argv or "gloo" in argv else "cuda"
    computed = compute_run_name(script, argv, world, device, tmp_path)
    assert computed == command.expected_run, f"{command.where()}\nthe docs say {command.expected_run}\n" \
                                             f"the code names it {computed}"


@pytest.mark.parametrize("where, name", RUN_NAMES, ids=[f"{where}:{name[:40]}" for where, name in RUN_NAMES])
def test_every_run_name_in_the_docs_is_what_its_recipe_computes(where, name, tmp_path):
    script, flags, world, device = recipe_of_name(name)
    computed = compute_run_name(script, flags, world, device, tmp_path)
    assert computed == name, f"{where}: the docs show\n  {name}\nits recipe ({script}) names those values\n  {computed}"


def synopsis_rows() -> dict[str, dict[str, str]]:
    text = (REPO_ROOT / "docs" / "launchers.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        launcher_cell = re.search(r"`(tools/launch_\w+\.sh)`", cells[0]) if line.startswith("|") else None
        if launcher_cell and len(cells) >= 3:
            rows[launcher_cell.group(1)] = {"script": cells[1], "positionals": cells[2]}
    return rows


@pytest.mark.parametrize("path", launcher_paths())
def test_the_launcher_synopsis_table_matches_each_launcher(path):
    info = launcher(path)
    rows = synopsis_rows()
    assert path in rows, f"docs/launchers.md has no synopsis row for {path}"
    assert f"`{info.script}`" in rows[path]["script"], f"{path} starts {info.script}; the table says {rows[path]}"
    documented = re.findall(r"\[([A-Z_]+)\]", rows[path]["positionals"])
    assert tuple(documented) == info.slots, f"{path}: positionals {info.slots}, the table says {documented}"
    usage = re.search(r"#\s+bash tools/launch_\w+\.sh ((?:\[[A-Z_]+\] ?)+)", (REPO_ROOT / path).read_text())
    if usage:
        assert tuple(re.findall(r"\[([A-Z_]+)\]", usage.group(1))) == info.slots, f"{path}: its own usage line"


@pytest.mark.parametrize("path", launcher_paths())
def test_each_launchers_example_run_name_is_the_run_its_real_launch_makes(path, tmp_path):
    """The name in a launcher's header ("RUN_DIR defaults to ..., e.g.") is its default launch on 8 GPUs with its
    inputs given (a tracker or a preset the header leaves out would name another run)."""
    info = launcher(path)
    example = RUN_NAME_TOKEN.search((REPO_ROOT / path).read_text())
    assert example, f"{path}: no example run name in its header"
    command = Command(REPO_ROOT / path, 1, f"bash {path}", {info.demo_needs_unset: "stub"}, "launcher", path, [])
    script, argv, world, device = launch_argv(command)
    assert compute_run_name(script, argv, world, device, tmp_path) == example.group(0), path


# ---------------------------------------------------------------------------------------------------------------
# 5. Links
# ---------------------------------------------------------------------------------------------------------------
LINKED_DOCS = sorted({*DOC_FILES, *(REPO_ROOT / "benchmarks" / "results").glob("*.md")})


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading:
            text = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower().replace("`", ""))
            anchors.add(text.replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda doc: str(doc.relative_to(REPO_ROOT)))
def test_every_link_leads_to_a_file_and_heading_that_exist(doc):
    problems = []
    for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if not resolved.exists():
                problems.append(f"{doc.relative_to(REPO_ROOT)}:{number}: {target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                problems.append(f"{doc.relative_to(REPO_ROOT)}:{number}: {target}: no such heading")
    assert not problems, "\n".join(problems)
