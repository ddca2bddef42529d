"""Run a script under `torchrun --standalone --nproc_per_node 2` (gloo on CPU) from a test, one thread per rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_two_ranks(script: Path | str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Launch `script` (a path relative to the repository root, or absolute) on 2 ranks; returns the finished
    process (stdout and stderr captured as text) whatever its exit status."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO_ROOT / script), *map(str, args)]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def assert_finished(result: subprocess.CompletedProcess) -> None:
    """Fail with the end of both streams when the launch did not exit 0."""
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
