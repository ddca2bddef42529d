"""benchmarks/fidelity_table.py: the F-P-P-F fidelity table from an eval's per-video results, worked by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import fidelity_table  # noqa: E402


def _write_run(root: Path) -> Path:
    """Scene s1 holds videos a, b; scene s2 holds c. Reuse PSNR 20, 22, 30; v4 25, 25, 33; SSIM and the rest
    simple ramps."""
    rows = {"a": ("s1", 20.0, 25.0), "b": ("s1", 22.0, 25.0), "c": ("s2", 30.0, 33.0)}
    (root / "videos").mkdir(parents=True)
    for index, (video, (scene, reuse, v4)) in enumerate(rows.items()):
        def entry(psnr):
            return {"metrics": {"psnr_full": psnr, "ssim": psnr / 100, "lpips_x": 1 / psnr,
                                "temporal_delta_mse": psnr / 1000}}
        result = {"key": video, "case_id": scene, "lpips_metric": "lpips_x",
                  "methods": {"reference": {"metrics": {}}, "plan_frrf": entry(reuse), "v4_fppf": entry(v4)}}
        (root / "videos" / f"{video}.json").write_text(json.dumps(result))
    return root


def test_the_table_averages_videos_and_resamples_scenes(tmp_path):
    """Means over the 3 videos: reuse (20 + 22 + 30) / 3 = 24, v4 (25 + 25 + 33) / 3 = 27.67, v4 - reuse
    (5 + 3 + 3) / 3 = 3.67; two scenes, so the interval of v4 - reuse spans the scene means 4 (s1) and 3 (s2) at
    most."""
    table = fidelity_table.fidelity(fidelity_table.read_results(_write_run(tmp_path)), {"v4": "v4_fppf"},
                                    "plan_frrf", resamples=500)
    assert (table["num_videos"], table["num_scenes"]) == (3, 2)
    assert table["rows"]["reuse"]["psnr_full"].value == pytest.approx(24.0)
    assert table["rows"]["v4"]["psnr_full"].value == pytest.approx(83.0 / 3.0)
    assert table["rows"]["v4"]["ssim"].value == pytest.approx(0.83 / 3.0)
    delta = table["rows"]["v4"]["psnr_vs_reuse"]
    assert delta.value == pytest.approx(11.0 / 3.0) and 3.0 <= delta.low <= delta.value <= delta.high <= 4.0
    assert "psnr_vs_reuse" not in table["rows"]["reuse"]
    text = fidelity_table.markdown(table, "t", fidelity_table.USER_ROWS)
    assert "| v4 | 27.67 [" in text and "22.11 / 0.767 / 0.117 / 0.00832" in text


def test_a_missing_row_or_run_is_one_line(tmp_path):
    run = _write_run(tmp_path / "run")
    for argv in ([str(run), "--reuse", "plan_frrf", "--row", "v4=nope"], [str(tmp_path), "--reuse", "plan_frrf"],
                 [str(run), "--reuse", "plan_frrf", "--row", "v4"]):
        result = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "fidelity_table.py"), *argv],
                                capture_output=True, text=True, cwd=REPO_ROOT)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
