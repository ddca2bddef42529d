#!/usr/bin/env bash
# The overfit8 rollout check (docs/rollout.md § overfit8): the rollout recipe with `--preset overfit8` - 8 fixed
# training cases x their actions, chosen with seed 20260721, fusion warmup and block freeze of 8 steps. It separates "the
# learning rate is wrong" from "the gradient path or the model cannot learn": the full-epoch mean loss must fall
# within a few epochs (8 GPUs, 32 trajectories: one epoch = 4 optimizer steps).
#
#   INIT_FROM=... DATASET_ROOT=... bash tools/launch_predictor_v4_rollout_overfit8_training.sh [RUN_DIR] [RESUME] [flags]
#   bash tools/launch_predictor_v4_rollout_overfit8_training.sh    # CPU demo: --preset overfit8_demo (16 steps)
#
# Run name, e.g.:
#   predictor_v4_rollout_fppp_blocks1-52_overfit8_seed20260721_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup8_bwarmup8_swanlab
# Everything else (DATASET_ROOT, INIT_FROM, the CPU demo, flags, environment) is the main launcher's:
# tools/launch_predictor_v4_rollout_training.sh.
set -euo pipefail
RECIPE_PRESET=overfit8 exec bash "$(dirname "${BASH_SOURCE[0]}")/launch_predictor_v4_rollout_training.sh" "$@"
