#!/usr/bin/env bash
# On-policy F-P-P-P self-rollout fine-tuning of the v4 Predictor with torchrun (notes §8, §9).
#
#   bash tools/launch_predictor_v4_rollout_training.sh [RUN_DIR] [RESUME] [extra train_predictor_v4_rollout.py flags]
#
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_rollout_training.sh          # 8 GPUs, blocks 1,52
#   DATASET_ROOT=/data/predictor_v4 bash tools/launch_predictor_v4_rollout_training.sh RUN_DIR RUN_DIR/training_latest.pt
#   bash tools/launch_predictor_v4_rollout_training.sh     # no GPU, no DATASET_ROOT: the complete CPU demo
#
# A fresh run starts from INIT_FROM (model weights only), by default the offline v4 [1,52] FP32-master run of
#   $OUTPUT_ROOT/predictor_v4_prefeature_blocks1-52_fp32master_<N>gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab/training_latest.pt
# RUN_DIR defaults to $OUTPUT_ROOT/<run name>, e.g.
#   predictor_v4_rollout_fppp_blocks1-52_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab
#
# The CPU demo (no GPU and no DATASET_ROOT) makes what is missing, in order: the demo assets and dataset
# ($DEMO_ROOT), a short offline v4 run (tools/launch_predictor_v4_training.sh with its demo defaults), then a short
# rollout run from that run's training_latest.pt. A few minutes on 2 CPU cores.
#
# Environment overrides (defaults = the notes' rollout recipe; the CPU demo scales them down):
#   DATASET_ROOT INIT_FROM TEACHER ACTION_CKPT SAMPLE_TABLE SOURCE_BLOCKS PRECISION FUSION_LR BLOCKS_LR MAX_STEPS
#   STOP_AT_STEP SCHEDULER_WARMUP_STEPS BLOCK_WARMUP_STEPS (-1 = none) GRAD_ACCUM CKPT_EVERY KEEP_LAST LOG_EVERY SEED
#   NUM_WORKERS TRACKER (swanlab|none) SWANLAB_PROJECT SWANLAB_MODE EXPERIMENT,
#   SUBSET_CASES SUBSET_SEED RUN_TAG (used by tools/launch_predictor_v4_rollout_overfit8_training.sh),
#   plus those of tools/_launch_common.sh (NPROC_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT OUTPUT_ROOT
#   DEMO_ROOT PYTHON). SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"

split_positional 2 "$@"
run_dir_arg="${POSITIONAL[0]:-}"
resume_arg="${POSITIONAL[1]:-}"
experiment="${EXPERIMENT:-predictor_v4_rollout_fppp}"

# ---- 1. Demo or real data ------------------------------------------------------------------------------------
demo=0
if [[ -z "${DATASET_ROOT:-}" ]]; then
  if (( NUM_GPUS > 0 )); then
    echo "[launch] set DATASET_ROOT to the offline dataset (case files with text K/V) of tools/build_predictor_dataset.py" >&2
    exit 2
  fi
  demo=1
  echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT}, runs in ${OUTPUT_ROOT})"
  ensure_demo_dataset
  experiment="${experiment}_demo"
fi

# Recipe defaults (notes §8.10), or the demo's scaled-down ones; every value can be overridden from the env.
d_blocks=1,52 d_precision=fp32master d_flr=1e-4 d_blr=1e-5 d_steps=2000 d_swarmup=100 d_bwarmup=100
d_ckpt=100 d_tracker=swanlab d_workers=2
if (( demo )); then
  d_blocks=1,2 d_precision=fp32 d_steps=8 d_swarmup=2 d_bwarmup=2 d_ckpt=4 d_tracker=none d_workers=0
fi
source_blocks="${SOURCE_BLOCKS:-${d_blocks}}"
precision="${PRECISION:-${d_precision}}"
fusion_lr="${FUSION_LR:-${d_flr}}" blocks_lr="${BLOCKS_LR:-${d_blr}}"
max_steps="${MAX_STEPS:-${d_steps}}"
swarmup="${SCHEDULER_WARMUP_STEPS:-${d_swarmup}}" bwarmup="${BLOCK_WARMUP_STEPS:-${d_bwarmup}}"
ckpt_every="${CKPT_EVERY:-${d_ckpt}}" keep_last="${KEEP_LAST:-20}" grad_accum="${GRAD_ACCUM:-1}"
tracker="${TRACKER:-${d_tracker}}" num_workers="${NUM_WORKERS:-${d_workers}}"
seed="${SEED:-0}" log_every="${LOG_EVERY:-1}"

