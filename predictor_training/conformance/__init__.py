"""Conformance of our Teacher and AR loop against golden vectors of the upstream HY-WorldPlay code.

The format of a conformance folder, and set A (``tests/data/conformance/worldplay_tiny_A``), are described in
``tests/data/conformance/README.md``:

* ``predictor_training.conformance.calls``: the single calls (text prefill, context prefill, chunk steps) and the
  scheduler, pose and retrieval helpers (README sections 4-11); command line ``tools/check_conformance.py``;
* ``predictor_training.conformance.trajectory``: the whole F-F-F-F rollout (README section "Full F-F-F-F
  trajectory"); command line ``tools/check_trajectory_conformance.py``.
"""

# README section 11 ("Recommended tolerances (float32, CPU)"): atol = rtol of the float32 model tensors per tier.
TIERS = {"portable": 1e-5, "strict": 3e-6}
