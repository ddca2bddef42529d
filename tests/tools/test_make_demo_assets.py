"""tools/make_demo_assets.py: the demo assets are complete, byte-deterministic,
guarded, and loadable by the Teacher and the readers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.data.encoders import ENCODER_COMPONENTS, load_encoded_case
from predictor_training.data.sample_table import STANDARD_ACTIONS, read_cases, read_sample_table
from predictor_training.teacher import WorldPlayTransformer, zero_initialised_entries


TOOL_PATH = Path(__file__).resolve().parents[2] / "tools" / "make_demo_assets.py"
COUNTS = {"train": 2, "holdout25": 1, "holdout50": 1}
ARGV = ["--num_train", "2", "--num_holdout25", "1", "--num_holdout50", "1", "--seed", "0", "--kind", "random"]


def run_tool(out: Path) -> subprocess.CompletedProcess:
    """tools/make_demo_assets.py as a command (one CPU thread, so two runs compare byte for byte)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(TOOL_PATH), "--out", str(out), *ARGV], capture_output=True, text=True,
                          env=env, timeout=600)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    result = run_tool(root / "D")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root / "D"


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_demo_assets_are_complete(demo):
    case_ids = [f"demo{index:03d}" for index in range(sum(COUNTS.values()))]
    files = set(file_bytes(demo))
    expected = {
        "cases.jsonl", "demo_config.json", "teacher/config.json", "teacher/diffusion_pytorch_model.safetensors",
        "encoders/model_index.json", "encoded/encode_config.json",
        *(f"samples/{name}.jsonl" for name in COUNTS),
        *(f"images/{case_id}.png" for case_id in case_ids),
        *(f"encoded/{case_id}.pt" for case_id in case_ids),
    }
    assert expected <= files, sorted(expected - files)
    assert len([name for name in files if name.startswith("samples/poses/")]) == len(STANDARD_ACTIONS)
    for component in ENCODER_COMPONENTS:
        assert any(name.startswith(f"encoders/{component}/") for name in files), component
    assert not [name for name in files if name.endswith(".tmp")]
    assert not list(demo.parent.glob(".D.*")), "staging folder left behind"
    assert sum(path.stat().st_size for path in demo.rglob("*") if path.is_file()) < 16 * 2**20


def test_demo_assets_fit_together(demo):
    config = json.loads((demo / "demo_config.json").read_text())
    teacher = WorldPlayTransformer.from_pretrained(str(demo / "teacher"))
    assert config["teacher_preset"] == "demo"
    grid = (config["latent_grid"]["height"], config["latent_grid"]["width"])
    assert grid == (config["resolution"]["height"] // 16, config["resolution"]["width"] // 16)
    assert config["latent_grid"]["channels"] == teacher.config.in_channels

    # upstream zero-initialised layers carry random values in the demo Teacher
    for entry in zero_initialised_entries(teacher):
        assert entry.tensor.abs().sum() > 0, entry.name

    # every case: one encoded file that fits the Teacher; the sample tables cover the cases, split as configured
    cases = read_cases(demo / "cases.jsonl")
    assert len({case.caption for case in cases}) == len(cases)
    for case in cases:
        encoded = load_encoded_case(demo / "encoded" / f"{case.case_id}.pt", teacher.config, grid)
        with torch.no_grad():
            text_kv = teacher.text_prefill(encoded["prompt_embeds"], encoded["prompt_mask"],
                                           encoded["byt5_text_states"], encoded["byt5_text_mask"],
                                           encoded["vision_states"])
        assert torch.isfinite(text_kv.layer(0)[0]).all()
    in_tables = {}
    for name, count in COUNTS.items():
        rows = read_sample_table(demo / config["samples"][name])
        assert len(rows) == count * len(STANDARD_ACTIONS) == config["sample_rows"][name]
        in_tables.update({row.case_id: name for row in rows})
        for row in rows:
            assert not Path(row.source_image).is_absolute()  # the folder can be moved
    assert sorted(in_tables) == sorted(case.case_id for case in cases)


def test_demo_assets_are_deterministic_and_guarded(demo, tmp_path):
    assert run_tool(tmp_path / "again").returncode == 0
    assert file_bytes(tmp_path / "again") == file_bytes(demo)
    refused = run_tool(tmp_path / "again")  # exists, no --overwrite
    assert refused.returncode == 2 and "already exists; pass --overwrite" in refused.stderr


def test_num_final_defaults_by_kind_and_is_checked(tmp_path, capsys):
    """--num_final: 12 final scenes for the world, none for the random kind (which has no final split), never < 0."""
    sys.path.insert(0, str(TOOL_PATH.parent))
    import make_demo_assets

    assert make_demo_assets.parse_args(["--out", str(tmp_path / "W")]).num_final == 12
    assert make_demo_assets.parse_args(["--out", str(tmp_path / "R"), "--kind", "random"]).num_final == 0
    assert make_demo_assets.parse_args(["--out", str(tmp_path / "R"), "--kind", "random", "--num_final", "0"]
                                       ).num_final == 0
    for argv, message in ((["--kind", "random", "--num_final", "2"], "--kind random has none"),
                          (["--num_final", "-1"], "--num_final must be >= 0")):
        with pytest.raises(SystemExit) as exited:
            make_demo_assets.parse_args(["--out", str(tmp_path / "X"), *argv])
        assert exited.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(ValueError, match="only --kind world has a final split"):
        make_demo_assets.build_demo_assets(tmp_path / "X", 1, 1, 1, 0, kind="random", num_final=1)
    assert not list(tmp_path.iterdir())
