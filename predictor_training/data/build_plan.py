"""The plan of a Predictor dataset build (data/builder.py): its cases and trajectories, every input (sample tables,
pose files, encoder outputs) read and validated before any work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from predictor_training.data.encoders import load_encoded_case
from predictor_training.data.sample_table import FINAL_SPLIT, check_disjoint_splits, read_sample_table
from predictor_training.rollout.camera import pose_to_input
from predictor_training.runtime.errors import UserInputError


class DatasetInputError(UserInputError):
    """Bad builder input; the message names the file and field and the expected value."""


@dataclass(frozen=True)
class CaseJob:
    """One case file. text_tokens: kept text tokens (SigLIP + valid ByT5 + valid LLM), None if not read."""

    case_id: str
    split: str
    encoded_path: Path | None
    text_tokens: int | None = None

    @property
    def file(self) -> str:
        return f"cases/{self.case_id}.safetensors"


@dataclass(frozen=True)
class TrajectoryJob:
    """One trajectory file; index = position over all tables (decides the rank that builds it)."""

    index: int
    case_id: str
    action_id: int
    split: str
    seed: int
    pose_path: Path

    @property
    def file(self) -> str:
        return f"trajectories/{self.case_id}__a{self.action_id}.safetensors"


@dataclass(frozen=True)
class BuildPlan:
    """cases in first-appearance order, trajectories in table order, grid = latent (H, W) or None if not read."""

    cases: list[CaseJob]
    trajectories: list[TrajectoryJob]
    tables: list[Path]
    grid: tuple[int, int] | None


def read_plan(tables, encoded_dir: Path | None, num_latents: int, teacher_config: dict,
              read_encoded: bool = True) -> BuildPlan:
    """Read and validate every input before any work; the split of a row is its table's file stem.

    Raises (naming file and field): a sample-table problem (missing image or pose file, bad field, duplicate row;
    ``read_sample_table``), a pose file whose latent count is not ``num_latents``, a missing or malformed encoder
    output (``load_encoded_case`` against the Teacher config), cases with different latent grids, two tables with
    the same stem, a case in two splits, a ``final`` table (the split nothing is chosen on never enters a dataset, so
    no recipe trains or validates on it; ``sample_table.FINAL_SPLIT``). With ``read_encoded=False`` (dry run) missing
    encoder outputs are allowed.
    """
    paths = [Path(table).resolve() for table in tables]
    stems = [path.stem for path in paths]
    if len(set(stems)) != len(stems):
        raise DatasetInputError(f"sample tables {list(map(str, paths))} have repeated file stems (= split names)")
    if FINAL_SPLIT in stems:
        raise DatasetInputError(f"sample table {paths[stems.index(FINAL_SPLIT)]}: split '{FINAL_SPLIT}' is the split "
                                "nothing is chosen on and never goes into a Predictor dataset (nothing may train or "
                                "validate on it); evaluate it from the sample table and encoder outputs instead "
                                "(tools/eval_predictor.py --split final, docs/eval.md)")
    rows_by_split = {path.stem: read_sample_table(path) for path in paths}
    check_disjoint_splits(rows_by_split)

    cases: dict[str, CaseJob] = {}
    trajectories: list[TrajectoryJob] = []
    checked_poses: set[Path] = set()
    grid = None
    for path in paths:
        split = path.stem
        for row in rows_by_split[split]:
            pose_path = row.pose_path(path.parent).resolve()
            if pose_path not in checked_poses:
                _check_pose_latents(pose_path, num_latents, path)
                checked_poses.add(pose_path)
            if row.case_id not in cases:
                encoded_path = None if encoded_dir is None else (Path(encoded_dir) / f"{row.case_id}.pt").resolve()
                text_tokens = None
                if encoded_path is not None and (read_encoded or encoded_path.is_file()):
                    if not encoded_path.is_file():
                        raise DatasetInputError(
                            f"sample table {path}: case_id '{row.case_id}': encoder output {encoded_path} does not "
                            "exist (expected one {case_id}.pt per case in --encoded)"
                        )
                    encoded = load_encoded_case(encoded_path, teacher_config, grid)
                    grid = tuple(encoded["image_cond"].shape[3:])
                    text_tokens = (encoded["vision_states"].shape[1] + int(encoded["byt5_text_mask"].sum())
                                   + int(encoded["prompt_mask"].sum()))
                cases[row.case_id] = CaseJob(row.case_id, split, encoded_path, text_tokens)
            trajectories.append(
                TrajectoryJob(len(trajectories), row.case_id, row.action_id, split, row.seed, pose_path)
            )
    return BuildPlan(cases=list(cases.values()), trajectories=trajectories, tables=paths, grid=grid)


def _check_pose_latents(pose_path: Path, num_latents: int, table: Path) -> None:
    try:
        pose_to_input(pose_path, num_latents)
    except ValueError as error:  # camera.PoseError names the file and the key count
        raise DatasetInputError(
            f"{error} (field 'pose' of sample table {table}; --num_latents {num_latents})"
        ) from None
