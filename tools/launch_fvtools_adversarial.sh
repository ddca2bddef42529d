#!/usr/bin/env bash
# DisCa-style adversarial training of the v4 Predictor with torchrun (fvtools/train_adversarial.py,
# docs/methods/adversarial.md).
#
#   bash tools/launch_fvtools_adversarial.sh [RUN_DIR] [RESUME] [fvtools/train_adversarial.py flags...]
#
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_fvtools_adversarial.sh                 # offline pairs, 8 GPUs
#   INIT_FROM=OFFLINE_RUN/training_latest.pt DATASET_ROOT=/data/predictor_v4 bash tools/launch_fvtools_adversarial.sh
#   INIT_FROM=OFFLINE_RUN/training_latest.pt DATASET_ROOT=/data/predictor_v4 bash tools/launch_fvtools_adversarial.sh \
#       --data rollout                                                                     # on-policy F-P-P-P
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_fvtools_adversarial.sh RUN_DIR RUN_DIR/training_latest.pt
#   bash tools/launch_fvtools_adversarial.sh      # no GPU, no DATASET_ROOT: the CPU demo
#
# RUN_DIR defaults to <--output_root>/<run name>, computed by fvtools/train_adversarial.py from the flags, e.g.
#   predictor_v4_adversarial_blocks1-52_offline_adv0.01_dlr1e-4_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab
# Running the same command again continues an interrupted run, or says the run is finished and exits 0.
#
# The CPU demo (no GPU and no DATASET_ROOT) runs on the demo world (docs/demo_world.md) on 2 gloo ranks and makes
# what is missing, in order: the demo assets and dataset ($DEMO_ROOT), the offline v4 demo run
# (tools/launch_predictor_v4_training.sh), then `--preset demo` (offline pairs, 120 steps) starting from that run's
# training_latest.pt: DisCa adds its discriminator to a Predictor already trained by regression, so the
# discriminator meets fakes close to the Teacher's hiddens. A from-scratch run is the same command with --init_from
# left out (its --adv_weight 0 case equals train_predictor_v4.py exactly; tests/recipes/test_train_adversarial.py).
#
# Every flag of `python fvtools/train_adversarial.py --help` can be given after the positionals, or as an environment
# variable of the same name in capitals (FLAG_VARIABLES in tools/_launch_common.sh, plus ADV_WEIGHT,
# ADV_WARMUP_STEPS, DISCRIMINATOR_LR, DISCRIMINATOR_EVERY, R1_WEIGHT, R1_EVERY, REPLACE_STEPS; --data only as a flag).
# SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on the command line or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
SCRIPT=fvtools/train_adversarial.py
FLAG_VARIABLES+=(ADV_WEIGHT ADV_WARMUP_STEPS DISCRIMINATOR_LR DISCRIMINATOR_EVERY R1_WEIGHT R1_EVERY REPLACE_STEPS)

split_positional "RUN_DIR RESUME" "$@"
args=()
if is_demo; then
  echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
  ensure_demo_dataset
  args+=(--preset demo --dataset_root "${DEMO_ROOT}/dataset")
  if [[ -z "${POSITIONAL[1]:-}" && -z "${INIT_FROM:-}" ]]; then
    # The offline v4 demo run this one starts from: its directory comes from its own script.
    offline=(--preset demo --dataset_root "${DEMO_ROOT}/dataset")
    [[ -n "${SOURCE_BLOCKS:-}" ]] && offline+=(--source_blocks "${SOURCE_BLOCKS}")
    [[ -n "${OUTPUT_ROOT:-}" ]] && offline+=(--output_root "${OUTPUT_ROOT}")
    status=0
    plan_run train_predictor_v4.py "${offline[@]}" || status=$?
    if (( status == 0 && CHECK_ONLY )); then
      first "train the offline v4 demo run ${RUN_DIR:-} (tools/launch_predictor_v4_training.sh), this run's start"
    elif (( status == 0 )); then
      echo "[launch] the offline demo checkpoint is not finished: running tools/launch_predictor_v4_training.sh first"
      env -u FUSION_LR -u BLOCKS_LR -u MAX_STEPS -u STOP_AT_STEP -u SCHEDULER_WARMUP_STEPS -u BLOCK_WARMUP_STEPS \
        -u CKPT_EVERY -u KEEP_LAST -u GRAD_ACCUM -u TRACKER -u NUM_WORKERS -u EXPERIMENT -u PRECISION \
        bash "${REPO_ROOT}/tools/launch_predictor_v4_training.sh"
    elif (( status != 3 )); then
      exit "${status}"
    fi
    args+=(--init_from "${RUN_DIR}/training_latest.pt")
  fi
fi
flags_from_environment
args+=("${FLAGS_FROM_ENV[@]}")
[[ -n "${POSITIONAL[0]:-}" ]] && args+=(--output_dir "${POSITIONAL[0]}")
[[ -n "${POSITIONAL[1]:-}" ]] && args+=(--resume "${POSITIONAL[1]}")
launch_recipe "${SCRIPT}" "${args[@]}" "${EXTRA_ARGS[@]}"
