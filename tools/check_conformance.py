#!/usr/bin/env python
"""Check our WorldPlay-1.5 teacher (and the scheduler / camera helpers) against a golden conformance folder.

A conformance folder (format: `predictor_training/conformance/golden/README.md`) holds `config.json`,
`weights.safetensors.xz`, `vectors.safetensors`, `vectors.json`, `pose.json` and `pose_from_string.json`. Nothing here
depends on the sizes of a particular set: depth, grid, lengths and chunk parameters are read from the files.

Model cases are teacher-forced: the context prefill and the chunk steps receive the stored reference text cache
(and the chunk with a context the stored context cache), so a failure points at the call that is wrong.

    python tools/check_conformance.py predictor_training/conformance/golden/worldplay_tiny_A
    python tools/check_conformance.py DIR --tier strict --cases text chunk_first scheduler

Prints one line per compared tensor (name, max abs error, tolerance, worst ratio, PASS/FAIL); exits 1 on any
failure, 0 otherwise. Model tensors use |got - ref| <= atol + rtol * |ref| with atol = rtol = the tier's value
(portable 1e-5, strict 3e-6); the scheduler, pose and retrieval cases use the fixed tolerances of that README's
section 11 ("Recommended tolerances"). The checks live in `predictor_training.conformance.calls`.
"""

from __future__ import annotations

import os

# The strict tier assumes ISA-independent float32 numerics: MKL would otherwise round matmuls differently on AVX-512
# and AVX2 CPUs (predictor_training/conformance/golden/README.md section 11). Must be set before torch (and MKL) loads.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import argparse
import sys
from pathlib import Path

from predictor_training.conformance.calls import CATEGORIES, TIERS, run_conformance
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.errors import CommandParser, MissingFileError, command
from predictor_training.runtime.flags import add_check_only_arg, add_threads_arg, report_check_only


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "folder", help="conformance folder (config.json, weights.safetensors.xz, vectors.*, pose*.json)"
    )
    parser.add_argument("--tier", choices=sorted(TIERS), default="portable",
                        help="tolerance tier of the model tensors: portable (1e-5) or strict (3e-6, float32 CPU)")
    parser.add_argument("--cases", nargs="+", default=None,
                        help=f"run only these categories {list(CATEGORIES)} or groups (e.g. txt_holes chunk_first)")
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
        missing = [name for name in ("config.json", "weights.safetensors.xz", "vectors.json", "vectors.safetensors")
                   if not (Path(args.folder) / name).is_file()]
        if missing:
            raise MissingFileError(f"folder {args.folder}: no {', '.join(missing)}; expected a conformance folder "
                                   "(predictor_training/conformance/golden/README.md)")
        return report_check_only(f"the {args.tier} tier of {args.folder}")
    set_cpu_threads(args.threads, tool="check_conformance", load_aware=False)
    results = run_conformance(args.folder, args.tier, args.cases)
    for result in results:
        print(result.line())
    failures = [result for result in results if not result.passed]
    worst = max((result.worst_ratio for result in results), default=0.0)
    print(f"{len(results)} cases, {len(failures)} failed, worst ratio {worst:.4g} ({args.tier} tier, {args.folder})")
    if not results:
        print("no cases selected", file=sys.stderr)
        return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
