#!/usr/bin/env bash
# Diffusion-forcing SFT of the AR world model with torchrun (fvtools/train_df_sft.py, docs/methods/df_sft.md).
#
#   bash tools/launch_fvtools_df_sft.sh [RUN_DIR] [RESUME] [fvtools/train_df_sft.py flags...]
#
#   TEACHER=/models/worldplay/transformer DATASET_ROOT=/data/video_latents bash tools/launch_fvtools_df_sft.sh
#   TEACHER=... DATASET_ROOT=/data/predictor_v4 bash tools/launch_fvtools_df_sft.sh --data teacher_samples  # real score
#   bash tools/launch_fvtools_df_sft.sh     # no GPU, no DATASET_ROOT: the CPU demo
#
# RUN_DIR defaults to <--output_root>/<run name>, computed by the script from the flags, e.g.
#   df_sft_lora64_fp32master_8gpu_lr1e-4_steps2000_warmup100_swanlab
# Running the same command again continues an interrupted run, or says the run is finished and exits 0.
#
# The CPU demo (no GPU and no DATASET_ROOT) makes what is missing: the demo-world assets and the video-latent dataset
# of their rendered clips ($DEMO_ROOT), then trains every parameter of a model of the world Teacher's config (12
# blocks, width 64) from scratch (`--preset demo`, 300 steps, FSDP2 on 2 gloo ranks). A few minutes on 2 CPU cores.
# It validates every 50 steps (and at step 300): the model's own 4-step rollout of the first holdout clip against
# its true video (val/* in train_log.jsonl, best.json, val_curve.png, validation/step_XXXXX.png; about 5 % of the
# demo's time). Real runs validate only with --val_every N (VAL_EVERY=N).
#
# Every flag of `python fvtools/train_df_sft.py --help` can be given after the positionals, or as an environment
# variable of the same name in capitals (LR, MAX_STEPS, TRAIN, ...; METHOD_FLAG_VARIABLES in tools/_launch_common.sh).
# SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on the command line or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
SCRIPT=fvtools/train_df_sft.py
FLAG_VARIABLES=("${METHOD_FLAG_VARIABLES[@]}")

split_positional "RUN_DIR RESUME" "$@"
args=()
if is_demo; then
  echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
  ensure_demo_video_latents
  args+=(--preset demo --teacher "${DEMO_ROOT}/assets/teacher" --dataset_root "${DEMO_ROOT}/video_latents")
fi
flags_from_environment
args+=("${FLAGS_FROM_ENV[@]}")
[[ -n "${POSITIONAL[0]:-}" ]] && args+=(--output_dir "${POSITIONAL[0]}")
[[ -n "${POSITIONAL[1]:-}" ]] && args+=(--resume "${POSITIONAL[1]}")
launch_recipe "${SCRIPT}" "${args[@]}" "${EXTRA_ARGS[@]}"
