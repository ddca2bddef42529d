"""The Predictor dataset builder: plan, Teacher rollouts, shards, manifest, resume (layout and CLI: docs/dataset.md).

``tools/build_predictor_dataset.py`` is the command line around this module: it parses the flags into an
``argparse.Namespace`` with the fields of ``BuildOptions`` and calls ``run``. Everything else lives here:

* ``read_plan`` (data/build_plan.py): read and validate every input (sample tables, pose files, encoder outputs)
  before any work;
* ``build_case_tensors`` / ``build_trajectory``: the text prefill of a case and the F-F-F-F rollout of one
  sample-table row (``predictor_training.rollout.ar_rollout``), as the tensors stored in the shards;
* ``dataset_config``, ``write_or_check_config``: what determines the stored tensors, and the resume guard;
* ``known_entries``, ``finished_entry``, ``merge_manifest``: the manifest parts, what a resume skips, the merge;
* ``estimate_trajectory_bytes``, ``estimate_case_bytes``, ``dry_run``: the size estimate;
* ``build``: the distributed build itself (cases on rank 0, trajectory i on rank i % world_size).

Every manifest entry carries a CRC-32 per tensor (``tensor_crc32``, ``data.shards``) that the readers check when
they load a tensor. A resume over entries written before that field existed adds it (read from the verified file).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs, record_rollout
from predictor_training.rollout.recorder import TrajectoryRecorder
from predictor_training.rollout.camera import pose_to_input
from predictor_training.data.build_plan import BuildPlan, DatasetInputError, TrajectoryJob, read_plan
from predictor_training.data.dataset_config import DATASET_CONFIG_NAME
from predictor_training.data.encoders import load_encoded_case
from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    ShardVerificationError,
    TensorChecksums,
    append_jsonl,
    file_tensor_crc32,
    load_tensors,
    make_manifest_entry,
    read_jsonl,
    verify_file,
    write_bytes_atomic,
    write_jsonl_atomic,
    write_safetensors_atomic,
)
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.flags import report_check_only
from predictor_training.runtime.io import (
    CreatedPaths,
    canonical_json,
    check_output_folder_kind,
    read_json_file,
    sha256_json,
)
from predictor_training.runtime.distributed import barrier, cleanup_distributed, init_distributed
from predictor_training.runtime.precision import autocast
from predictor_training.rollout.scheduler import flow_match_sigmas, sigmas_to_timesteps
from predictor_training.teacher import TextKV, WorldPlayTransformer
from predictor_training.teacher.config import DISTILLED_STEPS
from predictor_training.teacher.source import TeacherSource, load_teacher

BUILDER_VERSION = "1"
MANIFEST_FILE = "manifest.jsonl"
PARTS_DIR = "manifest_parts"
# Every top-level name a build writes into --out: it refuses a folder that holds anything else.
DATASET_LAYOUT = frozenset({DATASET_CONFIG_NAME, MANIFEST_FILE, PARTS_DIR, "cases", "trajectories"})
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# =============================================================================================================
# 1. Options
# =============================================================================================================
@dataclass
class BuildOptions:
    """What ``run`` builds from, named as the command line's flags (flags and defaults: docs/dataset.md;
    ``tools/build_predictor_dataset.py`` makes it with ``flags.settings_from_flags``).

    teacher: Teacher folder (config.json + safetensors); action_ckpt: optional action checkpoint on top of it;
    samples: sample tables (a row's split is its table's file stem); encoded: folder of encoder outputs
    ``{case_id}.pt`` (None only for a dry run); out: dataset root to create or resume; num_latents: latents per
    trajectory; prefeature_layers: stored context pre-feature blocks (None = ``default_prefeature_layers``);
    dtype / storage_dtype: names in ``DTYPES``; device: "auto", "cuda" or "cpu"; dry_run with assume_grid (H, W) and
    assume_text_tokens: print the size estimate only; stop_after: debug, stop each rank after that many trajectories;
    check_only: check the inputs and an existing --out, build nothing (`check_build`).
    """

    teacher: Path
    samples: list
    encoded: Path | None
    out: Path
    action_ckpt: Path | None = None
    num_latents: int = 32
    prefeature_layers: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    storage_dtype: str = "bfloat16"
    device: str = "auto"
    dry_run: bool = False
    assume_grid: tuple[int, int] | None = None
    assume_text_tokens: int | None = None
    stop_after: int | None = None
    check_only: bool = False


def default_prefeature_layers(depth: int) -> tuple[int, ...]:
    """Inputs of the source blocks of both Predictor variants: (1, depth-2) and (0, depth-1) -> {0, 1, 52, 53} for
    the 54-block Teacher; for tiny Teachers the same rule, clipped to valid blocks (depth 3 -> 0, 1, 2)."""
    return tuple(sorted({layer for layer in (0, 1, depth - 2, depth - 1) if 0 <= layer < depth}))


# =============================================================================================================
# 2. Teacher, encoder outputs, case tensors
# =============================================================================================================
@torch.no_grad()
def build_case_tensors(teacher, encoded: dict, device, dtype: torch.dtype, storage_dtype: torch.dtype) -> dict:
    """Text prefill -> text_k, text_v [depth, heads, L_txt, d] and image_cond [1, C, 1, H, W] (storage dtype)."""
    float_inputs = {name: encoded[name].to(device=device, dtype=dtype)
                    for name in ("prompt_embeds", "byt5_text_states", "vision_states")}
    with autocast(device, dtype):
        text_kv = teacher.text_prefill(
            float_inputs["prompt_embeds"], encoded["prompt_mask"].to(device),
            float_inputs["byt5_text_states"], encoded["byt5_text_mask"].to(device),
            float_inputs["vision_states"], mask_type="i2v",
        )
    return {
        "image_cond": encoded["image_cond"].to(storage_dtype),
        "text_k": torch.cat(text_kv.k, dim=0).to("cpu", storage_dtype),
        "text_v": torch.cat(text_kv.v, dim=0).to("cpu", storage_dtype),
    }


# =============================================================================================================
# 3. One trajectory
# =============================================================================================================
def rollout_config(prefeature_layers, dtype: torch.dtype) -> RolloutConfig:
    """The builder's loop settings: the distilled 4-step schedule; bf16 = the real pipeline's casts (section "F.4
    Precision of the real pipeline" of predictor_training/conformance/golden/README.md)."""
    return RolloutConfig(
        state_dtype=dtype,
        autocast_dtype=None if dtype == torch.float32 else dtype,
        prefeature_layers=tuple(prefeature_layers),
    )


def rollout_inputs_for_job(job: TrajectoryJob, image_cond: torch.Tensor, num_latents: int, device, state_dtype):
    """Noise, memory points and camera inputs of a trajectory, all derived from the sample-table row (its seed:
    `RolloutInputs.from_seed`, the same as the trainer and the eval)."""
    viewmats, Ks, action = pose_to_input(job.pose_path, num_latents)
    return RolloutInputs.from_seed(job.seed, image_cond, viewmats, Ks, action, state_dtype=state_dtype, device=device)


def trajectory_tensors(recorder: TrajectoryRecorder, inputs: RolloutInputs, rollout: ARRollout, seed: int) -> dict:
    """The stored tensors of one trajectory (names and shapes: docs/dataset.md); the batch axis is dropped."""
    tensors = {
        "viewmats": inputs.viewmats.to(torch.float32),
        "Ks": inputs.Ks.to(torch.float32),
        "action": inputs.action.to(torch.int64),
        "timesteps": rollout.timesteps.to(torch.float32),
        "sigmas": rollout.sigmas.to(torch.float32),
        "seed": torch.tensor([seed], dtype=torch.int64),
    }
    for chunk in recorder.chunks:
        prefix = f"chunk{chunk.chunk_index}"
        if chunk.ctx_indices:
            tensors[f"{prefix}.ctx_indices"] = torch.tensor(chunk.ctx_indices, dtype=torch.int64)
            for layer, feature in chunk.prefeatures.items():
                tensors[f"{prefix}.ctx_prefeature.layer{layer}"] = feature[0]
        for step_index, step in enumerate(chunk.steps):
            tensors[f"{prefix}.step{step_index}.latent_in"] = step.latent_in[0]
            tensors[f"{prefix}.step{step_index}.final_hidden"] = step.final_hidden[0]
            tensors[f"{prefix}.step{step_index}.velocity"] = step.velocity[0]
        tensors[f"{prefix}.final_latent"] = chunk.final_latent[0]
    return tensors


def build_trajectory(teacher, job: TrajectoryJob, case_tensors: dict, *, num_latents: int,
                     prefeature_layers: Sequence[int], device, dtype, storage_dtype) -> dict:
    """Run the F-F-F-F rollout of one sample-table row (`num_latents` latents, the pre-features of
    `prefeature_layers` recorded) and return its tensors (storage dtype)."""
    text_kv = TextKV.from_layer_stack(case_tensors["text_k"], case_tensors["text_v"], device, dtype)
    image_cond = case_tensors["image_cond"].to(device=device, dtype=dtype)
    inputs = rollout_inputs_for_job(job, image_cond, num_latents, device, dtype)
    config = rollout_config(prefeature_layers, dtype)
    rollout, recorder = record_rollout(teacher, text_kv, inputs, config, device, record_dtype=storage_dtype)
    return trajectory_tensors(recorder, inputs, rollout, job.seed)


# =============================================================================================================
# 4. Dataset config, manifest parts, resume
# =============================================================================================================
def dataset_config(options: BuildOptions, plan: BuildPlan, teacher_config: dict, grid: tuple[int, int, int]) -> dict:
    """Everything that determines the stored tensors (no timestamps, so a rebuild writes the same bytes)."""
    rollout = rollout_config(options.prefeature_layers, DTYPES[options.dtype])
    sigmas = flow_match_sigmas(rollout.num_steps, rollout.shift)
    teacher_files = sorted(
        {"name": path.name, "bytes": path.stat().st_size} for path in Path(options.teacher).glob("*.safetensors*")
    ) if Path(options.teacher).is_dir() else []
    return {
        "builder_version": BUILDER_VERSION,
        "teacher": {
            "folder": str(Path(options.teacher).resolve()),
            "config_sha256": sha256_json(teacher_config),
            "weight_files": sorted(teacher_files, key=lambda item: item["name"]),
            "action_ckpt": None if options.action_ckpt is None else str(Path(options.action_ckpt).resolve()),
            "depth": teacher_config["mm_double_blocks_depth"],
            "hidden": teacher_config["hidden_size"],
            "heads": teacher_config["heads_num"],
        },
        "sample_tables": [str(path) for path in plan.tables],
        "splits": sorted({job.split for job in plan.trajectories}),
        "num_cases": len(plan.cases),
        "num_trajectories": len(plan.trajectories),
        "grid": {"C": grid[0], "H": grid[1], "W": grid[2]},
        "num_latents": options.num_latents,
        "chunk_latents": rollout.chunk_latents,
        "num_chunks": options.num_latents // rollout.chunk_latents,
        "num_steps": rollout.num_steps,
        "shift": rollout.shift,
        "timesteps": sigmas_to_timesteps(sigmas).tolist(),
        "sigmas": sigmas.tolist(),
        "context_timestep": rollout.context_timestep,
        "memory": {"memory_frames": rollout.memory_frames, "temporal_context_size": rollout.temporal_context_size,
                   "pred_latent_size": rollout.chunk_latents, "points_seed": "row seed",
                   "num_points": 50000},
        "noise": "make_initial_noise(row seed): CPU torch.Generator, float32 randn, cast to the compute dtype",
        "prefeature_layers": list(options.prefeature_layers),
        "compute_dtype": options.dtype,
        "storage_dtype": options.storage_dtype,
    }


def write_or_check_config(root: Path, config: dict) -> None:
    """Write ``dataset_config.json``, or check that an existing one (resume) describes the same build."""
    if not check_existing_config(root, config):
        write_bytes_atomic(root / DATASET_CONFIG_NAME,
                           (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def check_existing_config(root: Path, config: dict) -> bool:
    """Whether ``root`` holds a ``dataset_config.json`` (a build to resume); one of other settings is refused."""
    path = root / DATASET_CONFIG_NAME
    if not path.is_file():
        return False
    existing = read_json_file(path, DatasetInputError)
    differing = sorted(key for key in set(existing) | set(config) if existing.get(key) != config.get(key))
    if differing:
        details = "; ".join(f"{key}: existing {existing.get(key)!r}, requested {config.get(key)!r}"
                            for key in differing[:4])
        raise DatasetInputError(
            f"{path}: the dataset in --out was built with other settings ({details}); use a new --out"
        )
    return True


@contextlib.contextmanager
def taken_back_on_refusal(root: Path, env) -> Iterator[None]:
    """A refusal (`UserInputError`) met by a one-process build before it finished any file leaves --out as it was:
    what the build created there (its config, empty folders) is removed. A file finished by then is kept with its
    record, for a rerun to resume from."""
    created = CreatedPaths(root).snapshot()
    try:
        yield
    except UserInputError:
        parts = sorted((Path(root) / PARTS_DIR).glob("*.jsonl")) if (Path(root) / PARTS_DIR).is_dir() else []
        if env.world_size == 1 and not any(part.stat().st_size for part in parts):
            created.remove()
        raise


def known_entries(root: Path) -> dict[str, list[dict]]:
    """All manifest entries from ``manifest.jsonl`` and the part files, grouped by file (in reading order)."""
    entries: dict[str, list[dict]] = {}
    sources = [root / MANIFEST_FILE] if (root / MANIFEST_FILE).is_file() else []
    sources += sorted((root / PARTS_DIR).glob("*.jsonl")) if (root / PARTS_DIR).is_dir() else []
    for source in sources:
        torn_ok = source.parent.name == PARTS_DIR  # a killed append can leave a torn last line in a part file
        for entry in read_jsonl(source, allow_torn_tail=torn_ok):
            entries.setdefault(entry["file"], []).append(entry)
    return entries


def drop_torn_tail(part_file: Path) -> None:
    """Rewrite this rank's part file without a torn last line (left by a kill), so new appends stay parseable."""
    if part_file.is_file() and not part_file.read_bytes().endswith(b"\n") and part_file.stat().st_size:
        write_jsonl_atomic(part_file, read_jsonl(part_file, allow_torn_tail=True))


def finished_entry(root: Path, file: str, candidates: list[dict]) -> tuple[dict | None, str]:
    """The known entry that the file on disk matches, or (None, reason) when the file must be (re)built."""
    if not (root / file).is_file():
        return None, "missing"
    reasons = []
    for entry in reversed(candidates):  # the newest entry first
        try:
            verify_file(entry, root)
            return entry, "verified"
        except ShardVerificationError as error:
            reasons.append(str(error))
    return None, reasons[0] if reasons else "no manifest entry"


def write_merged_manifest(root: Path, merged: list[dict]) -> None:
    """Write `manifest.jsonl` (atomically), then remove the ranks' part files, whose entries it now holds. The
    completion marker of a build: a manifest without `manifest_parts/` beside it."""
    write_jsonl_atomic(root / MANIFEST_FILE, merged)
    if (root / PARTS_DIR).is_dir():
        for part in sorted((root / PARTS_DIR).glob("*.jsonl")):
            part.unlink()
        (root / PARTS_DIR).rmdir()


def merge_manifest_entries(root: Path, files: Sequence[str], accepts=None) -> list[dict]:
    """Rank 0, after every rank finished: one verified entry per planned file, sorted by file name (so the manifest
    does not depend on the world size). `accepts(entry)` drops entries made from other inputs. Raises naming the
    file when one has no matching entry."""
    entries = known_entries(root)
    merged = []
    for file in sorted(files):
        candidates = [entry for entry in entries.get(file, []) if accepts is None or accepts(entry)]
        distinct = {canonical_json(entry): entry for entry in candidates}
        if not distinct:
            raise RuntimeError(f"{root / file}: no manifest entry after the build (it was not finished)")
        if len(distinct) == 1:
            entry = next(iter(distinct.values()))
            verify_file(entry, root, check_sha256=False)  # size + tensor list; the sha was checked when written
        else:
            entry, reason = finished_entry(root, file, list(distinct.values()))
            if entry is None:
                raise ShardVerificationError(f"{root / file}: matches none of its manifest entries: {reason}")
        merged.append(entry)
    return merged


def merge_manifest(root: Path, plan: BuildPlan) -> list[dict]:
    """The Teacher-trajectory dataset's manifest: every case and trajectory file of the plan."""
    return merge_manifest_entries(root, [job.file for job in plan.cases] + [job.file for job in plan.trajectories])


# =============================================================================================================
# 5. Size estimate (dry run)
# =============================================================================================================
def context_sizes(num_latents: int, chunk_latents: int, memory_frames: int) -> list[int]:
    """Context frames per chunk: all previous latents up to ``memory_frames``, then ``memory_frames``."""
    return [min(chunk * chunk_latents, memory_frames) for chunk in range(num_latents // chunk_latents)]


def estimate_trajectory_bytes(channels, height, width, hidden, num_latents, prefeature_layers, storage_bytes=2,
                              chunk_latents=4, num_steps=DISTILLED_STEPS, memory_frames=20) -> int:
    """Tensor bytes of one trajectory file (plus about 120 header bytes per tensor)."""
    tokens_per_frame = height * width
    latent = channels * chunk_latents * tokens_per_frame * storage_bytes
    hidden_states = chunk_latents * tokens_per_frame * hidden * storage_bytes
    total = num_latents * (16 + 9) * 4 + num_latents * 8 + num_steps * 4 + (num_steps + 1) * 4 + 8
    tensors = 6
    for n_ctx in context_sizes(num_latents, chunk_latents, memory_frames):
        total += num_steps * (2 * latent + hidden_states) + latent
        tensors += 3 * num_steps + 1
        if n_ctx:
            total += n_ctx * 8 + len(prefeature_layers) * n_ctx * tokens_per_frame * hidden * storage_bytes
            tensors += 1 + len(prefeature_layers)
    return total + 120 * tensors


def estimate_case_bytes(channels, height, width, depth, hidden, text_tokens, storage_bytes=2) -> int:
    return 2 * depth * text_tokens * hidden * storage_bytes + channels * height * width * storage_bytes + 400


def dry_run(options: BuildOptions, plan: BuildPlan, teacher_config: dict) -> None:
    """Print the trajectory count and the estimated dataset size (GiB) for the configured Teacher and grid."""
    channels, depth, hidden = (teacher_config[key] for key in ("in_channels", "mm_double_blocks_depth",
                                                                  "hidden_size"))
    storage_bytes = torch.tensor([], dtype=DTYPES[options.storage_dtype]).element_size()
    grid = plan.grid if plan.grid is not None else options.assume_grid
    missing = [job.case_id for job in plan.cases if job.text_tokens is None]
    if grid is None or (missing and options.assume_text_tokens is None):
        raise DatasetInputError(
            f"--dry_run: no encoder output for {len(missing)} case(s) (e.g. {missing[:1]}); give --assume_grid HxW "
            "and --assume_text_tokens N to estimate without them"
        )
    height, width = grid
    text_tokens = [job.text_tokens if job.text_tokens is not None else options.assume_text_tokens
                   for job in plan.cases]
    per_trajectory = estimate_trajectory_bytes(channels, height, width, hidden, options.num_latents,
                                               options.prefeature_layers, storage_bytes)
    case_bytes = sum(estimate_case_bytes(channels, height, width, depth, hidden, tokens, storage_bytes)
                     for tokens in text_tokens)
    total = per_trajectory * len(plan.trajectories) + case_bytes
    gib = 1024 ** 3
    print(f"dry run: {len(plan.trajectories)} trajectories, {len(plan.cases)} cases; grid C={channels} H={height} "
          f"W={width}, {options.num_latents} latents, depth {depth}, hidden {hidden}, prefeature layers "
          f"{list(options.prefeature_layers)}, storage {options.storage_dtype}")
    print(f"dry run: per trajectory {per_trajectory / gib:.3f} GiB ({per_trajectory} bytes); cases "
          f"{case_bytes / gib:.3f} GiB ({case_bytes} bytes); total {total / gib:.2f} GiB ({total} bytes)")


def read_teacher_config(teacher_dir: Path) -> dict:
    """The Teacher's full constructor arguments from ``config.json`` (no weights loaded)."""
    path = Path(teacher_dir) / "config.json"
    if not path.is_file():
        raise DatasetInputError(f"--teacher {teacher_dir}: no config.json")
    try:
        return WorldPlayTransformer.constructor_arguments(read_json_file(path, DatasetInputError), source=str(path))
    except ValueError as error:
        raise DatasetInputError(str(error)) from error


# =============================================================================================================
# 6. Run and build
# =============================================================================================================
def run(options: BuildOptions) -> int:
    """Plan, then either print the dry-run estimate or build (``torchrun``-aware); returns the exit status.

    ``options.prefeature_layers`` None is replaced by ``default_prefeature_layers`` of the Teacher's depth (in
    ``options``, which the caller then reads).
    """
    check_output_folder_kind(options.out, flag="--out", marker=DATASET_CONFIG_NAME, layout=DATASET_LAYOUT)
    teacher_config = read_teacher_config(options.teacher)
    depth = teacher_config["mm_double_blocks_depth"]
    if options.prefeature_layers is None:
        options.prefeature_layers = default_prefeature_layers(depth)
    bad_layers = [layer for layer in options.prefeature_layers if not 0 <= layer < depth]
    if bad_layers:
        raise DatasetInputError(f"--prefeature_layers {bad_layers}: the Teacher has double blocks 0..{depth - 1}")
    plan = read_plan(options.samples, options.encoded, options.num_latents, teacher_config,
                     read_encoded=not options.dry_run)
    if options.dry_run:
        dry_run(options, plan, teacher_config)
        return 0
    if options.check_only:
        return check_build(options, plan, teacher_config)

    env = init_distributed({"auto": "auto", "cpu": "gloo", "cuda": "nccl"}[options.device])
    try:
        with taken_back_on_refusal(options.out, env):
            return build(options, plan, teacher_config, env)
    finally:
        cleanup_distributed()


def check_build(options: BuildOptions, plan: BuildPlan, teacher_config: dict) -> int:
    """--check_only after the plan (the tables, every encoder output, the Teacher's config): the action checkpoint
    is a file, --out is a folder or absent, and a dataset there was built with the same settings; prints what a
    build would do. Reads no weights and writes nothing."""
    if options.action_ckpt is not None and not Path(options.action_ckpt).is_file():
        raise DatasetInputError(f"--action_ckpt {options.action_ckpt}: no such file; expected the action "
                                "checkpoint (.safetensors)")
    root = Path(options.out)
    if root.exists() and not root.is_dir():
        raise DatasetInputError(f"--out {root}: a file; expected a dataset folder to create or resume")
    grid = (teacher_config["in_channels"], *plan.grid)
    resuming = check_existing_config(root, dataset_config(options, plan, teacher_config, grid))
    done = sum(1 for entries in known_entries(root).values() if entries) if resuming else 0
    return report_check_only(
        f"{len(plan.cases)} cases, {len(plan.trajectories)} trajectories of splits "
        f"{sorted({job.split for job in plan.trajectories})}, grid {grid}, {options.num_latents} latents",
        f"dataset {root} ({f'resume: {done} files recorded' if resuming else 'new'})")


def add_missing_checksums(root: Path, entry: dict, part_file: Path) -> None:
    """A skipped file whose (verified) entry predates per-tensor checksums: append the entry with them added."""
    if TENSOR_CHECKSUM_FIELD not in entry:
        append_jsonl(part_file, {**entry, TENSOR_CHECKSUM_FIELD: file_tensor_crc32(root / entry["file"])})


def case_checksums(root: Path) -> TensorChecksums:
    """Per-tensor checksums of the case files from the newest manifest entry of each (read after the case build)."""
    expected = {}
    for file, entries in known_entries(root).items():
        if file.startswith("cases/") and TENSOR_CHECKSUM_FIELD in entries[-1]:
            expected[root / file] = entries[-1][TENSOR_CHECKSUM_FIELD]
    return TensorChecksums(expected)


def build(options: BuildOptions, plan: BuildPlan, teacher_config: dict, env) -> int:
    """Build (or resume) the dataset in ``options.out`` on this rank of ``env`` (``distributed.init_distributed``)."""
    root = options.out
    device, dtype, storage_dtype = env.device, DTYPES[options.dtype], DTYPES[options.storage_dtype]
    part_file = root / PARTS_DIR / f"rank{env.rank}.jsonl"
    log = (lambda message: print(f"[build_predictor_dataset] {message}", flush=True)) if env.is_main else (
        lambda message: None)

    # 1. Teacher, grid (from the first case's encoder output), dataset config.
    started = time.time()
    teacher = load_teacher(TeacherSource(Path(options.teacher), options.action_ckpt, "--teacher", None), device, dtype)
    grid = (teacher.config.in_channels, *plan.grid)
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        write_or_check_config(root, dataset_config(options, plan, teacher_config, grid))
    log(f"{len(plan.cases)} cases, {len(plan.trajectories)} trajectories, world size {env.world_size}, "
        f"device {device}, compute {options.dtype}, storage {options.storage_dtype}, grid {grid}, "
        f"prefeature layers {list(options.prefeature_layers)}")
    barrier()
    entries = known_entries(root)
    barrier()  # nobody appends to a part file before every rank has read them
    drop_torn_tail(part_file)

    # 2. Case files (rank 0), then every rank reads them.
    counts = {"cases_built": 0, "cases_skipped": 0, "built": 0, "skipped": 0}
    if env.is_main:
        for job in tqdm(plan.cases, desc="cases", disable=not env.is_main):
            entry, reason = finished_entry(root, job.file, entries.get(job.file, []))
            if entry is not None:
                counts["cases_skipped"] += 1
                add_missing_checksums(root, entry, part_file)
                continue
            encoded = load_encoded_case(job.encoded_path, teacher_config, plan.grid)
            facts = write_safetensors_atomic(root / job.file, build_case_tensors(
                teacher, encoded, device, dtype, storage_dtype))
            append_jsonl(part_file, make_manifest_entry("case", job.file, facts, job.case_id, None, job.split))
            counts["cases_built"] += 1
    barrier()
    cases = case_checksums(root)  # every case tensor a trajectory reads is checked against its manifest CRC-32

    # 3. Trajectories of this rank.
    mine = [job for job in plan.trajectories if job.index % env.world_size == env.rank]
    for job in tqdm(mine, desc=f"trajectories (rank 0 of {env.world_size})", disable=not env.is_main):
        entry, reason = finished_entry(root, job.file, entries.get(job.file, []))
        if entry is not None:
            counts["skipped"] += 1
            add_missing_checksums(root, entry, part_file)
            continue
        if reason != "missing":
            print(f"[rank {env.rank}] rebuilding {job.file}: {reason}", flush=True)
        case_tensors = load_tensors(root / f"cases/{job.case_id}.safetensors", checksums=cases)
        tensors = build_trajectory(teacher, job, case_tensors, num_latents=options.num_latents,
                                   prefeature_layers=options.prefeature_layers, device=device, dtype=dtype,
                                   storage_dtype=storage_dtype)
        facts = write_safetensors_atomic(root / job.file, tensors)
        append_jsonl(part_file, make_manifest_entry("trajectory", job.file, facts, job.case_id, job.action_id,
                                                    job.split))
        counts["built"] += 1
        if options.stop_after is not None and counts["built"] >= options.stop_after:
            break
    print(f"[rank {env.rank}] trajectories built {counts['built']}, skipped {counts['skipped']}; "
          f"cases built {counts['cases_built']}, skipped {counts['cases_skipped']}", flush=True)
    if options.stop_after is not None:
        print(f"[rank {env.rank}] --stop_after {options.stop_after}: stopping without a manifest (rerun to resume)",
              flush=True)
        return 0

    # 4. Manifest (rank 0, after every rank finished).
    barrier()
    if env.is_main:
        merged = merge_manifest(root, plan)
        write_merged_manifest(root, merged)
        log(f"manifest: {len(merged)} files; done in {time.time() - started:.1f} s")
    barrier()
    return 0
