"""tools/check_conformance.py as a command: one line per case and its exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from predictor_training.conformance import SET_A
from predictor_training.conformance.calls import run_conformance


REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "check_conformance.py"


def _run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)


def test_cli_prints_one_line_per_case_and_exit_codes():
    result = _run_tool(str(SET_A), "--tier", "strict", "--cases", "chunk_first", "scheduler")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("chunk_first.velocity") and line.endswith("PASS") for line in lines)
    assert not any(line.startswith("chunk.velocity") for line in lines)
    assert lines[-1].startswith(f"{len(lines) - 1} cases, 0 failed")
    with pytest.raises(ValueError, match="unknown case"):
        run_conformance(SET_A, cases=["no_such_group"])
    failed = _run_tool(str(SET_A), "--cases", "no_such_group")
    assert failed.returncode == 1 and "ValueError: unknown case(s) ['no_such_group']" in failed.stderr
