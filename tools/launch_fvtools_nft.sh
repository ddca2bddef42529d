#!/usr/bin/env bash
# DiffusionNFT of the AR world model with named rewards of decoded video, with torchrun (fvtools/train_nft.py,
# docs/methods/nft.md).
#
#   bash tools/launch_fvtools_nft.sh [RUN_DIR] [RESUME] [fvtools/train_nft.py flags...]
#
#   TEACHER=/models/worldplay/transformer DATASET_ROOT=/data/video_latents bash tools/launch_fvtools_nft.sh \
#       --rewards reference_agreement:1,smoothness:0.1 --samples_per_group 8
#   bash tools/launch_fvtools_nft.sh     # no GPU, no DATASET_ROOT: the CPU demo
#
# RUN_DIR defaults to <--output_root>/<run name>, e.g. nft_lora64_fp32master_8gpu_lr3e-4_steps1000_warmup20_swanlab;
# running the same command again continues an interrupted run, or says the run is finished and exits 0.
#
# The CPU demo (no GPU and no DATASET_ROOT) makes the demo video latents when missing, then trains a rank-16 LoRA
# policy on the shipped world Teacher (demo_data/assets/teacher) with `--preset demo` on 2 gloo ranks: 4 samples per
# clip from the old policy's 4-step rollout, rewarded for agreeing with the rendered ground truth
# (demo_data/assets/ground_truth) and for smooth motion. A few minutes on 2 CPU cores; train_log.jsonl holds the
# reward, KL, advantage and monitor/ figures (the policy against the reference from the same noise).
#
# Every flag of `python fvtools/train_nft.py --help` can be given after the positionals; those of
# METHOD_FLAG_VARIABLES in tools/_launch_common.sh (but CACHE_ROOT, CHUNKS_PER_CLIP) also as environment variables
# of the same name in capitals.
# SWANLAB_API_KEY is read by SwanLab from the environment; it is never passed on the command line or written.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_launch_common.sh"
SCRIPT=fvtools/train_nft.py
# The generic methods' variables, less those naming flags this script does not have (CACHE_ROOT: kd's;
# CHUNKS_PER_CLIP: this script's counterpart is --chunks_per_sample).
FLAG_VARIABLES=()
for name in "${METHOD_FLAG_VARIABLES[@]}"; do
  [[ "${name}" == CACHE_ROOT || "${name}" == CHUNKS_PER_CLIP ]] || FLAG_VARIABLES+=("${name}")
done

split_positional "RUN_DIR RESUME" "$@"
args=()
if is_demo; then
  echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
  ensure_demo_video_latents
  args+=(--preset demo --teacher "${DEMO_ROOT}/assets/teacher" --dataset_root "${DEMO_ROOT}/video_latents"
         --ground_truth "${DEMO_ROOT}/assets/ground_truth")
fi
flags_from_environment
args+=("${FLAGS_FROM_ENV[@]}")
[[ -n "${POSITIONAL[0]:-}" ]] && args+=(--output_dir "${POSITIONAL[0]}")
[[ -n "${POSITIONAL[1]:-}" ]] && args+=(--resume "${POSITIONAL[1]}")
launch_recipe "${SCRIPT}" "${args[@]}" "${EXTRA_ARGS[@]}"
