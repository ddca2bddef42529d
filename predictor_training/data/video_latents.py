"""The video-latent dataset: per clip, VAE latents + camera/action + caption encoder outputs + first-frame condition.

Input is one or more clip tables (JSONL, one clip per line; the split of a clip is its table's file stem)::

    {"clip_id": "c0001", "video": "videos/c0001.mp4", "pose": "poses/c0001.json", "caption": "A red car ..."}

``video`` is a folder of PNG frames or an mp4 (``predictor_training.video_io``), ``pose`` a WorldPlay pose JSON
with one entry per latent frame (``camera.pose_to_input``); relative paths are relative to the table's folder.

Output (layout, fields and commands: data.md, section "Video-latent dataset")::

    OUT/video_dataset_config.json      what determines the stored tensors (resume guard)
    OUT/manifest.jsonl                 one entry per clip: bytes, sha256, per-tensor CRC-32, input fingerprint
    OUT/clips/{clip_id}.safetensors    the tensors of one clip (names and shapes: ``CLIP_TENSORS``)

Stored tensors of one clip, with F = 4k+1 frames, T = k+1 latents, (H, W) = latent grid (pixels / 16), C = VAE
latent channels; "encoder dtype" = the dtype of the encoder that made it (``--storage_dtype keep``)::

    latents           [C, T, H, W]        VAE latent_dist.mode() * vae.config.scaling_factor (no sampling, no shift)
    image_cond        [1, C, 1, H, W]     first frame through the encoder stage's ``_get_image_latents`` (same scaling)
    viewmats          [T, 4, 4]  f32      world-to-camera (``camera.pose_to_input``)
    Ks                [T, 3, 3]  f32      normalised intrinsics
    action            [T]        int64    action labels 0..80
    prompt_embeds     [1, L, D_txt]       Qwen2.5-VL states of the caption (L = 1000, right padded)
    prompt_mask       [1, L]     int64
    byt5_text_states  [1, Lb, D_byt5]     ByT5 glyph states (Lb = 256)
    byt5_text_mask    [1, Lb]    int64
    vision_states     [1, Nv, D_vis]      SigLIP states of the first frame

The last six are exactly the encoder stage's ``{case_id}.pt`` fields (``data.encoders``, made by the same
``CaseEncoder.encode_image_caption`` from the clip's first frame and caption), so the Teacher's i2v text prefill
takes them as they are.

VAE scaling (diffusers 0.42, ``HunyuanVideo15ImageToVideoPipeline``): ``_get_image_latents`` encodes with
``retrieve_latents(vae.encode(x), sample_mode="argmax")`` (= ``latent_dist.mode()`` = the posterior mean) and
multiplies by ``vae.config.scaling_factor`` (1.03682 for the real VAE); the pipeline decodes ``latents /
scaling_factor``. There is no shift factor and no per-channel mean/std. The video latents here use the same
convention, on frames resized and centre-cropped to (height, width) exactly as the image condition, mapped to
[-1, 1] by the pipeline's ``video_processor``. The VAE is causal, so ``latents[:, 0]`` and ``image_cond[0, :, 0]``
agree up to float rounding.

Sections: 1. options and errors; 2. clip tables (the plan, validated before any work); 3. demo inputs; 4. encoding
one clip; 5. config, manifest entries, resume; 6. the build (``run``); 7. the reader (``VideoLatentDataset``,
``ClipWindowSampler``, ``collate_video_clips``).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler
from tqdm import tqdm

from predictor_training.camera import PoseError, pose_string_to_json, pose_to_input
from predictor_training.data.builder import (
    MANIFEST_FILE,
    PARTS_DIR,
    drop_torn_tail,
    finished_entry,
    known_entries,
    write_merged_manifest,
)
from predictor_training.data.encoders import CaseEncoder, validate_encoded_case
from predictor_training.data.pair_dataset import SafetensorsHandles, check_files_exist, verify_checksums
from predictor_training.data.samplers import epoch_generator
from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    ShardVerificationError,
    TensorChecksums,
    append_jsonl,
    canonical_json,
    read_jsonl,
    sha256_file,
    sha256_json,
    verify_file,
    write_bytes_atomic,
    write_safetensors_atomic,
)
from predictor_training.distributed import all_gather_objects, barrier, cleanup_distributed, init_distributed
from predictor_training.video_io import VIDEO_SUFFIXES, list_frame_files, read_video, write_video

BUILDER_VERSION = "1"
CONFIG_NAME = "video_dataset_config.json"

CLIPS_DIR = "clips"
MANIFEST_KIND = "clip"
CHUNK_LATENTS = 4  # latent frames per AR chunk of WorldPlay
TABLE_FIELDS = ("clip_id", "video", "pose", "caption")
TEXT_FIELDS = ("prompt_embeds", "prompt_mask", "byt5_text_states", "byt5_text_mask", "vision_states")
ENCODER_FIELDS = (*TEXT_FIELDS, "image_cond")  # [1, ...] tensors in the encoder stage's layout
CAMERA_FIELDS = ("viewmats", "Ks", "action")
CLIP_TENSORS = ("latents", "image_cond", *CAMERA_FIELDS, *TEXT_FIELDS)
MANIFEST_FIELDS = ("kind", "file", "clip_id", "split", "bytes", "sha256", "tensors", TENSOR_CHECKSUM_FIELD,
                   "inputs_sha256")
ENCODER_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORAGE_DTYPES = ("keep", "bfloat16", "float32")
VAE_CONVENTION = ("latent_dist.mode() * vae.config.scaling_factor (posterior mean, no sampling, no shift, no "
                  "per-channel mean/std); decode with latents / scaling_factor")

# Demo: tiny clips through the demo's tiny random encoders (predictor_training.demo).
DEMO_HEIGHT, DEMO_WIDTH = 32, 48  # encoded resolution -> latent grid 2 x 3
DEMO_FRAME_SIZE = (40, 64)  # (height, width) of the written frames: wider than 32 x 48, so resize + crop runs
DEMO_NUM_FRAMES = 29  # 4*7+1 frames -> 8 latents = 2 chunks
DEMO_ENCODER_SEED = 3000  # tools/make_demo_assets.py's encoder sub-seed (_ENCODER_SEED) for --seed 0
DEMO_CLIPS_DIR = "video_clips"
DEMO_ENCODERS_DIR = "encoders"
DEMO_SETTINGS_NAME = "demo_clips.json"
DEMO_MOTIONS = (("forward", "w"), ("forward_left", "w+left"), ("backward", "s"), ("forward_right", "w+right"))


# =============================================================================================================
# 1. Options and errors
# =============================================================================================================
class VideoDatasetInputError(ValueError):
    """Bad builder input or a refused resume; the message names the file, the field and the expected value."""


@dataclass
class VideoBuildOptions:
    """What ``run`` needs (the command line's flags; data.md lists them).

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


def latents_for_frames(num_frames: int) -> int:
    """Latent frames of the causal VAE (temporal factor 4): 4k+1 frames -> k+1 latents (125 -> 32).

    Raises ValueError for a count that is not of the form 4k+1.
    """
    if num_frames < 1 or (num_frames - 1) % 4:
        raise ValueError(f"{num_frames} frames: the VAE needs 4k+1 frames (1, 5, ..., 125) and makes k+1 latents")
    return (num_frames - 1) // 4 + 1


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
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise VideoDatasetInputError(f"clip table {path} line {number}: not valid JSON ({error})") from None
            if not isinstance(record, dict):
                raise VideoDatasetInputError(f"clip table {path} line {number}: expected a JSON object, got "
                                             f"{type(record).__name__}")
            yield number, record


def _resolve(table: Path, value: str) -> Path:
    path = Path(value)
    return (path if path.is_absolute() else table.parent / path).resolve()


def read_clip_plan(tables: Sequence[str | Path], num_frames: int) -> ClipPlan:
    """Read and validate every clip table before any work.

    Checks (each error names the table, line, clip, field and the expected value): fields (exactly
    ``TABLE_FIELDS``, non-empty strings), clip ids (file-name safe, unique over all tables), table stems (= split
    names) distinct, the video exists (a folder of PNG frames with exactly ``num_frames`` frames, or a file with a
    video suffix; an mp4's frame count is checked when it is decoded, or up front with ``check_inputs``), and the
    pose file gives exactly ``latents_for_frames(num_frames)`` latents through ``camera.pose_to_input``.
    """
    num_latents = latents_for_frames(num_frames)
    paths = [Path(table).resolve() for table in tables]
    if not paths:
        raise VideoDatasetInputError("no clip tables given (--clips)")
    stems = [path.stem for path in paths]
    if len(set(stems)) != len(stems):
        raise VideoDatasetInputError(f"clip tables {[str(p) for p in paths]} have repeated file stems (= split names)")
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
# 3. Demo inputs: procedural moving clips, tiny encoders
# =============================================================================================================
def render_demo_frames(spec, motion: str, num_frames: int, frame_size: tuple[int, int]) -> np.ndarray:
    """uint8 [F, h, w, 3] of a demo scene (``demo.SceneSpec``) seen by a camera that follows ``motion`` ("w", "s",
    "w+left", "w+right"; per latent, as the pose strings): forward zooms in, backward out, a yaw pans. Latent i
    is video frame 4i, so the motion advances by 1/4 latent per frame."""
    from predictor_training.demo import render_scene

    height, width = frame_size
    big_h, big_w = 2 * height, 2 * width
    scene = render_scene(spec, big_h, big_w)
    moves = motion.split("+")
    forward = 1.0 if "w" in moves else -1.0 if "s" in moves else 0.0
    yaw = 1.0 if "right" in moves else -1.0 if "left" in moves else 0.0
    frames = []
    for index in range(num_frames):
        latent = index / 4.0
        zoom = 1.0 + 0.05 * forward * latent
        crop_h, crop_w = 0.6 * big_h / zoom, 0.6 * big_w / zoom
        centre_x = big_w / 2 + yaw * 0.03 * big_w * latent
        centre_x = min(max(centre_x, crop_w / 2), big_w - crop_w / 2)
        box = (centre_x - crop_w / 2, big_h / 2 - crop_h / 2, centre_x + crop_w / 2, big_h / 2 + crop_h / 2)
        frames.append(np.asarray(scene.resize((width, height), Image.Resampling.BILINEAR, box=box), dtype=np.uint8))
    return np.stack(frames)


def _demo_settings(num_clips: int, num_holdout: int, seed: int) -> dict:
    return {"version": 1, "num_clips": num_clips, "num_holdout": num_holdout, "seed": seed,
            "num_frames": DEMO_NUM_FRAMES, "frame_size": list(DEMO_FRAME_SIZE),
            "motions": [name for name, _ in DEMO_MOTIONS], "mp4_clip": "the last clip of each table, lossless H.264"}


def make_demo_clips(folder: str | Path, num_clips: int = 6, num_holdout: int = 2, seed: int = 0) -> list[Path]:
    """Write the demo's clips into ``folder`` (the clip tables' folder) and return the two tables.

    ``folder/frames/{clip_id}/`` PNG frames (or ``folder/videos/{clip_id}.mp4``, lossless, for the last clip of
    each table), ``folder/poses/{clip_id}.json`` (inference-format pose from a pose string, one key per latent),
    ``folder/train.jsonl`` and ``folder/holdout.jsonl``, ``folder/demo_clips.json`` (the settings). Deterministic
    from the arguments; an existing folder with the same settings is reused, one with other settings is refused.
    """
    from predictor_training.demo import make_demo_scenes

    folder = Path(folder)
    settings = _demo_settings(num_clips, num_holdout, seed)
    tables = [folder / "train.jsonl", folder / "holdout.jsonl"]
    if not 1 <= num_holdout < num_clips:
        raise ValueError(f"demo: num_holdout={num_holdout} must be in [1, num_clips={num_clips})")
    if (folder / DEMO_SETTINGS_NAME).is_file():
        existing = json.loads((folder / DEMO_SETTINGS_NAME).read_text())
        if existing != settings:
            raise VideoDatasetInputError(f"{folder / DEMO_SETTINGS_NAME}: the demo clips there were made with "
                                         f"{existing}, this run asks for {settings}; use another --demo folder")
        return tables
    if folder.exists():
        raise VideoDatasetInputError(f"{folder}: exists but has no {DEMO_SETTINGS_NAME}, so the demo did not make it; "
                                     "use another --demo folder (the demo never replaces files it did not write)")
    staging = folder.parent / f".{folder.name}.building"
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "poses").mkdir(parents=True)
    num_latents = latents_for_frames(DEMO_NUM_FRAMES)
    rows: dict[str, list[dict]] = {"train": [], "holdout": []}
    for index, scene in enumerate(make_demo_scenes(num_clips, seed)):
        clip_id = f"clip{index:03d}"
        split = "train" if index < num_clips - num_holdout else "holdout"
        last_of_split = index == num_clips - num_holdout - 1 or index == num_clips - 1
        motion = DEMO_MOTIONS[index % len(DEMO_MOTIONS)][1]
        frames = render_demo_frames(scene.spec, motion, DEMO_NUM_FRAMES, DEMO_FRAME_SIZE)
        video = f"videos/{clip_id}.mp4" if last_of_split else f"frames/{clip_id}"
        write_video(staging / video, frames, fps=24, lossless=True)
        pose = pose_string_to_json(f"{motion}-{num_latents - 1}")
        write_bytes_atomic(staging / "poses" / f"{clip_id}.json", (json.dumps(pose) + "\n").encode("utf-8"))
        rows[split].append({"clip_id": clip_id, "video": video, "pose": f"poses/{clip_id}.json",
                            "caption": scene.caption})
    for table in tables:
        lines = "".join(json.dumps(row) + "\n" for row in rows[table.stem])
        write_bytes_atomic(staging / table.name, lines.encode("utf-8"))
    write_bytes_atomic(staging / DEMO_SETTINGS_NAME, (json.dumps(settings, indent=2) + "\n").encode("utf-8"))
    staging.rename(folder)
    return tables


