#!/usr/bin/env python
"""The memory rehearsal at real size against the user's GPUs (issue 20, item 3): about 5 CPU-minutes, no GPU.

    python benchmarks/check_real_size_memory.py              # the three rows; exit 1 when a check fails
    python benchmarks/check_real_size_memory.py --recipes v4 disca

For v4 (20 context frames: the bucket that sets the run's peak), disca and the rollout F-P-P-P (8 chunks, one
trajectory), each at the batch the user ran, it rehearses the training step twice with `tools/estimate_memory.py`:
once with the code as the user measured it (`--undo_cuts`: this code's memory cuts undone) —
that estimate must lie within 10 % of the user's `torch.cuda.max_memory_allocated` — and once with this code,
which must stay under the targets of issue 20 (v4 <= 52, disca <= 25, rollout <= 48 GiB). The test suite checks
at tiny size that each cut lowers the peak
(`tests/tools/test_estimate_memory.py::test_each_offline_memory_cut_lowers_the_peak`);
this check is the real-size one (two 8-chunk rollouts on fake tensors: minutes, so a benchmark, not a timed test).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from predictor_training.predictor.memory_cuts import CUTS
from predictor_training.runtime.flags import add_check_only_arg, report_check_only
from predictor_training.runtime.memory_rehearsal import relative_error

ESTIMATE_MEMORY = Path(__file__).resolve().parents[1] / "tools" / "estimate_memory.py"
# The user's torch.cuda.max_memory_allocated per recipe (v4 at 20 context frames, the batch he ran).
USER_MEASURED_GIB = {"v4": 62.82, "disca": 31.18, "rollout": 49.13}
MEMORY_TARGETS_GIB = {"v4": 52.0, "disca": 25.0, "rollout": 48.0}
TOLERANCE = 0.10


def rehearse(recipe: str, extra: list[str], *, undo=()) -> float:
    """Peak GiB of one recipe's rehearsal by `tools/estimate_memory.py` at its defaults plus the `extra` flags, with
    the memory cuts named in `undo` undone (CUTS: the code as the user ran it; (): this code)."""
    command = [sys.executable, str(ESTIMATE_MEMORY), "--recipe", recipe, "--json", *extra]
    if undo:
        command += ["--undo_cuts", *undo]
    lines = subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()
    return json.loads(lines[-1])["peak_gib"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", choices=list(MEMORY_TARGETS_GIB), default=list(MEMORY_TARGETS_GIB),
                        help="which of the user's three measurements to check (default: all)")
    add_check_only_arg(parser, what="the rehearsals it would run (each recipe's tools/estimate_memory.py command)")
    args = parser.parse_args(argv)
    if args.check_only:
        return report_check_only(*(f"{recipe}: tools/estimate_memory.py --recipe {recipe} --json, with and without "
                                   "--undo_cuts" for recipe in args.recipes))
    print(f"{'recipe':<8} {'user code GiB':>13} {'user GPU GiB':>12} {'diff':>7} {'this code GiB':>13} "
          f"{'target':>7}  verdict", flush=True)
    failures = []
    for recipe in args.recipes:
        before = rehearse(recipe, [], undo=CUTS)
        after = rehearse(recipe, [])
        measured = USER_MEASURED_GIB[recipe]
        error = relative_error(before, measured)
        problems = ([f"off by {error:+.1%} (> {TOLERANCE:.0%})"] if abs(error) > TOLERANCE else []) + \
                   ([f"over the {MEMORY_TARGETS_GIB[recipe]:.0f} GiB target"] if after > MEMORY_TARGETS_GIB[recipe]
                    else [])
        failures += [f"{recipe}: {problem}" for problem in problems]
        print(f"{recipe:<8} {before:>13.2f} {measured:>12.2f} {error:>+7.1%} {after:>13.2f} "
              f"{MEMORY_TARGETS_GIB[recipe]:>7.1f}  {'; '.join(problems) or 'ok'}", flush=True)
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
