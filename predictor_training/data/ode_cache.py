"""The ODE-state cache of causal KD: a many-step teacher's AR rollouts, stored chunk by chunk (fvtools/train_kd.py).

Built by ``tools/build_ode_cache.py``; layout, commands and sizes: docs/ode_cache.md.

Each sample is one condition (first-frame latent, per-latent cameras and actions, text encoder outputs) and a seed.
The builder runs the teacher's AR loop (``ar_rollout.ARRollout``: memory selection, context prefill at timestep 14,
the chunk's Euler steps) with ``steps`` steps of the flow-matching schedule at ``shift``, from the seed's noise and
memory-retrieval points (``RolloutInputs.from_seed``). Of every chunk it keeps the running latents entering the
steps that lie on the ``store_grid``-step schedule of the same shift (``store_grid`` must divide ``steps``, so those
noise levels are exactly on the teacher's grid; ``store_grid = steps`` keeps every state) and the chunk's final
latents.

Conditions come from a video-latent dataset split (its clips' conditions; a clip's seed is
``stream_seed(seed, crc32(clip_id))``) or from sample tables with the encoder stage's outputs (each row's seed).

Layout of ``OUT/``::

    ode_cache_config.json          teacher (config sha256), steps, shift, store_grid, sigmas, dtypes, inputs
    samples/{sample_id}.safetensors
        states      [S, C, T, H, W]   states[k]: every chunk's latents entering its k-th stored step
        sigmas      [S]      f32      the noise level of states[k]
        final       [C, T, H, W]      every chunk's final latents (the teacher's video; later chunks' context)
        image_cond  [1, C, 1, H, W];  viewmats [T, 4, 4] f32;  Ks [T, 3, 3] f32;  action [T] int64;  seed [1] int64
        prompt_embeds, prompt_mask, byt5_text_states, byt5_text_mask, vision_states   (the encoder outputs)
    manifest.jsonl                 one entry per sample (bytes, sha256, per-tensor CRC-32, split, inputs)
    manifest_parts/rank{r}.jsonl   only while a build runs or after it was interrupted
    COMPLETE                       written last, after the merged manifest: the cache is finished

A reader that re-runs a chunk on this history (KD's student) must select its context with the sample's own memory
points, ``make_retrieval_points(seed)`` (``TeacherForcedClip(..., memory_seed=item["seed"])``), and the AR loop's
default memory settings: past ``memory_frames`` latents the memory ranking is a Monte-Carlo FOV overlap, and other
points can pick other context frames than the ones the stored states and final latents were made with.

Resume: rerun the same command; finished samples whose files match their entries are kept, the rest built. A folder
built with other settings is refused, naming the differing fields.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.data.builder import (
    MANIFEST_FILE,
    PARTS_DIR,
    drop_torn_tail,
    finished_entry,
    known_entries,
    merge_manifest_entries,
    write_merged_manifest,
)
from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    TensorChecksums,
    append_jsonl,
    check_listed_file,
    load_tensors,
    read_jsonl,
    verify_file,
    write_bytes_atomic,
    write_safetensors_atomic,
)
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import read_json_file, sha256_json
from predictor_training.runtime.distributed import barrier
from predictor_training.runtime.random_streams import stream_seed
from predictor_training.rollout.scheduler import flow_match_sigmas
from predictor_training.teacher.source import teacher_config_sha256
from predictor_training.rollout.teacher_forcing import TEXT_ENCODER_FIELDS, clip_text_kv

CACHE_CONFIG_NAME = "ode_cache_config.json"
COMPLETE_MARKER = "COMPLETE"
SAMPLES_DIR = "samples"
# Every top-level name a build writes into --out: it refuses a folder that holds anything else.
CACHE_LAYOUT = frozenset({CACHE_CONFIG_NAME, COMPLETE_MARKER, SAMPLES_DIR, MANIFEST_FILE, PARTS_DIR})
MANIFEST_KIND = "ode_sample"
CONDITION_TENSORS = ("image_cond", "viewmats", "Ks", "action", *TEXT_ENCODER_FIELDS)
SAMPLE_TENSORS = ("states", "sigmas", "final", "seed", *CONDITION_TENSORS)
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class OdeCacheError(UserInputError):
    """A cache folder that cannot be read or resumed as asked (names the file and field)."""


# ---------------------------------------------------------------------------------------------------------------
# 1. Stored noise levels
# ---------------------------------------------------------------------------------------------------------------
def stored_step_indices(steps: int, store_grid: int) -> list[int]:
    """The teacher steps whose input states are kept: every (steps / store_grid)-th one."""
    if steps < 1 or store_grid < 1 or steps % store_grid:
        raise ValueError(f"store_grid={store_grid} must be >= 1 and divide steps={steps}, so the stored noise levels "
                         "lie on the teacher's grid")
    return list(range(0, steps, steps // store_grid))


# ---------------------------------------------------------------------------------------------------------------
# 2. One sample
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheJob:
    """index: position in the plan (rank = index % world size); sample_id: file stem; split; seed; condition:
    how to load the condition (`load_condition`)."""

    index: int
    sample_id: str
    split: str
    seed: int
    condition: tuple

    @property
    def file(self) -> str:
        return f"{SAMPLES_DIR}/{self.sample_id}.safetensors"


class _StateRecorder:
    """Keeps, per chunk, the latents entering the stored steps and the final latents (an `ARRollout` recorder)."""

    def __init__(self, stored_steps: Sequence[int]):
        self.stored_steps = set(stored_steps)
        self.states: dict[tuple[int, int], torch.Tensor] = {}
        self.finals: dict[int, torch.Tensor] = {}

    def on_context(self, chunk_index, frame_start, context) -> None:
        pass

    def on_step(self, chunk_index: int, step_index: int, step) -> None:
        if step_index in self.stored_steps:
            self.states[(chunk_index, step_index)] = step.latent_in.detach().float().cpu()

    def on_chunk_end(self, chunk_index: int, final_latent: torch.Tensor) -> None:
        self.finals[chunk_index] = final_latent.detach().float().cpu()


@torch.no_grad()
def rollout_states(teacher, condition: Mapping, seed: int, *, steps: int, shift: float, store_grid: int,
                   device: torch.device, autocast_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Run the teacher's AR loop with `steps` steps at `shift` from the seed's noise; returns states
    [S, C, T, H, W], sigmas [S] and final [C, T, H, W] (float32, CPU)."""
    stored = stored_step_indices(steps, store_grid)
    config = RolloutConfig(num_steps=steps, shift=shift, state_dtype=torch.float32, autocast_dtype=autocast_dtype)
    text_kv = clip_text_kv(teacher, condition, device, autocast_dtype, grad=False)
    inputs = RolloutInputs.from_seed(seed, condition["image_cond"].float(), condition["viewmats"].double(),
                                     condition["Ks"].double(), condition["action"], device=device)
    recorder = _StateRecorder(stored)
    rollout = ARRollout(teacher, text_kv, inputs, config, recorder=recorder, device=device)
    rollout.run()
    chunks = range(rollout.num_chunks)
    states = torch.stack([torch.cat([recorder.states[(chunk, step)] for chunk in chunks], dim=2)[0]
                          for step in stored])
    final = torch.cat([recorder.finals[chunk] for chunk in chunks], dim=2)[0]
    return {"states": states, "sigmas": rollout.sigmas[stored].float().clone(), "final": final}