def ensure_demo_encoders(folder: str | Path, seed: int = 0) -> Path:
    """``folder`` if it holds encoders already (e.g. the ``encoders/`` of ``tools/make_demo_assets.py``), else the
    demo's tiny random encoders written there (``demo.save_tiny_encoders``, the sizes of the demo Teacher and the
    sub-seed make_demo_assets uses, so they equal the demo assets' encoders for the same seed)."""
    from predictor_training.demo import TinyEncoderSizes, save_tiny_encoders

    folder = Path(folder)
    if (folder / "model_index.json").is_file():
        return folder
    if folder.exists():
        raise VideoDatasetInputError(f"{folder}: exists but has no model_index.json (not a diffusers encoder folder); "
                                     "use another --demo folder")
    staging = folder.parent / f".{folder.name}.building"
    if staging.exists():
        shutil.rmtree(staging)
    save_tiny_encoders(staging, TinyEncoderSizes(), seed + DEMO_ENCODER_SEED)
    staging.rename(folder)
    return folder


def prepare_demo_inputs(demo: str | Path, num_clips: int = 6, num_holdout: int = 2, seed: int = 0):
    """(encoders folder, clip tables) of the demo folder ``demo``, made when absent (call on one rank only)."""
    demo = Path(demo)
    demo.mkdir(parents=True, exist_ok=True)
    encoders = ensure_demo_encoders(demo / DEMO_ENCODERS_DIR, seed)
    tables = make_demo_clips(demo / DEMO_CLIPS_DIR, num_clips, num_holdout, seed)
    return encoders, tables


