"""Sample table (predictor_training/data/sample_table.py): standard action poses, rows and
seeds, table I/O validation, splits."""

import json
import random
from pathlib import Path

import pytest

from predictor_training.data.sample_table import (
    DEFAULT_SPLIT_SIZES,
    STANDARD_ACTIONS,
    STANDARD_NUM_LATENTS,
    Case,
    SampleTableError,
    build_sample_rows,
    check_disjoint_splits,
    read_sample_table,
    sample_seed,
    split_cases,
    write_sample_table,
    write_standard_pose_files,
)
from predictor_training.rollout.camera import pose_to_input


def make_cases(folder: Path, count: int) -> list[Case]:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    cases = []
    for index in range(count):
        image = folder / "images" / f"img{index:03d}.png"
        image.write_bytes(b"not really a png")
        cases.append(Case(f"case{index:03d}", str(image), f"caption number {index}"))
    return cases


def write_table_folder(folder: Path, cases: list[Case]) -> Path:
    write_standard_pose_files(folder)
    table = folder / "train.jsonl"
    write_sample_table(table, build_sample_rows(cases))
    return table


def rewrite_line(table: Path, line_index: int, edit) -> None:
    lines = table.read_text().splitlines()
    record = json.loads(lines[line_index])
    edit(record)
    lines[line_index] = json.dumps(record)
    table.write_text("\n".join(lines) + "\n")


# ---- standard actions and rows --------------------------------------------------------------------------------
def test_standard_action_poses_have_the_documented_motion(tmp_path):
    paths = write_standard_pose_files(tmp_path)
    # predictor_training/conformance/golden/README.md section 9 labels: forward 1, backward 2 (translation, x9); yaw right 1,
    # yaw left 2 (rotation)
    expected_label = {0: 1 * 9, 1: 2 * 9, 2: 1 * 9 + 2, 3: 1 * 9 + 1}
    assert sorted(paths) == sorted(STANDARD_ACTIONS)
    for action_id, path in paths.items():
        _, _, action = pose_to_input(path, STANDARD_NUM_LATENTS)
        assert action.tolist() == [0] + [expected_label[action_id]] * (STANDARD_NUM_LATENTS - 1), action_id


def test_rows_cover_every_case_and_action_with_order_free_seeds(tmp_path):
    cases = make_cases(tmp_path, 5)
    rows = build_sample_rows(cases)
    assert [(row.case_id, row.action_id) for row in rows] == [(c.case_id, a) for c in cases for a in (0, 1, 2, 3)]
    assert all(row.pose.startswith("poses/") and not Path(row.pose).is_absolute() for row in rows)
    # the seed depends on (case, action) only: not on the order or on the other cases
    reversed_rows = build_sample_rows(list(reversed(cases))[:2], action_ids=(3, 1))
    seeds = {(row.case_id, row.action_id): row.seed for row in rows}
    assert all(seeds[(row.case_id, row.action_id)] == row.seed for row in reversed_rows)
    assert len(set(seeds.values())) == len(seeds)
    assert sample_seed("case000", 0, seed_base=1) != sample_seed("case000", 0, seed_base=0)
    with pytest.raises(ValueError, match="unknown action_id 7"):
        build_sample_rows(cases, action_ids=(0, 7))


def test_table_round_trip(tmp_path):
    cases = make_cases(tmp_path, 3)
    table = write_table_folder(tmp_path, cases)
    rows = read_sample_table(table)
    assert rows == build_sample_rows(cases)
    assert rows[0].pose_path(table.parent).is_file() and rows[0].image_path(table.parent).is_file()
    assert not list(tmp_path.glob("*.tmp"))