# ---------------------------------------------------------------------------------------------------------------
# 3. The build
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSettings:
    """What determines the stored tensors (with the teacher and the plan): written to ode_cache_config.json."""

    steps: int
    shift: float
    store_grid: int
    compute_dtype: str
    storage_dtype: str

    def __post_init__(self):
        stored_step_indices(self.steps, self.store_grid)
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype={self.storage_dtype!r}; expected one of {sorted(STORAGE_DTYPES)}")


def cache_config(settings: CacheSettings, teacher, plan: Sequence[CacheJob], inputs: Mapping) -> dict:
    sigmas = flow_match_sigmas(settings.steps, settings.shift)
    stored = stored_step_indices(settings.steps, settings.store_grid)
    return {
        "version": 1,
        "teacher": {"config_sha256": teacher_config_sha256(teacher), "num_layers": int(teacher.num_layers),
                    "in_channels": int(teacher.config.in_channels)},
        "steps": settings.steps, "shift": settings.shift, "store_grid": settings.store_grid,
        "stored_steps": stored, "stored_sigmas": [float(sigmas[index]) for index in stored],
        "compute_dtype": settings.compute_dtype, "storage_dtype": settings.storage_dtype,
        "inputs": dict(inputs),
        "samples": len(plan), "splits": {split: sum(job.split == split for job in plan)
                                         for split in sorted({job.split for job in plan})},
        "plan_sha256": sha256_json([[job.sample_id, job.split, job.seed] for job in plan]),
    }


