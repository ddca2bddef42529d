#!/usr/bin/env bash
# Offline v4 Predictor training with torchrun (notes §4 "v4", §9).
#
#   bash tools/launch_predictor_v4_training.sh [RUN_DIR] [SOURCE_BLOCKS] [RESUME] [extra train_predictor_v4.py flags]
#
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh                 # blocks 1,52, 8 GPUs
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh "" 0,53         # blocks 0,53
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh RUN_DIR 1,52 RUN_DIR/training_latest.pt
#   bash tools/launch_predictor_v4_training.sh          # no GPU, no DATASET_ROOT: the CPU demo (builds demo data first)
#
# RUN_DIR defaults to $OUTPUT_ROOT/<run name>, e.g.
#   predictor_v4_prefeature_blocks1-52_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab
# Environment overrides (defaults = the offline recipe; the CPU demo scales steps/warmups/batch down):
#   DATASET_ROOT TEACHER ACTION_CKPT SOURCE_BLOCKS PAIRS PRECISION FUSION_LR BLOCKS_LR MAX_STEPS STOP_AT_STEP
#   SCHEDULER_WARMUP_STEPS BLOCK_WARMUP_STEPS (-1 = none) BATCH_SIZE GRAD_ACCUM CKPT_EVERY KEEP_LAST LOG_EVERY SEED
#   NUM_WORKERS TRACKER (swanlab|none) SWANLAB_PROJECT SWANLAB_MODE EXPERIMENT, plus those of tools/_launch_common.sh
#   (NPROC_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT OUTPUT_ROOT DEMO_ROOT PYTHON).
# SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on the command line or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
launch_offline_training v4 train_predictor_v4.py "${EXPERIMENT:-predictor_v4_prefeature}" "$@"
