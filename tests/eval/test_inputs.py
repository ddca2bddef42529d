"""The eval's inputs (predictor_training/eval/inputs.py): `--demo D` names its ground truth from
D's demo_config.json, an explicit --ground_truth wins."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.helpers.eval_world import REPO_ROOT


TOOL = REPO_ROOT / "tools" / "eval_predictor.py"


def load_eval_tool():
    """tools/eval_predictor.py as a module (its parser and parse_args, in-process)."""
    spec = importlib.util.spec_from_file_location("eval_predictor_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_demo_folder_names_its_ground_truth(tmp_path, capsys):
    """--demo D: the ground truth defaults to D/<demo_config.json's "ground_truth">; older demo folders have none."""
    tool = load_eval_tool()
    demo = tmp_path / "demo"
    (demo / "samples").mkdir(parents=True)
    (demo / "samples" / "holdout25.jsonl").write_text("")
    argv = ["--demo", str(demo), "--lpips_random_backbone"]
    parse = lambda *extra: tool.parse_args(tool.build_parser(), [*argv, *extra])  # noqa: E731
    assert parse().ground_truth is None  # no demo_config.json
    (demo / "demo_config.json").write_text(json.dumps({"num_latents": 32}))
    assert parse().ground_truth is None  # a demo config without ground truth
    (demo / "demo_config.json").write_text(json.dumps({"num_latents": 32, "ground_truth": "ground_truth"}))
    with pytest.raises(SystemExit):
        parse()
    assert f"ground truth {demo / 'ground_truth'} (from the 'ground_truth' entry of" in capsys.readouterr().err
    (demo / "ground_truth").mkdir()
    assert parse().ground_truth == demo / "ground_truth"
    (tmp_path / "elsewhere").mkdir()
    assert parse("--ground_truth", str(tmp_path / "elsewhere")).ground_truth == tmp_path / "elsewhere"
