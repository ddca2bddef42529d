#!/usr/bin/env python
"""The memory rehearsal at real size against the user's GPUs (issue 20, item 3): about 5 CPU-minutes, no GPU.

    python benchmarks/check_real_size_memory.py              # the three rows; exit 1 when a check fails
    python benchmarks/check_real_size_memory.py --recipes v4 disca

For v4 (20 context frames: the bucket that sets the run's peak), disca and the rollout F-P-P-P (8 chunks, one
trajectory), each at the batch the user ran, it rehearses the training step twice with `tools/estimate_memory.py`'s
own functions: once with the code as the user measured it (`as_the_user_ran`: this code's memory cuts undone) —
that estimate must lie within 10 % of the user's `torch.cuda.max_memory_allocated` — and once with this code,
which must stay under the targets of issue 20 (v4 <= 52, disca <= 25, rollout <= 48 GiB). The test suite checks
at tiny size that each cut lowers the peak (`tests/test_memory_rehearsal.py::test_each_memory_cut_lowers_the_peak`);
this check is the real-size one (two 8-chunk rollouts on fake tensors: minutes, so a benchmark, not a timed test).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import estimate_memory  # noqa: E402
from predictor_training.runtime.memory_rehearsal import patched, relative_error  # noqa: E402

MEMORY_TARGETS_GIB = {"v4": 52.0, "disca": 25.0, "rollout": 48.0}
TOLERANCE = 0.10


# This code's memory cuts (docs/memory.md): each can be undone alone.
CUTS = ("rms_norm_dtype", "attention_inputs", "rollout_context", "offline_prefeatures")


@contextlib.contextmanager
def as_the_user_ran(undo=CUTS):
    """The memory cuts of issue 20 named in `undo` undone (default all), so that a rehearsal runs the code as the
    user measured it: `rms_norm_dtype` RMSNorm's product with the FP32 weight (q and k promoted to float32),
    `attention_inputs` image_forward's attention inputs alive to the end of the call, `rollout_context` the rollout
    chunk's context K/V of every layer alive through its backward (`ChunkGraph.release_context` a no-op).
    `offline_prefeatures` (the offline batch's pre-features released once the context is built) is undone by the
    caller: `rehearse` passes `host="cpu"` so that the loop's batch stays on the device for the whole step, as the
    caller's dict kept it."""
    from predictor_training.predictor.self_rollout import ChunkGraph
    from predictor_training.teacher import layers
    from predictor_training.teacher import model as teacher_model

    def rms_forward_as_the_user_ran(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    unknown = set(undo) - set(CUTS)
    if unknown:
        raise ValueError(f"as_the_user_ran: unknown cuts {sorted(unknown)}; expected some of {CUTS}")
    patches = {"rms_norm_dtype": (layers.RMSNorm, "forward", rms_forward_as_the_user_ran),
               "attention_inputs": (teacher_model, "RELEASE_ATTENTION_INPUTS", False),
               "rollout_context": (ChunkGraph, "release_context", lambda self: None)}
    with patched(*(patch for cut, patch in patches.items() if cut in undo)):
        yield


def rehearse(recipe: str, extra: list[str], *, undo=()):
    """One recipe's rehearsal (estimate_memory's MemoryReport) at estimate_memory's defaults plus the `extra` flags,
    with the memory cuts named in `undo` undone (CUTS: the code as the user ran it; (): this code)."""
    args = estimate_memory.parse_args(["--recipe", recipe, *extra])
    with as_the_user_ran(undo):
        if recipe == "rollout":
            return estimate_memory.rehearse_rollout(args)
        host = "cpu" if "offline_prefeatures" in undo else "meta"
        return estimate_memory.rehearse_offline(args, recipe, 20 if recipe == "v4" else 0, host=host)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", choices=list(MEMORY_TARGETS_GIB), default=list(MEMORY_TARGETS_GIB),
                        help="which of the user's three measurements to check (default: all)")
    args = parser.parse_args(argv)
    print(f"{'recipe':<8} {'user code GiB':>13} {'user GPU GiB':>12} {'diff':>7} {'this code GiB':>13} "
          f"{'target':>7}  verdict", flush=True)
    failures = []
    for recipe in args.recipes:
        before = rehearse(recipe, [], undo=CUTS).peak_gib
        after = rehearse(recipe, []).peak_gib
        measured = estimate_memory.USER_MEASURED_GIB[recipe]
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
