#!/usr/bin/env bash
# Causal KD of a few-step AR student from a many-step teacher's ODE states with torchrun (fvtools/train_kd.py,
# docs/methods/kd.md).
#
#   bash tools/launch_fvtools_kd.sh [RUN_DIR] [RESUME] [fvtools/train_kd.py flags...]
#
#   TEACHER=RUN/model CACHE_ROOT=/data/ode_cache bash tools/launch_fvtools_kd.sh
#   bash tools/launch_fvtools_kd.sh     # no GPU, no CACHE_ROOT: the CPU demo
#
# The cache comes first (tools/build_ode_cache.py, docs/ode_cache.md). RUN_DIR defaults to
# <--output_root>/<run name>, e.g. kd_lora64_fp32master_8gpu_lr1e-4_steps2000_warmup100_swanlab; running the same
# command again continues an interrupted run, or says the run is finished and exits 0.
#
# The CPU demo (no GPU and no CACHE_ROOT) makes what is missing, in order: the df_sft demo model
# (tools/launch_fvtools_df_sft.sh), its 32-step ODE cache over the demo video latents' train and holdout clips
# ($DEMO_ROOT/ode_cache), then distils it to 4 steps (`--preset demo`) and reports, in kd_eval.json, how far the
# student's own 4-step rollout is from the 32-step teacher on the holdout clips before and after. A few minutes on
# 2 CPU cores. It also validates every 50 steps (and at the last): the student's 4-step rollout of the first holdout
# sample, decoded by the VAE of the video latents the cache was built from, against the teacher's final latents
# (val/*_vs_teacher in train_log.jsonl, best.json, val_curve.png). Real runs validate only with --val_every N.
#
# Every flag of `python fvtools/train_kd.py --help` can be given after the positionals, or as an environment
# variable of the same name in capitals (METHOD_FLAG_VARIABLES in tools/_launch_common.sh).
# SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on the command line or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
SCRIPT=fvtools/train_kd.py
FLAG_VARIABLES=("${METHOD_FLAG_VARIABLES[@]}")

split_positional "RUN_DIR RESUME" "$@"
args=()
if [[ -z "${CACHE_ROOT:-}" ]] && (( NUM_GPUS == 0 )); then
  echo "[launch] no GPU and no CACHE_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
  ensure_demo_video_latents
  # 1. The many-step teacher: the df_sft demo model (trained first when it is not finished).
  sft=(--preset demo --teacher "${DEMO_ROOT}/assets/teacher" --dataset_root "${DEMO_ROOT}/video_latents")
  [[ -n "${OUTPUT_ROOT:-}" ]] && sft+=(--output_root "${OUTPUT_ROOT}")
  status=0
  plan_run fvtools/train_df_sft.py "${sft[@]}" || status=$?
  if (( status == 0 && CHECK_ONLY )); then
    first "train the df_sft demo model ${RUN_DIR:-} (tools/launch_fvtools_df_sft.sh)"
  elif (( status == 0 )); then
    echo "[launch] the df_sft demo model is not finished: running tools/launch_fvtools_df_sft.sh first"
    env -u LR -u MAX_STEPS -u STOP_AT_STEP -u WARMUP_STEPS -u TRAIN -u INIT_WEIGHTS -u LORA_RANK -u LORA_ALPHA \
      -u CHUNKS_PER_CLIP -u CKPT_EVERY -u KEEP_LAST -u GRAD_ACCUM -u TRACKER -u NUM_WORKERS -u EXPERIMENT \
      -u PRECISION -u TEACHER bash "${REPO_ROOT}/tools/launch_fvtools_df_sft.sh"
  elif (( status != 3 )); then
    exit "${status}"
  fi
  teacher="${RUN_DIR}/model"
  # 2. Its 32-step ODE states over the demo clips. The builder always runs: it keeps the samples already built
  #    (verified), resumes an interrupted build, and refuses a cache made by other teacher weights.
  cache="${DEMO_ROOT}/ode_cache"
  if (( CHECK_ONLY )); then
    first "build (or check) the demo ODE cache in ${cache} (tools/build_ode_cache.py)"
  else
    echo "[launch] building (or checking) the demo ODE cache in ${cache}"
    "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node 2 "${REPO_ROOT}/tools/build_ode_cache.py" \
      --teacher "${teacher}" --video_latents "${DEMO_ROOT}/video_latents" --splits train,holdout --steps 32 \
      --dtype float32 --storage_dtype float32 --out "${cache}"
  fi
  args+=(--preset demo --teacher "${teacher}" --cache_root "${cache}")
fi
flags_from_environment
args+=("${FLAGS_FROM_ENV[@]}")
[[ -n "${POSITIONAL[0]:-}" ]] && args+=(--output_dir "${POSITIONAL[0]}")
[[ -n "${POSITIONAL[1]:-}" ]] && args+=(--resume "${POSITIONAL[1]}")
launch_recipe "${SCRIPT}" "${args[@]}" "${EXTRA_ARGS[@]}"
