# Shared helpers for the tools/launch_*.sh launchers (sourced, not executed).
#
# Environment (all optional):
#   NPROC_PER_NODE  processes per node (default: number of visible GPUs, 8 on a full node; 2 on a CPU-only machine)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node rendezvous (defaults: 1, 0, 127.0.0.1, 29500)
#   OUTPUT_ROOT     where run directories go (default: <repo>/checkpoints)
#   DEMO_ROOT       where demo assets and the demo dataset go (default: <repo>/demo_data)
#   PYTHON          python interpreter (default: python)

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
OUTPUT_ROOT="${OUTPUT_ROOT:-${REPO_ROOT}/checkpoints}"
DEMO_ROOT="${DEMO_ROOT:-${REPO_ROOT}/demo_data}"

count_gpus() {
  "${PYTHON}" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
}

NUM_GPUS="$(count_gpus)"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  if (( NUM_GPUS > 0 )); then NPROC_PER_NODE="${NUM_GPUS}"; else NPROC_PER_NODE=2; fi
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
WORLD_SIZE_TOTAL=$(( NPROC_PER_NODE * NNODES ))
if (( NUM_GPUS > 0 )); then DEVICE_TAG="${WORLD_SIZE_TOTAL}gpu"; else DEVICE_TAG="${WORLD_SIZE_TOTAL}cpu"; fi

# run_torchrun RUN_DIR SCRIPT ARGS...: start the job, keep the full console in RUN_DIR/torchrun.log,
# and show rank 0's lines (plus torchrun's own) on the terminal.
run_torchrun() {
  local run_dir="$1"; shift
  mkdir -p "${run_dir}"
  # tqdm sees a pipe under torchrun, so every refresh becomes a log line; the per-step lines show progress anyway.
  export TQDM_MININTERVAL="${TQDM_MININTERVAL:-30}"
  echo "[launch] run dir: ${run_dir}"
  echo "[launch] nodes=${NNODES} node_rank=${NODE_RANK} nproc_per_node=${NPROC_PER_NODE} master=${MASTER_ADDR}:${MASTER_PORT}"
  set +e
  "${PYTHON}" -m torch.distributed.run \
    --nnodes "${NNODES}" --node_rank "${NODE_RANK}" --nproc_per_node "${NPROC_PER_NODE}" \
    --master_addr "${MASTER_ADDR}" --master_port "${MASTER_PORT}" \
    --tee 3 \
    "$@" 2>&1 | tee -a "${run_dir}/torchrun.log" | grep --line-buffered -v -E '^\[default[1-9][0-9]*\]:'
  local status=${PIPESTATUS[0]}
  set -e
  return "${status}"
}

# ensure_demo_dataset: make the demo assets and the demo Teacher-trajectory dataset if they are missing.
# Completion markers are what the tools write last: make_demo_assets.py moves its finished folder (with
# demo_config.json) into place in one rename; build_predictor_dataset.py writes manifest.jsonl after every rank
# finished and then removes manifest_parts/. A half-built dataset is resumed by rerunning the builder.
ensure_demo_dataset() {
  if [[ ! -f "${DEMO_ROOT}/assets/demo_config.json" ]]; then
    echo "[launch] making demo assets in ${DEMO_ROOT}/assets"
    "${PYTHON}" "${REPO_ROOT}/tools/make_demo_assets.py" --out "${DEMO_ROOT}/assets"
  fi
  if [[ ! -f "${DEMO_ROOT}/dataset/manifest.jsonl" || -d "${DEMO_ROOT}/dataset/manifest_parts" ]]; then
    echo "[launch] building the demo dataset in ${DEMO_ROOT}/dataset"
    "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node 2 \
      "${REPO_ROOT}/tools/build_predictor_dataset.py" --demo "${DEMO_ROOT}/assets" --out "${DEMO_ROOT}/dataset"
  fi
}

