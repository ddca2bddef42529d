"""The sample table: which (image, caption, camera action) trajectories the trainers and the dataset builder use.

A table is a JSONL file with one row per (case_id, action_id)::

    {"case_id": "c0007", "source_image": "/data/img/c0007.png", "caption": "a harbour at dusk",
     "action_id": 2, "pose": "poses/action2_forward_left.json", "seed": 1829301145}

* ``source_image``: absolute, or relative to the table's folder.
* ``pose``: an inference-format pose JSON (see ``predictor_training.rollout.camera``), relative to the table's folder.
* ``seed``: derived from (seed_base, case_id, action_id) only (``sample_seed``), so a rollout is reproducible and does
  not depend on the row order or on which other cases are in the table.

Standard actions, each a 32-latent pose file (= 125 video frames) made by ``camera.pose_string_to_json``:

    ====  ===================================  ============
    id    motion per latent                    pose string
    ====  ===================================  ============
    0     forward 0.08                         ``w-31``
    1     backward 0.08                        ``s-31``
    2     forward 0.08 + yaw left 3 deg        ``w+left-31``
    3     forward 0.08 + yaw right 3 deg       ``w+right-31``
    ====  ===================================  ============

Your own camera paths (``read_camera_paths``, ``tools/make_sample_table.py --poses FILE``): a JSONL file with one
path per line, ``{"action_id": 4, "pose": "cams/orbit.json"}`` (an inference- or training-format pose JSON, relative
to the file) or ``{"action_id": 5, "pose_string": "w-10, left-21"}``, optionally ``"name"`` (the pose file's name in
the table folder) and ``"case_id"`` (the path is then used for that case only). ``action_id`` only names the path in
the table: every case gets one row per path (its own paths included), seeded by the same rule.

Splits: the image-caption cases are shuffled with a seed (after sorting by case_id, so the input order does not
matter) and cut into ``train`` / ``holdout25`` / ``holdout50`` (default 100 / 25 / 50 cases, i.e. 400 / 100 / 200
rows). No case_id and no (source_image, caption) pair may appear in two splits (``check_disjoint_splits``).
``tools/make_sample_table.py`` writes the pose files and the three tables.

``final`` (``FINAL_SPLIT``) is the split nothing is chosen on: new scenes of the demo world made like holdout25's
(``tools/make_demo_assets.py --num_final``). Presets, shipped weights and hyperparameters are chosen on holdout25 /
holdout50 only; ``final`` is evaluated (``--split final``) for the headline and never goes into a dataset (the
Predictor dataset builder, the video-latent builder and ``tools/build_ode_cache.py`` refuse a table of that name), so
nothing trains or validates on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from itertools import combinations
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import read_jsonl_objects
from predictor_training.runtime.io import write_text_atomic
from predictor_training.rollout.camera import load_pose, pose_string_to_json


@dataclass(frozen=True)
class StandardAction:
    action_id: int
    name: str
    pose_string: str


STANDARD_NUM_LATENTS = 32
STANDARD_ACTIONS = {
    0: StandardAction(0, "forward", "w-31"),
    1: StandardAction(1, "backward", "s-31"),
    2: StandardAction(2, "forward_left", "w+left-31"),
    3: StandardAction(3, "forward_right", "w+right-31"),
}
FINAL_SPLIT = "final"  # the split nothing is chosen on (module docstring)
SPLIT_NAMES = ("train", "holdout25", "holdout50", FINAL_SPLIT)  # the tables an eval may read (--split)
DEFAULT_SPLIT_SIZES = {"train": 100, "holdout25": 25, "holdout50": 50}
POSE_FOLDER = "poses"
CASE_FIELDS = ("case_id", "source_image", "caption")
ROW_FIELDS = ("case_id", "source_image", "caption", "action_id", "pose", "seed")


class SampleTableError(UserInputError):
    """Bad sample-table / cases input; the message names the file, line and field."""


@dataclass(frozen=True)
class Case:
    """One image-caption pair."""

    case_id: str
    source_image: str
    caption: str


@dataclass(frozen=True)
class SampleRow:
    """One trajectory: a case under one camera action (fields exactly as stored in the table)."""

    case_id: str
    source_image: str
    caption: str
    action_id: int
    pose: str
    seed: int

    def to_json(self) -> dict:
        return asdict(self)

    def pose_path(self, table_dir: str | Path) -> Path:
        """The pose JSON path (``pose`` is relative to the table's folder)."""
        return Path(table_dir) / self.pose

    def image_path(self, table_dir: str | Path) -> Path:
        """The source image path (absolute, or relative to the table's folder)."""
        return Path(table_dir) / self.source_image


@dataclass(frozen=True)
class CameraPath:
    """A camera path that becomes one row per case: ``pose_json`` is written to ``relpath`` under the table's folder;
    ``case_id`` None = every case, else that case only."""

    action_id: int
    relpath: str
    pose_json: dict
    case_id: str | None = None


# =============================================================================================================
# Rows and standard poses
# =============================================================================================================
def standard_pose_relpath(action_id: int) -> str:
    """Where the pose file of a standard action lives, relative to the table's folder."""
    action = _standard_action(action_id)
    return f"{POSE_FOLDER}/action{action.action_id}_{action.name}.json"


def standard_pose_json(action_id: int) -> dict:
    """The inference-format pose JSON of a standard action (32 latents)."""
    return pose_string_to_json(_standard_action(action_id).pose_string)


def sample_seed(case_id: str, action_id: int, seed_base: int = 0) -> int:
    """Deterministic per-trajectory seed in [0, 2**31) from (seed_base, case_id, action_id)."""
    digest = hashlib.sha256(f"{seed_base}/{case_id}/{action_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def build_sample_rows(
    cases: Iterable[Case | Mapping], action_ids: Sequence[int] = (0, 1, 2, 3), seed_base: int = 0,
    camera_paths: Sequence[CameraPath] = (),
) -> list[SampleRow]:
    """One row per (case, camera path), cases in the given order: first the standard actions in ``action_ids``
    order, then ``camera_paths`` in file order (a path with a ``case_id`` only for that case)."""
    for action_id in action_ids:
        _standard_action(action_id)
    if len(set(action_ids)) != len(action_ids):
        raise ValueError(f"action_ids contains duplicates: {list(action_ids)}")
    rows = []
    for case in (_as_case(case) for case in cases):
        paths = [(action_id, standard_pose_relpath(action_id)) for action_id in action_ids]
        paths += [(path.action_id, path.relpath) for path in camera_paths if path.case_id in (None, case.case_id)]
        for action_id, relpath in paths:
            rows.append(
                SampleRow(
                    case_id=case.case_id,
                    source_image=case.source_image,
                    caption=case.caption,
                    action_id=action_id,
                    pose=relpath,
                    seed=sample_seed(case.case_id, action_id, seed_base),
                )
            )
    return rows


def write_standard_pose_files(table_dir: str | Path, action_ids: Sequence[int] = (0, 1, 2, 3)) -> dict[int, Path]:
    """Write the pose JSON of each standard action under ``table_dir`` (atomically); returns action_id -> path."""
    paths = {}
    for action_id in action_ids:
        path = Path(table_dir) / standard_pose_relpath(action_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(standard_pose_json(action_id), indent=1) + "\n")
        paths[action_id] = path
    return paths


CAMERA_PATH_FIELDS = ("action_id", "pose", "pose_string", "name", "case_id")


def read_camera_paths(path: str | Path, *, num_latents: int = STANDARD_NUM_LATENTS,
                      standard_ids: Sequence[int] = (), case_ids: Iterable[str] | None = None) -> list[CameraPath]:
    """Read a camera-path file (JSONL; see the module docstring): each path is loaded and must describe exactly
    ``num_latents`` latents. An ``action_id`` may not repeat for a case (a path for every case counts for all of
    them) nor reuse one of ``standard_ids``; a ``case_id`` must be one of ``case_ids`` (when given). Raises
    SampleTableError naming the file, line and field."""
    path = Path(path)
    if not path.is_file():
        raise SampleTableError(f"camera-path file {path} does not exist")
    known_cases = None if case_ids is None else set(case_ids)
    paths: list[CameraPath] = []
    used: dict[tuple[int, str | None], int] = {}  # (action_id, case_id or None for every case) -> line
    for line_number, record in _read_jsonl(path):
        where = f"camera-path file {path} line {line_number}"
        # 1. fields
        unknown = sorted(set(record) - set(CAMERA_PATH_FIELDS))
        if unknown:
            raise SampleTableError(f"{where}: unknown field '{unknown[0]}'; expected {', '.join(CAMERA_PATH_FIELDS)}")
        if "action_id" not in record:
            raise SampleTableError(f"{where}: field 'action_id' is missing")
        _require_int(record, "action_id", where)
        if ("pose" in record) == ("pose_string" in record):
            raise SampleTableError(f"{where}: give exactly one of the fields 'pose' (a pose JSON file) and "
                                   "'pose_string' (e.g. \"w-10, left-21\")")
        for field in ("pose", "pose_string", "name", "case_id"):
            if field in record:
                _require_text(record, field, where)
        action_id, case_id, name = record["action_id"], record.get("case_id"), record.get("name", "custom")
        if not all(char.isalnum() or char in "-_." for char in name):
            raise SampleTableError(f"{where}: field 'name' is {name!r}; expected letters, digits, '-', '_', '.'")
        # 2. ids: unique per case, apart from the standard actions, for a known case
        if case_id is not None and known_cases is not None and case_id not in known_cases:
            raise SampleTableError(f"{where}: field 'case_id' is '{case_id}', which is not a case of the cases file")
        if action_id in standard_ids:
            raise SampleTableError(f"{where}: action_id {action_id} is also a standard action of --actions; "
                                   "choose another id")
        clash = [line for (other_id, other_case), line in used.items() if other_id == action_id
                 and (case_id is None or other_case is None or other_case == case_id)]
        if clash:
            raise SampleTableError(f"{where}: action_id {action_id} is already used on line {clash[0]} for "
                                   f"{'case ' + repr(case_id) if case_id else 'the same cases'}")
        used[(action_id, case_id)] = line_number
        # 3. the pose itself, with exactly num_latents latents
        if "pose" in record:
            pose_file = Path(record["pose"])
            pose_file = pose_file if pose_file.is_absolute() else path.parent / pose_file
            try:
                load_pose(pose_file, num_latents)
            except UserInputError as error:
                raise SampleTableError(f"{where}: field 'pose': {error}") from None
            pose_json = json.loads(pose_file.read_text(encoding="utf-8"))
        else:
            try:
                pose_json = pose_string_to_json(record["pose_string"])
            except UserInputError as error:
                raise SampleTableError(f"{where}: field 'pose_string': {error}") from None
            if len(pose_json) != num_latents:
                raise SampleTableError(f"{where}: field 'pose_string' {record['pose_string']!r} gives "
                                       f"{len(pose_json)} latents (1 + its step counts); expected {num_latents}")
        folder = POSE_FOLDER if case_id is None else f"{POSE_FOLDER}/{case_id}"
        paths.append(CameraPath(action_id, f"{folder}/action{action_id}_{name}.json", pose_json, case_id))
    if not paths:
        raise SampleTableError(f"camera-path file {path} has no rows")
    return paths


def write_camera_pose_files(table_dir: str | Path, camera_paths: Sequence[CameraPath]) -> dict[str, Path]:
    """Write each camera path's pose JSON under ``table_dir`` (atomically); returns relpath -> path."""
    written = {}
    for camera_path in camera_paths:
        target = Path(table_dir) / camera_path.relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(target, json.dumps(camera_path.pose_json, indent=1) + "\n")
        written[camera_path.relpath] = target
    return written


# =============================================================================================================
# Table I/O
# =============================================================================================================
def format_sample_table(rows: Sequence[SampleRow]) -> str:
    """The JSONL text of a table (validated: field types, unique (case_id, action_id), consistent cases)."""
    rows = list(rows)
    for index, row in enumerate(rows):
        if not isinstance(row, SampleRow):
            raise TypeError(f"row {index} is a {type(row).__name__}, expected SampleRow")
        _check_row_fields(row.to_json(), where=f"row {index}")
    _check_row_consistency(rows, [f"row {index}" for index in range(len(rows))])
    return "".join(json.dumps(row.to_json(), ensure_ascii=False) + "\n" for row in rows)


def write_sample_table(path: str | Path, rows: Sequence[SampleRow]) -> None:
    """Write a table atomically (``path.tmp`` then rename); an existing table is untouched on error."""
    text = format_sample_table(rows)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(Path(path), text)


def read_sample_table(path: str | Path) -> list[SampleRow]:
    """Read and validate a table: every field of every row, the pose files (must load) and the source images."""
    path = Path(path)
    table_dir = path.parent
    if not path.is_file():
        raise SampleTableError(f"sample table {path} does not exist")
    rows, places = [], []
    checked_poses: set[Path] = set()
    for line_number, record in _read_jsonl(path):
        where = f"sample table {path} line {line_number}"
        _check_fields(record, ROW_FIELDS, where)
        _check_row_fields(record, where)
        row = SampleRow(**record)
        pose_path = row.pose_path(table_dir)
        if pose_path not in checked_poses:
            if not pose_path.is_file():
                raise SampleTableError(f"{where}: field 'pose' points to {pose_path}, which does not exist")
            load_pose(pose_path)
            checked_poses.add(pose_path)
        if not row.image_path(table_dir).is_file():
            raise SampleTableError(
                f"{where}: field 'source_image' points to {row.image_path(table_dir)}, which does not exist"
            )
        rows.append(row)
        places.append(where)
    if not rows:
        raise SampleTableError(f"sample table {path} has no rows")
    _check_row_consistency(rows, places)
    return rows


def read_cases(path: str | Path) -> list[Case]:
    """Read a cases JSONL (fields case_id, source_image, caption; one row per image-caption pair).

    A relative ``source_image`` is taken relative to the cases file's folder and returned as an absolute path.
    Raises on a missing/empty field, an unknown field, a missing image or a duplicate case_id.
    """
    path = Path(path)
    if not path.is_file():
        raise SampleTableError(f"cases file {path} does not exist")
    cases, seen = [], {}
    for line_number, record in _read_jsonl(path):
        where = f"cases file {path} line {line_number}"
        _check_fields(record, CASE_FIELDS, where)
        for field in CASE_FIELDS:
            _require_text(record, field, where)
        image = Path(record["source_image"])
        image = (image if image.is_absolute() else path.parent / image).resolve()
        if not image.is_file():
            raise SampleTableError(f"{where}: field 'source_image' points to {image}, which does not exist")
        if record["case_id"] in seen:
            raise SampleTableError(
                f"{where}: case_id '{record['case_id']}' already used on line {seen[record['case_id']]}"
            )
        seen[record["case_id"]] = line_number
        cases.append(Case(record["case_id"], str(image), record["caption"]))
    if not cases:
        raise SampleTableError(f"cases file {path} has no rows")
    return cases


# =============================================================================================================
# Splits
# =============================================================================================================
def split_cases(
    cases: Sequence[Case | Mapping], sizes: Mapping[str, int] = DEFAULT_SPLIT_SIZES, seed: int = 0
) -> dict[str, list[Case]]:
    """Deterministic disjoint splits: sort by case_id, shuffle with ``random.Random(seed)``, cut in ``sizes`` order.

    Cases beyond ``sum(sizes)`` are left out. Each split comes back sorted by case_id.
    Raises when there are too few cases, or when two cases share a case_id or an (image, caption) pair.
    """
    cases = [_as_case(case) for case in cases]
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"split '{name}': size must be a non-negative int, got {size!r}")
    needed = sum(sizes.values())
    if needed > len(cases):
        raise SampleTableError(f"split sizes {dict(sizes)} need {needed} cases, but only {len(cases)} were given; "
                               "give more cases or smaller splits (tools/make_sample_table.py --train-size, "
                               "--holdout25-size, --holdout50-size)")
    _check_unique_cases(cases)

    order = sorted(cases, key=lambda case: case.case_id)
    random.Random(seed).shuffle(order)
    splits, start = {}, 0
    for name, size in sizes.items():
        splits[name] = sorted(order[start : start + size], key=lambda case: case.case_id)
        start += size
    check_disjoint_splits(splits)
    return splits


