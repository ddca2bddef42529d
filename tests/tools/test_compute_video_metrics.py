"""tools/compute_video_metrics.py runs as a script and reports usage errors."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from predictor_training.video.io import write_video


REPO_ROOT = Path(__file__).resolve().parents[2]
CLI_PATH = REPO_ROOT / "tools" / "compute_video_metrics.py"


def random_video_pair(seed: int, frames: int = 4, height: int = 48, width: int = 64):
    """A uint8 reference [T, H, W, 3] and a noisy, clipped copy of it (noise level grows with the frame index)."""
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    noise = rng.normal(0.0, 1.0, size=ref.shape) * np.linspace(5.0, 40.0, frames)[:, None, None, None]
    test = np.clip(ref.astype(np.float64) + noise, 0, 255).round().astype(np.uint8)
    return ref, test


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """tools/compute_video_metrics.py as a subprocess, on this checkout's package (installed or not)."""
    return subprocess.run([sys.executable, str(CLI_PATH), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT, timeout=120)


# ---------------------------------------------------------------------------------------------------------------
# Folder comparison and its command line
# ---------------------------------------------------------------------------------------------------------------
def make_video_folders(root: Path):
    """ref/: a.mp4 (lossless) + clip_b/ PNG frames; test/: a/ PNG frames + clip_b.mp4 (mixed on purpose)."""
    ref_a, test_a = random_video_pair(seed=9, frames=3, height=32, width=48)
    ref_b, test_b = random_video_pair(seed=10, frames=2, height=32, width=48)
    write_video(root / "ref" / "a.mp4", ref_a, fps=8, lossless=True)
    write_video(root / "ref" / "sub" / "clip_b", ref_b, fps=8)
    write_video(root / "test" / "a", test_a, fps=8)
    write_video(root / "test" / "sub" / "clip_b.mp4", test_b, fps=8, lossless=True)
    return {"a": (ref_a, test_a), "sub/clip_b": (ref_b, test_b)}


def test_cli_runs_as_a_script_and_reports_usage_errors(tmp_path):
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "--lpips_random_backbone" in result.stdout and "NOT_LPIPS" in result.stdout
    make_video_folders(tmp_path)
    ref, test, out = str(tmp_path / "ref"), str(tmp_path / "test"), tmp_path / "out"
    result = run_cli(ref, test, "--out", str(out), "--device", "cpu", "--lpips_random_backbone")
    assert result.returncode == 0, result.stderr
    assert "NOT LPIPS" in result.stdout and f"wrote {out / 'metrics.json'}" in result.stdout
    # folders that do not pair up, an unknown device: one line, exit code 2, nothing written
    (tmp_path / "ref" / "extra.mp4").write_bytes((tmp_path / "ref" / "a.mp4").read_bytes())
    for args, message in (((ref, test), "has no partner"), ((ref, ref, "--device", "nodevice"), "--device nodevice")):
        result = run_cli(*args, "--out", str(tmp_path / "not_written"), "--lpips_random_backbone")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        errors = [line for line in result.stderr.splitlines() if "cpu threads:" not in line]
        assert len(errors) == 1 and errors[0].startswith("compute_video_metrics.py: error: ") and message in errors[0]
    assert not (tmp_path / "not_written").exists()
