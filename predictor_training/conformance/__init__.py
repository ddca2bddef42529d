"""Conformance of our Teacher and AR loop against golden vectors of the upstream HY-WorldPlay code.

The golden data ships in ``golden/`` beside this file (``predictor_training/conformance/golden``; ``GOLDEN_DIR``). The format
of a conformance folder, and set A (``golden/worldplay_tiny_A``, ``SET_A``), are described in ``golden/README.md``:

* ``predictor_training.conformance.calls``: the single calls (text prefill, context prefill, chunk steps) and the
  scheduler, pose and retrieval helpers (README sections 4-11); command line ``tools/check_conformance.py``;
* ``predictor_training.conformance.trajectory``: the whole F-F-F-F rollout (README section "Full F-F-F-F
  trajectory"); command line ``tools/check_trajectory_conformance.py``.
"""

from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"  # the golden data and its README
SET_A = GOLDEN_DIR / "worldplay_tiny_A"  # README section 13

# README section 11 ("Recommended tolerances (float32, CPU)"): atol = rtol of the float32 model tensors per tier.
TIERS = {"portable": 1e-5, "strict": 3e-6}