def _check_or_write_config(root: Path, config: dict, is_main: bool) -> None:
    path = root / CACHE_CONFIG_NAME
    if path.is_file():
        existing = read_json_file(path, OdeCacheError)
        differing = sorted(key for key in existing.keys() | config.keys() if existing.get(key) != config.get(key))
        if differing:
            details = "; ".join(f"{key}: existing {existing.get(key)!r}, requested {config.get(key)!r}"
                                for key in differing)
            raise OdeCacheError(f"{path}: the cache in --out was built with other settings ({details}); use a new "
                                "--out, or rerun with the settings it was built with")
    elif is_main:
        root.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def build_cache(teacher, plan: Sequence[CacheJob], load_condition, settings: CacheSettings, out: str | Path, *,
                env, inputs: Mapping, stop_after: int | None = None) -> dict:
    """Build (or resume) the cache in `out`: sample i on rank i % world size; then rank 0 merges the manifest and
    writes COMPLETE. `load_condition(job)` returns the job's condition tensors (`CONDITION_TENSORS`). A collective.
    Returns {"built", "skipped"} of this rank."""
    root = Path(out)
    part_file = root / PARTS_DIR / f"rank{env.rank}.jsonl"
    storage_dtype = STORAGE_DTYPES[settings.storage_dtype]
    autocast_dtype = None if settings.compute_dtype == "float32" else STORAGE_DTYPES[settings.compute_dtype]
    started = time.time()
    config = cache_config(settings, teacher, plan, inputs)
    _check_or_write_config(root, config, env.is_main)
    barrier()
    if env.is_main and (root / COMPLETE_MARKER).is_file():
        (root / COMPLETE_MARKER).unlink()  # (re)building: not complete until the manifest is merged again
    entries = known_entries(root)
    barrier()
    drop_torn_tail(part_file)
    counts = {"built": 0, "skipped": 0}
    mine = [job for job in plan if job.index % env.world_size == env.rank]
    for job in tqdm(mine, desc=f"ode cache (rank 0 of {env.world_size})", disable=not env.is_main):
        entry, reason = finished_entry(root, job.file, entries.get(job.file, []))
        if entry is not None:
            counts["skipped"] += 1
            continue
        if reason != "missing":
            print(f"[rank {env.rank}] rebuilding {job.file}: {reason}", flush=True)
        condition = load_condition(job)
        tensors = rollout_states(teacher, condition, job.seed, steps=settings.steps, shift=settings.shift,
                                 store_grid=settings.store_grid, device=env.device, autocast_dtype=autocast_dtype)
        tensors = {"states": tensors["states"].to(storage_dtype), "sigmas": tensors["sigmas"],
                   "final": tensors["final"].to(storage_dtype), "seed": torch.tensor([job.seed], dtype=torch.int64),
                   **{name: condition[name].contiguous() for name in CONDITION_TENSORS}}
        facts = write_safetensors_atomic(root / job.file, tensors)
        append_jsonl(part_file, {"kind": MANIFEST_KIND, "file": job.file, "sample_id": job.sample_id,
                                 "split": job.split, **facts})
        counts["built"] += 1
        if stop_after is not None and counts["built"] >= stop_after:
            break
    print(f"[rank {env.rank}] ode cache samples built {counts['built']}, skipped {counts['skipped']}", flush=True)
    if stop_after is not None:
        return counts
    barrier()
    if env.is_main:
        merged = merge_manifest_entries(root, [job.file for job in plan])
        write_merged_manifest(root, merged)
        marker = {"samples": len(merged), "manifest_sha256": sha256_json(merged), "seconds": time.time() - started}
        write_bytes_atomic(root / COMPLETE_MARKER, (json.dumps(marker, sort_keys=True) + "\n").encode("utf-8"))
        print(f"[build_ode_cache] {len(merged)} samples; {COMPLETE_MARKER} written", flush=True)
    barrier()
    return counts


