"""tools/print_flop_bounds.py on the real 480p config (meta device, no weights)."""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_real_config_flop_bounds_tool(capsys):
    """tools/print_flop_bounds.py on the real 480p config (meta device, no weights): the incremental context makes
    F-P-P-P at least 3x cheaper than exact F-F-F-F, and a cached frame costs K and V of every layer."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import print_flop_bounds

    assert print_flop_bounds.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    bounds = {(row["schedule"], row["context_mode"]): row["bound"] for row in report["rows"]}
    assert bounds[("F-F-F-F", "exact")] == 1.0
    assert 1.5 < bounds[("F-P-P-P", "exact")] < 1.8
    assert bounds[("F-P-P-P", "incremental")] >= 3.0
    assert bounds[("F-F-F-F", "incremental")] > 1.3
    assert report["contexts"] == [0, 4, 8, 12, 16, 20, 20, 20]
    assert report["cache"]["bytes_per_frame_all_layers"] == 2 * 54 * 30 * 52 * 2048 * 2