def check_disjoint_splits(tables: Mapping[str, Sequence[Case | SampleRow]]) -> None:
    """Raise if a case_id or an (source_image, caption) pair appears in two splits (rows or cases)."""
    by_split = {}
    for name, rows in tables.items():
        ids = {}
        pairs = {}
        for row in rows:
            ids.setdefault(row.case_id, row)
            pairs.setdefault(_image_caption_key(row), row)
        by_split[name] = (ids, pairs)
    for first, second in combinations(by_split, 2):
        first_ids, first_pairs = by_split[first]
        second_ids, second_pairs = by_split[second]
        shared_ids = sorted(first_ids.keys() & second_ids.keys())
        if shared_ids:
            raise SampleTableError(
                f"splits '{first}' and '{second}' overlap: case_id '{shared_ids[0]}' is in both "
                f"({len(shared_ids)} shared case_ids)"
            )
        shared_pairs = sorted(first_pairs.keys() & second_pairs.keys())
        if shared_pairs:
            image, caption = shared_pairs[0]
            raise SampleTableError(
                f"splits '{first}' and '{second}' overlap: the image-caption pair (source_image={image!r}, "
                f"caption={caption!r}) is case '{first_pairs[shared_pairs[0]].case_id}' in '{first}' and case "
                f"'{second_pairs[shared_pairs[0]].case_id}' in '{second}'"
            )


