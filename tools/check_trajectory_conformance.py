"""Check our AR rollout against a golden full F-F-F-F trajectory (format: predictor_training/conformance/golden/README.md,
section "Full F-F-F-F trajectory"; the check itself: ``predictor_training.conformance.trajectory``).

    python tools/check_trajectory_conformance.py predictor_training/conformance/golden/worldplay_tiny_A
    python tools/check_trajectory_conformance.py DIR --tier portable

DIR holds config.json, weights.safetensors.xz (or weights.safetensors), vectors.safetensors (the text-side inputs),
trajectory.safetensors and trajectory.json. The check loads the model into our Teacher (float32, CPU), runs the text
prefill on the stored encoder stand-ins, then the whole rollout of ``predictor_training.rollout.ar_rollout`` - the loop the
dataset builder uses - on its OWN running state (every chunk's context comes from our own earlier chunks), with the
stored memory points (``retr.points``; regenerated from trajectory.json's retrieval seed when absent). It compares
every recorded float tensor elementwise, ``|got - ref| <= atol + rtol * |ref|`` with that README's section 11 tiers
(strict: atol = rtol = 3e-6, float32 on CPU; portable: 1e-5), every context index exactly, and that the stored noise
and image latent are what ``make_initial_noise`` gives for the recorded seeds. One line per chunk, one per tensor
kind; exit status 1 when anything fails. Nothing about the set's sizes is assumed.
"""

from __future__ import annotations

import os

# The strict tier assumes ISA-independent float32 numerics: MKL would otherwise round matmuls differently on AVX-512
# and AVX2 CPUs (predictor_training/conformance/golden/README.md section 11). Must be set before torch (and MKL) loads.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import argparse
import sys
from pathlib import Path

import torch

from predictor_training.conformance.trajectory import (
    TIERS,
    check_trajectory,
    print_report,
)
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.errors import CommandParser, MissingFileError, command
from predictor_training.runtime.flags import add_check_only_arg, add_threads_arg, report_check_only


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="conformance folder with trajectory.safetensors / trajectory.json, "
                        "config.json, weights.safetensors(.xz) and vectors.safetensors")
    parser.add_argument("--tier", choices=sorted(TIERS), default="strict", help="tolerance tier (section 11 of "
                        "predictor_training/conformance/golden/README.md): strict (3e-6, float32 on CPU) or portable "
                        "(1e-5, any float32 backend)")
    add_check_only_arg(parser, what="the folder's files it would compare against (it writes nothing in any case)")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    if not Path(args.folder).is_dir():
        parser.error(f"folder {str(args.folder)!r}: no such directory")
    return args


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_only:
        missing = [name for name in ("config.json", "trajectory.json", "trajectory.safetensors")
                   if not (args.folder / name).is_file()]
        if missing:
            raise MissingFileError(f"folder {args.folder}: no {', '.join(missing)}; expected a conformance folder "
                                   "with a trajectory (predictor_training/conformance/golden/README.md)")
        return report_check_only(f"the {args.tier} tier of {args.folder}'s trajectory")
    set_cpu_threads(args.threads, tool="check_trajectory_conformance", load_aware=False)
    torch.backends.cuda.matmul.allow_tf32 = False
    report = check_trajectory(args.folder, args.tier)
    print_report(report)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