def test_failed_write_keeps_the_existing_table(tmp_path):
    cases = make_cases(tmp_path, 2)
    table = write_table_folder(tmp_path, cases)
    before = table.read_text()
    rows = build_sample_rows(cases)
    with pytest.raises(SampleTableError, match="duplicate"):
        write_sample_table(table, rows + rows[:1])
    assert table.read_text() == before and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda record: record.pop("caption"), "line 2: missing field 'caption'"),
        (lambda record: record.update(extra=1), "line 2: unknown field 'extra'"),
        (lambda record: record.update(action_id="1"), "line 2: field 'action_id' must be a non-negative integer"),
        (lambda record: record.update(seed=-1), "line 2: field 'seed'"),
        (lambda record: record.update(case_id=""), "line 2: field 'case_id' must be a non-empty string"),
        (lambda record: record.update(pose="poses/nowhere.json"), "line 2: field 'pose' points to .*nowhere.json"),
        (lambda record: record.update(source_image="gone.png"), "line 2: field 'source_image' points to .*gone.png"),
        (lambda record: record.update(action_id=0), "line 2: duplicate \\(case_id, action_id\\)"),
        (lambda record: record.update(caption="other"), "different source_image/caption"),
    ],
)
def test_bad_rows_are_reported_with_file_line_and_field(tmp_path, edit, message):
    table = write_table_folder(tmp_path, make_cases(tmp_path, 2))
    rewrite_line(table, 1, edit)
    with pytest.raises(SampleTableError, match=message) as error:
        read_sample_table(table)
    assert str(table) in str(error.value)


def test_unreadable_tables_are_reported(tmp_path):
    table = write_table_folder(tmp_path, make_cases(tmp_path, 1))
    table.write_text(table.read_text() + "{broken\n")
    with pytest.raises(SampleTableError, match="line 5: not valid JSON"):
        read_sample_table(table)
    with pytest.raises(SampleTableError, match="does not exist"):
        read_sample_table(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SampleTableError, match="no rows"):
        read_sample_table(tmp_path / "empty.jsonl")
    (tmp_path / "poses" / "action1_backward.json").write_text("{}")
    write_sample_table(tmp_path / "ok.jsonl", build_sample_rows(make_cases(tmp_path, 1)))
    with pytest.raises(ValueError, match="action1_backward.json"):
        read_sample_table(tmp_path / "ok.jsonl")


# ---- splits ---------------------------------------------------------------------------------------------------
def test_default_splits_are_disjoint_deterministic_and_order_free(tmp_path):
    cases = make_cases(tmp_path, 180)
    splits = split_cases(cases, seed=0)
    assert {name: len(split) for name, split in splits.items()} == DEFAULT_SPLIT_SIZES
    all_ids = [case.case_id for split in splits.values() for case in split]
    assert len(set(all_ids)) == len(all_ids) == 175
    shuffled = list(cases)
    random.Random(1).shuffle(shuffled)
    assert split_cases(shuffled, seed=0) == splits
    assert split_cases(cases, seed=1)["holdout25"] != splits["holdout25"]
    small = split_cases(cases[:10], {"train": 6, "holdout25": 2, "holdout50": 2}, seed=0)
    assert [len(split) for split in small.values()] == [6, 2, 2]


def test_split_input_errors(tmp_path):
    cases = make_cases(tmp_path, 10)
    with pytest.raises(ValueError, match="need 175 cases, but only 10"):
        split_cases(cases)
    with pytest.raises(SampleTableError, match="case_id 'case001' appears twice"):
        split_cases(cases + [Case("case001", "x.png", "y")], {"train": 1})
    twin = Case("twin", cases[3].source_image, cases[3].caption)
    with pytest.raises(SampleTableError, match="'case003' and 'twin' have the same image-caption pair"):
        split_cases(cases + [twin], {"train": 1})


def test_overlapping_splits_are_refused_with_both_names(tmp_path):
    cases = make_cases(tmp_path, 4)
    check_disjoint_splits({"train": build_sample_rows(cases[:2]), "holdout25": build_sample_rows(cases[2:])})
    with pytest.raises(SampleTableError, match="'train' and 'holdout50' overlap: case_id 'case001'"):
        check_disjoint_splits({"train": cases[:2], "holdout25": cases[2:3], "holdout50": cases[1:2]})
    renamed = Case("case_copy", cases[0].source_image, cases[0].caption)
    with pytest.raises(SampleTableError, match="is case 'case000' in 'train' and case 'case_copy' in 'holdout25'"):
        check_disjoint_splits({"train": build_sample_rows(cases[:2]), "holdout25": build_sample_rows([renamed])})
