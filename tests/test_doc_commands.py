"""Docs that run (issue 49): every command of README.md, train.md, data.md and docs/**/*.md, and every command a tool
prints (the main job's closing lines, each Predictor recipe's "next, the leaderboard: ..." line), is executed here
as written, with `--check_only`: the command parses its flags, checks every input path's kind and the files it
reads first, computes its run name and output folder, refuses as the real run would (one line, exit 2), and exits
having created nothing. tests/test_docs.py checks the same commands statically (flags, variables, run names).

- The walkthrough's path variables (docs/walkthrough.md § Paths) are evaluated with CKPTS and WORK moved into a
  sandbox, and tiny stand-ins of the kind each path names are written there (tests/helpers/doc_world.py): a
  54-block Teacher of tiny width, its action checkpoint, tiny encoders and their outputs, sample tables of the
  walkthrough's camera paths, a Predictor dataset, video latents, an ODE cache, and the run directories the pages
  name, each a finished run with the flags its documented launch computes. The CPU demo's assets are the real
  ones (tools/make_demo_assets.py, few scenes), its datasets and runs stand-ins.
- A block's own assignments (`REF_DIR=$GT`) are kept; a command's redirection is dropped (the file it would write is
  a stand-in); the output folder of a tool that makes one (`--out` of a builder) is a fresh one, so its check sees
  a new output, as the docs' order makes it.
- The commands run in the sandbox (the repository's folders linked into it), the launchers under bash, `python`
  and `torchrun` through a fork server that has torch imported (tests/helpers/command_server.py; a torchrun
  command runs once with WORLD_SIZE set, as a launcher's dry run does). A command on the real model's paths is
  checked as on the 8-GPU node it is written for (torch reports 8 CUDA devices to it, so a launcher counts 8 ranks
  and the run is named `..._8gpu_...`); a demo command as on a CPU-only machine.
- A few cheap CPU commands run for real instead (REAL_RUNS: the sample tables, FLOP bounds, dry runs).
- Lines that are no command of this repository (pip, pytest, `hf download`, `cp`) are listed in EXTERNAL and
  not run; `hf download`'s flags are checked against `hf download --help`.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import doc_world
from tests.test_docs import DOC_FILES, REPO_ROOT, logical_lines, parse_command, shell_blocks

SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
# Lines of command blocks that are no command of this repository: not run (their start, as written).
EXTERNAL = ("python -m pip install", "python -m pytest", "python -c ", "cp ", "tail ", "hf download ")
# Tools that make an output folder or file: the flag naming it gets a fresh path, so the check sees a new output.
FRESH_OUTPUTS = {"tools/make_sample_table.py": "--out", "tools/make_demo_assets.py": "--out",
                 "tools/build_predictor_dataset.py": "--out", "tools/build_video_latent_dataset.py": "--out",
                 "tools/build_ode_cache.py": "--out", "tools/encode_cases.py": "--out", "tools/render_world.py": "--out",
                 "tools/build_demo_world.py": "--out", "tools/compute_video_metrics.py": "--out",
                 "tools/convert_sharded_checkpoint.py": "--out", "benchmarks/gpu_acceptance.py": "--out_dir"}
# Cheap CPU commands run for real (a substring of the command): nothing else of theirs to check.
REAL_RUNS = ("tools/make_sample_table.py", "tools/print_flop_bounds.py", "--dry_run")


# ---------------------------------------------------------------------------------------------------------------
# 1. The docs' command lines, with the assignments of their block before them
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DocCommand:
    where: str
    text: str                    # the logical line as written
    assignments: list[str]       # the block's NAME=value lines above it
    script: str                  # the repository file it runs (a launcher or a Python script)
    expected_run: str | None = None  # the `# -> <run name>` line below it


def block_language(doc: Path, start: int) -> str:
    return doc.read_text(encoding="utf-8").splitlines()[start - 2].strip()[3:].strip().lower()


def is_assignment(text: str) -> bool:
    tokens = shlex.split(text, comments=True)
    return bool(tokens) and all(re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", token) for token in tokens)


def doc_commands() -> tuple[list[DocCommand], list[str], list[str]]:
    """(the commands, the external lines as written, lines of command blocks that are neither)."""
    commands, external, unknown = [], [], []
    for doc in DOC_FILES:
        for start, lines in shell_blocks(doc):
            language, assignments = block_language(doc, start), []
            for number, text in logical_lines(start, lines):
                where, stripped = f"{doc.relative_to(REPO_ROOT)}:{number}", text.strip()
                marker = re.match(r"^\s*#\s*->\s*(\S+)\s*$", text)
                if marker and commands and commands[-1].where.rsplit(":", 1)[0] == where.rsplit(":", 1)[0]:
                    commands[-1].expected_run = marker.group(1)
                if not stripped or stripped.startswith("#"):
                    continue
                parsed = parse_command(doc, number, text)
                if parsed is not None:
                    commands.append(DocCommand(where, stripped, list(assignments), parsed.script))
                elif language in SHELL_BLOCKS and is_assignment(stripped):
                    assignments.append(stripped.split("#", 1)[0].strip())
                elif language in SHELL_BLOCKS and stripped.startswith(EXTERNAL):
                    external.append(stripped)
                elif language in SHELL_BLOCKS:
                    unknown.append(f"{where}: {stripped}")
    return commands, external, unknown


COMMANDS, EXTERNAL_LINES, UNKNOWN_LINES = doc_commands()


def shell_word(token: str) -> str:
    """`token` for bash: variables still expanded ("$ROLLOUT/x"), everything else quoted; an assignment in front of
    a command stays one (NAME="value")."""
    name, equals, value = token.partition("=")
    if equals and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
        return f"{name}={shell_word(value)}" if value else f"{name}="
    if "$" in token:
        return '"' + token.replace('"', '\\"') + '"'
    return shlex.quote(token)


def rendered(text: str, script: str, fresh: Path, check_only: bool) -> str:
    """The command line to run: synopsis placeholders and redirections dropped, a fresh output path, --check_only
    appended."""
    tokens = shlex.split(text.removeprefix("$ "), comments=True)
    tokens = [token.strip("[]") if token.startswith("[--") else token for token in tokens
              if not (token.startswith("[") and token.endswith("]") and not token.startswith("[--"))
              and token not in ("...", "…")]
    kept, skip = [], False
    for token in tokens:
        if skip:
            skip = False
            continue
        if token in (">", ">>", "2>", "2>&1", "&>"):
            skip = token != "2>&1"
            continue
        kept.append(token)
    flag = FRESH_OUTPUTS.get(script)
    if flag in kept:  # a fresh folder, or a file of the same name in one
        index = kept.index(flag) + 1
        kept[index] = str(fresh / Path(kept[index]).name if Path(kept[index]).suffix else fresh)
    if check_only:
        kept.append("--check_only")
    return " ".join(shell_word(token) for token in kept)


# ---------------------------------------------------------------------------------------------------------------
# 2. The sandbox, the fork server and the stand-ins
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A working directory where the repository's files are links, and the outputs (checkpoints/, eval/,
    demo_data/) are the sandbox's own."""
    root = tmp_path_factory.mktemp("docs_sandbox")
    for entry in REPO_ROOT.iterdir():
        if entry.name not in (".git", "checkpoints", "eval", "demo_data") and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    return root


