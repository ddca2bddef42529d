"""tools/check_trajectory_conformance.py as a command: exit status 1 and
the failing tensor on a damaged copy of set A."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from predictor_training.conformance import SET_A


REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_trajectory_tool_command_line(tmp_path):
    """tools/check_trajectory_conformance.py as a command: exit status 1 and the failing tensor on a damaged copy."""
    folder = tmp_path / "set"
    shutil.copytree(SET_A, folder)
    golden = load_file(folder / "trajectory.safetensors")
    golden["chunk1.step2.velocity"] = golden["chunk1.step2.velocity"] + 1e-3
    save_file(golden, folder / "trajectory.safetensors")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "check_trajectory_conformance.py"),
                             str(folder), "--tier", "portable", "--threads", "1"],
                            capture_output=True, text=True, timeout=300)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    assert lines[-1].startswith("FAIL: ") and any(line.startswith("FAILED chunk1.step2.velocity") for line in lines)
