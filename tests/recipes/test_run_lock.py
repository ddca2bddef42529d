"""One writer per run directory, end to end: a second launch of a live run, and kill -9 of a
launcher's group.

The tests launch `tests/helpers/toy_launch_recipe.py` (which starts and ends as every recipe does) through the
launchers' own bash functions (`tools/_launch_common.sh`: --print_run_dir, then torchrun with 2 gloo ranks)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from predictor_training.runtime.run_directory import RUN_LOCK_NAME


REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 12
GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free port, never one handed out before in this process (two launches may start at once)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in GIVEN_PORTS:
            GIVEN_PORTS.add(port)
            return port


def launch(output_root: Path, *extra: str, pause: tuple[int, Path] | None = None) -> subprocess.Popen:
    """The launcher path of every recipe, in its own session (so its whole group can be killed). `pause=(N, FILE)`:
    every rank holds in its step function after N steps until FILE exists (TOY_PAUSE,
    tests/helpers/toy_launch_recipe.py), so the run is alive at a known step for as long as the test needs, without
    sleeping through its steps."""
    command = (f"source {REPO_ROOT}/tools/_launch_common.sh && launch_recipe tests/helpers/toy_launch_recipe.py "
               f"--output_root {output_root} --max_steps {MAX_STEPS} --no_progress --backend gloo {' '.join(extra)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    env.pop("TOY_PAUSE", None)
    if pause is not None:
        env["TOY_PAUSE"] = f"{pause[0]}:{pause[1]}"
    return subprocess.Popen(["bash", "-c", command], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def torchrun(output_root: Path) -> subprocess.Popen:
    """The same run under torchrun without the launcher's own steps (what a reference run needs)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), "tests/helpers/toy_launch_recipe.py", "--output_root", str(output_root), "--max_steps",
               str(MAX_STEPS), "--no_progress", "--backend", "gloo"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TOY_PAUSE", None)
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    """Kill a launch's whole group if it still runs (a failed test must not leave a held run behind)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "train_log.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(run_dir: Path, step: int, process: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if logged_steps(run_dir) and max(logged_steps(run_dir)) >= step:
            return
        if process.poll() is not None:
            raise AssertionError(f"the launch ended early ({process.returncode}): {process.communicate()}")
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split()[2] == "Z")


@pytest.mark.slow
def test_second_launch_is_refused_and_the_first_is_unharmed(tmp_path):
    release = tmp_path / "release_the_first"
    first = launch(tmp_path, pause=(2, release))  # holds before its step 3 until released: surely alive
    try:
        run_dir = tmp_path / "toy_run"
        wait_for_step(run_dir, 2, first)
        second = launch(tmp_path)
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2, (out, err)
        refusal = [line for line in err.splitlines() if "already running" in line]
        assert len(refusal) == 1 and str(run_dir) in refusal[0] and "PIDs" in refusal[0], err
        assert first.poll() is None and logged_steps(run_dir) == [1, 2]  # refused while the first ran, mid-run
        release.touch()
        out, err = first.communicate(timeout=300)
        assert first.returncode == 0, err
        assert logged_steps(run_dir) == list(range(1, MAX_STEPS + 1))
    finally:
        release.touch()
        stop(first)


@pytest.mark.slow
def test_kill_9_of_the_launcher_group_leaves_no_orphan_and_a_relaunch_finishes_the_run(tmp_path):
    reference = torchrun(tmp_path / "reference")  # uninterrupted; runs while the other one is killed and relaunched
    # Killed while its ranks hold in step 5 (after 4 steps and their checkpoints); released only when the test ends,
    # so that ranks a broken launcher orphaned finish instead of holding.
    release = tmp_path / "release_the_orphans"
    interrupted = launch(tmp_path / "killed", pause=(4, release))
    run_dir = tmp_path / "killed" / "toy_run"
    try:
        wait_for_step(run_dir, 4, interrupted)
        holders = (run_dir / RUN_LOCK_NAME).read_text()
        worker_pids = [int(pid) for pid in holders.split(";")[0].removeprefix("PIDs ").split(", ")]
        assert len(worker_pids) == 2 and all(alive(pid) for pid in worker_pids), holders
        os.killpg(interrupted.pid, signal.SIGKILL)
        interrupted.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(pid) for pid in worker_pids), f"orphaned ranks {worker_pids} still run"
        assert logged_steps(run_dir) == [1, 2, 3, 4]
        relaunch = launch(tmp_path / "killed")
        out, err = relaunch.communicate(timeout=300)
        assert relaunch.returncode == 0, err
        assert logged_steps(run_dir) == list(range(1, MAX_STEPS + 1))
        out, err = reference.communicate(timeout=300)
        assert reference.returncode == 0, err
    finally:
        release.touch()
        stop(interrupted)
        stop(reference)
    final = f"predictor_step_{MAX_STEPS:05d}.safetensors"
    resumed = load_file(run_dir / final)
    uninterrupted = load_file(tmp_path / "reference" / "toy_run" / final)
    assert resumed.keys() == uninterrupted.keys()
    assert all((resumed[key] == uninterrupted[key]).all() for key in resumed)
