"""The light trajectory dataset of self-rollout training: one item per sample-table row ``(case_id, action_id)``.

An item is the row's metadata plus its camera/action inputs for every latent (from the row's pose file through
``camera.pose_to_input``)::

    case_id, caption, source_image (absolute path), action_id, seed, pose (absolute path)
    key       (case_id, action_id)
    viewmats  [T, 4, 4] float64 world-to-camera
    Ks        [T, 3, 3] float64 normalised intrinsics
    action    [T] int64 action labels

No stored teacher state is ever read: the rollout trainer generates every target online. The static per-case
tensors come from ``load_case(case_id)``, on demand, from one of two sources:

* ``dataset_root``: the offline dataset's case file ``cases/{case_id}.safetensors`` (located through the manifest):
  ``image_cond`` [1, C, 1, H, W], ``text_k`` / ``text_v`` [depth, heads, L_txt, d] (valid tokens only), each tensor
  checked against its manifest CRC-32 the first time a process loads it;
* ``encoded_dir``: the encoder outputs ``{case_id}.pt`` (upstream trainer layout, docs/encoders.md): ``image_cond``,
  ``prompt_embeds``, ``prompt_mask``, ``byt5_text_states``, ``byt5_text_mask``, ``vision_states`` (the trainer then
  runs the text prefill itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import Dataset

from predictor_training.rollout.camera import pose_to_input
from predictor_training.data.batches import ResumableBatches, one_item_per_rank_batches
from predictor_training.data.dataset_config import (
    DATASET_CONFIG_NAME,
    config_field,
    read_dataset_config,
    recorded_sample_table,
)
from predictor_training.data.manifest import (
    check_files_exist,
    read_manifest,
    tensor_checksums,
    verify_checksums,
)
from predictor_training.data.sample_table import SampleRow, read_sample_table
from predictor_training.data.shards import load_tensors
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.errors import MissingFieldError, MissingFileError, UserInputError

CASE_TENSORS = ("image_cond", "text_k", "text_v")
ENCODED_TENSORS = ("prompt_embeds", "prompt_mask", "byt5_text_states", "byt5_text_mask", "vision_states", "image_cond")


def choose_subset_cases(case_ids: Sequence[str], subset: int | Sequence[str], seed: int) -> list[str]:
    """Cases kept by ``subset``: an int n picks n of the sorted case ids with a seeded permutation; a list is taken
    as is (every id must exist). Returns sorted case ids."""
    available = sorted(set(case_ids))
    if isinstance(subset, int) and not isinstance(subset, bool):
        if not 1 <= subset <= len(available):
            raise UserInputError(f"subset_cases={subset}: the tables have {len(available)} cases")
        generator = torch.Generator().manual_seed(int(seed))
        picked = torch.randperm(len(available), generator=generator)[:subset].tolist()
        return sorted(available[index] for index in picked)
    unknown = sorted(set(subset) - set(available))
    if unknown:
        raise UserInputError(f"subset_cases names case_id(s) {unknown[:5]} that are not in the sample tables")
    return sorted(set(subset))


class TrajectoryTableDataset(Dataset):
    """Sample-table rows with their camera inputs; see the module docstring.

    Args:
        table_paths: one sample-table JSONL or several (their rows are concatenated in the given order).
        dataset_root: offline dataset root whose ``cases/`` provide ``load_case`` (exclusive with ``encoded_dir``).
        encoded_dir: folder of encoder outputs ``{case_id}.pt`` (exclusive with ``dataset_root``).
        num_latents: latents per trajectory (32 in the real setup); every pose must cover exactly this many.
        subset_cases: keep only these cases: an int n (seeded choice, e.g. 8 for overfit8) or a list of case ids.
        subset_seed: seed of the choice when ``subset_cases`` is an int.
        verify: with ``dataset_root``, check size and sha256 of the used case files against the manifest.

    With ``dataset_root``, ``load_case`` checks every tensor against its manifest CRC-32 (once per tensor per
    process); a manifest without per-tensor checksums (older builder) loads with one ``UncheckedTensorsWarning``.
    """

    def __init__(
        self,
        table_paths: str | Path | Sequence[str | Path],
        *,
        dataset_root: str | Path | None = None,
        encoded_dir: str | Path | None = None,
        num_latents: int = 32,
        subset_cases: int | Sequence[str] | None = None,
        subset_seed: int = 0,
        verify: bool = False,
    ):
        if (dataset_root is None) == (encoded_dir is None):
            raise ValueError("give exactly one case source: dataset_root or encoded_dir")
        self.num_latents = int(num_latents)
        paths = [table_paths] if isinstance(table_paths, (str, Path)) else list(table_paths)
        if not paths:
            raise ValueError("table_paths is empty")

        # 1. rows of all tables, unique keys, optional subset
        rows, table_dirs, origin = [], [], {}
        for path in map(Path, paths):
            for row in read_sample_table(path):
                key = (row.case_id, row.action_id)
                if key in origin:
                    raise UserInputError(f"(case_id, action_id) = {key} appears in {origin[key]} and again in {path}")
                origin[key] = path
                rows.append(row)
                table_dirs.append(path.parent.resolve())
        if subset_cases is not None:
            kept = set(choose_subset_cases([row.case_id for row in rows], subset_cases, subset_seed))
            table_dirs = [folder for row, folder in zip(rows, table_dirs) if row.case_id in kept]
            rows = [row for row in rows if row.case_id in kept]
        self.rows: list[SampleRow] = rows
        self.table_dirs: list[Path] = table_dirs

        # 2. where each case's static tensors live
        self.case_ids = sorted({row.case_id for row in rows})
        self.dataset_root = None if dataset_root is None else Path(dataset_root)
        self.encoded_dir = None if encoded_dir is None else Path(encoded_dir)
        self._checksums = None
        self.case_files = self._locate_dataset_cases(verify) if self.dataset_root else self._locate_encoded_cases()

        # 3. camera inputs, once per pose file
        self._pose_inputs: dict[Path, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for row, folder in zip(rows, table_dirs):
            pose_path = row.pose_path(folder)
            if pose_path not in self._pose_inputs:
                self._pose_inputs[pose_path] = pose_to_input(pose_path, self.num_latents)

    def _locate_dataset_cases(self, verify: bool) -> dict[str, Path]:
        config = read_dataset_config(self.dataset_root)
        stored_latents = int(config_field(config, "num_latents", self.dataset_root))
        if stored_latents != self.num_latents:
            raise UserInputError(
                f"{self.dataset_root / 'dataset_config.json'}: num_latents={stored_latents}, "
                f"this dataset was asked for num_latents={self.num_latents}"
            )
        entries = {entry.case_id: entry for entry in read_manifest(self.dataset_root) if entry.kind == "case"}
        missing = [case_id for case_id in self.case_ids if case_id not in entries]
        if missing:
            raise UserInputError(f"{self.dataset_root / 'manifest.jsonl'}: no case entry for case_id(s) {missing[:5]}")
        used = [entries[case_id] for case_id in self.case_ids]
        check_files_exist(self.dataset_root, used)
        if verify:
            verify_checksums(self.dataset_root, used)
        self._checksums = tensor_checksums(self.dataset_root, used, verified=verify)
        return {entry.case_id: self.dataset_root / entry.file for entry in used}

    def _locate_encoded_cases(self) -> dict[str, Path]:
        files = {case_id: self.encoded_dir / f"{case_id}.pt" for case_id in self.case_ids}
        for case_id, path in files.items():
            if not path.is_file():
                raise MissingFileError(f"encoder output of case {case_id!r} not found: {path}")
        return files

    # ---- items ------------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def keys(self) -> list[tuple[str, int]]:
        """(case_id, action_id) of every item, in index order (all distinct)."""
        return [(row.case_id, row.action_id) for row in self.rows]

    def __getitem__(self, index: int) -> dict:
        row, folder = self.rows[index], self.table_dirs[index]
        viewmats, intrinsics, action = self._pose_inputs[row.pose_path(folder)]
        return {
            "key": (row.case_id, row.action_id),
            "case_id": row.case_id,
            "action_id": row.action_id,
            "caption": row.caption,
            "source_image": str(row.image_path(folder)),
            "pose": str(row.pose_path(folder)),
            "seed": row.seed,
            "viewmats": viewmats.clone(),
            "Ks": intrinsics.clone(),
            "action": action.clone(),
        }

    # ---- static case tensors ----------------------------------------------------------------------------------------
    def load_case(self, case_id: str) -> dict[str, torch.Tensor]:
        """The case's static tensors (CPU, stored dtype): ``CASE_TENSORS`` from the dataset, or ``ENCODED_TENSORS``
        from the encoder outputs. KeyError naming the file and tensor when one is missing; with ``dataset_root``,
        ``shards.TensorChecksumError`` naming the file and tensor when a tensor disagrees with its manifest CRC-32."""
        if case_id not in self.case_files:
            raise KeyError(f"case_id {case_id!r} is not in this dataset")
        path = self.case_files[case_id]
        if self.dataset_root is not None:
            return load_tensors(path, CASE_TENSORS, checksums=self._checksums)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(loaded, dict):
            raise UserInputError(f"{path}: expected a dict of tensors, got {type(loaded).__name__}")
        missing = [name for name in ENCODED_TENSORS if name not in loaded]
        if missing:
            raise MissingFieldError(f"{path}: missing tensor(s) {missing}; expected {list(ENCODED_TENSORS)}")
        return {name: loaded[name] for name in ENCODED_TENSORS}


@dataclass
class TrajectoryBatches:
    """What an on-policy recipe trains on: the trajectories of a split, one per rank per micro-batch, and the AR
    loop's settings of the dataset they come from."""

    dataset: TrajectoryTableDataset
    batches: ResumableBatches
    sample_table: Path
    rollout_config: RolloutConfig


