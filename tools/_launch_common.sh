# Shared helpers for the tools/launch_*.sh launchers (sourced, not executed).
#
# A launcher passes to its Python script only what the user set: positional arguments, the environment variables
# below, and every extra flag, unchanged and last (so a flag always wins). All defaults, all validation and the
# run name live in the Python script (docs/launchers.md § Run names); the launcher asks it for the run directory first
# (`--print_run_dir`), so torchrun's console log lands in that directory.
#
# `--check_only` among the flags: nothing is started or made. The launcher runs its script once, as `python` with the
# world size it would have, with the same flags (the script checks every flag and input, prints the run name and
# directory and exits); the CPU demo's missing data and earlier runs are named, not made (docs/troubleshooting.md).
#
# Environment (all optional):
#   NPROC_PER_NODE  processes per node (default: number of visible GPUs, 8 on a full node; 2 on a CPU-only machine)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   multi-node rendezvous (defaults: 1, 0, 127.0.0.1, 29500)
#   DEMO_ROOT       where demo assets and the demo dataset go (default: <repo>/demo_data)
#   PYTHON          python interpreter (default: python)
#   and one variable per flag, named as the flag in capitals (FUSION_LR -> --fusion_lr): see FLAG_VARIABLES.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
DEMO_ROOT="${DEMO_ROOT:-${REPO_ROOT}/demo_data}"

# CHECK_ONLY=1 when the launcher's own arguments (sourced without arguments, this file sees them) hold --check_only;
# DEMO_PENDING=1 once a check-only launch meets demo data or an earlier demo run that a launch would make first.
CHECK_ONLY=0
DEMO_PENDING=0
for argument in "$@"; do
  [[ "${argument}" == "--check_only" ]] && CHECK_ONLY=1
done

# Environment variables that become the flag of the same name in lower case, when set.
FLAG_VARIABLES=(
  DATASET_ROOT TEACHER ACTION_CKPT SOURCE_BLOCKS PAIRS PRECISION FUSION_LR BLOCKS_LR MAX_STEPS STOP_AT_STEP
  SCHEDULER_WARMUP_STEPS BLOCK_WARMUP_STEPS BATCH_SIZE GRAD_ACCUM VELOCITY_WEIGHT HIDDEN_WEIGHT CKPT_EVERY KEEP_LAST
  LOG_EVERY SEED NUM_WORKERS TRACKER SWANLAB_PROJECT SWANLAB_MODE EXPERIMENT OUTPUT_ROOT
  INIT_FROM SAMPLE_TABLE SUBSET_CASES SUBSET_SEED VAL_EVERY VAL_VIDEOS VAL_SPLIT
)

# The generic methods' launchers (launch_fvtools_*.sh) use this list instead: their scripts' flag names.
METHOD_FLAG_VARIABLES=(
  DATASET_ROOT CACHE_ROOT TEACHER ACTION_CKPT TRAIN INIT_WEIGHTS LORA_RANK LORA_ALPHA PRECISION LR MAX_STEPS
  STOP_AT_STEP WARMUP_STEPS GRAD_ACCUM CHUNKS_PER_CLIP CKPT_EVERY KEEP_LAST LOG_EVERY SEED NUM_WORKERS TRACKER
  SWANLAB_PROJECT SWANLAB_MODE EXPERIMENT OUTPUT_ROOT VAL_EVERY VAL_VIDEOS VAL_SPLIT
)

count_gpus() {
  "${PYTHON}" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
}