def evenly_spaced(count: int, limit: int | None) -> list[int]:
    """Indices of at most `limit` of `count` items, evenly spaced from the first (all of them without a limit, or
    when `limit` >= `count`): the clip subset of `tools/build_ode_cache.py --max_clips` (and of the encode stage of
    `tools/build_demo_world.py --distil_clips`, so a dataset of only those clips gives the same subset)."""
    if limit is None or limit >= count:
        return list(range(count))
    return [index * count // limit for index in range(limit)]


def video_clip_seed(seed: int, clip_id: str) -> int:
    """The noise seed of a video clip's cached rollout: a pure function of the build seed and the clip id."""
    return stream_seed(seed, zlib.crc32(clip_id.encode("utf-8")))


# ---------------------------------------------------------------------------------------------------------------
# 4. The reader
# ---------------------------------------------------------------------------------------------------------------
class OdeCacheDataset(Dataset):
    """The samples of one split of a finished ODE-state cache, sorted by sample_id.

    An item: sample_id (str), seed (int: the rollout's noise and memory-retrieval points), states [S, C, T, H, W],
    sigmas [S], final [C, T, H, W] (also under "latents": the known history of teacher forcing), image_cond
    [1, C, 1, H, W], viewmats [T, 4, 4], Ks [T, 3, 3], action [T] and the encoder outputs (`TEXT_ENCODER_FIELDS`).
    Every tensor is checked against its manifest CRC-32 the first time the process reads it; `verify` also checks size
    and sha256 of every file up front.
    """

    def __init__(self, root: str | Path, split: str = "train", *, verify: bool = False):
        self.root = Path(root)
        self.split = split
        if not (self.root / COMPLETE_MARKER).is_file():
            raise OdeCacheError(f"{self.root}: no {COMPLETE_MARKER} marker, the cache is not finished; rerun "
                                "tools/build_ode_cache.py with the same arguments to finish it")
        self.config = read_json_file(self.root / CACHE_CONFIG_NAME, OdeCacheError)
        entries = [entry for entry in read_jsonl(self.root / MANIFEST_FILE) if entry.get("kind") == MANIFEST_KIND]
        self.entries = sorted((entry for entry in entries if entry["split"] == split),
                              key=lambda entry: entry["sample_id"])
        if not self.entries:
            raise OdeCacheError(f"{self.root / MANIFEST_FILE}: no sample of split {split!r}; splits present: "
                                f"{sorted({entry['split'] for entry in entries})}")
        for entry in self.entries:
            missing = [name for name in SAMPLE_TENSORS if name not in entry["tensors"]]
            if missing:
                raise OdeCacheError(f"{self.root / MANIFEST_FILE}: entry of {entry['file']!r} lacks tensor(s) "
                                    f"{missing}")
            if verify:
                verify_file(entry, self.root)
            else:
                check_listed_file(self.root, entry["file"], entry["bytes"], self.root / MANIFEST_FILE)
        self.checksums = TensorChecksums({self.root / entry["file"]: entry[TENSOR_CHECKSUM_FIELD]
                                          for entry in self.entries})
        self.stored_sigmas = [float(value) for value in self.config["stored_sigmas"]]
        self.num_latents = int(self.entries[0]["tensors"]["final"][0][1])

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict:
        entry = self.entries[index]
        tensors = load_tensors(self.root / entry["file"], SAMPLE_TENSORS, checksums=self.checksums)
        for name in ("states", "final"):  # KD's targets
            if not bool(torch.isfinite(tensors[name]).all()):
                raise OdeCacheError(f"{self.root / entry['file']}: tensor {name!r} holds NaN/Inf; expected finite "
                                    "values (rebuild the cache with tools/build_ode_cache.py)")
        item = {"sample_id": entry["sample_id"], "clip_id": entry["sample_id"], **tensors}
        item["seed"] = int(tensors["seed"][0])
        item["latents"] = tensors["final"]
        return item