def demo_tables(demo: str | Path) -> list[Path]:
    """The clip tables ``prepare_demo_inputs`` writes in the demo folder ``demo``."""
    return [Path(demo) / DEMO_CLIPS_DIR / "train.jsonl", Path(demo) / DEMO_CLIPS_DIR / "holdout.jsonl"]


# =============================================================================================================
# 4. Encoding one clip
# =============================================================================================================
def load_video_encoder(options, device) -> CaseEncoder:
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


def encode_clip(encoder: CaseEncoder, job: ClipJob, options) -> dict[str, torch.Tensor]:
    """Every stored tensor of one clip (names, shapes: module docstring); nothing is written here.

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
    viewmats, intrinsics, action = pose_to_input(job.pose, num_latents)
    tensors = {"latents": _store(latents[0], options.storage_dtype)}
    tensors.update({name: _store(encoded[name], options.storage_dtype) for name in ENCODER_FIELDS})
    tensors.update(viewmats=viewmats.to(torch.float32), Ks=intrinsics.to(torch.float32), action=action.to(torch.int64))
    return tensors


# =============================================================================================================
# 5. Dataset config, manifest entries, resume
# =============================================================================================================
def vae_config_sha256(vae) -> str:
    """sha256 of the VAE's config (its constructor arguments; private keys such as _name_or_path left out)."""
    return sha256_json({key: value for key, value in dict(vae.config).items() if not key.startswith("_")})