@pytest.fixture(scope="module")
def server(sandbox, tmp_path_factory):
    """The fork server (started here, ended by its PID) and the folder of its `python` / `torchrun` shims."""
    folder = tmp_path_factory.mktemp("command_server")
    socket_path = folder / "server.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, str(REPO_ROOT / "tests/helpers/command_server.py"), "serve",
                                str(socket_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                               text=True)
    try:
        line = process.stdout.readline()
        assert line.strip() == "ready", line + process.stdout.read()
        shims = subprocess.run([sys.executable, str(REPO_ROOT / "tests/helpers/command_server.py"), "shims",
                                str(socket_path), str(folder / "bin")], capture_output=True, text=True, check=True,
                               env=env).stdout.strip()
        yield shims
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def world(sandbox) -> dict[str, str]:
    """The walkthrough's paths in the sandbox, with their stand-ins written; also the demo's. What the sandbox holds
    then is recorded (`BEFORE`): the checks may create nothing (the last test)."""
    paths = doc_world.walkthrough_paths(sandbox)
    demo = doc_world.write_demo_world(sandbox)
    doc_world.write_real_world(paths, sandbox, demo)
    BEFORE.update(sandbox_files(sandbox))
    return paths


BEFORE: dict[str, int] = {}
REPO_EVAL = REPO_ROOT / "eval"  # the eval's and the leaderboard's default --output_root
REPO_EVAL_EXISTED = REPO_EVAL.exists()


