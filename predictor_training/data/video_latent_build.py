"""Build the video-latent dataset (``run``): clip tables -> one safetensors file per clip, config and manifest.

``tools/build_video_latent_dataset.py`` is the command line around this module. The layout of what it writes, the
stored tensors and the VAE scaling convention: ``predictor_training.data.video_latents`` (module docstring) and
docs/video_latents.md; the ``--demo`` inputs are made by ``predictor_training.world.video_latent_demo``.

Input is one or more clip tables (JSONL, one clip per line; the split of a clip is its table's file stem)::

    {"clip_id": "c0001", "video": "videos/c0001.mp4", "pose": "poses/c0001.json", "caption": "A red car ..."}

``video`` is a folder of PNG frames or an mp4 (``predictor_training.video.io``), ``pose`` a WorldPlay pose JSON
with one entry per latent frame (``camera.pose_to_input``); relative paths are relative to the table's folder.

Sections: 1. options; 2. clip tables (the plan, validated before any work); 3. encoding one clip; 4. config,
manifest entries, resume; 5. the build (``run``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm

from predictor_training.rollout.camera import PoseError, pose_to_input
from predictor_training.data.builder import (
    MANIFEST_FILE,
    PARTS_DIR,
    drop_torn_tail,
    finished_entry,
    known_entries,
    merge_manifest_entries,
    taken_back_on_refusal,
    write_merged_manifest,
)
from predictor_training.data.encoders import CaseEncoder, validate_encoded_case, warn_if_caption_truncated
from predictor_training.data.sample_table import FINAL_SPLIT
from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    append_jsonl,
    write_bytes_atomic,
    write_safetensors_atomic,
)
from predictor_training.runtime.io import (
    check_output_folder_kind,
    read_json_file,
    read_jsonl_objects,
    sha256_file,
    sha256_json,
)
from predictor_training.data.video_latents import (
    CHUNK_LATENTS,
    CLIP_TENSORS,
    CLIPS_DIR,
    CONFIG_NAME,
    ENCODER_FIELDS,
    MANIFEST_KIND,
    VideoDatasetInputError,
    latents_for_frames,
)
from predictor_training.runtime.distributed import barrier, cleanup_distributed, init_distributed
from predictor_training.runtime.flags import report_check_only
from predictor_training.video.io import VIDEO_SUFFIXES, list_frame_files, read_video

BUILDER_VERSION = "1"
TABLE_FIELDS = ("clip_id", "video", "pose", "caption")
ENCODER_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORAGE_DTYPES = ("keep", "bfloat16", "float32")
# Every top-level name a build writes into --out: it refuses a folder that holds anything else.
VIDEO_DATASET_LAYOUT = frozenset({CONFIG_NAME, MANIFEST_FILE, PARTS_DIR, CLIPS_DIR})
VAE_CONVENTION = ("latent_dist.mode() * vae.config.scaling_factor (posterior mean, no sampling, no shift, no "
                  "per-channel mean/std); decode with latents / scaling_factor")


# =============================================================================================================
# 1. Options
# =============================================================================================================
@dataclass
class VideoBuildOptions:
    """What ``run`` needs (the command line's flags; docs/video_latents.md lists them).

    clips: clip tables (a clip's split is its table's file stem); encoders: diffusers-format HunyuanVideo-1.5 i2v
    folder (text_encoder, tokenizer, text_encoder_2, tokenizer_2, image_encoder, feature_extractor, vae); out:
    dataset root to create or resume; height, width: encoded resolution (multiples of 16); num_frames: frames per
    clip, 4k+1; dtype / byt5_dtype / vae_dtype: encoder dtypes (names in ``ENCODER_DTYPES``); vision_crop: as
    ``CaseEncoder``; vae_tiling: ``vae.enable_tiling()``; storage_dtype: "keep" (each encoder's dtype) or a dtype
    for every floating tensor but the cameras; device: "auto", "cuda" or "cpu"; stop_after: debug, each rank stops
    after building that many clips (no manifest); check_only: validate every input (mp4 frame counts included)
    and exit; demo: demo folder whose clips and encoders are made (if absent) before the build; demo_clips /
    demo_holdout / demo_seed: the demo's clip counts and seed.
    """

    clips: list
    encoders: Path
    out: Path
    height: int = 480
    width: int = 832
    num_frames: int = 125
    dtype: str = "float16"
    byt5_dtype: str = "float32"
    vae_dtype: str = "float32"
    vision_crop: str = "bucket"
    vae_tiling: bool = False
    storage_dtype: str = "keep"
    device: str = "auto"
    stop_after: int | None = None
    check_only: bool = False
    demo: Path | None = None
    demo_clips: int = 6
    demo_holdout: int = 2
    demo_seed: int = 0


def _frame_count_error(video: Path, found: int, expected: int, where: str) -> VideoDatasetInputError:
    note = "" if (found - 1) % 4 == 0 and found >= 1 else f"; {found} is not of the form 4k+1"
    return VideoDatasetInputError(
        f"{video}: field 'video' of {where}: has {found} frames, expected {expected} (--num_frames; the causal VAE "
        f"maps 4k+1 frames to k+1 latents, here {latents_for_frames(expected)}{note})"
    )


# =============================================================================================================
# 2. Clip tables: the plan, validated before any work
# =============================================================================================================
@dataclass(frozen=True)
class ClipJob:
    """One clip of the plan. index: position over all tables in order (clip i is built by rank i % world size);
    where: "clip table T line n" for messages; video / pose: absolute paths."""

    index: int
    clip_id: str
    split: str
    video: Path
    pose: Path
    caption: str
    where: str

    @property
    def file(self) -> str:
        return f"{CLIPS_DIR}/{self.clip_id}.safetensors"

    def inputs_fingerprint(self) -> str:
        """sha256 of the caption, the pose file's bytes and the video's frame-file names and sizes (no video bytes
        are hashed: cheap enough to recompute on every resume). A finished clip whose inputs changed is rebuilt."""
        if self.video.is_dir():
            video = [[path.name, path.stat().st_size] for path in list_frame_files(self.video)]
        else:
            video = [[self.video.name, self.video.stat().st_size]]
        return sha256_json({"caption": self.caption, "pose_sha256": sha256_file(self.pose), "video": video})


@dataclass(frozen=True)
class ClipPlan:
    clips: list[ClipJob]
    tables: list[Path]
    num_frames: int

    @property
    def num_latents(self) -> int:
        return latents_for_frames(self.num_frames)

    def splits(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.clips:
            counts[job.split] = counts.get(job.split, 0) + 1
        return dict(sorted(counts.items()))


def check_clip_id(clip_id, where: str) -> str:
    """A clip_id usable as a file name: a non-empty string without '/', '\\', a leading '.' or surrounding spaces."""
    if not isinstance(clip_id, str) or not clip_id or clip_id != clip_id.strip():
        raise VideoDatasetInputError(f"{where}: field 'clip_id' must be a non-empty string without surrounding "
                                     f"spaces, got {clip_id!r}")
    if "/" in clip_id or "\\" in clip_id or clip_id.startswith("."):
        raise VideoDatasetInputError(f"{where}: field 'clip_id' {clip_id!r} cannot be a file name (expected no '/', "
                                     "'\\' or leading '.')")
    return clip_id


def _read_table_records(path: Path) -> Iterator[tuple[int, dict]]:
    return read_jsonl_objects(path, VideoDatasetInputError, "clip table ")


def _resolve(table: Path, value: str) -> Path:
    path = Path(value)
    return (path if path.is_absolute() else table.parent / path).resolve()


def read_clip_plan(tables: Sequence[str | Path], num_frames: int) -> ClipPlan:
    """Read and validate every clip table before any work.

    Checks (each error names the table, line, clip, field and the expected value): fields (exactly
    ``TABLE_FIELDS``, non-empty strings), clip ids (file-name safe, unique over all tables), table stems (= split
    names) distinct and none of them ``final`` (``sample_table.FINAL_SPLIT``, the split nothing is chosen on), the
    video exists (a folder of PNG frames with exactly ``num_frames`` frames, or a file with a video suffix; an mp4's
    frame count is checked when it is decoded, or up front with ``check_inputs``), and the pose file gives exactly
    ``latents_for_frames(num_frames)`` latents through ``camera.pose_to_input``.
    """
    num_latents = latents_for_frames(num_frames)
    paths = [Path(table).resolve() for table in tables]
    if not paths:
        raise VideoDatasetInputError("no clip tables given (--clips)")
    stems = [path.stem for path in paths]
    if len(set(stems)) != len(stems):
        raise VideoDatasetInputError(f"clip tables {[str(p) for p in paths]} have repeated file stems (= split names)")
    if FINAL_SPLIT in stems:
        raise VideoDatasetInputError(f"clip table {paths[stems.index(FINAL_SPLIT)]}: split '{FINAL_SPLIT}' is the split "
                                     "nothing is chosen on and never goes into a dataset (nothing may train or "
                                     "validate on it); docs/eval.md")
    clips: list[ClipJob] = []
    seen: dict[str, str] = {}
    for table in paths:
        if not table.is_file():
            raise VideoDatasetInputError(f"clip table {table} does not exist")
        rows = 0
        for number, record in _read_table_records(table):
            where = f"clip table {table} line {number}"
            missing = [name for name in TABLE_FIELDS if name not in record]
            unknown = sorted(set(record) - set(TABLE_FIELDS))
            if missing or unknown:
                problem = f"missing field '{missing[0]}'" if missing else f"unknown field '{unknown[0]}'"
                raise VideoDatasetInputError(f"{where}: {problem} (expected fields {list(TABLE_FIELDS)})")
            clip_id = check_clip_id(record["clip_id"], where)
            for name in ("video", "pose", "caption"):
                if not isinstance(record[name], str) or not record[name].strip():
                    raise VideoDatasetInputError(f"{where}: clip '{clip_id}': field '{name}' must be a non-empty "
                                                 f"string, got {record[name]!r}")
            if clip_id in seen:
                raise VideoDatasetInputError(f"{where}: clip_id '{clip_id}' is already used ({seen[clip_id]})")
            seen[clip_id] = where
            where = f"{where} (clip '{clip_id}')"
            video, pose = _resolve(table, record["video"]), _resolve(table, record["pose"])
            _check_video_up_front(video, num_frames, where)
            if not pose.is_file():
                raise VideoDatasetInputError(f"{pose}: field 'pose' of {where}: the pose file does not exist")
            try:
                pose_to_input(pose, num_latents)
            except PoseError as error:
                raise VideoDatasetInputError(
                    f"{error} (field 'pose' of {where}; --num_frames {num_frames} -> {num_latents} latents)"
                ) from None
            clips.append(ClipJob(len(clips), clip_id, table.stem, video, pose, record["caption"], where))
            rows += 1
        if not rows:
            raise VideoDatasetInputError(f"clip table {table} has no clips")
    return ClipPlan(clips=clips, tables=paths, num_frames=num_frames)


def _check_video_up_front(video: Path, num_frames: int, where: str) -> None:
    if video.is_dir():
        found = len(list_frame_files(video))
        if found != num_frames:
            raise _frame_count_error(video, found, num_frames, where)
    elif video.is_file():
        if video.suffix.lower() not in VIDEO_SUFFIXES:
            raise VideoDatasetInputError(f"{video}: field 'video' of {where}: suffix {video.suffix!r} is not a video "
                                         f"(expected one of {VIDEO_SUFFIXES} or a folder of PNG frames)")
    else:
        raise VideoDatasetInputError(f"{video}: field 'video' of {where}: does not exist (expected a folder of PNG "
                                     f"frames or a {'/'.join(VIDEO_SUFFIXES)} file)")


def count_video_frames(video: Path) -> int:
    """Frames of a PNG folder (file count) or a video file (ffmpeg's count of the first video stream)."""
    if video.is_dir():
        return len(list_frame_files(video))
    import imageio_ffmpeg

    return int(imageio_ffmpeg.count_frames_and_secs(str(video))[0])


def check_inputs(plan: ClipPlan, rank: int = 0, world_size: int = 1) -> list[str]:
    """This rank's share of the deep input check (frame counts of video files, decodable first frame): messages of
    the clips that fail, [] when all pass. The cheap checks already ran in ``read_clip_plan``."""
    problems = []
    mine = [job for job in plan.clips if job.index % world_size == rank]
    for job in tqdm(mine, desc=f"check inputs (rank {rank})", disable=rank != 0):
        try:
            found = count_video_frames(job.video)
            if found != plan.num_frames:
                raise _frame_count_error(job.video, found, plan.num_frames, job.where)
            if job.video.is_dir():
                with Image.open(list_frame_files(job.video)[0]) as image:
                    image.convert("RGB")
        except Exception as error:  # collect every problem, not only the first one
            problems.append(str(error))
    return problems


# =============================================================================================================
# 3. Encoding one clip
# =============================================================================================================
def load_video_encoder(options: VideoBuildOptions, device) -> CaseEncoder:
    """The encoder stage's ``CaseEncoder`` (all seven pipeline components) with ``options``' dtypes and tiling."""
    encoder = CaseEncoder.from_pretrained(
        options.encoders, device, ENCODER_DTYPES[options.dtype], byt5_dtype=ENCODER_DTYPES[options.byt5_dtype],
        vae_dtype=ENCODER_DTYPES[options.vae_dtype], vision_crop=options.vision_crop,
    )
    if options.vae_tiling:
        encoder.pipeline.vae.enable_tiling()
    return encoder


@torch.no_grad()
def encode_video_latents(encoder: CaseEncoder, frames: Sequence[Image.Image], height: int, width: int) -> torch.Tensor:
    """VAE latents of one clip (batch 1: diffusers' VAE is reported wrong for batch > 1).

    frames: F = 4k+1 PIL images. Each is resized to cover and centre-cropped to height x width exactly as the
    encoder stage prepares the image condition (``video_processor.resize(..., resize_mode="crop")``), mapped to
    [-1, 1] by ``video_processor.preprocess_video``, encoded, and ``latent_dist.mode() * scaling_factor`` is
    returned: [1, C, k+1, height/16, width/16] in the VAE's dtype, on the encoder's device.
    """
    pipe = encoder.pipeline
    encoder.latent_grid(height, width)
    latents_for_frames(len(frames))
    resized = [pipe.video_processor.resize(frame, height=height, width=width, resize_mode="crop") for frame in frames]
    video = pipe.video_processor.preprocess_video(resized, height=height, width=width)  # [1, 3, F, H, W]
    video = video.to(device=encoder.device, dtype=pipe.vae.dtype)
    posterior = pipe.vae.encode(video).latent_dist
    return posterior.mode() * pipe.vae.config.scaling_factor


def read_clip_frames(job: ClipJob, num_frames: int) -> list[Image.Image]:
    """The clip's frames as RGB PIL images; an unreadable video or a wrong frame count raises naming the file."""
    try:
        frames = read_video(job.video)
    except (OSError, ValueError, RuntimeError) as error:
        raise VideoDatasetInputError(f"{job.video}: field 'video' of {job.where}: cannot be read ({error})") from error
    if len(frames) != num_frames:
        raise _frame_count_error(job.video, len(frames), num_frames, job.where)
    return [Image.fromarray(frame) for frame in frames]


def _store(tensor: torch.Tensor, storage_dtype: str) -> torch.Tensor:
    tensor = tensor.detach().to("cpu")
    if storage_dtype != "keep" and tensor.is_floating_point():
        tensor = tensor.to(getattr(torch, storage_dtype))
    return tensor.contiguous().clone()


def encode_clip(encoder: CaseEncoder, job: ClipJob, options: VideoBuildOptions) -> dict[str, torch.Tensor]:
    """Every stored tensor of one clip (names, shapes: ``video_latents``' module docstring); nothing is written here.

    Raises VideoDatasetInputError (file, field, expected value) for a wrong frame count or an unreadable video,
    and EncodedCaseError when an encoder output has an unexpected shape.
    """
    num_latents = latents_for_frames(options.num_frames)
    frames = read_clip_frames(job, options.num_frames)
    latents = encode_video_latents(encoder, frames, options.height, options.width)
    expected = [1, int(encoder.pipeline.vae.config.latent_channels), num_latents,
                *encoder.latent_grid(options.height, options.width)]
    if list(latents.shape) != expected:
        raise RuntimeError(f"{job.video}: the VAE returned latents {list(latents.shape)}, expected {expected}")
    encoded = encoder.encode_image_caption(frames[0], job.caption, options.height, options.width)
    encoded = validate_encoded_case(encoded, encoder.output_spec(options.height, options.width),
                                    source=f"{job.where}, freshly encoded")
    warn_if_caption_truncated(encoded, job.where, job.caption)
    viewmats, intrinsics, action = pose_to_input(job.pose, num_latents)
    tensors = {"latents": _store(latents[0], options.storage_dtype)}
    tensors.update({name: _store(encoded[name], options.storage_dtype) for name in ENCODER_FIELDS})
    tensors.update(viewmats=viewmats.to(torch.float32), Ks=intrinsics.to(torch.float32), action=action.to(torch.int64))
    return tensors


# =============================================================================================================
# 4. Dataset config, manifest entries, resume
# =============================================================================================================
def vae_config_sha256(vae) -> str:
    """sha256 of the VAE's config (its constructor arguments; private keys such as _name_or_path left out)."""
    return sha256_json({key: value for key, value in dict(vae.config).items() if not key.startswith("_")})


def video_dataset_config(options: VideoBuildOptions, plan: ClipPlan, encoder: CaseEncoder) -> dict:
    """Everything that determines the stored tensors (no timestamps, no device): video_dataset_config.json."""
    vae = encoder.pipeline.vae
    grid = encoder.latent_grid(options.height, options.width)
    folder = Path(options.encoders).resolve()
    weight_files = sorted(
        ({"name": path.relative_to(folder).as_posix(), "bytes": path.stat().st_size}
         for path in folder.rglob("*.safetensors*") if path.is_file()), key=lambda item: item["name"])
    describe = encoder.describe()
    return {
        "builder_version": BUILDER_VERSION,
        "kind": "video_latents",
        "clip_tables": [str(path) for path in plan.tables],
        "splits": plan.splits(),
        "num_clips": len(plan.clips),
        "num_frames": plan.num_frames,
        "num_latents": plan.num_latents,
        "chunk_latents": CHUNK_LATENTS,
        "num_chunks": plan.num_latents // CHUNK_LATENTS,
        "resolution": {"height": options.height, "width": options.width},
        "latent_shape": {"C": int(vae.config.latent_channels), "T": plan.num_latents, "H": grid[0], "W": grid[1]},
        "vae": {
            "class": type(vae).__name__,
            "config_sha256": vae_config_sha256(vae),
            "scaling_factor": float(vae.config.scaling_factor),
            "temporal_compression_ratio": int(vae.config.temporal_compression_ratio),
            "spatial_compression_ratio": int(vae.config.spatial_compression_ratio),
            "dtype": describe["vae_dtype"],
            "tiling": bool(options.vae_tiling),
            "latents": VAE_CONVENTION,
        },
        "encoders": {"folder": str(folder), "weight_files": weight_files,
                     **{key: value for key, value in describe.items()
                        if key not in ("vae_dtype", "vae_scaling_factor")}},
        "storage_dtype": options.storage_dtype,
        "tensors": list(CLIP_TENSORS),
    }


def _flatten(record, prefix: str = "") -> dict:
    if isinstance(record, Mapping):
        flat = {}
        for key, value in record.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat if flat or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: record}


def config_differences(existing: Mapping, requested: Mapping) -> list[str]:
    """``field: existing X, requested Y`` for every differing field (nested fields dotted, e.g. ``vae.dtype``)."""
    old, new = _flatten(existing), _flatten(requested)
    missing = object()
    lines = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, missing), new.get(key, missing)
        if before != after:
            show = lambda value: "(absent)" if value is missing else repr(value)  # noqa: E731
            lines.append(f"{key}: existing {show(before)}, requested {show(after)}")
    return lines


def check_config(root: Path, config: dict) -> bool:
    """True when ``root/video_dataset_config.json`` exists and equals ``config``; False when absent. Raises
    VideoDatasetInputError listing every differing field when the folder was built with other settings."""
    path = Path(root) / CONFIG_NAME
    if not path.is_file():
        return False
    differences = config_differences(read_json_file(path, VideoDatasetInputError), config)
    if differences:
        raise VideoDatasetInputError(
            f"{path}: the dataset in --out was built with other settings; differing fields:\n  "
            + "\n  ".join(differences) + "\nuse a new --out, or rerun with the settings it was built with"
        )
    return True


def write_config(root: Path, config: dict) -> None:
    write_bytes_atomic(Path(root) / CONFIG_NAME, (json.dumps(config, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def make_clip_entry(job: ClipJob, file_facts: Mapping, inputs_sha256: str) -> dict:
    """The manifest record of one finished clip file (``file_facts``: what ``write_safetensors_atomic`` returns)."""
    return {
        "kind": MANIFEST_KIND,
        "file": job.file,
        "clip_id": job.clip_id,
        "split": job.split,
        "bytes": int(file_facts["bytes"]),
        "sha256": str(file_facts["sha256"]),
        "tensors": dict(file_facts["tensors"]),
        TENSOR_CHECKSUM_FIELD: dict(file_facts[TENSOR_CHECKSUM_FIELD]),
        "inputs_sha256": inputs_sha256,
    }


def finished_clip_entry(root: Path, job: ClipJob, candidates: list[dict], inputs_sha256: str):
    """(entry, "verified") when the clip's file matches a known entry made from the same inputs, else (None,
    reason): "missing", "inputs changed", or the verification failure (``builder.finished_entry``)."""
    same_inputs = [entry for entry in candidates if entry.get("inputs_sha256") == inputs_sha256]
    if candidates and not same_inputs and (root / job.file).is_file():
        return None, "inputs changed (caption, pose file or video files) since it was built"
    return finished_entry(root, job.file, same_inputs)


def merge_clip_manifest(root: Path, plan: ClipPlan) -> list[dict]:
    """Rank 0, after every rank finished: one entry per planned clip, made from the clip's current inputs."""
    fingerprints = {job.file: job.inputs_fingerprint() for job in plan.clips}
    return merge_manifest_entries(root, list(fingerprints),
                                  accepts=lambda entry: entry.get("inputs_sha256") == fingerprints[entry["file"]])


# =============================================================================================================
# 5. The build
# =============================================================================================================
def run(options: VideoBuildOptions, prepare_demo=None) -> int:
    """Build (or resume) the video-latent dataset in ``options.out``; ``torchrun``-aware. Returns the exit status.

    ``options``: the build's named values (tools/build_video_latent_dataset.py makes them from its flags).
    ``prepare_demo``: with ``options.demo`` set, the function that writes the demo inputs first (rank 0), called as
    ``prepare_demo(demo, clips, holdout, seed)`` (``world.video_latent_demo.prepare_demo_inputs``).
    """
    check_output_folder_kind(options.out, flag="--out", marker=CONFIG_NAME, layout=VIDEO_DATASET_LAYOUT)
    if options.check_only:  # one process checks every clip, under torchrun too: no process group is made
        return check_build_inputs(options)
    env = init_distributed({"auto": "auto", "cpu": "gloo", "cuda": "nccl"}[options.device])
    try:
        if options.demo is not None:
            if prepare_demo is None:
                raise ValueError("run: options.demo is set but no prepare_demo function was given")
            if env.is_main:
                prepare_demo(options.demo, options.demo_clips, options.demo_holdout, options.demo_seed)
            barrier()
        plan = read_clip_plan(options.clips, options.num_frames)  # every rank, so every rank fails alike
        with taken_back_on_refusal(options.out, env):
            return build(options, plan, env)
    finally:
        cleanup_distributed()


def check_build_inputs(options: VideoBuildOptions) -> int:
    """--check_only: every clip's table entry, pose and frame count, the encoders folder's kind and --out; loads no
    encoder and writes nothing (with --demo and its inputs not made yet, says that a build makes them first)."""
    if options.demo is not None and not all(Path(table).is_file() for table in options.clips):
        return report_check_only(f"--demo {options.demo}: a build first makes its inputs there "
                                 f"({options.demo_clips} procedural clips, tiny encoders), then encodes them -> "
                                 f"{options.out}")
    plan = read_clip_plan(options.clips, options.num_frames)
    problems = check_inputs(plan, 0, 1)
    if problems:
        raise VideoDatasetInputError(f"{len(problems)} of {len(plan.clips)} clips fail the input check:\n  "
                                     + "\n  ".join(problems[:20]))
    if not (Path(options.encoders) / "model_index.json").is_file():
        raise VideoDatasetInputError(f"--encoders {options.encoders}: no model_index.json; expected the diffusers "
                                     "HunyuanVideo-1.5 i2v folder")
    root = Path(options.out)
    if root.exists() and not root.is_dir():
        raise VideoDatasetInputError(f"--out {root}: a file; expected a dataset folder to create or resume")
    print(f"[build_video_latent_dataset] inputs ok: {len(plan.clips)} clips {plan.splits()}, "
          f"{plan.num_frames} frames -> {plan.num_latents} latents each", flush=True)
    return report_check_only(f"dataset {root} ({'resume' if (root / CONFIG_NAME).is_file() else 'new'})")


def build(options: VideoBuildOptions, plan: ClipPlan, env) -> int:
    """Encode this rank's clips (clip i on rank i % world size) into ``options.out``, then merge the manifest."""
    root = Path(options.out)
    part_file = root / PARTS_DIR / f"rank{env.rank}.jsonl"
    log = (lambda message: print(f"[build_video_latent_dataset] {message}", flush=True)) if env.is_main else (
        lambda message: None)
    started = time.time()

    # 1. Encoders, config (every rank checks an existing one; rank 0 writes a new one).
    encoder = load_video_encoder(options, env.device)
    config = video_dataset_config(options, plan, encoder)
    if not check_config(root, config) and env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        write_config(root, config)
    log(f"{len(plan.clips)} clips {plan.splits()}, world size {env.world_size}, device {env.device}, "
        f"{plan.num_frames} frames -> latents {config['latent_shape']}, storage {options.storage_dtype}")
    barrier()
    entries = known_entries(root)
    barrier()  # nobody appends to a part file before every rank has read them
    drop_torn_tail(part_file)

    # 2. This rank's clips.
    counts = {"built": 0, "skipped": 0}
    mine = [job for job in plan.clips if job.index % env.world_size == env.rank]
    for job in tqdm(mine, desc=f"clips (rank 0 of {env.world_size})", disable=not env.is_main):
        fingerprint = job.inputs_fingerprint()
        entry, reason = finished_clip_entry(root, job, entries.get(job.file, []), fingerprint)
        if entry is not None:
            counts["skipped"] += 1
            continue
        if reason != "missing":
            print(f"[rank {env.rank}] rebuilding {job.file}: {reason}", flush=True)
        tensors = encode_clip(encoder, job, options)  # every check of this clip runs before its file is written
        facts = write_safetensors_atomic(root / job.file, tensors)
        append_jsonl(part_file, make_clip_entry(job, facts, fingerprint))
        counts["built"] += 1
        if options.stop_after is not None and counts["built"] >= options.stop_after:
            break
    print(f"[rank {env.rank}] clips built {counts['built']}, skipped {counts['skipped']}", flush=True)
    if options.stop_after is not None:
        print(f"[rank {env.rank}] --stop_after {options.stop_after}: stopping without a manifest (rerun to resume)",
              flush=True)
        return 0

    # 3. Manifest (rank 0, after every rank finished); leftovers of killed writes go.
    barrier()
    if env.is_main:
        merged = merge_clip_manifest(root, plan)
        write_merged_manifest(root, merged)
        for leftover in sorted((root / CLIPS_DIR).glob("*.tmp")):
            leftover.unlink()
        log(f"manifest: {len(merged)} clips; done in {time.time() - started:.1f} s")
    barrier()
    return 0
