#!/usr/bin/env bash
# The overfit8 F-P-P-F rollout run (docs/rollout.md § overfit8): the rollout recipe with `--preset overfit8_fppf` - the
# 8 fixed training cases of overfit8 (seed 20260721) x their actions, trained under F-P-P-F (`--replace_steps 1,2`:
# the Predictor runs steps 1 and 2, the Teacher step 3) over a 300-step schedule, fusion warmup and block freeze of
# 8 steps.
#
#   INIT_FROM=... DATASET_ROOT=... bash tools/launch_predictor_v4_rollout_overfit8_fppf_training.sh [RUN_DIR] [RESUME] [flags]
#   bash tools/launch_predictor_v4_rollout_overfit8_fppf_training.sh    # CPU demo: --preset overfit8_fppf_demo (16 steps)
#
# Run name, e.g.:
#   predictor_v4_rollout_fppf_blocks1-52_overfit8_seed20260721_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps300_swarmup8_bwarmup8_swanlab
# Evaluate it under the schedule it was trained for: tools/eval_predictor.py --replace_steps 1,2.
# Everything else (DATASET_ROOT, INIT_FROM, the CPU demo, flags, environment) is the main launcher's:
# tools/launch_predictor_v4_rollout_training.sh.
set -euo pipefail
RECIPE_PRESET=overfit8_fppf exec bash "$(dirname "${BASH_SOURCE[0]}")/launch_predictor_v4_rollout_training.sh" "$@"
