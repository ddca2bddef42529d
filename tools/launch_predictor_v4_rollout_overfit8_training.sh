#!/usr/bin/env bash
# The overfit8 rollout check (notes §8.10): 8 fixed training cases x their 4 actions (32 trajectories), chosen with
# seed 20260721, same LRs as the main rollout recipe (1e-4 / 1e-5) but fusion warmup and block freeze of 8 steps.
# It separates "the learning rate is wrong" from "the gradient path or the model cannot learn": the full-epoch mean
# loss must fall within a few epochs (8 GPUs: one epoch = 4 optimizer steps).
#
#   bash tools/launch_predictor_v4_rollout_overfit8_training.sh [RUN_DIR] [RESUME] [extra flags]
#
# Run name, e.g.:
#   predictor_v4_rollout_fppp_blocks1-52_overfit8_seed20260721_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup8_bwarmup8_swanlab
# Everything else (DATASET_ROOT, INIT_FROM, the CPU demo without GPU and DATASET_ROOT, env overrides) is the main
# launcher's: tools/launch_predictor_v4_rollout_training.sh. On the demo the 8 cases are 8 of the demo's training
# cases (all of them if it has fewer), and the run is scaled down to 16 steps.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"

subset_seed="${SUBSET_SEED:-20260721}"
subset_cases="${SUBSET_CASES:-8}"
if [[ -z "${DATASET_ROOT:-}" ]] && (( NUM_GPUS == 0 )); then
  ensure_demo_dataset
  demo_cases="$("${PYTHON}" -c "import json,sys; print(len({json.loads(l)['case_id'] for l in open(sys.argv[1]) if l.strip()}))" \
    "${DEMO_ROOT}/assets/samples/train.jsonl")"
  if (( demo_cases < subset_cases )); then subset_cases="${demo_cases}"; fi
  export MAX_STEPS="${MAX_STEPS:-16}" CKPT_EVERY="${CKPT_EVERY:-8}"
fi

export SUBSET_CASES="${subset_cases}" SUBSET_SEED="${subset_seed}"
export SCHEDULER_WARMUP_STEPS="${SCHEDULER_WARMUP_STEPS:-8}" BLOCK_WARMUP_STEPS="${BLOCK_WARMUP_STEPS:-8}"
export RUN_TAG="${RUN_TAG:-overfit${subset_cases}_seed${subset_seed}}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/launch_predictor_v4_rollout_training.sh" "$@"
