"""The whole F-F-F-F trajectory check (predictor_training/conformance/trajectory.py)
on conformance set A: it passes at the strict tier, flags wrong context indices and small errors, and regenerates the
memory points from the seed when the folder lacks them."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from predictor_training.conformance import SET_A
import predictor_training.conformance.trajectory as trajectory_check


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---- set A --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def set_a_run():
    """One run of the check on set A as the tool runs it (check_trajectory: our rollout compared with the golden
    tensors, then print_report): (exit status the tool returns, printed lines, our tensors under the golden names)."""
    golden = trajectory_check.GoldenTrajectory.load(SET_A)
    ours = trajectory_check.our_trajectory(golden)
    report = trajectory_check.compare_with_golden(golden, ours, "strict")
    stream = io.StringIO()
    trajectory_check.print_report(report, stream)
    return 0 if report.passed else 1, stream.getvalue().splitlines(), ours


@pytest.fixture(scope="module")
def set_a_ours(set_a_run):
    return set_a_run[2]


def test_trajectory_tool_passes_set_a_at_strict_tier(set_a_run):
    status, lines, _ = set_a_run
    assert status == 0
    chunk_lines = [line for line in lines if line.split()[1:2] and line.split()[1].startswith("chunk")]
    assert len(chunk_lines) == 8 and all(line.startswith("PASS") for line in chunk_lines)
    assert sum("ctx_indices=exact" in line for line in chunk_lines) == 7  # chunk 0 has no context
    assert lines[-1].startswith("PASS: ") and " 0 failed" in lines[-1]


def test_trajectory_comparison_flags_wrong_context_indices_and_small_errors(set_a_ours, capsys):
    golden = trajectory_check.GoldenTrajectory.load(SET_A)
    assert trajectory_check.compare_with_golden(golden, set_a_ours, "strict").passed
    # chunk 6 with the second-best memory group (predictor_training/conformance/golden/README.md F.6), one velocity 2.5x
    # outside the strict budget
    golden.tensors["chunk6.ctx.indices"] = torch.cat([torch.arange(4), torch.arange(8, 24)])
    velocity = golden.tensors["chunk3.step1.velocity"].clone()
    velocity[0, 0, 0, 0, 0] += 2.5 * 3e-6 * (1 + velocity[0, 0, 0, 0, 0].abs())
    golden.tensors["chunk3.step1.velocity"] = velocity
    report = trajectory_check.compare_with_golden(golden, set_a_ours, "strict")
    assert {item.name for item in report.failures()} == {"chunk6.ctx.indices", "chunk3.step1.velocity"}
    trajectory_check.print_report(report)
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("FAIL: ") and "FAIL  chunk6" in out and "ctx_indices=DIFFER" in out
    # the same error is inside the portable budget (1e-5): only the indices fail there
    portable = trajectory_check.compare_with_golden(golden, set_a_ours, "portable")
    assert {item.name for item in portable.failures()} == {"chunk6.ctx.indices"}
    # a tensor we do not produce is a failure, not silently skipped
    golden.tensors["chunk2.ctx.block7_in"] = torch.zeros(1)
    assert "chunk2.ctx.block7_in" in {item.name for item in trajectory_check.compare_with_golden(
        golden, set_a_ours, "portable").failures()}


def test_trajectory_tool_regenerates_points_from_the_seed(tmp_path):
    folder = tmp_path / "set"
    folder.mkdir()
    for name in ("trajectory.json", "trajectory.safetensors"):
        shutil.copy(SET_A / name, folder / name)
    vectors = load_file(SET_A / "vectors.safetensors")
    stored_points = vectors.pop("retr.points")
    save_file(vectors, folder / "vectors.safetensors")
    points, source = trajectory_check.GoldenTrajectory.load(folder).memory_points()
    assert source == "make_retrieval_points(0)"
    # equal up to float32 rounding: the vectorised sin/cos/pow of the point rule differ by an ulp between thread counts
    torch.testing.assert_close(points, stored_points, rtol=0, atol=1e-6)
    with pytest.raises(trajectory_check.ConformanceInputError, match="config.json"):
        trajectory_check.check_trajectory(folder)
