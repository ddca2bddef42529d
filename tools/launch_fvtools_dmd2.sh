#!/usr/bin/env bash
# DMD2 distribution matching (+ Self-Forcing rollouts) of an AR few-step generator with torchrun
# (fvtools/train_dmd2.py, docs/methods/dmd2.md).
#
#   bash tools/launch_fvtools_dmd2.sh [RUN_DIR] [RESUME] [fvtools/train_dmd2.py flags...]
#
#   TEACHER=/models/worldplay/transformer DATASET_ROOT=/data/video_latents REAL_SCORE=DF_SFT_RUN/model \
#     INIT_FROM=ROLLOUT_RUN/training_latest.pt bash tools/launch_fvtools_dmd2.sh          # the F-P-P-P composite
#   TEACHER=... DATASET_ROOT=... REAL_SCORE=... bash tools/launch_fvtools_dmd2.sh --generator student
#   bash tools/launch_fvtools_dmd2.sh     # no GPU, no DATASET_ROOT: the CPU demo
#
# RUN_DIR defaults to <--output_root>/<run name>, computed by the script from the flags, e.g.
#   dmd2_predictor-fppp-blocks1-52_rollout-self_every5_fake-lora_fp32master_8gpu_flr1e-5_blr1e-6_fslr1e-5_steps2000_warmup100_swanlab
# Running the same command again continues an interrupted run, or says the run is finished and exits 0.
#
# The CPU demo (no GPU and no DATASET_ROOT) makes what is missing, in order: the demo world's video latents and the
# rollout demo Predictor (the generator's start; tools/launch_predictor_v4_rollout_training.sh), then runs DMD2 +
# Self-Forcing on the F-P-P-P composite with its anchor (`--preset demo`: 60 steps, generator every 2, a full fake
# score) on 2 gloo ranks. The real score is the world Teacher: on the demo world it is a df_sft model trained on the
# renders at every noise level, not a distilled one. A few minutes on 2 CPU cores. It validates at steps 30 and 60:
# the F-P-P-P generator on the first holdout clip against its true video and the Teacher's F-F-F-F of the same noise,
# with the collapse monitors (val/* in train_log.jsonl, best.json, val_curve.png). Real runs validate only with
# --val_every N. Its predictor_step_XXXXX.safetensors are evaluated like the other Predictors:
#   python tools/eval_predictor.py --demo demo_data/assets --split holdout25 --replace_steps 1,2,3 \
#     --ckpt RUN_DIR/predictor_step_00060.safetensors --lpips_random_backbone
#
# Every flag of `python fvtools/train_dmd2.py --help` can be given after the positionals, or as an environment
# variable of the same name in capitals (METHOD_FLAG_VARIABLES in tools/_launch_common.sh, and REAL_SCORE,
# INIT_FROM, GENERATOR, ROLLOUT, GENERATOR_EVERY, ANCHOR_WEIGHT, FAKE_SCORE_TRAIN, FAKE_SCORE_LR, FUSION_LR,
# BLOCKS_LR, SOURCE_BLOCKS). SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
SCRIPT=fvtools/train_dmd2.py
FLAG_VARIABLES=("${METHOD_FLAG_VARIABLES[@]}" REAL_SCORE INIT_FROM GENERATOR ROLLOUT GENERATOR_EVERY ANCHOR_WEIGHT
                FAKE_SCORE_TRAIN FAKE_SCORE_LR FUSION_LR BLOCKS_LR SOURCE_BLOCKS)

split_positional "RUN_DIR RESUME" "$@"
args=()
if is_demo; then
  echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
  ensure_demo_video_latents
  # 1. The real score: the world Teacher itself. It is no distilled model: it was trained from scratch by
  #    fvtools/train_df_sft.py (5000 steps, sigma uniform in [0, 1]) on the world's renders, so it is a score model of
  #    the data at every noise level (predictor_training/world/weights/README.md).
  real_score="${DEMO_ROOT}/assets/teacher"
  # 2. The generator's start: the rollout demo Predictor, which starts from the offline v4 demo run (both made by
  #    tools/launch_predictor_v4_rollout_training.sh when not finished).
  offline=(--preset demo --dataset_root "${DEMO_ROOT}/dataset")
  [[ -n "${OUTPUT_ROOT:-}" ]] && offline+=(--output_root "${OUTPUT_ROOT}")
  rollout_done() {
    [[ -f "${DEMO_ROOT}/dataset/manifest.jsonl" ]] && (( ! DEMO_PENDING )) || return 1
    plan_run train_predictor_v4.py "${offline[@]}" 2>/dev/null || [[ $? == 3 ]] || return 1
    [[ -f "${RUN_DIR}/training_latest.pt" ]] || return 1
    local status=0
    plan_run train_predictor_v4_rollout.py "${offline[@]}" --init_from "${RUN_DIR}/training_latest.pt" \
      2>/dev/null || status=$?
    (( status == 3 ))
  }
  if (( CHECK_ONLY )) && ! rollout_done; then
    first "run the main job's demo (tools/launch_predictor_v4_rollout_training.sh): its Predictor is this run's start"
  elif ! rollout_done; then
    echo "[launch] the rollout demo Predictor is not finished: running tools/launch_predictor_v4_rollout_training.sh first"
    env -u MAX_STEPS -u STOP_AT_STEP -u CKPT_EVERY -u KEEP_LAST -u GRAD_ACCUM -u TRACKER -u NUM_WORKERS \
      -u EXPERIMENT -u PRECISION -u INIT_FROM -u FUSION_LR -u BLOCKS_LR -u SOURCE_BLOCKS -u TEACHER \
      -u DATASET_ROOT bash "${REPO_ROOT}/tools/launch_predictor_v4_rollout_training.sh"
    rollout_done || { echo "[launch] the rollout demo Predictor is still not finished; see its log" >&2; exit 1; }
  fi
  predictor_init="${RUN_DIR}/training_latest.pt"
  args+=(--preset demo --teacher "${DEMO_ROOT}/assets/teacher" --dataset_root "${DEMO_ROOT}/video_latents"
         --real_score "${real_score}")
  [[ -z "${POSITIONAL[1]:-}" && -z "${INIT_FROM:-}" ]] && args+=(--init_from "${predictor_init}")
fi
flags_from_environment
args+=("${FLAGS_FROM_ENV[@]}")
[[ -n "${POSITIONAL[0]:-}" ]] && args+=(--output_dir "${POSITIONAL[0]}")
[[ -n "${POSITIONAL[1]:-}" ]] && args+=(--resume "${POSITIONAL[1]}")
launch_recipe "${SCRIPT}" "${args[@]}" "${EXTRA_ARGS[@]}"
