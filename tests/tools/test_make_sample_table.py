"""tools/make_sample_table.py: poses and three disjoint tables, your own camera paths,
and bad cases or camera paths refused before anything is written."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from predictor_training.data.sample_table import (
    STANDARD_ACTIONS,
    STANDARD_NUM_LATENTS,
    Case,
    check_disjoint_splits,
    read_sample_table,
    sample_seed,
)
from predictor_training.rollout.camera import pose_to_input


TOOL_PATH = Path(__file__).resolve().parents[2] / "tools" / "make_sample_table.py"


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL_PATH), *args], capture_output=True, text=True, timeout=120)


def make_cases(folder: Path, count: int) -> list[Case]:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    cases = []
    for index in range(count):
        image = folder / "images" / f"img{index:03d}.png"
        image.write_bytes(b"not really a png")
        cases.append(Case(f"case{index:03d}", str(image), f"caption number {index}"))
    return cases


# ---- tool -----------------------------------------------------------------------------------------------------
def write_cases_file(folder: Path, count: int) -> Path:
    make_cases(folder, count)
    cases_path = folder / "cases.jsonl"
    with open(cases_path, "w") as handle:
        for index in range(count):  # relative image paths: relative to the cases file
            record = {"case_id": f"c{index}", "source_image": f"images/img{index:03d}.png", "caption": f"cap {index}"}
            handle.write(json.dumps(record) + "\n")
    return cases_path


def test_tool_writes_poses_and_three_disjoint_tables(tmp_path):
    cases_path = write_cases_file(tmp_path, 12)
    out = tmp_path / "table"
    sizes = ["--train-size", "6", "--holdout25-size", "2", "--holdout50-size", "3"]
    assert run_tool("--cases", str(cases_path), "--out", str(out), *sizes).returncode == 0
    paths = {name: out / f"{name}.jsonl" for name in ("train", "holdout25", "holdout50")}
    tables = {name: read_sample_table(path) for name, path in paths.items()}
    assert {name: len(rows) for name, rows in tables.items()} == {"train": 24, "holdout25": 8, "holdout50": 12}
    check_disjoint_splits(tables)
    assert len(list((out / "poses").glob("*.json"))) == len(STANDARD_ACTIONS)
    assert Path(tables["train"][0].source_image).is_absolute()

    before = {name: path.read_text() for name, path in paths.items()}
    assert run_tool("--cases", str(cases_path), "--out", str(out), *sizes).returncode == 0  # same inputs: same files
    assert {name: path.read_text() for name, path in paths.items()} == before
    refused = run_tool("--cases", str(cases_path), "--out", str(out), *sizes, "--split-seed", "5")
    assert refused.returncode == 2 and "--overwrite" in refused.stderr and "Traceback" not in refused.stderr
    assert {name: path.read_text() for name, path in paths.items()} == before
    assert run_tool("--cases", str(cases_path), "--out", str(out), *sizes, "--split-seed", "5",
                    "--overwrite").returncode == 0
    assert paths["train"].read_text() != before["train"]


def test_tool_rejects_bad_cases_before_writing(tmp_path):
    cases_path = write_cases_file(tmp_path, 4)
    lines = cases_path.read_text().splitlines()
    lines[2] = json.dumps({"case_id": "c2", "source_image": "images/missing.png", "caption": "cap"})
    cases_path.write_text("\n".join(lines) + "\n")
    out = tmp_path / "table"
    bad_case = run_tool("--cases", str(cases_path), "--out", str(out), "--train-size", "2")
    assert bad_case.returncode == 2 and "Traceback" not in bad_case.stderr
    assert re.search(r"line 3: field 'source_image' points to .*missing.png", bad_case.stderr), bad_case.stderr
    assert not out.exists()
    bad_flag = run_tool("--cases", str(cases_path), "--out", str(out), "--actions", "0,9")
    assert bad_flag.returncode == 2 and bad_flag.stderr.startswith("make_sample_table.py: error: --actions")


# ---- your own camera paths (--poses) ---------------------------------------------------------------------------
def test_tool_takes_your_own_camera_paths_for_every_case_or_one_case(tmp_path):
    """--poses: a pose file (training format, 125 frames), a pose string, and a path for one case only; every case
    gets one row per path, with the pose copied into the table folder and the seed of (seed_base, case, action)."""
    from predictor_training.rollout.camera import pose_string_to_json

    cases_path = write_cases_file(tmp_path, 5)
    cams = tmp_path / "cams"
    cams.mkdir()
    inference = pose_string_to_json("d-10, right-21")
    training = {str(frame): {"w2c": torch_free_inverse(inference[str(frame // 4)]["extrinsic"]),
                             "intrinsic": inference[str(frame // 4)]["K"]} for frame in range(125)}
    (cams / "strafe.json").write_text(json.dumps(training))
    (cams / "c1_walk.json").write_text(json.dumps(pose_string_to_json("w-20, s-11")))
    poses = tmp_path / "camera_paths.jsonl"
    poses.write_text("\n".join(json.dumps(line) for line in [
        {"action_id": 4, "pose": "cams/strafe.json", "name": "strafe"},
        {"action_id": 5, "pose_string": "w-10, left-21"},
        {"action_id": 6, "pose": "cams/c1_walk.json", "case_id": "c1", "name": "walk"},
    ]) + "\n")
    out = tmp_path / "table"
    sizes = ["--train-size", "3", "--holdout25-size", "1", "--holdout50-size", "1"]
    result = run_tool("--cases", str(cases_path), "--out", str(out), "--poses", str(poses), *sizes)
    assert result.returncode == 0, result.stderr
    rows = [row for name in ("train", "holdout25", "holdout50") for row in read_sample_table(out / f"{name}.jsonl")]
    by_case = {}
    for row in rows:
        by_case.setdefault(row.case_id, []).append((row.action_id, row.pose))
    assert by_case["c0"] == [(4, "poses/action4_strafe.json"), (5, "poses/action5_custom.json")]
    assert by_case["c1"] == [(4, "poses/action4_strafe.json"), (5, "poses/action5_custom.json"),
                             (6, "poses/c1/action6_walk.json")]
    assert all(row.seed == sample_seed(row.case_id, row.action_id) for row in rows)
    assert not (out / "poses" / "action0_forward.json").exists()  # --poses alone: no standard actions
    _, _, action = pose_to_input(out / "poses" / "action5_custom.json", STANDARD_NUM_LATENTS)
    assert action.tolist()[1:] == pose_to_input(pose_string_to_json("w-10, left-21"), 32)[2].tolist()[1:]
    viewmats, _, _ = pose_to_input(out / "poses" / "action4_strafe.json", 32)
    assert viewmats.shape == (32, 4, 4)
    # the standard actions can join, under other ids
    both = run_tool("--cases", str(cases_path), "--out", str(tmp_path / "both"), "--poses", str(poses),
                    "--actions", "0,1", *sizes)
    assert both.returncode == 0, both.stderr
    assert [row.action_id for row in read_sample_table(tmp_path / "both" / "holdout50.jsonl")][:4] == [0, 1, 4, 5]


@pytest.mark.parametrize("lines, message", [
    ([{"action_id": 4, "pose_string": "w-10"}], "line 1: field 'pose_string' 'w-10' gives 11 latents (1 + its step "
                                                "counts); expected 32"),
    ([{"action_id": 4, "pose_string": "w-31"}, {"action_id": 4, "pose_string": "s-31"}],
     "line 2: action_id 4 is already used on line 1"),
    ([{"action_id": 0, "pose_string": "w-31"}], None),  # fine alone; clashes with --actions 0 below
    ([{"action_id": 4, "pose": "nowhere.json"}], "line 1: field 'pose': pose file"),
    ([{"action_id": 4, "pose_string": "w-31", "case_id": "c99"}], "field 'case_id' is 'c99', which is not a case"),
    ([{"action_id": 4, "pose_string": "w-31", "pose": "x.json"}], "give exactly one of the fields 'pose'"),
    ([{"action_id": 4, "pose_string": "w-31", "speed": 2}], "unknown field 'speed'"),
])
def test_tool_refuses_bad_camera_paths_before_writing(tmp_path, lines, message, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_sample_table", TOOL_PATH)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cases_path = write_cases_file(tmp_path, 3)
    poses = tmp_path / "camera_paths.jsonl"
    poses.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "table"
    sizes = ["--train-size", "1", "--holdout25-size", "1", "--holdout50-size", "1"]
    extra = ["--actions", "0"] if message is None else []
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--cases", str(cases_path), "--out", str(out), "--poses", str(poses), *extra, *sizes])
    stderr = capsys.readouterr().err
    expected = "line 1: action_id 0 is also a standard action of --actions" if message is None else message
    assert exit_info.value.code == 2 and expected in stderr, stderr
    assert "error: camera-path file " in stderr and stderr.count("\n") == 1
    assert not out.exists()


def torch_free_inverse(extrinsic):
    """w2c of a camera-to-world 4x4 (the training format stores w2c)."""
    import numpy as np

    return np.linalg.inv(np.array(extrinsic, dtype=np.float64)).tolist()