# =============================================================================================================
# Helpers
# =============================================================================================================
def _standard_action(action_id: int) -> StandardAction:
    if action_id not in STANDARD_ACTIONS:
        raise ValueError(f"unknown action_id {action_id!r}; standard actions are {sorted(STANDARD_ACTIONS)}")
    return STANDARD_ACTIONS[action_id]


def _as_case(case: Case | Mapping) -> Case:
    if isinstance(case, Case):
        return case
    if isinstance(case, Mapping):
        where = f"case {dict(case)!r}"
        _check_fields(case, CASE_FIELDS, where)
        for field in CASE_FIELDS:
            _require_text(case, field, where)
        return Case(case["case_id"], case["source_image"], case["caption"])
    raise TypeError(f"expected a Case or a mapping with {CASE_FIELDS}, got {type(case).__name__}")


def _image_caption_key(row: Case | SampleRow) -> tuple[str, str]:
    return (os.path.normpath(row.source_image), row.caption)


def _check_unique_cases(cases: Sequence[Case]) -> None:
    ids, pairs = {}, {}
    for case in cases:
        if case.case_id in ids:
            raise SampleTableError(f"case_id '{case.case_id}' appears twice in the case list")
        ids[case.case_id] = case
        key = _image_caption_key(case)
        if key in pairs:
            raise SampleTableError(
                f"cases '{pairs[key].case_id}' and '{case.case_id}' have the same image-caption pair "
                f"(source_image={key[0]!r}, caption={key[1]!r}); they would leak across splits"
            )
        pairs[key] = case


