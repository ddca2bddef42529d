"""One writer per run directory: the lock, a second launch of a live run, and kill -9 of a launcher's group.

The end-to-end tests launch `tests/toy_launch_recipe.py` (which starts and ends as every recipe does) through the
launchers' own bash functions (`tools/_launch_common.sh`: --print_run_dir, then torchrun with 2 gloo ranks).
"""

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

from predictor_training.runtime.run_directory import RUN_LOCK_NAME, RunLock, RunLockedError, RunStart, report_run_start

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 12


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """A process that takes the run lock, says so on stdout, and sleeps."""
    code = ("import sys, time; from predictor_training.runtime.run_directory import RunLock; "
            "lock = RunLock(sys.argv[1]); lock.acquire(); lock.record_holders('PIDs holder'); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_held_lock_refuses_and_dies_with_its_holder(tmp_path, capsys):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(RunLockedError, match="already running \\(PIDs holder\\)"):
            RunLock(tmp_path).acquire()
        start = RunStart(tmp_path, "run", "continue", None, 3, 10)
        assert report_run_start(start) == 2
        assert "already running (PIDs holder)" in capsys.readouterr().err
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(tmp_path)  # the kernel released the dead holder's lock
    assert lock.holders() is None
    lock.acquire()
    lock.release()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(output_root: Path, *extra: str) -> subprocess.Popen:
    """The launcher path of every recipe, in its own session (so its whole group can be killed)."""
    command = (f"source {REPO_ROOT}/tools/_launch_common.sh && launch_recipe tests/toy_launch_recipe.py "
               f"--output_root {output_root} --max_steps {MAX_STEPS} --no_progress --backend gloo {' '.join(extra)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    return subprocess.Popen(["bash", "-c", command], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


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
    first = launch(tmp_path, "--step_seconds", "3")
    run_dir = tmp_path / "toy_run"
    wait_for_step(run_dir, 2, first)
    second = launch(tmp_path, "--step_seconds", "3")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, (out, err)
    refusal = [line for line in err.splitlines() if "already running" in line]
    assert len(refusal) == 1 and str(run_dir) in refusal[0] and "PIDs" in refusal[0], err
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert logged_steps(run_dir) == list(range(1, MAX_STEPS + 1))


@pytest.mark.slow
def test_kill_9_of_the_launcher_group_leaves_no_orphan_and_a_relaunch_finishes_the_run(tmp_path):
    reference = launch(tmp_path / "reference")
    assert reference.wait(timeout=300) == 0, reference.communicate()
    interrupted = launch(tmp_path / "killed", "--step_seconds", "2")
    run_dir = tmp_path / "killed" / "toy_run"
    wait_for_step(run_dir, 4, interrupted)
    holders = (run_dir / RUN_LOCK_NAME).read_text()
    worker_pids = [int(pid) for pid in holders.split(";")[0].removeprefix("PIDs ").split(", ")]
    os.killpg(interrupted.pid, signal.SIGKILL)
    interrupted.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in worker_pids), f"orphaned ranks {worker_pids} still run"
    relaunch = launch(tmp_path / "killed", "--step_seconds", "2")
    out, err = relaunch.communicate(timeout=300)
    assert relaunch.returncode == 0, err
    assert logged_steps(run_dir) == list(range(1, MAX_STEPS + 1))
    final = f"predictor_step_{MAX_STEPS:05d}.safetensors"
    resumed = load_file(run_dir / final)
    uninterrupted = load_file(tmp_path / "reference" / "toy_run" / final)
    assert resumed.keys() == uninterrupted.keys()
    assert all((resumed[key] == uninterrupted[key]).all() for key in resumed)