def sandbox_files(sandbox: Path) -> dict[str, int]:
    """{path: mtime} of every file and folder the sandbox holds itself (the repository's links not followed)."""
    found = {}
    for folder, folders, files in os.walk(sandbox):
        for name in folders + files:
            path = Path(folder) / name
            found[str(path.relative_to(sandbox))] = path.lstat().st_mtime_ns
    return found


def on_gpu_node(text: str) -> bool:
    """Whether a command is written for the real model's GPU node: it names a path of the walkthrough that is no
    demo's."""
    return "$" in text and "DEMO_" not in text and "demo_data" not in text and "--demo " not in text


def run_line(line: str, assignments: list[str], sandbox: Path, shims: str, paths: dict[str, str],
             gpus: int = 0, timeout: int = 300) -> subprocess.CompletedProcess:
    """`line` under bash in the sandbox, after the walkthrough's paths and the block's assignments as shell
    variables (set, not exported, as the walkthrough sets them: a launcher does not see them); `gpus`: the CUDA
    devices torch reports (tests/helpers/command_server.py)."""
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **({"DOC_FAKE_GPUS": str(gpus)} if gpus else {})}
    for name in ("WORLD_SIZE", "PYTHON", *paths):
        env.pop(name, None)
    variables = [f"{name}={shlex.quote(value)}" for name, value in paths.items()]
    return subprocess.run(["bash", "-c", "\n".join(["set -e", *variables, *assignments, line])], capture_output=True,
                          text=True, cwd=sandbox, env=env, timeout=timeout)


def fresh_path(sandbox: Path, where: str, check_only: bool = True) -> Path:
    """Where a command's output goes: a new folder of its own (under real_runs/ for the commands run for real)."""
    return sandbox / ("fresh" if check_only else "real_runs") / re.sub(r"\W", "_", where)


