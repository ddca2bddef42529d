#!/usr/bin/env bash
# On-policy F-P-P-P self-rollout fine-tuning of the v4 Predictor with torchrun (docs/rollout.md).
#
#   bash tools/launch_predictor_v4_rollout_training.sh [RUN_DIR] [RESUME] [train_predictor_v4_rollout.py flags...]
#
#   INIT_FROM=OFFLINE_RUN/training_latest.pt DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_rollout_training.sh
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_rollout_training.sh RUN_DIR RUN_DIR/training_latest.pt
#   bash tools/launch_predictor_v4_rollout_training.sh     # no GPU, no DATASET_ROOT: the complete CPU demo
#
# A fresh run starts from --init_from / INIT_FROM (model weights of an offline v4 run; required outside the demo).
# RUN_DIR defaults to <--output_root>/<run name>, computed by train_predictor_v4_rollout.py from the flags, e.g.
#   predictor_v4_rollout_fppp_blocks1-52_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab
# Running the same command again continues an interrupted run, or says the run is finished and exits 0.
#
# The CPU demo (no GPU and no DATASET_ROOT) runs on the demo world (the shipped world Teacher and VAE, rendered
# scenes with ground truth; docs/demo_world.md) and makes what is missing, in order: the demo assets and dataset
# ($DEMO_ROOT), the offline v4 demo run (tools/launch_predictor_v4_training.sh), then a short rollout run
# (`--preset demo`) from that run's training_latest.pt. About 8 minutes on 2 CPU cores.
#
# Every flag of `python train_predictor_v4_rollout.py --help` can be given after the positionals, or as an
# environment variable of the same name in capitals (INIT_FROM, FUSION_LR, ...; see tools/_launch_common.sh).
# SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on the command line or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
SCRIPT=train_predictor_v4_rollout.py
# tools/launch_predictor_v4_rollout_overfit8_training.sh sets RECIPE_PRESET=overfit8.
recipe_preset="${RECIPE_PRESET:-}"

split_positional "RUN_DIR RESUME" "$@"
args=()
if is_demo; then
  echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
  ensure_demo_dataset
  args+=(--preset "${recipe_preset:+${recipe_preset}_}demo" --dataset_root "${DEMO_ROOT}/dataset")
  if [[ -z "${POSITIONAL[1]:-}" && -z "${INIT_FROM:-}" ]]; then
    # The offline v4 demo run this rollout starts from: its directory comes from its own script.
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
        -u VAL_EVERY -u VAL_VIDEOS -u VAL_SPLIT \
        bash "${REPO_ROOT}/tools/launch_predictor_v4_training.sh"
    elif (( status != 3 )); then
      exit "${status}"
    fi
    args+=(--init_from "${RUN_DIR}/training_latest.pt")
    offline_dir="${RUN_DIR}"
  fi
elif [[ -n "${recipe_preset}" ]]; then
  args+=(--preset "${recipe_preset}")
fi
flags_from_environment
args+=("${FLAGS_FROM_ENV[@]}")
[[ -n "${POSITIONAL[0]:-}" ]] && args+=(--output_dir "${POSITIONAL[0]}")
[[ -n "${POSITIONAL[1]:-}" ]] && args+=(--resume "${POSITIONAL[1]}")
launch_recipe "${SCRIPT}" "${args[@]}" "${EXTRA_ARGS[@]}"
if [[ -n "${offline_dir:-}" && -n "${RUN_DIR:-}" ]]; then
  # What the demo made, and the eval that shows whether the rollout stage bought anything (docs/rollout.md).
  (( CHECK_ONLY )) && echo "[launch] check only: a launch would end with these lines:"
  echo "[launch] demo finished."
  echo "[launch]   offline v4 run (the start): ${offline_dir}"
  echo "[launch]   rollout run:                ${RUN_DIR}"
  echo "[launch] Held-out F-P-P-P of both, against F-F-F-F and the ground truth (32 and 8 videos: several minutes on CPU; torchrun --nproc_per_node 2 halves it):"
  for split in holdout25 holdout50; do
    echo "  ${PYTHON} tools/eval_predictor.py --demo ${DEMO_ROOT}/assets --split ${split} --lpips_random_backbone" \
         "--ckpt ${offline_dir}/training_latest.pt --ckpt ${RUN_DIR}/training_latest.pt"
  done
  echo "[launch] Where they land against what you could run instead (fewer Teacher steps, training-free caches), at"
  echo "[launch] matched cost with intervals (docs/leaderboard.md; the samplers and one mixture: about 20 min on 2 cores):"
  echo "  ${PYTHON} tools/leaderboard.py --demo ${DEMO_ROOT}/assets --split holdout25 --lpips_random_backbone" \
       "--samplers 1,2 --caches '' --predictor_plans trained,F-R-R-P" \
       "--ckpt ${offline_dir}/training_latest.pt --ckpt ${RUN_DIR}/training_latest.pt"
fi
