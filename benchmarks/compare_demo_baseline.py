"""Check that the CPU demo trains and evaluates exactly as the recorded baseline did (losses bit for bit).

The baseline (`benchmarks/baselines/demo_world/`) holds the `train_log.jsonl` of the three demo launchers and the
eval's `aggregate.json` on the demo world (README.md of that folder: the commit and machine it was recorded on). Run
the demo the same way on the same kind of CPU, then compare:

    bash tools/launch_predictor_v4_rollout_training.sh      # offline v4 demo, then the rollout demo
    bash tools/launch_predictor_disca_training.sh
    R=checkpoints/predictor_v4_rollout_fppp_demo_blocks1-10_fp32_2cpu_flr5e-4_blr5e-5_schedsteps96_swarmup2_bwarmup2_notracker
    O=checkpoints/predictor_v4_prefeature_demo_blocks1-10_fp32_2cpu_flr1e-4_blr1e-5_schedsteps240_swarmup10_bwarmup10_notracker
    D=checkpoints/predictor_disca_demo_blocks1-10_fp32_2cpu_flr1e-4_blr1e-5_schedsteps240_swarmup10_bwarmup10_notracker
    torchrun --standalone --nproc_per_node 2 tools/eval_predictor.py --demo demo_data/assets --split holdout25 \
        --replace_steps 1,2,3 --lpips_random_backbone --threads 1 --ckpt $R/predictor_step_00096.safetensors \
        --ckpt $O/predictor_step_00240.safetensors --ckpt $D/predictor_step_00240.safetensors \
        --context_modes exact,incremental --run_name world_demo_fppp_holdout25 --num_side_by_side 4
    python benchmarks/compare_demo_baseline.py --checkpoints checkpoints --eval eval

Every logged number except wall-clock times, memory and the validation figures must be equal (==, not approximately); eval metrics must
be equal too (timings, and the absolute paths in the header - checkpoints, LPIPS heads, ground truth - are
skipped). Exit code 1 on any difference, with one line per difference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

BASELINE = Path(__file__).resolve().parent / "baselines" / "demo_world"
# The three demo run directories (2 CPU ranks) -> their baseline log.
RUNS = {
    "predictor_v4_prefeature_demo_blocks1-10_fp32_2cpu_flr1e-4_blr1e-5_schedsteps240_swarmup10_bwarmup10_notracker":
        "offline_v4.train_log.jsonl",
    "predictor_disca_demo_blocks1-10_fp32_2cpu_flr1e-4_blr1e-5_schedsteps240_swarmup10_bwarmup10_notracker":
        "offline_disca.train_log.jsonl",
    "predictor_v4_rollout_fppp_demo_blocks1-10_fp32_2cpu_flr5e-4_blr5e-5_schedsteps96_swarmup2_bwarmup2_notracker":
        "rollout_fppp.train_log.jsonl",
}
EVAL_NAME = "world_demo_fppp_holdout25"
SKIPPED_PREFIXES = ("time/", "memory/", "val/")  # validation came after the baseline; it changes no loss
# Wall-clock figures, and the header entries that hold absolute paths: the checkpoints' (where the demo ran), the
# LPIPS linear heads' (where the pinned lpips package is installed, e.g. a virtual environment) and the ground truth's.
SKIPPED_EVAL_KEYS = {"timings", "speedup", "checkpoints", "legend", "linear_heads", "ground_truth"}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def same_number(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_logs(baseline: list[dict], current: list[dict], label: str) -> list[str]:
    """Differences between two train logs, ignoring wall-clock and memory keys."""
    problems = []
    if len(baseline) != len(current):
        problems.append(f"{label}: {len(current)} records, baseline has {len(baseline)}")
    for old, new in zip(baseline, current):
        keys = {key for key in old.keys() | new.keys() if not key.startswith(SKIPPED_PREFIXES)}
        for key in sorted(keys):
            if key not in old or key not in new or not same_number(old[key], new[key]):
                problems.append(f"{label} step {old.get('step')}: {key} baseline {old.get(key)!r} now {new.get(key)!r}")
    return problems


def compare_tree(baseline, current, where: str) -> list[str]:
    """Recursive equality of two JSON values, skipping timing subtrees."""
    if isinstance(baseline, dict) and isinstance(current, dict):
        problems = []
        for key in sorted(baseline.keys() | current.keys()):
            if key in SKIPPED_EVAL_KEYS:
                continue
            if key not in baseline or key not in current:
                problems.append(f"{where}.{key}: only in {'baseline' if key in baseline else 'current'}")
            else:
                problems.extend(compare_tree(baseline[key], current[key], f"{where}.{key}"))
        return problems
    if isinstance(baseline, list) and isinstance(current, list) and len(baseline) == len(current):
        return [problem for index, (a, b) in enumerate(zip(baseline, current))
                for problem in compare_tree(a, b, f"{where}[{index}]")]
    return [] if same_number(baseline, current) else [f"{where}: baseline {baseline!r} now {current!r}"]


def require_dir(path: Path) -> Path:
    if not path.is_dir():
        raise SystemExit(f"error: {path} does not exist; run the demo commands of this script's docstring first")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"),
                        help="folder holding the three demo run directories (default %(default)s)")
    parser.add_argument("--eval", type=Path, default=Path("eval"),
                        help="folder holding the demo eval's output directory (default %(default)s)")
    parser.add_argument("--baseline", type=Path, default=BASELINE, help="recorded baseline (default %(default)s)")
    args = parser.parse_args(argv)

    problems = []
    for name, log_name in RUNS.items():
        run_dir = require_dir(args.checkpoints / name)
        current = read_jsonl(run_dir / "train_log.jsonl")
        found = compare_logs(read_jsonl(args.baseline / log_name), current, run_dir.name)
        problems.extend(found)
        print(f"{run_dir.name}: {len(current)} records, {'identical' if not found else f'{len(found)} differences'}")
    eval_dir = require_dir(args.eval / EVAL_NAME)
    baseline_eval = json.loads((args.baseline / "eval_holdout25.aggregate.json").read_text())
    current_eval = json.loads((eval_dir / "aggregate.json").read_text())
    found = compare_tree(baseline_eval, current_eval, "aggregate")
    problems.extend(found)
    print(f"{eval_dir.name}/aggregate.json: {'identical metrics' if not found else f'{len(found)} differences'}")
    for problem in problems:
        print(f"DIFF {problem}")
    print("OK: the demo reproduces the baseline" if not problems else f"FAILED: {len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