# split_positional MAX ARGS...: the first up-to-MAX arguments that do not start with '-' go to POSITIONAL
# (empty strings count, so `"" 0,53` skips the first one); everything after them goes to EXTRA_ARGS.
split_positional() {
  local max="$1"; shift
  POSITIONAL=()
  while (( $# > 0 && ${#POSITIONAL[@]} < max )) && [[ "$1" != -* ]]; do
    POSITIONAL+=("$1"); shift
  done
  EXTRA_ARGS=("$@")
}

# run_name EXPERIMENT SOURCE_BLOCKS PRECISION FUSION_LR BLOCKS_LR MAX_STEPS SWARMUP BWARMUP TRACKER
# -> e.g. predictor_v4_prefeature_blocks1-52_fp32master_8gpu_flr1e-4_blr1e-5_schedsteps2000_swarmup100_bwarmup100_swanlab
# (SPEC §5; the LRs are written as given; BWARMUP -1 is written "none"; tracker "none" is written "notracker").
run_name() {
  local experiment="$1" blocks="$2" precision="$3" flr="$4" blr="$5" steps="$6" swarmup="$7" bwarmup="$8" tracker="$9"
  local bwarmup_tag="${bwarmup}" tracker_tag="${tracker}"
  [[ "${bwarmup}" == "-1" ]] && bwarmup_tag="none"
  [[ "${tracker}" == "none" ]] && tracker_tag="notracker"
  echo "${experiment}_blocks${blocks/,/-}_${precision}_${DEVICE_TAG}_flr${flr}_blr${blr}_schedsteps${steps}_swarmup${swarmup}_bwarmup${bwarmup_tag}_${tracker_tag}"
}

# launch_offline_training VARIANT SCRIPT EXPERIMENT [RUN_DIR] [SOURCE_BLOCKS] [RESUME] [extra flags...]
# The body of launch_predictor_{v4,disca}_training.sh. Hyper-parameters come from the environment (defaults: the
# notes' offline recipe); with no GPU and no DATASET_ROOT it runs the CPU demo instead (scaled-down defaults).
launch_offline_training() {
  local variant="$1" script="$2" experiment="$3"; shift 3
  split_positional 3 "$@"
  local run_dir_arg="${POSITIONAL[0]:-}" blocks_arg="${POSITIONAL[1]:-}" resume_arg="${POSITIONAL[2]:-}"

  local demo=0
  if [[ -z "${DATASET_ROOT:-}" ]]; then
    if (( NUM_GPUS > 0 )); then
      echo "[launch] set DATASET_ROOT to the dataset made by tools/build_predictor_dataset.py" >&2
      return 2
    fi
    demo=1
    echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
    ensure_demo_dataset
    DATASET_ROOT="${DEMO_ROOT}/dataset"
    experiment="${experiment}_demo"
  fi

  # Recipe defaults (notes §3-§4), or the demo's scaled-down ones; every value can be overridden from the env.
  local d_blocks=1,52 d_precision=fp32master d_flr=1e-4 d_blr=1e-5 d_steps=2000 d_swarmup=100 d_bwarmup=100
  local d_batch=16 d_ckpt=100 d_tracker=swanlab d_workers=4
  if (( demo )); then
    d_blocks=1,2 d_precision=fp32 d_flr=1e-4 d_blr=1e-5 d_steps=240 d_swarmup=10 d_bwarmup=10
    d_batch=8 d_ckpt=40 d_tracker=none d_workers=0
  fi
  local source_blocks="${blocks_arg:-${SOURCE_BLOCKS:-${d_blocks}}}"
  local precision="${PRECISION:-${d_precision}}"
  local fusion_lr="${FUSION_LR:-${d_flr}}" blocks_lr="${BLOCKS_LR:-${d_blr}}"
  local max_steps="${MAX_STEPS:-${d_steps}}"
  local swarmup="${SCHEDULER_WARMUP_STEPS:-${d_swarmup}}" bwarmup="${BLOCK_WARMUP_STEPS:-${d_bwarmup}}"
  local batch_size="${BATCH_SIZE:-${d_batch}}" grad_accum="${GRAD_ACCUM:-1}"
  local ckpt_every="${CKPT_EVERY:-${d_ckpt}}" keep_last="${KEEP_LAST:-20}"
  local tracker="${TRACKER:-${d_tracker}}" num_workers="${NUM_WORKERS:-${d_workers}}"
  local pairs="${PAIRS:-0-1,1-2,2-3}" seed="${SEED:-0}" log_every="${LOG_EVERY:-1}"

  local name
  name="$(run_name "${experiment}" "${source_blocks}" "${precision}" "${fusion_lr}" "${blocks_lr}" "${max_steps}" \
    "${swarmup}" "${bwarmup}" "${tracker}")"
  local run_dir="${run_dir_arg:-${OUTPUT_ROOT}/${name}}"

  local args=(
    "${REPO_ROOT}/${script}"
    --dataset_root "${DATASET_ROOT}" --output_dir "${run_dir}"
    --source_blocks "${source_blocks}" --pairs "${pairs}" --precision "${precision}"
    --fusion_lr "${fusion_lr}" --blocks_lr "${blocks_lr}" --max_steps "${max_steps}"
    --scheduler_warmup_steps "${swarmup}" --block_warmup_steps "${bwarmup}"
    --batch_size "${batch_size}" --grad_accum "${grad_accum}"
    --ckpt_every "${ckpt_every}" --keep_last "${keep_last}" --log_every "${log_every}"
    --seed "${seed}" --num_workers "${num_workers}" --tracker "${tracker}"
  )
  [[ -n "${TEACHER:-}" ]] && args+=(--teacher "${TEACHER}")
  [[ -n "${ACTION_CKPT:-}" ]] && args+=(--action_ckpt "${ACTION_CKPT}")
  [[ -n "${SWANLAB_PROJECT:-}" ]] && args+=(--swanlab_project "${SWANLAB_PROJECT}")
  [[ -n "${SWANLAB_MODE:-}" ]] && args+=(--swanlab_mode "${SWANLAB_MODE}")
  [[ -n "${STOP_AT_STEP:-}" ]] && args+=(--stop_at_step "${STOP_AT_STEP}")
  [[ -n "${resume_arg}" ]] && args+=(--resume "${resume_arg}")
  args+=("${EXTRA_ARGS[@]}")

  echo "[launch] ${variant}: ${name}"
  run_torchrun "${run_dir}" "${args[@]}"
}
