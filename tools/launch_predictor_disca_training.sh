#!/usr/bin/env bash
# Offline disca Predictor training with torchrun (docs/offline.md).
#
#   bash tools/launch_predictor_disca_training.sh [RUN_DIR] [SOURCE_BLOCKS] [RESUME] [train_predictor_disca.py flags...]
#
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh              # blocks 1,52, 8 GPUs
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh "" 0,53      # blocks 0,53
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_disca_training.sh RUN_DIR 0,53 RUN_DIR/training_latest.pt
#   bash tools/launch_predictor_disca_training.sh       # no GPU, no DATASET_ROOT: the CPU demo (builds demo data first)
#
# RUN_DIR defaults to <--output_root>/<run name>, computed by train_predictor_disca.py from the flags, e.g.
#   predictor_disca_blocks1-52_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab
# Flags and environment variables: as tools/launch_predictor_v4_training.sh.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
launch_offline_training train_predictor_disca.py "$@"