def video_dataset_config(options, plan: ClipPlan, encoder: CaseEncoder) -> dict:
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
    differences = config_differences(json.loads(path.read_text(encoding="utf-8")), config)
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
    """Rank 0, after every rank finished: one entry per planned clip, sorted by file name (so the manifest does not
    depend on the world size). Raises naming the file when a clip has no matching entry."""
    entries = known_entries(root)
    merged = []
    for job in sorted(plan.clips, key=lambda job: job.file):
        fingerprint = job.inputs_fingerprint()
        candidates = [entry for entry in entries.get(job.file, []) if entry.get("inputs_sha256") == fingerprint]
        distinct = {canonical_json(entry): entry for entry in candidates}
        if not distinct:
            raise RuntimeError(f"{root / job.file}: no manifest entry for clip '{job.clip_id}' after the build")
        if len(distinct) == 1:
            entry = next(iter(distinct.values()))
            verify_file(entry, root, check_sha256=False)  # size + tensor list; the sha256 was made when written
        else:
            entry, reason = finished_entry(root, job.file, list(distinct.values()))
            if entry is None:
                raise ShardVerificationError(f"{root / job.file}: matches none of its manifest entries: {reason}")
        merged.append(entry)
    return merged


# =============================================================================================================
# 6. The build
# =============================================================================================================
def run(options) -> int:
    """Build (or resume) the video-latent dataset in ``options.out``; ``torchrun``-aware. Returns the exit status.

    ``options``: a ``VideoBuildOptions`` or the command line's namespace with the same fields.
    """
    env = init_distributed({"auto": "auto", "cpu": "gloo", "cuda": "nccl"}[options.device])
    try:
        if options.demo is not None:
            if env.is_main:
                prepare_demo_inputs(options.demo, options.demo_clips, options.demo_holdout, options.demo_seed)
            barrier()
        plan = read_clip_plan(options.clips, options.num_frames)  # every rank, so every rank fails alike
        if options.check_only:
            return _check_only(plan, env)
        return build(options, plan, env)
    finally:
        cleanup_distributed()