def _read_jsonl(path: Path) -> Iterable[tuple[int, dict]]:
    """(line number, object) for each non-blank line."""
    return read_jsonl_objects(path, SampleTableError)


def _check_fields(record: Mapping, fields: Sequence[str], where: str) -> None:
    for field in fields:
        if field not in record:
            raise SampleTableError(f"{where}: missing field '{field}' (expected fields {list(fields)})")
    unknown = sorted(set(record) - set(fields))
    if unknown:
        raise SampleTableError(f"{where}: unknown field '{unknown[0]}' (expected fields {list(fields)})")


def _require_text(record: Mapping, field: str, where: str) -> None:
    value = record[field]
    if not isinstance(value, str) or not value.strip():
        raise SampleTableError(f"{where}: field '{field}' must be a non-empty string, got {value!r}")


def _require_int(record: Mapping, field: str, where: str) -> None:
    value = record[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SampleTableError(f"{where}: field '{field}' must be a non-negative integer, got {value!r}")


def _check_row_fields(record: Mapping, where: str) -> None:
    for field in ("case_id", "source_image", "caption", "pose"):
        _require_text(record, field, where)
    for field in ("action_id", "seed"):
        _require_int(record, field, where)
    if Path(record["pose"]).is_absolute():
        raise SampleTableError(f"{where}: field 'pose' must be relative to the table's folder, got {record['pose']!r}")


def _check_row_consistency(rows: Sequence[SampleRow], places: Sequence[str]) -> None:
    """Unique (case_id, action_id); every row of a case has the same image and caption."""
    first_place: dict[tuple[str, int], str] = {}
    case_rows: dict[str, tuple[SampleRow, str]] = {}
    for row, place in zip(rows, places):
        key = (row.case_id, row.action_id)
        if key in first_place:
            raise SampleTableError(
                f"{place}: duplicate (case_id, action_id) = ('{row.case_id}', {row.action_id}), "
                f"first at {first_place[key]}"
            )
        first_place[key] = place
        if row.case_id in case_rows:
            other, other_place = case_rows[row.case_id]
            if (other.source_image, other.caption) != (row.source_image, row.caption):
                raise SampleTableError(
                    f"{place}: case '{row.case_id}' has a different source_image/caption than at {other_place}"
                )
        else:
            case_rows[row.case_id] = (row, place)
