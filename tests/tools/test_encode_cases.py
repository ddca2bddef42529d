"""tools/encode_cases.py: writes, validates and skips finished cases; a missing image is
reported before anything is encoded."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from predictor_training.data.encoders import CaseEncoder, encode_cases_to_folder, jobs_from_cases, load_encoded_case
from predictor_training.data.sample_table import read_cases
from predictor_training.teacher import preset_config
from predictor_training.world.demo_assets import TinyEncoderSizes, build_tiny_encoder_pipeline, make_demo_scenes


TOOL_PATH = Path(__file__).resolve().parents[2] / "tools" / "encode_cases.py"
TEACHER_CONFIG = preset_config("demo")
SIZES = TinyEncoderSizes.for_teacher_config(TEACHER_CONFIG)
HEIGHT, WIDTH = 64, 96
GRID = (HEIGHT // 16, WIDTH // 16)


def run_tool(argv: list[str]) -> subprocess.CompletedProcess:
    """tools/encode_cases.py as a command (one CPU thread, like the in-process tests)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TOOL_PATH), *argv], capture_output=True, text=True, env=env,
                          timeout=600)


def tool_counts(result: subprocess.CompletedProcess) -> tuple[int, int, int]:
    """(written, skipped, finished) from the tool's output of a successful single-rank run."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("rank 0: wrote "))
    written, skipped = (int(part.split()[-1]) for part in line.removesuffix(" existing").split(", "))
    summary = next(line for line in result.stdout.splitlines() if "cases encoded in" in line)
    finished = int(summary.split("encode_cases: ")[1].split("/")[0])
    return written, skipped, finished


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_encoder_pipeline(SIZES, seed=0)


@pytest.fixture(scope="module")
def encoder(pipeline):
    return CaseEncoder(pipeline, device="cpu", vision_crop="target")


@pytest.fixture(scope="module")
def encoders_folder(tmp_path_factory, pipeline):
    folder = tmp_path_factory.mktemp("encoders")
    pipeline.save_pretrained(str(folder))
    return folder


# ---- the encoder stage over many cases ---------------------------------------------------------------------
def write_cases(folder: Path, count: int) -> Path:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for scene in make_demo_scenes(count, seed=11):
        scene.image.save(folder / "images" / f"{scene.case_id}.png")
        lines.append(json.dumps({"case_id": scene.case_id, "source_image": f"images/{scene.case_id}.png",
                                 "caption": scene.caption}))
    (folder / "cases.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "cases.jsonl"


def test_encode_cases_tool_writes_validates_and_skips_finished(tmp_path, encoders_folder):
    cases = write_cases(tmp_path, 3)
    out = tmp_path / "encoded"
    argv = ["--encoders", str(encoders_folder), "--cases", str(cases), "--out", str(out), "--height", str(HEIGHT),
            "--width", str(WIDTH), "--device", "cpu", "--dtype", "float32"]

    assert tool_counts(run_tool(argv)) == (3, 0, 3)
    files = sorted(out.glob("*.pt"))
    assert [path.stem for path in files] == ["demo000", "demo001", "demo002"]
    for path in files:
        load_encoded_case(path, TEACHER_CONFIG, GRID)
    stamps = {path.name: (path.read_bytes(), os.stat(path).st_mtime_ns) for path in files}

    # resume: nothing is re-encoded; a deleted output is made again with the same bytes
    files[1].unlink()
    assert tool_counts(run_tool(argv)) == (1, 2, 3)
    assert {path.name: (path.read_bytes(), os.stat(path).st_mtime_ns) for path in files if path != files[1]} == {
        name: stamp for name, stamp in stamps.items() if name != files[1].name
    }
    assert files[1].read_bytes() == stamps[files[1].name][0]

    # other settings into the same folder: refused, naming the settings file and field
    refused = run_tool(argv + ["--vision_crop", "target"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr  # one line (runtime.errors.command)
    assert re.search(r"encode_config.json: field 'vision_crop' is 'bucket'.*'target'", refused.stderr)


def test_missing_image_is_reported_before_anything_is_encoded(tmp_path, encoders_folder, encoder):
    cases = write_cases(tmp_path, 3)
    out = tmp_path / "encoded"
    argv = ["--encoders", str(encoders_folder), "--cases", str(cases), "--out", str(out), "--height", str(HEIGHT),
            "--width", str(WIDTH), "--device", "cpu", "--dtype", "float32"]
    encode_cases_to_folder(encoder, jobs_from_cases(read_cases(cases)), out, HEIGHT, WIDTH, show_progress=False)
    finished = {path.name: path.read_bytes() for path in out.glob("*.pt")}
    (tmp_path / "images" / "demo002.png").unlink()
    (out / "demo002.pt").unlink()
    refused = run_tool(argv)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr  # one line (runtime.errors.command)
    assert re.search(r"cases.jsonl line 3: field 'source_image' points to .*demo002.png", refused.stderr)
    assert {path.name: path.read_bytes() for path in out.glob("*.pt")} == {
        name: data for name, data in finished.items() if name != "demo002.pt"
    }