def _check_only(plan: ClipPlan, env) -> int:
    problems = [message for part in all_gather_objects(check_inputs(plan, env.rank, env.world_size))
                for message in part]
    if problems:
        raise VideoDatasetInputError(f"{len(problems)} of {len(plan.clips)} clips fail the input check:\n  "
                                     + "\n  ".join(problems[:20]))
    if env.is_main:
        print(f"[build_video_latent_dataset] inputs ok: {len(plan.clips)} clips {plan.splits()}, "
              f"{plan.num_frames} frames -> {plan.num_latents} latents each", flush=True)
    return 0


def build(options, plan: ClipPlan, env) -> int:
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


# =============================================================================================================
# 7. The reader
# =============================================================================================================
@dataclass(frozen=True)
class ClipEntry:
    """One line of the video dataset's manifest.jsonl. tensors: {name: (shape, dtype)}."""

    kind: str
    file: str
    clip_id: str
    split: str
    bytes: int
    sha256: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    tensor_crc32: dict[str, str]
    record: dict = field(repr=False, compare=False)


def read_clip_manifest(root: str | Path) -> list[ClipEntry]:
    """Parse ``root/manifest.jsonl``; ValueError naming the line and field for a malformed entry."""
    path = Path(root) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"video dataset manifest not found: {path} (build it with "
                                "tools/build_video_latent_dataset.py)")
    entries = []
    for number, record in enumerate(read_jsonl(path), start=1):
        where = f"{path} line {number}"
        missing = [name for name in MANIFEST_FIELDS if name not in record]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}; expected fields {list(MANIFEST_FIELDS)}")
        if record["kind"] != MANIFEST_KIND:
            raise ValueError(f"{where}: field 'kind' is {record['kind']!r}, expected {MANIFEST_KIND!r}")
        tensors = {name: (tuple(int(size) for size in spec[0]), str(spec[1]))
                   for name, spec in record["tensors"].items()}
        checksums = record[TENSOR_CHECKSUM_FIELD]
        if not isinstance(checksums, dict) or sorted(checksums) != sorted(tensors):
            raise ValueError(f"{where}: field {TENSOR_CHECKSUM_FIELD!r} must name the same tensors as field 'tensors'")
        entries.append(ClipEntry(MANIFEST_KIND, record["file"], str(record["clip_id"]), str(record["split"]),
                                 int(record["bytes"]), str(record["sha256"]), tensors, dict(checksums), record))
    return entries