# ---- 2. The offline v4 checkpoint to start from ----------------------------------------------------------------
init_from="${INIT_FROM:-}"
if [[ -z "${resume_arg}" && -z "${init_from}" ]]; then
  if (( demo )); then
    pattern="${OUTPUT_ROOT}/predictor_v4_prefeature_demo_blocks${source_blocks/,/-}_fp32_*/training_latest.pt"
    shopt -s nullglob
    found=(${pattern})
    if (( ${#found[@]} == 0 )); then
      echo "[launch] no offline demo checkpoint (${pattern}): running tools/launch_predictor_v4_training.sh first"
      # Only the shared settings reach the offline demo; this launcher's hyper-parameters stay out of it.
      env -u FUSION_LR -u BLOCKS_LR -u MAX_STEPS -u STOP_AT_STEP -u SCHEDULER_WARMUP_STEPS -u BLOCK_WARMUP_STEPS \
        -u CKPT_EVERY -u KEEP_LAST -u GRAD_ACCUM -u TRACKER -u NUM_WORKERS -u EXPERIMENT -u PRECISION \
        SOURCE_BLOCKS="${source_blocks}" bash "${REPO_ROOT}/tools/launch_predictor_v4_training.sh"
      found=(${pattern})
    fi
    shopt -u nullglob
    if (( ${#found[@]} != 1 )); then
      echo "[launch] expected one offline demo checkpoint matching ${pattern}, found ${#found[@]}; set INIT_FROM" >&2
      exit 2
    fi
    init_from="${found[0]}"
  else
    offline_name="$(run_name predictor_v4_prefeature "${source_blocks}" fp32master 1e-4 1e-5 2000 100 100 swanlab)"
    init_from="${OUTPUT_ROOT}/${offline_name}/training_latest.pt"
  fi
fi
if (( demo )); then DATASET_ROOT="${DEMO_ROOT}/dataset"; fi

# ---- 3. Run name and flags -------------------------------------------------------------------------------------
# RUN_TAG (e.g. overfit8_seed20260721) goes between the source blocks and the precision, as in the notes' names.
name="$(run_name "${experiment}" "${source_blocks}" "${RUN_TAG:+${RUN_TAG}_}${precision}" "${fusion_lr}" "${blocks_lr}" \
  "${max_steps}" "${swarmup}" "${bwarmup}" "${tracker}")"
run_dir="${run_dir_arg:-${OUTPUT_ROOT}/${name}}"

args=(
  "${REPO_ROOT}/train_predictor_v4_rollout.py"
  --dataset_root "${DATASET_ROOT}" --output_dir "${run_dir}"
  --source_blocks "${source_blocks}" --precision "${precision}"
  --fusion_lr "${fusion_lr}" --blocks_lr "${blocks_lr}" --max_steps "${max_steps}"
  --scheduler_warmup_steps "${swarmup}" --block_warmup_steps "${bwarmup}" --grad_accum "${grad_accum}"
  --ckpt_every "${ckpt_every}" --keep_last "${keep_last}" --log_every "${log_every}"
  --seed "${seed}" --num_workers "${num_workers}" --tracker "${tracker}"
)
if [[ -n "${resume_arg}" ]]; then
  args+=(--resume "${resume_arg}")
else
  args+=(--init_from "${init_from}")
fi
[[ -n "${TEACHER:-}" ]] && args+=(--teacher "${TEACHER}")
[[ -n "${ACTION_CKPT:-}" ]] && args+=(--action_ckpt "${ACTION_CKPT}")
[[ -n "${SAMPLE_TABLE:-}" ]] && args+=(--sample_table "${SAMPLE_TABLE}")
[[ -n "${SUBSET_CASES:-}" ]] && args+=(--subset_cases "${SUBSET_CASES}")
[[ -n "${SUBSET_SEED:-}" ]] && args+=(--subset_seed "${SUBSET_SEED}")
[[ -n "${STOP_AT_STEP:-}" ]] && args+=(--stop_at_step "${STOP_AT_STEP}")
[[ -n "${SWANLAB_PROJECT:-}" ]] && args+=(--swanlab_project "${SWANLAB_PROJECT}")
[[ -n "${SWANLAB_MODE:-}" ]] && args+=(--swanlab_mode "${SWANLAB_MODE}")
args+=("${EXTRA_ARGS[@]}")

echo "[launch] rollout: ${name}"
if [[ -n "${resume_arg}" ]]; then echo "[launch] resume from ${resume_arg}"; else echo "[launch] init from ${init_from}"; fi
run_torchrun "${run_dir}" "${args[@]}"