def open_trajectory_table(dataset_root: str | Path, split: str, *, sample_table: Path | None, verify: bool = False,
                          subset_cases: int | list[str] | None = None,
                          subset_seed: int = 0) -> tuple[TrajectoryTableDataset, Path]:
    """(the trajectories of `sample_table` - default: the one the dataset recorded for `split` - over the dataset's
    cases, that table's path). Reads tables and manifest only, so a launch can open it before it creates anything."""
    sample_table = Path(sample_table or recorded_sample_table(dataset_root, split))
    dataset = TrajectoryTableDataset(
        sample_table, dataset_root=dataset_root,
        num_latents=int(config_field(read_dataset_config(dataset_root), "num_latents", dataset_root)),
        subset_cases=subset_cases, subset_seed=subset_seed, verify=verify,
    )
    check_table_splits(dataset, sample_table, split)
    return dataset, sample_table


def check_table_splits(dataset: TrajectoryTableDataset, sample_table: Path, split: str) -> None:
    """Every case a run trains on must be one the dataset's manifest records under the trained `split`: a table
    rewritten since the build (e.g. `make_sample_table --overwrite` with another --split-seed) would otherwise train
    on cases the dataset holds out."""
    recorded = {entry.case_id: entry.split for entry in read_manifest(dataset.dataset_root) if entry.kind == "case"}
    other = sorted(case_id for case_id in dataset.case_ids if recorded[case_id] != split)
    if other:
        raise UserInputError(
            f"--sample_table {sample_table}: case {other[0]!r} ({len(other)} of {len(dataset.case_ids)} cases) is "
            f"recorded as split {recorded[other[0]]!r} in {dataset.dataset_root / 'manifest.jsonl'}; expected only "
            f"cases of split {split!r} (the table was changed since the dataset was built: use the table it was "
            "built from, or rebuild the dataset)")


