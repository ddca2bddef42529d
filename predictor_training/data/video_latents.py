"""The video-latent dataset's layout and reader: ``VideoLatentDataset``, ``ClipWindowSampler``, ``collate_video_clips``.

Per clip: VAE latents + camera/action + caption encoder outputs + first-frame condition. Built by
``predictor_training.data.video_latent_build`` (``run``; command line ``tools/build_video_latent_dataset.py``, demo
inputs ``predictor_training.world.video_latent_demo``). This module also holds what the builder and the demo share
with the reader: the file and tensor names below, ``latents_for_frames`` and ``VideoDatasetInputError``.

Layout (fields and commands: docs/video_latents.md)::

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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

from predictor_training.data.builder import MANIFEST_FILE
from predictor_training.data.manifest import check_files_exist, verify_checksums
from predictor_training.data.safetensors_handles import SafetensorsHandles, check_finite_tensor
from predictor_training.data.samplers import epoch_generator
from predictor_training.data.shards import TENSOR_CHECKSUM_FIELD, TensorChecksums, read_jsonl
from predictor_training.runtime.errors import MissingFieldError, MissingFileError, UserInputError
from predictor_training.runtime.io import read_json_file

CONFIG_NAME = "video_dataset_config.json"

CLIPS_DIR = "clips"
MANIFEST_KIND = "clip"
CHUNK_LATENTS = 4  # latent frames per AR chunk of WorldPlay
TEXT_FIELDS = ("prompt_embeds", "prompt_mask", "byt5_text_states", "byt5_text_mask", "vision_states")
ENCODER_FIELDS = (*TEXT_FIELDS, "image_cond")  # [1, ...] tensors in the encoder stage's layout
CAMERA_FIELDS = ("viewmats", "Ks", "action")
CLIP_TENSORS = ("latents", "image_cond", *CAMERA_FIELDS, *TEXT_FIELDS)
MANIFEST_FIELDS = ("kind", "file", "clip_id", "split", "bytes", "sha256", "tensors", TENSOR_CHECKSUM_FIELD,
                   "inputs_sha256")


# =============================================================================================================
# 1. Shared with the builder and the demo
# =============================================================================================================
class VideoDatasetInputError(UserInputError):
    """Bad builder input or a refused resume; the message names the file, the field and the expected value."""


def latents_for_frames(num_frames: int) -> int:
    """Latent frames of the causal VAE (temporal factor 4): 4k+1 frames -> k+1 latents (125 -> 32).

    Raises ValueError for a count that is not of the form 4k+1.
    """
    if num_frames < 1 or (num_frames - 1) % 4:
        raise ValueError(f"{num_frames} frames: the VAE needs 4k+1 frames (1, 5, ..., 125) and makes k+1 latents")
    return (num_frames - 1) // 4 + 1


# =============================================================================================================
# 2. The reader
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
        raise MissingFileError(f"video dataset manifest not found: {path} (build it with "
                                "tools/build_video_latent_dataset.py)")
    entries = []
    for number, record in enumerate(read_jsonl(path), start=1):
        where = f"{path} line {number}"
        missing = [name for name in MANIFEST_FIELDS if name not in record]
        if missing:
            raise UserInputError(f"{where}: missing field(s) {missing}; expected fields {list(MANIFEST_FIELDS)}")
        if record["kind"] != MANIFEST_KIND:
            raise UserInputError(f"{where}: field 'kind' is {record['kind']!r}, expected {MANIFEST_KIND!r}")
        tensors = {name: (tuple(int(size) for size in spec[0]), str(spec[1]))
                   for name, spec in record["tensors"].items()}
        checksums = record[TENSOR_CHECKSUM_FIELD]
        if not isinstance(checksums, dict) or sorted(checksums) != sorted(tensors):
            raise UserInputError(f"{where}: field {TENSOR_CHECKSUM_FIELD!r} must name the same tensors as field 'tensors'")
        entries.append(ClipEntry(MANIFEST_KIND, record["file"], str(record["clip_id"]), str(record["split"]),
                                 int(record["bytes"]), str(record["sha256"]), tensors, dict(checksums), record))
    return entries


def read_video_dataset_config(root: str | Path) -> dict:
    path = Path(root) / CONFIG_NAME
    if not path.is_file():
        raise MissingFileError(f"video dataset config not found: {path} (build the dataset with "
                                "tools/build_video_latent_dataset.py)")
    config = read_json_file(path, VideoDatasetInputError)
    if not isinstance(config, dict):
        raise VideoDatasetInputError(f"{path}: holds a {type(config).__name__}; expected a JSON object")
    return config


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
                raise MissingFieldError(f"{self.root / CONFIG_NAME}: missing field {name!r}")
        self.num_latents = int(self.config["num_latents"])
        self.chunk_latents = int(self.config["chunk_latents"])
        self.num_chunks = self.num_latents // self.chunk_latents

        # 1. the split's clips, sorted by clip_id; files present; recorded shapes as the config says
        entries = read_clip_manifest(self.root)
        self.clips = sorted((entry for entry in entries if entry.split == split), key=lambda entry: entry.clip_id)
        if not self.clips:
            raise UserInputError(f"{self.root / MANIFEST_FILE}: no clip of split {split!r}; splits present: "
                             f"{sorted({entry.split for entry in entries})}")
        check_files_exist(self.root, self.clips)
        if verify:
            verify_checksums(self.root, self.clips)
        shape = self.config["latent_shape"]
        expected = (shape["C"], shape["T"], shape["H"], shape["W"])
        for entry in self.clips:
            absent = [name for name in CLIP_TENSORS if name not in entry.tensors]
            if absent:
                raise UserInputError(f"{self.root / MANIFEST_FILE}: entry of {entry.file!r} lacks tensor(s) {absent}")
            if entry.tensors["latents"][0] != expected:
                raise UserInputError(f"{self.root / entry.file}: tensor 'latents' has shape {entry.tensors['latents'][0]}, "
                                 f"{CONFIG_NAME} field 'latent_shape' says {list(expected)}")

        # 2. windows
        if window_chunks is not None and not 1 <= int(window_chunks) <= self.num_chunks:
            raise UserInputError(f"window_chunks={window_chunks}: the clips have {self.num_chunks} whole chunks of "
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
        check_finite_tensor(item["latents"], path, "latents")  # every method's training target
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