def refusal(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"


# ---------------------------------------------------------------------------------------------------------------
# 3. The checks
# ---------------------------------------------------------------------------------------------------------------
def test_every_line_of_a_command_block_is_a_command_an_assignment_or_a_known_external():
    assert len(COMMANDS) > 150, len(COMMANDS)
    assert not UNKNOWN_LINES, "lines of command blocks this test neither runs nor knows:\n" + "\n".join(UNKNOWN_LINES)


def test_external_commands_exist_with_the_flags_shown():
    help_text = subprocess.run(["hf", "download", "--help"], capture_output=True, text=True).stdout
    for line in EXTERNAL_LINES:
        if line.startswith("hf download"):
            for flag in re.findall(r"\s(--[a-z-]+)", line):
                assert flag in help_text, f"{line}: hf download has no {flag}"


@pytest.mark.parametrize("command", COMMANDS, ids=[command.where for command in COMMANDS])
def test_every_documented_command_runs_as_written(command, sandbox, server, world):
    check_only = not any(marker in command.text for marker in REAL_RUNS)
    fresh = fresh_path(sandbox, command.where, check_only)
    line = rendered(command.text, command.script, fresh, check_only)
    result = run_line(line, command.assignments, sandbox, server, world, gpus=8 if on_gpu_node(command.text) else 0)
    assert result.returncode == 0, f"{command.where}: {line}\n{refusal(result)}"
    assert "Traceback" not in result.stderr, f"{command.where}: {line}\n{refusal(result)}"
    if check_only:  # the command's own check ran (a launcher's: its script's, or the demo steps it would run first)
        report = "[launch] check only: " if command.script.startswith("tools/launch_") else "check only: "
        assert report in result.stdout, f"{command.where}: no check-only report\n{refusal(result)}"
    if command.script == "tools/make_sample_table.py":  # run for real: the three tables
        assert all((fresh / f"{split}.jsonl").is_file() for split in ("train", "holdout25", "holdout50")), line
    finished = [Path(path).name for path in world.values() if (sandbox / path / "training_latest.pt").is_file()]
    if command.expected_run in finished:  # a stand-in run with its training state: found, finished
        assert f"check only: run name {command.expected_run}\n" in result.stdout, refusal(result)
        assert "already finished" in result.stdout, f"{command.where}: did not find its run\n{refusal(result)}"


def test_the_main_jobs_closing_lines_run(sandbox, server, world):
    """The README's main command on the demo: a launch's check names both runs and prints the commands the demo
    ends with; each of them runs (the evals on both held-out splits, the leaderboard)."""
    result = run_line("bash tools/launch_predictor_v4_rollout_training.sh --check_only", [], sandbox, server, world)
    assert result.returncode == 0, refusal(result)
    assert "a launch would end with these lines" in result.stdout, refusal(result)
    printed = [line.strip() for line in result.stdout.splitlines() if line.startswith("  ")]
    assert len(printed) == 3 and all(line.startswith("python tools/") for line in printed), printed
    for line in printed:
        ran = run_line(f"{line} --check_only", [], sandbox, server, world)
        assert ran.returncode == 0 and "check only: " in ran.stdout, f"{line}\n{refusal(ran)}"


@pytest.mark.parametrize("run, dataset, world_size", [("OFFLINE", "DATASET", 8), ("ROLLOUT", "DATASET", 8),
                                                      ("DEMO_OFFLINE", "demo", 2), ("DEMO_ROLLOUT", "demo", 2)])
def test_the_leaderboard_line_each_recipe_prints_runs(run, dataset, world_size, sandbox, server, world):
    """The Predictor recipes end with "next, the leaderboard: <command>" (eval/leaderboard_command.py):
    on the real dataset it leaves $VAE and $ALEXNET to the walkthrough's paths, on the demo it is complete."""
    from predictor_training.eval.leaderboard_command import leaderboard_command

    root = sandbox / "demo_data" / "dataset" if dataset == "demo" else Path(world[dataset])
    line = leaderboard_command(sandbox / world[run], dataset_root=root, world_size=world_size)
    result = run_line(f"{line} --check_only", [], sandbox, server, world, gpus=8 if dataset != "demo" else 0)
    assert result.returncode == 0 and "check only: " in result.stdout, f"{line}\n{refusal(result)}"


def test_a_renamed_flag_fails_the_check_and_long_eval_names_are_shortened(sandbox, server, world):
    """What this test is for: the walkthrough's two-checkpoint eval with a flag its script does not have fails in
    one line naming it; as written, its automatic name (two runs' names, 260 characters in full) is shortened to fit
    the file system."""
    command = next(command for command in COMMANDS if "--ckpt $OFFLINE/predictor_step_02000.safetensors --ckpt"
                   in command.text and command.where.startswith("docs/walkthrough.md"))
    renamed = command.text.replace("--lpips_alexnet", "--lpips_alexnet_path")
    result = run_line(rendered(renamed, command.script, sandbox / "fresh" / "renamed", True), [], sandbox, server,
                      world)
    assert result.returncode == 2 and "--lpips_alexnet_path" in result.stderr, refusal(result)
    result = run_line(rendered(command.text, command.script, sandbox / "fresh" / "named", True), [], sandbox, server,
                      world)
    name = re.search(r"check only: eval run name (\S+)", result.stdout)
    assert result.returncode == 0 and name, refusal(result)
    assert len(name.group(1)) <= 255 and "__and1more_" in name.group(1), name.group(1)


def test_the_checks_created_nothing(sandbox, world):
    """Runs last (tests run in file order): after every check above, the sandbox holds exactly what the stand-ins
    put there, unchanged (no run directory, lock, config, output folder or dataset was made; real_runs/ holds what
    the REAL_RUNS wrote), and the repository's own eval/ (the eval's default --output_root) was not made either."""
    after = {path: mtime for path, mtime in sandbox_files(sandbox).items() if not path.startswith("real_runs")}
    assert sorted(set(after) - set(BEFORE)) == [], f"made by a check: {sorted(set(after) - set(BEFORE))}"
    assert sorted(path for path in BEFORE if after.get(path) != BEFORE[path]) == [], "changed by a check"
    assert REPO_EVAL.exists() == REPO_EVAL_EXISTED