# require_integer NAME MIN [MAX]: the variable NAME holds a whole number in [MIN, MAX], else one line and exit 2
# (before anything is created: bash arithmetic would read "abc" as an unset variable and 0 would start no rank).
require_integer() {
  local name="$1" min="$2" max="${3:-}" value="${!1}"
  if [[ ! "${value}" =~ ^[0-9]+$ ]] || (( 10#${value} < min )) || { [[ -n "${max}" ]] && (( 10#${value} > max )); }; then
    echo "$(basename "$0"): error: ${name}=${value}: expected a whole number >= ${min}${max:+ and <= ${max}}" >&2
    exit 2
  fi
}

NUM_GPUS="$(count_gpus)"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  if (( NUM_GPUS > 0 )); then NPROC_PER_NODE="${NUM_GPUS}"; else NPROC_PER_NODE=2; fi
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
require_integer NPROC_PER_NODE 1
require_integer NNODES 1
require_integer NODE_RANK 0 $(( 10#${NNODES} - 1 ))
require_integer MASTER_PORT 1 65535
WORLD_SIZE_TOTAL=$(( 10#${NPROC_PER_NODE} * 10#${NNODES} ))

# is_demo: no GPU and no DATASET_ROOT -> the launchers run the CPU demo (their script's `--preset demo`).
is_demo() {
  [[ -z "${DATASET_ROOT:-}" ]] && (( NUM_GPUS == 0 ))
}

# On a GPU node a launch without DATASET_ROOT (CACHE_ROOT for kd) is a real run, not the demo: say how to get the
# demo there, in case that is what was meant (docs/troubleshooting.md).
if (( NUM_GPUS > 0 )) && [[ -z "${DATASET_ROOT:-}${CACHE_ROOT:-}" ]]; then
  echo "[launch] ${NUM_GPUS} GPU(s) visible and no DATASET_ROOT: a real run, not the CPU demo" \
    "(the demo runs with no GPU visible: CUDA_VISIBLE_DEVICES= bash $0)" >&2
fi

# flags_from_environment: FLAGS_FROM_ENV=(--fusion_lr 5e-4 ...) for every variable of FLAG_VARIABLES that is set.
flags_from_environment() {
  FLAGS_FROM_ENV=()
  local name
  for name in "${FLAG_VARIABLES[@]}"; do
    if [[ -n "${!name:-}" ]]; then FLAGS_FROM_ENV+=("--${name,,}" "${!name}"); fi
  done
}

# split_positional "SLOT ..." ARGS...: the launcher's positional slots (RUN_DIR, SOURCE_BLOCKS, RESUME, in its own
# order), then the command line. The first up-to-as-many arguments that do not start with '-' go to POSITIONAL
# (empty strings count, so `"" 0,53` skips the first one); everything after them goes to EXTRA_ARGS. A value that
# cannot be what its slot means is refused with one line naming the slot, before anything runs: a blocks spec such
# as 1,52 in a path slot, a file as RUN_DIR, a RESUME that is not a file, SOURCE_BLOCKS that are not two indices.
split_positional() {
  local -a slots
  read -r -a slots <<< "$1"; shift
  POSITIONAL=()
  while (( $# > 0 && ${#POSITIONAL[@]} < ${#slots[@]} )) && [[ "$1" != -* ]]; do
    check_positional "${slots[${#POSITIONAL[@]}]}" "$(( ${#POSITIONAL[@]} + 1 ))" "$1" "${slots[*]}"
    POSITIONAL+=("$1"); shift
  done
  EXTRA_ARGS=("$@")
}

# check_positional SLOT INDEX VALUE "SLOTS": one line and exit 2 when VALUE cannot fill SLOT (an empty one is skipped).
check_positional() {
  local slot="$1" index="$2" value="$3" synopsis="[${4// /] [}]" problem=""
  [[ -z "${value}" ]] && return 0
  local blocks_spec='^[[:space:]]*[0-9]+[[:space:]]*,[[:space:]]*[0-9]+[[:space:]]*$'
  case "${slot}" in
    RUN_DIR)
      if [[ "${value}" =~ ${blocks_spec} ]]; then
        problem="looks like a source-blocks spec; expected the run's folder"
      elif [[ -f "${value}" || "${value}" == *.pt || "${value}" == *.safetensors ]]; then
        problem="is a file; expected the run's folder (a training state to resume goes in the RESUME slot)"
      fi ;;
    SOURCE_BLOCKS)
      [[ "${value}" =~ ${blocks_spec} ]] || problem="expected two Teacher block indices such as 1,52" ;;
    RESUME)
      if [[ "${value}" =~ ${blocks_spec} ]]; then
        problem="looks like a source-blocks spec; expected a training state file such as RUN_DIR/training_latest.pt"
        [[ " ${4} " == *" SOURCE_BLOCKS "* ]] || problem+=" (this launcher takes the blocks as SOURCE_BLOCKS=a,b or --source_blocks a,b)"
      elif [[ -d "${value}" ]]; then
        problem="is a folder; expected a training state file such as ${value%/}/training_latest.pt"
      elif [[ ! -f "${value}" ]]; then
        problem="no such file; expected a training state file such as RUN_DIR/training_latest.pt"
      fi ;;
    *)
      echo "$(basename "$0"): internal error: unknown positional slot ${slot}" >&2; exit 2 ;;
  esac
  if [[ -n "${problem}" ]]; then
    echo "$(basename "$0"): error: positional ${index} (${slot}) '${value}': ${problem}; positionals: ${synopsis}" >&2
    exit 2
  fi
}

# ensure_demo_assets / ensure_demo_dataset / ensure_demo_video_latents: make what the CPU demo needs when missing.
# The demo is the shipped demo world (tools/make_demo_assets.py --kind world: the trained world Teacher and VAE,
# rendered scenes with ground truth; docs/demo_world.md). Completion markers are what the tools write last:
# make_demo_assets.py moves its finished folder (with demo_config.json) into place in one rename; the dataset
# builders write manifest.jsonl after every rank finished and then remove manifest_parts/. A half-built dataset is
# resumed by rerunning the builder. Demo folders made by an older version (a random Teacher, or a world Teacher
# other than the shipped one, e.g. the flow-matching Teacher shipped before 2026-12-06) are refused, not replaced:
# move ${DEMO_ROOT} away or set DEMO_ROOT.
ensure_demo_assets() {
  local config="${DEMO_ROOT}/assets/demo_config.json"
  local shipped="${REPO_ROOT}/predictor_training/world/weights/teacher/diffusion_pytorch_model.safetensors"
  if [[ ! -f "${config}" ]] && (( CHECK_ONLY )); then
    first "make the demo-world assets in ${DEMO_ROOT}/assets (tools/make_demo_assets.py)"
  elif [[ ! -f "${config}" ]]; then
    echo "[launch] making the demo-world assets in ${DEMO_ROOT}/assets"
    "${PYTHON}" "${REPO_ROOT}/tools/make_demo_assets.py" --out "${DEMO_ROOT}/assets"
  elif ! grep -q '"kind": "world"' "${config}"; then
    echo "[launch] ${DEMO_ROOT}/assets holds the old random-Teacher demo (its demo_config.json has no \"kind\": \"world\")." >&2
    echo "[launch] The demo now runs on the demo world: move ${DEMO_ROOT} away (or set DEMO_ROOT=another/folder) and rerun." >&2
    exit 2
  elif ! grep -q '"teacher_source"' "${config}" \
      && ! cmp -s "${DEMO_ROOT}/assets/teacher/diffusion_pytorch_model.safetensors" "${shipped}"; then
    echo "[launch] ${DEMO_ROOT}/assets/teacher is not the shipped world Teacher (${shipped}); the demo assets (and the dataset and runs made from them) are of an older Teacher: move ${DEMO_ROOT} away (or set DEMO_ROOT=another/folder) and rerun" >&2
    exit 2
  fi
}

ensure_demo_dataset() {
  ensure_demo_assets
  if [[ ! -f "${DEMO_ROOT}/dataset/manifest.jsonl" || -d "${DEMO_ROOT}/dataset/manifest_parts" ]] \
      && (( CHECK_ONLY )); then
    first "build the demo dataset in ${DEMO_ROOT}/dataset (tools/build_predictor_dataset.py --demo)"
  elif [[ ! -f "${DEMO_ROOT}/dataset/manifest.jsonl" || -d "${DEMO_ROOT}/dataset/manifest_parts" ]]; then
    echo "[launch] building the demo dataset in ${DEMO_ROOT}/dataset"
    "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node 2 \
      "${REPO_ROOT}/tools/build_predictor_dataset.py" --demo "${DEMO_ROOT}/assets" --out "${DEMO_ROOT}/dataset"
  fi
}

# ensure_demo_video_latents: the demo assets, then the video-latent dataset of their world clips (the rendered
# ground truth of the train / holdout rows, encoded with the world VAE and the tiny encoders) in
# ${DEMO_ROOT}/video_latents.
ensure_demo_video_latents() {
  ensure_demo_assets
  local assets="${DEMO_ROOT}/assets"
  if [[ ! -f "${DEMO_ROOT}/video_latents/manifest.jsonl" || -d "${DEMO_ROOT}/video_latents/manifest_parts" ]] \
      && (( CHECK_ONLY )); then
    first "build the demo video-latent dataset in ${DEMO_ROOT}/video_latents (tools/build_video_latent_dataset.py)"
  elif [[ ! -f "${DEMO_ROOT}/video_latents/manifest.jsonl" || -d "${DEMO_ROOT}/video_latents/manifest_parts" ]]; then
    echo "[launch] building the demo video-latent dataset in ${DEMO_ROOT}/video_latents"
    local size
    read -r -a size < <("${PYTHON}" -c "import json,sys; c=json.load(open(sys.argv[1])); \
print(c['resolution']['height'], c['resolution']['width'], 4 * (c['num_latents'] - 1) + 1)" "${assets}/demo_config.json")
    "${PYTHON}" -m torch.distributed.run --standalone --nproc_per_node 2 \
      "${REPO_ROOT}/tools/build_video_latent_dataset.py" --clips "${assets}/clips/train.jsonl,${assets}/clips/holdout.jsonl" \
      --encoders "${assets}/encoders" --height "${size[0]}" --width "${size[1]}" --num_frames "${size[2]}" \
      --dtype float32 --storage_dtype float32 --out "${DEMO_ROOT}/video_latents"
  fi
}

# first WHAT: with --check_only, say that a launch would do WHAT first (make demo data, train an earlier demo run)
# instead of doing it; the script's own check then waits for those inputs (DEMO_PENDING).
first() {
  echo "[launch] check only: a launch would first $1"
  DEMO_PENDING=1
}

# plan_run SCRIPT ARGS...: RUN_DIR=the run directory the script computes from these flags for this world size.
# Returns 0 to start or continue, 3 when that run already finished, 2 (after the script's one-line error) when
# the flags are wrong or the directory holds a run with other settings. With --check_only and demo inputs still to
# be made (DEMO_PENDING) it cannot ask the script and returns 0 (to start) without a RUN_DIR.
plan_run() {
  if (( DEMO_PENDING )); then
    RUN_DIR=""
    return 0
  fi
  local script="$1"; shift
  local status=0
  RUN_DIR="$(WORLD_SIZE="${WORLD_SIZE_TOTAL}" "${PYTHON}" "${REPO_ROOT}/${script}" "$@" --print_run_dir)" || status=$?
  return "${status}"
}

# launch_recipe SCRIPT ARGS...: plan the run, then start it under torchrun in its directory. A finished run is
# reported and exits 0; an interrupted one is continued by the script itself.
launch_recipe() {
  local script="$1"; shift
  if (( CHECK_ONLY )); then
    if (( DEMO_PENDING )); then
      echo "[launch] check only: ${script} is checked once the inputs named above exist"
      RUN_DIR=""
      return 0
    fi
    echo "[launch] check only: ${script} on ${WORLD_SIZE_TOTAL} process(es) (${NNODES} node(s) x ${NPROC_PER_NODE})"
    local output status=0
    output="$(WORLD_SIZE="${WORLD_SIZE_TOTAL}" "${PYTHON}" "${REPO_ROOT}/${script}" "$@")" || status=$?
    [[ -n "${output}" ]] && printf '%s\n' "${output}"
    RUN_DIR="$(sed -n 's/^check only: run directory //p' <<< "${output}")"
    return "${status}"
  fi
  local status=0
  plan_run "${script}" "$@" || status=$?
  if (( status == 3 )); then return 0; fi
  if (( status != 0 )); then return "${status}"; fi
  run_torchrun "${RUN_DIR}" "${REPO_ROOT}/${script}" "$@" --output_dir "${RUN_DIR}"
}

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

# launch_offline_training SCRIPT [RUN_DIR] [SOURCE_BLOCKS] [RESUME] [flags...]: the body of
# launch_predictor_{v4,disca}_training.sh. With no GPU and no DATASET_ROOT it runs the CPU demo (`--preset demo`
# on the demo dataset, made first if missing).
launch_offline_training() {
  local script="$1"; shift
  split_positional "RUN_DIR SOURCE_BLOCKS RESUME" "$@"
  local args=()
  if is_demo; then
    echo "[launch] no GPU and no DATASET_ROOT: running the CPU demo (demo data in ${DEMO_ROOT})"
    ensure_demo_dataset
    args+=(--preset demo --dataset_root "${DEMO_ROOT}/dataset")
  fi
  flags_from_environment
  args+=("${FLAGS_FROM_ENV[@]}")
  [[ -n "${POSITIONAL[0]:-}" ]] && args+=(--output_dir "${POSITIONAL[0]}")
  [[ -n "${POSITIONAL[1]:-}" ]] && args+=(--source_blocks "${POSITIONAL[1]}")
  [[ -n "${POSITIONAL[2]:-}" ]] && args+=(--resume "${POSITIONAL[2]}")
  launch_recipe "${script}" "${args[@]}" "${EXTRA_ARGS[@]}"
}
