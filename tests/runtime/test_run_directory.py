"""Run directories (predictor_training/runtime/run_directory.py): learning rates written
as in the run names, and the run lock (refuses a second holder, dies with its holder)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from predictor_training.runtime.run_directory import RunLock, RunLockedError, RunStart, format_lr, report_run_start


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """A process that takes the run lock, says so on stdout, and sleeps."""
    code = ("import sys, time; from predictor_training.runtime.run_directory import RunLock; "
            "lock = RunLock(sys.argv[1]); lock.acquire(); lock.record_holders('PIDs holder'); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_held_lock_refuses_and_dies_with_its_holder(tmp_path):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(RunLockedError, match="already running \\(PIDs holder\\)"):
            RunLock(tmp_path).acquire()
        start = RunStart(tmp_path, "run", "continue", None, 3, 10)
        with pytest.raises(RunLockedError, match="already running \\(PIDs holder\\)"):
            report_run_start(start)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = RunLock(tmp_path)  # the kernel released the dead holder's lock
    assert lock.holders() is None
    lock.acquire()
    lock.release()


@pytest.mark.parametrize("value, text", [
    (1e-4, "1e-4"), (5e-4, "5e-4"), (1e-5, "1e-5"), (2.5e-5, "2.5e-5"), (0.001, "1e-3"), (3e-3, "3e-3"),
    (0.1, "1e-1"), (1.0, "1e0"), (1.25e-4, "1.25e-4"),
])
def test_learning_rates_are_written_like_the_run_names(value, text):
    assert format_lr(value) == text
