#!/usr/bin/env bash
# Offline v4 Predictor training with torchrun (docs/offline.md).
#
#   bash tools/launch_predictor_v4_training.sh [RUN_DIR] [SOURCE_BLOCKS] [RESUME] [train_predictor_v4.py flags...]
#
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh                 # blocks 1,52, 8 GPUs
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh "" 0,53         # blocks 0,53
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh --fusion_lr 5e-4 --max_steps 600
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_training.sh RUN_DIR 1,52 RUN_DIR/training_latest.pt
#   bash tools/launch_predictor_v4_training.sh          # no GPU, no DATASET_ROOT: the CPU demo (builds demo data first)
#
# RUN_DIR defaults to <--output_root>/<run name>, the name computed by train_predictor_v4.py from the flags, e.g.
#   predictor_v4_prefeature_blocks1-52_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab
# Running the same command again continues an interrupted run, or says the run is finished and exits 0.
# Every flag of `python train_predictor_v4.py --help` can be given after the positionals, or as an environment
# variable of the same name in capitals (FUSION_LR=5e-4); see tools/_launch_common.sh for the rendezvous ones.
# SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on the command line or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
launch_offline_training train_predictor_v4.py "$@"
