"""Pair reader of the offline Predictor dataset (layout: docs/dataset.md; built by
``tools/build_predictor_dataset.py``).

One item is one supervision pair ``(anchor step j -> target step k)`` of one chunk ``c`` of one trajectory
``(case_id, action_id)``. The Predictor sees the noisy input of step ``k`` and the Teacher's final hidden of step
``j`` and must reproduce the Teacher's final hidden and velocity of step ``k``. With T = ``chunk_latents`` of the
dataset config (4) and N = T*H*W tokens (order frame, row, column)::

    noisy_input      [2C+1, T, H, W]  latent_in of step k | image-cond channels | mask   (cond rebuilt, see below)
    timestep         []      f32      model timestep of step k
    action           [T]     int64    action labels of the chunk's latent frames
    viewmats         [T,4,4] f32      world-to-camera matrices of those frames
    Ks               [T,3,3] f32      normalised intrinsics of those frames
    anchor_hidden    [N, D]           final hidden of step j
    target_hidden    [N, D]           final hidden of step k
    target_velocity  [C,T,H,W]        Teacher velocity of step k
    prev_chunk_hidden [N, D]          final hidden of step k of chunk c-1          (with_prev_chunk_hidden)
    ctx_prefeatures  {L: [n*H*W, D]}  hidden entering double block L during the context prefill, L in source_layers
    ctx_action [n], ctx_viewmats [n,4,4], ctx_Ks [n,3,3], n_ctx (int)   of the chunk's context frames (with_prefeatures)
    text_k, text_v   [2, heads, L_txt, d]   exact text K/V of the two source layers, in source_layers order
    case_id, action_id, chunk, step (= k), anchor_step (= j)

Floating tensors come in the storage dtype (bf16) unless ``float_dtype`` is given; the trainer casts.

Condition channels are not stored: frame 0 of the video (chunk 0, frame 0) carries the case's ``image_cond`` and
mask 1, every other frame carries zeros.

Files are opened lazily with ``safetensors.safe_open`` (memory-mapped) in the process that reads them, so a dataset
object is safe to hand to DataLoader workers (fork or spawn): open handles never cross a process boundary
(``safetensors_handles.SafetensorsHandles``).

Every tensor is checked against its CRC-32 from the manifest (``tensor_crc32``; data/manifest.py) the first time a
process reads it (``shards.TensorChecksums``); a damaged tensor raises ``shards.TensorChecksumError`` naming the file
and the tensor. A manifest written before per-tensor checksums existed still loads, with one
``manifest.UncheckedTensorsWarning``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, DistributedSampler

from predictor_training.data.dataset_config import DATASET_CONFIG_NAME, config_field, read_dataset_config
from predictor_training.data.manifest import (
    MANIFEST_NAME,
    ManifestEntry,
    check_files_exist,
    read_manifest,
    tensor_checksums,
    verify_checksums,
)
from predictor_training.data.safetensors_handles import SafetensorsHandles, check_finite_tensor
from predictor_training.data.samplers import BucketBatchSampler
from predictor_training.runtime.distributed import DistEnv
from predictor_training.data.batches import ResumableBatches
from predictor_training.runtime.errors import UserInputError

DEFAULT_PAIRS: tuple[tuple[int, int], ...] = ((0, 1), (1, 2), (2, 3))


# ---------------------------------------------------------------------------------------------------------------------
# Tensor names inside a trajectory file
# ---------------------------------------------------------------------------------------------------------------------
def step_tensor(chunk: int, step: int, what: str) -> str:
    """e.g. ``chunk3.step1.final_hidden``."""
    return f"chunk{chunk}.step{step}.{what}"


def ctx_indices_tensor(chunk: int) -> str:
    return f"chunk{chunk}.ctx_indices"


def ctx_prefeature_tensor(chunk: int, layer: int) -> str:
    return f"chunk{chunk}.ctx_prefeature.layer{layer}"


def n_ctx_from_manifest(entry: ManifestEntry, chunk: int) -> int:
    """Number of context frames of a chunk from the recorded shapes (0 for chunk 0, which has no context)."""
    if chunk == 0:
        return 0
    return entry.shape(ctx_indices_tensor(chunk))[0]


def build_condition_channels(image_cond: torch.Tensor, chunk: int, num_frames: int) -> torch.Tensor:
    """Condition channels of one chunk's frames: ``[image-cond (C) | mask (1)]``.

    Args:
        image_cond: [1, C, 1, H, W] (case file layout).
    Returns:
        [C + 1, num_frames, H, W] in ``image_cond``'s dtype; only video frame 0 (chunk 0, frame 0) is non-zero.
    """
    if image_cond.dim() != 5 or image_cond.shape[0] != 1 or image_cond.shape[2] != 1:
        raise ValueError(f"image_cond must be [1, C, 1, H, W], got {tuple(image_cond.shape)}")
    latent = image_cond[0, :, 0]
    channels, height, width = latent.shape
    cond = torch.zeros(channels + 1, num_frames, height, width, dtype=image_cond.dtype)
    if chunk == 0:
        cond[:channels, 0] = latent
        cond[channels, 0] = 1
    return cond


# ---------------------------------------------------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairRef:
    """Address of one item: trajectory (index into the dataset's trajectory list), chunk, anchor and target step."""

    trajectory: int
    chunk: int
    anchor_step: int
    target_step: int


class PairDataset(Dataset):
    """Supervision pairs of the offline dataset; see the module docstring for the item layout.

    Args:
        root: dataset root (``dataset_config.json``, ``manifest.jsonl``, ``cases/``, ``trajectories/``).
        split: manifest ``split`` of the trajectories to use (e.g. "train", "holdout25").
        pairs: (anchor step, target step) pairs, 0 <= j < k < num_steps.
        with_prefeatures: add the context (pre-features of ``source_layers`` and the context frames' camera/action).
        with_prev_chunk_hidden: add the final hidden of step k of chunk c-1.
        source_layers: the Predictor's two source blocks (a, b); selects text K/V (and pre-features) layers.
        verify: check size and sha256 of every file the split reads against the manifest first.
        check_tensors: check every tensor against its manifest CRC-32 when this process first reads it (default;
            ``False`` only to measure what the check costs, ``benchmarks/bench_tensor_checksums.py``).
        include_chunk0: None = include chunk 0 exactly when neither the context nor the previous chunk is used;
            False = leave it out anyway (the upstream disca recipe trained on chunks 1-7 only: 400 x 7 x 3 = 8400
            pairs); True is refused when the context or the previous chunk is used (chunk 0 has neither).
        float_dtype: cast floating tensors to this dtype (None keeps the storage dtype).
        max_open_files: open handles kept per process.

    Chunk 0 is left out when the context or the previous chunk is needed (it has neither), or on request.
    A manifest without per-tensor checksums (older builder) loads with one ``UncheckedTensorsWarning``.
    """

    def __init__(
        self,
        root: str | Path,
        split: str = "train",
        pairs: Sequence[tuple[int, int]] = DEFAULT_PAIRS,
        with_prefeatures: bool = True,
        with_prev_chunk_hidden: bool = True,
        *,
        source_layers: tuple[int, int],
        verify: bool = False,
        include_chunk0: bool | None = None,
        float_dtype: torch.dtype | None = None,
        max_open_files: int = 32,
        check_tensors: bool = True,
    ):
        self.root = Path(root)
        self.split = split
        self.with_prefeatures = bool(with_prefeatures)
        self.with_prev_chunk_hidden = bool(with_prev_chunk_hidden)
        self.float_dtype = float_dtype
        config = read_dataset_config(self.root)
        self.num_chunks = int(config_field(config, "num_chunks", self.root))
        self.num_steps = int(config_field(config, "num_steps", self.root))
        self.chunk_latents = int(config_field(config, "chunk_latents", self.root))
        self.pairs = self._checked_pairs(pairs)
        self.source_layers = self._checked_source_layers(source_layers, config)

        # 1. the split's trajectories (sorted by key) and their case files
        entries = read_manifest(self.root)
        self.trajectories = sorted(
            (e for e in entries if e.kind == "trajectory" and e.split == split), key=lambda e: (e.case_id, e.action_id)
        )
        if not self.trajectories:
            splits = sorted({e.split for e in entries if e.kind == "trajectory"})
            raise UserInputError(f"{self.root / MANIFEST_NAME}: no trajectory of split {split!r}; splits present: {splits}")
        cases = {e.case_id: e for e in entries if e.kind == "case"}
        missing_cases = sorted({t.case_id for t in self.trajectories} - set(cases))
        if missing_cases:
            raise UserInputError(f"{self.root / MANIFEST_NAME}: no case entry for case_id(s) {missing_cases[:5]}")
        self.cases = {t.case_id: cases[t.case_id] for t in self.trajectories}

        # 2. files present (always), checksums (verify=True), tensors recorded
        used = [*self.cases.values(), *self.trajectories]
        check_files_exist(self.root, used)
        if verify:
            verify_checksums(self.root, used)
        for trajectory in self.trajectories:
            self._check_recorded_tensors(trajectory)

        # 3. item index and the per-item context sizes (manifest shapes only, no tensor reads)
        first_chunk = 0 if self._chunk0_included(include_chunk0) else 1
        self.refs = [
            PairRef(index, chunk, anchor, target)
            for index in range(len(self.trajectories))
            for chunk in range(first_chunk, self.num_chunks)
            for anchor, target in self.pairs
        ]
        self._n_ctx = [n_ctx_from_manifest(self.trajectories[r.trajectory], r.chunk) for r in self.refs]
        checksums = tensor_checksums(self.root, used, verified=verify) if check_tensors else None
        self._files = SafetensorsHandles(max_open_files, checksums)

    # ---- validation -------------------------------------------------------------------------------------------------
    def _chunk0_included(self, include_chunk0: bool | None) -> bool:
        needs_previous = self.with_prefeatures or self.with_prev_chunk_hidden
        if include_chunk0 is None:
            return not needs_previous
        if include_chunk0 and needs_previous:
            raise ValueError("include_chunk0=True needs with_prefeatures=False and with_prev_chunk_hidden=False")
        return bool(include_chunk0)

    def _checked_pairs(self, pairs) -> tuple[tuple[int, int], ...]:
        checked = tuple((int(j), int(k)) for j, k in pairs)
        for anchor, target in checked:
            if not 0 <= anchor < target < self.num_steps:
                raise UserInputError(
                    f"--pairs: pair {anchor}-{target}: expected 0 <= anchor < target < num_steps={self.num_steps} "
                    f"(of {self.root / DATASET_CONFIG_NAME})"
                )
        if not checked:
            raise ValueError("pairs is empty")
        return checked

    def _checked_source_layers(self, source_layers, config: dict) -> tuple[int, int]:
        layers = tuple(int(layer) for layer in source_layers)
        if len(layers) != 2:
            raise ValueError(f"source_layers must be two block indices (a, b), got {source_layers!r}")
        if self.with_prefeatures:
            stored = [int(layer) for layer in config_field(config, "prefeature_layers", self.root)]
            absent = [layer for layer in layers if layer not in stored]
            if absent:
                raise UserInputError(
                    f"--source_blocks {','.join(map(str, layers))}: {self.root / DATASET_CONFIG_NAME} has "
                    f"prefeature_layers={stored}, without layer(s) {absent}; expected source blocks the dataset "
                    "stored pre-features of"
                )
        return layers

    def _check_recorded_tensors(self, trajectory: ManifestEntry) -> None:
        required = ["viewmats", "Ks", "action", "timesteps"]
        for chunk in range(self.num_chunks):
            for step in range(self.num_steps):
                required += [step_tensor(chunk, step, name) for name in ("latent_in", "final_hidden", "velocity")]
            if chunk > 0 and self.with_prefeatures:
                required.append(ctx_indices_tensor(chunk))
                required += [ctx_prefeature_tensor(chunk, layer) for layer in self.source_layers]
        absent = [name for name in required if name not in trajectory.tensors]
        if absent:
            raise UserInputError(f"manifest entry for {trajectory.file!r} lacks tensor(s) {absent[:6]}")
        # the targets' recorded shapes: a velocity as its step's latents, every final hidden as the first one
        hidden_shape = trajectory.shape(step_tensor(0, 0, "final_hidden"))
        for chunk in range(self.num_chunks):
            for step in range(self.num_steps):
                latent_shape = trajectory.shape(step_tensor(chunk, step, "latent_in"))
                for name, expected in (("velocity", latent_shape), ("final_hidden", hidden_shape)):
                    found = trajectory.shape(step_tensor(chunk, step, name))
                    if found != expected:
                        like = "its latent_in" if name == "velocity" else "every final_hidden"
                        raise UserInputError(
                            f"{self.root / trajectory.file}: tensor {step_tensor(chunk, step, name)!r} has shape "
                            f"{list(found)}; expected {list(expected)} (as {like})")
        frames = trajectory.shape("action")[0]
        expected = self.num_chunks * self.chunk_latents
        if frames != expected:
            raise UserInputError(
                f"{trajectory.file}: action has {frames} frames, expected num_chunks*chunk_latents = {expected}"
            )

    # ---- sizes ------------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.refs)

    def n_ctx_of(self, index: int) -> int:
        """Context frames of item ``index`` (from the manifest, no tensor read); 0 when context is not used."""
        return self._n_ctx[index] if self.with_prefeatures else 0

    def n_ctx_list(self) -> list[int]:
        """``n_ctx_of`` for every item, in index order (input of ``BucketBatchSampler``)."""
        return [self.n_ctx_of(index) for index in range(len(self))]

    def key_of(self, index: int) -> tuple[str, int, int, int]:
        """(case_id, action_id, chunk, target step) of item ``index``."""
        ref = self.refs[index]
        trajectory = self.trajectories[ref.trajectory]
        return trajectory.case_id, trajectory.action_id, ref.chunk, ref.target_step

    # ---- reading ----------------------------------------------------------------------------------------------------
    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.float_dtype is not None and tensor.is_floating_point():
            return tensor.to(self.float_dtype)
        return tensor

    def __getitem__(self, index: int) -> dict:
        ref = self.refs[index]
        trajectory = self.trajectories[ref.trajectory]
        case = self.cases[trajectory.case_id]
        path = self.root / trajectory.file
        case_path = self.root / case.file
        read = self._files.read
        chunk, anchor, target = ref.chunk, ref.anchor_step, ref.target_step
        frames = slice(chunk * self.chunk_latents, (chunk + 1) * self.chunk_latents)

        # 1. noisy input of step k with the rebuilt condition channels
        latent_in = read(path, step_tensor(chunk, target, "latent_in"))
        if chunk == 0:
            cond = build_condition_channels(read(case_path, "image_cond"), chunk, self.chunk_latents)
        else:
            channels, frames_in_chunk, height, width = latent_in.shape
            cond = torch.zeros(channels + 1, frames_in_chunk, height, width, dtype=latent_in.dtype)
        item = {
            "case_id": trajectory.case_id,
            "action_id": trajectory.action_id,
            "chunk": chunk,
            "step": target,
            "anchor_step": anchor,
            "noisy_input": torch.cat([latent_in, cond.to(latent_in.dtype)], dim=0),
            "timestep": read(path, "timesteps")[target].to(torch.float32),
        }

        # 2. the chunk's cameras and actions, anchor and targets
        viewmats, intrinsics, action = read(path, "viewmats"), read(path, "Ks"), read(path, "action")
        item.update(
            action=action[frames],
            viewmats=viewmats[frames],
            Ks=intrinsics[frames],
            anchor_hidden=read(path, step_tensor(chunk, anchor, "final_hidden")),
            target_hidden=read(path, step_tensor(chunk, target, "final_hidden")),
            target_velocity=read(path, step_tensor(chunk, target, "velocity")),
        )
        for key, name in (("noisy_input", step_tensor(chunk, target, "latent_in")),
                          ("anchor_hidden", step_tensor(chunk, anchor, "final_hidden")),
                          ("target_hidden", step_tensor(chunk, target, "final_hidden")),
                          ("target_velocity", step_tensor(chunk, target, "velocity"))):
            check_finite_tensor(item[key], path, name)
        if self.with_prev_chunk_hidden:
            item["prev_chunk_hidden"] = read(path, step_tensor(chunk - 1, target, "final_hidden"))

        # 3. context of the chunk (v4)
        if self.with_prefeatures:
            indices = read(path, ctx_indices_tensor(chunk)).long()
            item.update(
                ctx_prefeatures={
                    layer: read(path, ctx_prefeature_tensor(chunk, layer)) for layer in self.source_layers
                },
                ctx_action=action[indices],
                ctx_viewmats=viewmats[indices],
                ctx_Ks=intrinsics[indices],
                n_ctx=int(indices.numel()),
            )

        # 4. text K/V of the two source layers: [2, heads, L_txt, d]
        item["text_k"] = self._files.read_rows(case_path, "text_k", self.source_layers)
        item["text_v"] = self._files.read_rows(case_path, "text_v", self.source_layers)
        return {name: self._cast_value(value) for name, value in item.items()}

    def _cast_value(self, value):
        if isinstance(value, torch.Tensor):
            return self._cast(value)
        if isinstance(value, dict):
            return {key: self._cast(tensor) for key, tensor in value.items()}
        return value


# ---------------------------------------------------------------------------------------------------------------------
# Collation
# ---------------------------------------------------------------------------------------------------------------------
_STACKED = (
    "noisy_input", "timestep", "action", "viewmats", "Ks", "anchor_hidden", "target_hidden", "target_velocity",
    "prev_chunk_hidden", "ctx_action", "ctx_viewmats", "ctx_Ks",
)
_ID_INTS = ("action_id", "chunk", "step", "anchor_step")


def pad_text_kv(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad per-item text K or V along the token axis.

    Args:
        tensors: B tensors [layers, heads, L_i, d].
    Returns:
        padded [B, layers, heads, L_max, d] and mask [B, L_max] bool (True = valid token).
    """
    longest = max(tensor.shape[-2] for tensor in tensors)
    layers, heads, _, dim = tensors[0].shape
    padded = tensors[0].new_zeros(len(tensors), layers, heads, longest, dim)
    mask = torch.zeros(len(tensors), longest, dtype=torch.bool)
    for row, tensor in enumerate(tensors):
        length = tensor.shape[-2]
        padded[row, :, :, :length] = tensor
        mask[row, :length] = True
    return padded, mask


def collate_pairs(items: Sequence[dict]) -> dict:
    """Batch ``PairDataset`` items.

    Returns a dict with the item tensors stacked on a new batch axis B (``noisy_input`` [B, 2C+1, 4, H, W], ...),
    ``text_k``/``text_v`` [B, 2, heads, L_max, d] zero-padded with ``text_mask`` [B, L_max] bool, ``case_id`` a list,
    ``action_id``/``chunk``/``step``/``anchor_step`` int64 [B]; with context also ``ctx_prefeatures``
    {layer: [B, n*H*W, D]}, ``ctx_action`` [B, n], ``ctx_viewmats`` [B, n, 4, 4], ``ctx_Ks`` [B, n, 3, 3] and
    ``n_ctx`` (int). Raises ValueError when items differ in their fields or in n_ctx (bucket the batches).
    """
    if not items:
        raise ValueError("collate_pairs got an empty batch")
    fields = set(items[0])
    for item in items[1:]:
        if set(item) != fields:
            raise ValueError(f"items carry different fields: {sorted(fields ^ set(item))}")
    batch: dict = {"case_id": [item["case_id"] for item in items]}
    for name in _ID_INTS:
        batch[name] = torch.tensor([item[name] for item in items], dtype=torch.int64)
    if "n_ctx" in fields:
        values = sorted({item["n_ctx"] for item in items})
        if len(values) > 1:
            raise ValueError(f"a batch with context needs one n_ctx, got n_ctx values {values}; use BucketBatchSampler")
        batch["n_ctx"] = values[0]
        batch["ctx_prefeatures"] = {
            layer: torch.stack([item["ctx_prefeatures"][layer] for item in items])
            for layer in items[0]["ctx_prefeatures"]
        }
    for name in _STACKED:
        if name in fields:
            batch[name] = torch.stack([item[name] for item in items])
    batch["text_k"], batch["text_mask"] = pad_text_kv([item["text_k"] for item in items])
    batch["text_v"], _ = pad_text_kv([item["text_v"] for item in items])
    return batch


def v4_pair_dataset(dataset_root: str | Path, *, split: str, pairs: Sequence[tuple[int, int]],
                    source_layers: Sequence[int], verify: bool = False, check_tensors: bool = True) -> PairDataset:
    """The v4 recipe's pairs: with the context pre-features of `source_layers` and the previous chunk's hidden
    (chunks 1-7). `check_tensors=False` with `verify=False` reads the manifest only: what a launch checks before it
    creates anything."""
    return PairDataset(dataset_root, split=split, pairs=pairs, with_prefeatures=True, with_prev_chunk_hidden=True,
                       source_layers=tuple(source_layers), verify=verify, check_tensors=check_tensors)


def v4_pair_batches(
    dataset_root: str | Path,
    *,
    split: str,
    pairs: Sequence[tuple[int, int]],
    source_layers: Sequence[int],
    batch_size: int,
    seed: int,
    num_workers: int,
    verify: bool,
    env: DistEnv,
) -> tuple[PairDataset, ResumableBatches, float]:
    """The v4 offline recipe's data -> (pairs dataset, this rank's `loop.ResumableBatches`, the dataset's context
    timestep). Shared by train_predictor_v4.py and fvtools/train_adversarial.py --data offline, so both read the
    same batches in the same order for the same seed.

    Pairs with the context pre-features of `source_layers` and the previous chunk's hidden (chunks 1-7), in batches
    of `batch_size` items of one context length (`BucketBatchSampler`, seeded by `seed`, incomplete batches dropped),
    the same number of batches on every rank. env: the `distributed.DistEnv` (rank, world size, device).
    """
    dataset = v4_pair_dataset(dataset_root, split=split, pairs=pairs, source_layers=source_layers, verify=verify)
    context_timestep = float(config_field(read_dataset_config(dataset_root), "context_timestep", dataset_root))
    sampler = BucketBatchSampler(dataset.n_ctx_list(), batch_size, num_replicas=env.world_size, rank=env.rank,
                                 seed=seed, drop_last=True)
    batches = ResumableBatches(sampler, dataset, collate_pairs, batch_size=None, num_workers=num_workers,
                               pin_memory=env.device.type == "cuda", seed=seed)
    return dataset, batches, context_timestep


def disca_pair_dataset(dataset_root: str | Path, *, split: str, pairs: Sequence[tuple[int, int]],
                       source_layers: Sequence[int], include_chunk0: bool, verify: bool = False,
                       check_tensors: bool = True) -> PairDataset:
    """The disca recipe's pairs: no context or previous-chunk hidden (chunks 1-7, or 0-7 with `include_chunk0`)."""
    return PairDataset(dataset_root, split=split, pairs=pairs, with_prefeatures=False, with_prev_chunk_hidden=False,
                       source_layers=tuple(source_layers), verify=verify, include_chunk0=include_chunk0,
                       check_tensors=check_tensors)


def disca_pair_batches(
    dataset_root: str | Path,
    *,
    split: str,
    pairs: Sequence[tuple[int, int]],
    source_layers: Sequence[int],
    include_chunk0: bool,
    batch_size: int,
    seed: int,
    num_workers: int,
    verify: bool,
    env: DistEnv,
) -> tuple[PairDataset, ResumableBatches, float]:
    """The disca offline recipe's data -> (pairs dataset, this rank's `ResumableBatches`, the dataset's context
    timestep), from a plain DistributedSampler (every item has the same shapes, so no bucketing); incomplete batches
    are dropped, so every rank sees the same number."""
    dataset = disca_pair_dataset(dataset_root, split=split, pairs=pairs, source_layers=source_layers,
                                 include_chunk0=include_chunk0, verify=verify)
    context_timestep = float(config_field(read_dataset_config(dataset_root), "context_timestep", dataset_root))
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=seed,
                                 drop_last=True)
    batches = ResumableBatches(sampler, dataset, collate_pairs, batch_size=batch_size, drop_last=True,
                               num_workers=num_workers, pin_memory=env.device.type == "cuda", seed=seed)
    return dataset, batches, context_timestep