def read_video_dataset_config(root: str | Path) -> dict:
    path = Path(root) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"video dataset config not found: {path} (build the dataset with "
                                "tools/build_video_latent_dataset.py)")
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class WindowRef:
    """Address of one item: clip (index into the dataset's clips) and the first chunk of its window."""

    clip: int
    start_chunk: int


class VideoLatentDataset(Dataset):
    """Clips of one split of a video-latent dataset (built by ``tools/build_video_latent_dataset.py``).

    Args:
        root: dataset root (video_dataset_config.json, manifest.jsonl, clips/).
        split: manifest split (the clip table's file stem, e.g. "train").
        window_chunks: None = one item per clip, all T latents; n = one item per (clip, window of n whole chunks of
            4 latents): item ``clip * num_windows + start_chunk``, latents ``[4*start_chunk, 4*(start_chunk+n))``.
            ``ClipWindowSampler`` draws one window per clip and epoch.
        verify: check size and sha256 of every file of the split first (``shards.verify_file``).
        check_tensors: check every tensor against its manifest CRC-32 the first time this process reads it.
        float_dtype: cast floating tensors to this dtype (None keeps the stored dtype).

    An item (no randomness in ``__getitem__``; T_w = window latents, or T)::

        latents [C, T_w, H, W]; viewmats [T_w, 4, 4], Ks [T_w, 3, 3], action [T_w] (the window's frames, cameras in
        the clip's frame, not re-centred); image_cond [1, C, 1, H, W] (the clip's first frame = latent 0, also for
        windows that start later); prompt_embeds [1, L, D], prompt_mask [1, L], byt5_text_states [1, Lb, Db],
        byt5_text_mask [1, Lb], vision_states [1, Nv, Dv]; clip_id (str), latent_start (int: first latent).

    A tensor whose bytes disagree with its manifest CRC-32 raises ``shards.TensorChecksumError`` naming the file
    and the tensor.
    """

    def __init__(self, root: str | Path, split: str = "train", *, window_chunks: int | None = None,
                 verify: bool = False, check_tensors: bool = True, float_dtype: torch.dtype | None = None,
                 max_open_files: int = 32):
        self.root = Path(root)
        self.split = split
        self.float_dtype = float_dtype
        self.config = read_video_dataset_config(self.root)
        for name in ("num_latents", "chunk_latents", "latent_shape"):
            if name not in self.config:
                raise KeyError(f"{self.root / CONFIG_NAME}: missing field {name!r}")
        self.num_latents = int(self.config["num_latents"])
        self.chunk_latents = int(self.config["chunk_latents"])
        self.num_chunks = self.num_latents // self.chunk_latents

        # 1. the split's clips, sorted by clip_id; files present; recorded shapes as the config says
        entries = read_clip_manifest(self.root)
        self.clips = sorted((entry for entry in entries if entry.split == split), key=lambda entry: entry.clip_id)
        if not self.clips:
            raise ValueError(f"{self.root / MANIFEST_FILE}: no clip of split {split!r}; splits present: "
                             f"{sorted({entry.split for entry in entries})}")
        check_files_exist(self.root, self.clips)
        if verify:
            verify_checksums(self.root, self.clips)
        shape = self.config["latent_shape"]
        expected = (shape["C"], shape["T"], shape["H"], shape["W"])
        for entry in self.clips:
            absent = [name for name in CLIP_TENSORS if name not in entry.tensors]
            if absent:
                raise ValueError(f"{self.root / MANIFEST_FILE}: entry of {entry.file!r} lacks tensor(s) {absent}")
            if entry.tensors["latents"][0] != expected:
                raise ValueError(f"{self.root / entry.file}: tensor 'latents' has shape {entry.tensors['latents'][0]}, "
                                 f"{CONFIG_NAME} field 'latent_shape' says {list(expected)}")

        # 2. windows
        if window_chunks is not None and not 1 <= int(window_chunks) <= self.num_chunks:
            raise ValueError(f"window_chunks={window_chunks}: the clips have {self.num_chunks} whole chunks of "
                             f"{self.chunk_latents} latents ({self.num_latents} latents)")
        self.window_chunks = None if window_chunks is None else int(window_chunks)
        self.num_windows = 1 if window_chunks is None else self.num_chunks - self.window_chunks + 1
        checksums = TensorChecksums({self.root / entry.file: entry.tensor_crc32 for entry in self.clips}) if (
            check_tensors) else None
        self._checksums = checksums
        self._files = SafetensorsHandles(max_open_files, checksums)

    # ---- index ------------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.clips) * self.num_windows

    @property
    def num_clips(self) -> int:
        return len(self.clips)

    def ref(self, index: int) -> WindowRef:
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} outside the {len(self)} items of split {self.split!r}")
        return WindowRef(index // self.num_windows, index % self.num_windows)

    def index_of(self, clip: int, start_chunk: int = 0) -> int:
        """The item index of window ``start_chunk`` of clip ``clip`` (``start_chunk`` 0 without windows)."""
        if not (0 <= clip < len(self.clips) and 0 <= start_chunk < self.num_windows):
            raise IndexError(f"clip {clip}, start_chunk {start_chunk}: expected clip < {len(self.clips)} and "
                             f"start_chunk < {self.num_windows}")
        return clip * self.num_windows + start_chunk

    def latent_range(self, index: int) -> tuple[int, int]:
        """[first, end) latent of item ``index``."""
        ref = self.ref(index)
        if self.window_chunks is None:
            return 0, self.num_latents
        first = ref.start_chunk * self.chunk_latents
        return first, first + self.window_chunks * self.chunk_latents

    # ---- reading ----------------------------------------------------------------------------------------------------
    def _read_frames(self, path: Path, name: str, axis: int, first: int, end: int, whole: int) -> torch.Tensor:
        """``tensor[..., first:end, ...]`` along ``axis``; the whole tensor on its first (checked) read."""
        if (first, end) == (0, whole) or (self._checksums is not None and self._checksums.pending(path, name)):
            tensor = self._files.read(path, name)
            return tensor.narrow(axis, first, end - first).clone() if (first, end) != (0, whole) else tensor
        view = self._files.get(path).get_slice(name)
        return view[(slice(None),) * axis + (slice(first, end),)]

    def __getitem__(self, index: int) -> dict:
        entry = self.clips[self.ref(index).clip]
        path = self.root / entry.file
        first, end = self.latent_range(index)
        item = {
            "clip_id": entry.clip_id,
            "latent_start": first,
            "latents": self._read_frames(path, "latents", 1, first, end, self.num_latents),
        }
        for name in CAMERA_FIELDS:
            item[name] = self._read_frames(path, name, 0, first, end, self.num_latents)
        for name in ENCODER_FIELDS:
            item[name] = self._files.read(path, name)
        if self.float_dtype is not None:
            item = {key: value.to(self.float_dtype) if isinstance(value, torch.Tensor) and value.is_floating_point()
                    else value for key, value in item.items()}
        return item


def collate_video_clips(items: Sequence[dict]) -> dict:
    """Batch ``VideoLatentDataset`` items: latents [B, C, T_w, H, W], viewmats [B, T_w, 4, 4], Ks [B, T_w, 3, 3],
    action [B, T_w], latent_start int64 [B]; the encoder-stage fields concatenated on their batch axis
    (image_cond [B, C, 1, H, W], prompt_embeds [B, L, D], prompt_mask [B, L], byt5_text_states [B, Lb, Db],
    byt5_text_mask [B, Lb], vision_states [B, Nv, Dv]); clip_id a list."""
    if not items:
        raise ValueError("collate_video_clips got an empty batch")
    batch = {"clip_id": [item["clip_id"] for item in items],
             "latent_start": torch.tensor([item["latent_start"] for item in items], dtype=torch.int64)}
    for name in ("latents", *CAMERA_FIELDS):
        batch[name] = torch.stack([item[name] for item in items])
    for name in ENCODER_FIELDS:
        batch[name] = torch.cat([item[name] for item in items], dim=0)
    return batch


class ClipWindowSampler(Sampler[int]):
    """One item per clip and epoch, in a shuffled clip order, with a random window start for every clip.

    The order and the windows of epoch e are a pure function of (seed, e): ``samplers.epoch_generator(seed, e)``
    draws a permutation of the clips, then one start chunk per clip. The epoch's list is padded (drop_last=False,
    repeating its start) or cut (drop_last=True) to a multiple of ``num_replicas`` and dealt round-robin, so every
    rank yields ``len(self)`` items. ``ResumableBatches`` calls ``set_epoch`` and skips the batches already seen,
    which gives exactly the remaining items of an uninterrupted run.
    """

    def __init__(self, dataset: VideoLatentDataset, *, seed: int = 0, shuffle: bool = True, num_replicas: int = 1,
                 rank: int = 0, drop_last: bool = False):
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank}, num_replicas={num_replicas}: expected 0 <= rank < num_replicas")
        self.num_clips = dataset.num_clips
        self.num_windows = dataset.num_windows
        self.seed, self.shuffle, self.num_replicas, self.rank = int(seed), bool(shuffle), int(num_replicas), int(rank)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        per_rank = self.num_clips // num_replicas if drop_last else -(-self.num_clips // num_replicas)
        if per_rank == 0:
            raise ValueError(f"{self.num_clips} clips leave no item per rank for {num_replicas} ranks")
        self._per_rank = per_rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def epoch_items(self, epoch: int) -> list[int]:
        """Dataset indices of every rank's items of ``epoch`` in dealing order (``len(self) * num_replicas``)."""
        generator = epoch_generator(self.seed, epoch)
        order = torch.randperm(self.num_clips, generator=generator).tolist() if self.shuffle else list(
            range(self.num_clips))
        starts = torch.randint(0, self.num_windows, (self.num_clips,), generator=generator).tolist()
        items = [clip * self.num_windows + starts[clip] for clip in order]
        wanted = self._per_rank * self.num_replicas
        while len(items) < wanted:
            items += items[: wanted - len(items)]
        return items[:wanted]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_items(self.epoch)[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self._per_rank