def trajectory_batches(dataset_root: str | Path, split: str, env: DistEnv, *, sample_table: Path | None, seed: int,
                       num_workers: int, verify: bool, state_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
                       subset_cases: int | list[str] | None = None, subset_seed: int = 0,
                       context_mode: str = "exact") -> TrajectoryBatches:
    """The rollout recipe's (and adversarial --data rollout's) data: `sample_table` (default: the one the dataset
    recorded for `split`) as trajectories, one whole trajectory per rank per micro-batch (ranks never share one),
    and the dataset's AR loop (`RolloutConfig.from_dataset_config`) with the given running-latent dtype, Teacher
    autocast and context mode."""
    dataset, sample_table = open_trajectory_table(dataset_root, split, sample_table=sample_table, verify=verify,
                                                  subset_cases=subset_cases, subset_seed=subset_seed)
    dataset_config = read_dataset_config(dataset_root)
    batches = one_item_per_rank_batches(dataset, env, seed=seed, num_workers=num_workers)
    rollout_config = replace(RolloutConfig.from_dataset_config(
        dataset_config, str(Path(dataset_root) / DATASET_CONFIG_NAME),
        state_dtype=state_dtype, autocast_dtype=autocast_dtype,
    ), context_mode=context_mode)
    return TrajectoryBatches(dataset, batches, sample_table, rollout_config)
