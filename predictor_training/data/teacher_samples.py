"""The Teacher's own F-F-F-F videos as training data: one item per trajectory of the offline Predictor dataset.

The dataset built by ``tools/build_predictor_dataset.py`` (layout: docs/dataset.md § Layout of DS/) stores, for every
trajectory, the running latents after the last Euler step of every chunk (``chunk{c}.final_latent`` [C, 4, H, W]).
Concatenated along the frame axis they are the Teacher's finished video latent ``[C, T, H, W]``: "final latents as
data" for a diffusion-forcing SFT. Everything else of a trajectory file (per-step latents, hiddens, velocities,
context pre-features) is never read.

An item uses the keys and shapes of ``video_latents.VideoLatentDataset`` items where they overlap (whole clips,
``window_chunks=None``), with T = ``num_latents``::

    clip_id       str                      f"{case_id}__a{action_id}"
    latent_start  int                      0 (whole trajectories)
    latents       [C, T, H, W]             cat(chunk0.final_latent, ..., chunk{T/4-1}.final_latent) along T
    viewmats      [T, 4, 4]   f32          world-to-camera
    Ks            [T, 3, 3]   f32          normalised intrinsics
    action        [T]         int64        action labels
    image_cond    [1, C, 1, H, W]          the case's reference-image latent (belongs to latent 0)
    text_k, text_v [depth, heads, L, d]    the case's stored text K/V of every double block, valid tokens only
                                           (instead of the encoder outputs of the video dataset)
    seed          int                      the row's seed: the initial noise and the memory-retrieval points of
                                           the Teacher's rollout (a trainer re-selecting the context on these
                                           latents uses it, with ``dataset.config``'s memory settings, to pick the
                                           frames the Teacher picked)
    case_id (str), action_id (int)

Floating tensors keep the storage dtype (bf16) unless ``float_dtype`` is given.

Checks: at construction (no tensor read) the config fields, the split, every used file's presence, the tensors each
manifest entry lists and their recorded shapes against ``dataset_config.json``; with ``verify=True`` also size,
sha256 and tensor list of every used file (``shards.verify_file``). On read, every tensor is checked against its
manifest CRC-32 the first time the process reads it (``shards.TensorChecksumError`` naming file and tensor), exactly
as ``PairDataset`` does (``SafetensorsHandles``). Case tensors are not cached across items: the files are
memory-mapped, each tensor is hashed once per process, and a cached tensor handed to several items could be changed
in place by one consumer under the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, config_field, read_dataset_config
from predictor_training.data.manifest import (
    MANIFEST_NAME,
    ManifestEntry,
    check_files_exist,
    read_manifest,
    tensor_checksums,
    verify_checksums,
)
from predictor_training.data.pair_dataset import pad_text_kv
from predictor_training.data.safetensors_handles import SafetensorsHandles
from predictor_training.runtime.errors import MissingFieldError, UserInputError

CASE_TENSORS = ("image_cond", "text_k", "text_v")
CAMERA_TENSORS = ("viewmats", "Ks", "action")


def final_latent_tensor(chunk: int) -> str:
    """e.g. ``chunk3.final_latent``."""
    return f"chunk{chunk}.final_latent"


class TeacherSampleDataset(Dataset):
    """Whole Teacher trajectories of one split as video latents; see the module docstring for the item layout.

    Args:
        dataset_root: root of a dataset built by ``tools/build_predictor_dataset.py`` (``dataset_config.json``,
            ``manifest.jsonl``, ``cases/``, ``trajectories/``).
        split: manifest ``split`` of the trajectories (the sample table's file stem: "train", "holdout25", ...).
        verify: check size, sha256 and tensor list of every used file against the manifest first.
        check_tensors: check every tensor against its manifest CRC-32 the first time this process reads it
            (default; ``False`` only to measure the cost).
        float_dtype: cast floating tensors to this dtype (None keeps the storage dtype).
        max_open_files: open safetensors handles kept per process.

    Items are ordered by ``(case_id, action_id)``. A manifest without per-tensor checksums (older builder) loads with
    one ``manifest.UncheckedTensorsWarning`` (none with ``verify=True``).
    """

    def __init__(
        self,
        dataset_root: str | Path,
        split: str = "train",
        *,
        verify: bool = False,
        check_tensors: bool = True,
        float_dtype: torch.dtype | None = None,
        max_open_files: int = 32,
    ):
        self.root = Path(dataset_root)
        self.split = split
        self.float_dtype = float_dtype
        self._read_config()

        # 1. the split's trajectories (sorted by key) and their case files
        entries = read_manifest(self.root)
        self.trajectories: list[ManifestEntry] = sorted(
            (e for e in entries if e.kind == "trajectory" and e.split == split), key=lambda e: (e.case_id, e.action_id)
        )
        if not self.trajectories:
            splits = sorted({e.split for e in entries if e.kind == "trajectory"})
            raise UserInputError(f"{self.root / MANIFEST_NAME}: no trajectory of split {split!r}; splits present: {splits}")
        cases = {e.case_id: e for e in entries if e.kind == "case"}
        missing = sorted({t.case_id for t in self.trajectories} - set(cases))
        if missing:
            raise UserInputError(f"{self.root / MANIFEST_NAME}: no case entry for case_id(s) {missing[:5]}")
        self.cases: dict[str, ManifestEntry] = {t.case_id: cases[t.case_id] for t in self.trajectories}

        # 2. files present (always), whole-file checks (verify=True), recorded tensors and shapes (always)
        used = [*self.cases.values(), *self.trajectories]
        check_files_exist(self.root, used)
        if verify:
            verify_checksums(self.root, used)
        for case in self.cases.values():
            self._check_case_entry(case)
        for trajectory in self.trajectories:
            self._check_trajectory_entry(trajectory)
        checksums = tensor_checksums(self.root, used, verified=verify) if check_tensors else None
        self._files = SafetensorsHandles(max_open_files, checksums)

    # ---- construction checks ----------------------------------------------------------------------------------------
    def _read_config(self) -> None:
        config = read_dataset_config(self.root)
        self.config = config  # the build's settings (AR loop, memory window), for a reader that re-runs its context
        where = self.root / DATASET_CONFIG_NAME
        self.num_latents = int(config_field(config, "num_latents", self.root))
        self.chunk_latents = int(config_field(config, "chunk_latents", self.root))
        if self.chunk_latents < 1 or self.num_latents < 1 or self.num_latents % self.chunk_latents:
            raise UserInputError(f"{where}: fields 'num_latents'={self.num_latents} and 'chunk_latents'="
                             f"{self.chunk_latents}: num_latents must be a positive multiple of chunk_latents")
        self.num_chunks = self.num_latents // self.chunk_latents
        if "num_chunks" in config and int(config["num_chunks"]) != self.num_chunks:
            raise UserInputError(f"{where}: field 'num_chunks'={config['num_chunks']}, but num_latents / chunk_latents = "
                             f"{self.num_chunks}")
        grid = config_field(config, "grid", self.root)
        if not isinstance(grid, dict):
            raise UserInputError(f"{where}: field 'grid' is {grid!r}, expected {{'C': .., 'H': .., 'W': ..}}")
        absent = [axis for axis in ("C", "H", "W") if axis not in grid]
        if absent:
            raise MissingFieldError(f"{where}: missing field(s) {['grid.' + axis for axis in absent]}")
        self.channels, self.height, self.width = (int(grid[axis]) for axis in ("C", "H", "W"))

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """``(C, T, H, W)`` of an item's ``latents``."""
        return self.channels, self.num_latents, self.height, self.width

    def _expect_shapes(self, entry: ManifestEntry, expected: dict[str, tuple[int, ...] | None]) -> None:
        """Every name in ``expected`` is listed by ``entry`` with that shape (None: any shape); else ValueError
        naming the file, the tensor and ``dataset_config.json``."""
        absent = [name for name in expected if name not in entry.tensors]
        if absent:
            raise UserInputError(f"{self.root / MANIFEST_NAME}: entry of {entry.file!r} lacks tensor(s) {absent[:6]}")
        for name, shape in expected.items():
            if shape is not None and entry.shape(name) != shape:
                raise UserInputError(
                    f"{self.root / entry.file}: tensor {name!r} has shape {list(entry.shape(name))}, "
                    f"{DATASET_CONFIG_NAME} (grid, num_latents, chunk_latents) says {list(shape)}"
                )

    def _check_case_entry(self, case: ManifestEntry) -> None:
        self._expect_shapes(case, {"image_cond": (1, self.channels, 1, self.height, self.width),
                                   "text_k": None, "text_v": None})
        if case.shape("text_k") != case.shape("text_v") or len(case.shape("text_k")) != 4:
            raise UserInputError(f"{self.root / case.file}: tensors 'text_k' {list(case.shape('text_k'))} and 'text_v' "
                             f"{list(case.shape('text_v'))} must share one shape [depth, heads, L, d]")

    def _check_trajectory_entry(self, trajectory: ManifestEntry) -> None:
        frames, chunk = self.num_latents, (self.channels, self.chunk_latents, self.height, self.width)
        expected: dict[str, tuple[int, ...] | None] = {
            "viewmats": (frames, 4, 4), "Ks": (frames, 3, 3), "action": (frames,), "seed": (1,),
        }
        expected.update({final_latent_tensor(c): chunk for c in range(self.num_chunks)})
        self._expect_shapes(trajectory, expected)

    # ---- index ------------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def num_clips(self) -> int:
        """Number of trajectories (= ``len(self)``; named like ``VideoLatentDataset.num_clips``)."""
        return len(self.trajectories)

    def key_of(self, index: int) -> tuple[str, int]:
        """(case_id, action_id) of item ``index``."""
        trajectory = self.trajectories[index]
        return trajectory.case_id, trajectory.action_id

    def keys(self) -> list[tuple[str, int]]:
        """(case_id, action_id) of every item, in index order."""
        return [self.key_of(index) for index in range(len(self))]

    # ---- reading ----------------------------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} outside the {len(self)} trajectories of split {self.split!r}")
        trajectory = self.trajectories[index]
        path = self.root / trajectory.file
        case_path = self.root / self.cases[trajectory.case_id].file
        read = self._files.read
        item = {
            "clip_id": f"{trajectory.case_id}__a{trajectory.action_id}",
            "case_id": trajectory.case_id,
            "action_id": int(trajectory.action_id),
            "latent_start": 0,
            "latents": torch.cat([read(path, final_latent_tensor(c)) for c in range(self.num_chunks)], dim=1),
            **{name: read(path, name) for name in CAMERA_TENSORS},
            **{name: read(case_path, name) for name in CASE_TENSORS},
            "seed": int(read(path, "seed").reshape(-1)[0]),
        }
        if self.float_dtype is not None:
            item = {key: value.to(self.float_dtype) if isinstance(value, torch.Tensor) and value.is_floating_point()
                    else value for key, value in item.items()}
        return item


def collate_teacher_samples(items: Sequence[dict]) -> dict:
    """Batch ``TeacherSampleDataset`` items: ``latents`` [B, C, T, H, W], ``viewmats`` [B, T, 4, 4], ``Ks``
    [B, T, 3, 3], ``action`` [B, T]; ``image_cond`` [B, C, 1, H, W] (concatenated on its batch axis, like
    ``collate_video_clips``); ``text_k``/``text_v`` [B, depth, heads, L_max, d] zero-padded with ``text_mask``
    [B, L_max] bool (True = valid token; ``pair_dataset.pad_text_kv``); ``latent_start``, ``action_id``, ``seed``
    int64 [B]; ``clip_id``, ``case_id`` lists."""
    if not items:
        raise ValueError("collate_teacher_samples got an empty batch")
    batch: dict = {name: [item[name] for item in items] for name in ("clip_id", "case_id")}
    for name in ("latent_start", "action_id", "seed"):
        batch[name] = torch.tensor([item[name] for item in items], dtype=torch.int64)
    for name in ("latents", *CAMERA_TENSORS):
        batch[name] = torch.stack([item[name] for item in items])
    batch["image_cond"] = torch.cat([item["image_cond"] for item in items], dim=0)
    batch["text_k"], batch["text_mask"] = pad_text_kv([item["text_k"] for item in items])
    batch["text_v"], _ = pad_text_kv([item["text_v"] for item in items])
    return batch
