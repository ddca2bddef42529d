"""The launchers turn environment variables into flags (tools/_launch_common.sh: FLAG_VARIABLES for the Predictor
recipes, METHOD_FLAG_VARIABLES for fvtools): every variable in those lists must be a flag of the scripts it is
passed to, or setting it would stop the run with an argparse error (and a flag missing from the list is ignored)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import subprocess
from pathlib import Path

import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]


# Which scripts each list serves (launch_fvtools_adversarial.sh uses the Predictor list, the other fvtools launchers
# the method list).
PREDICTOR_SCRIPTS = ("train_predictor_v4", "train_predictor_disca", "train_predictor_v4_rollout",
                     "fvtools.train_adversarial")
METHOD_SCRIPTS = ("fvtools.train_df_sft", "fvtools.train_kd", "fvtools.train_dmd2", "fvtools.train_nft")


# Flags only some recipes have; the launchers pass them only when a person sets them for such a recipe.
RECIPE_SPECIFIC = {"SAMPLE_TABLE", "SUBSET_CASES", "SUBSET_SEED", "INIT_FROM", "PAIRS", "BATCH_SIZE",
                   "VELOCITY_WEIGHT", "HIDDEN_WEIGHT", "CACHE_ROOT", "DATASET_ROOT", "TRAIN", "INIT_WEIGHTS",
                   "LORA_RANK", "LORA_ALPHA", "CHUNKS_PER_CLIP", "WARMUP_STEPS"}


def variables(name: str) -> list[str]:
    text = (REPO_ROOT / "tools" / "_launch_common.sh").read_text()
    return re.search(rf"^{name}=\(([^)]*)\)", text, re.MULTILINE).group(1).split()


def help_text(module: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        importlib.import_module(module).parse_args(["--help"])
    return out.getvalue()


@pytest.mark.parametrize("list_name, modules", [("FLAG_VARIABLES", PREDICTOR_SCRIPTS),
                                                ("METHOD_FLAG_VARIABLES", METHOD_SCRIPTS)])
def test_every_launcher_variable_is_a_flag_of_its_scripts(list_name, modules):
    names = variables(list_name)
    assert {"VAL_EVERY", "VAL_VIDEOS", "VAL_SPLIT", "MAX_STEPS"} <= set(names)
    texts = {module: help_text(module) for module in modules}
    for name in names:
        flag = f"--{name.lower()}"
        having = [module for module, text in texts.items() if re.search(rf"{flag}\b", text)]
        if name in RECIPE_SPECIFIC:
            assert having, f"{list_name}: {name} is a flag of none of {modules}"
        else:
            assert having == list(modules), f"{list_name}: {name} is not a flag of {sorted(set(modules) - set(having))}"


# ---------------------------------------------------------------------------------------------------------------
# Positional slots: a value that cannot be what its slot means is refused with one line naming the slot
# ---------------------------------------------------------------------------------------------------------------
def fake_python(tmp_path: Path) -> Path:
    """A PYTHON for the launchers that reports no GPU and does nothing else (the refusals come before any Python)."""
    script = tmp_path / "fake_python"
    script.write_text("#!/usr/bin/env bash\necho 0\n")
    script.chmod(0o755)
    return script


def run_launcher(tmp_path: Path, launcher: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": str(fake_python(tmp_path)), "DEMO_ROOT": str(tmp_path / "demo")}
    return subprocess.run(["bash", str(REPO_ROOT / "tools" / launcher), *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=60)


@pytest.mark.parametrize("launcher, args, message", [
    ("launch_predictor_v4_rollout_training.sh", ["RUN", "1,52"],
     "positional 2 (RESUME) '1,52': looks like a source-blocks spec; expected a training state file such as "
     "RUN_DIR/training_latest.pt (this launcher takes the blocks as SOURCE_BLOCKS=a,b or --source_blocks a,b); "
     "positionals: [RUN_DIR] [RESUME]"),
    ("launch_predictor_v4_rollout_training.sh", ["RUN", "RUN"], "positional 2 (RESUME) 'RUN': is a folder"),
    ("launch_predictor_v4_training.sh", ["1,52"], "positional 1 (RUN_DIR) '1,52': looks like a source-blocks spec"),
    ("launch_predictor_v4_training.sh", ["RUN", "RUN/training_latest.pt"],
     "positional 2 (SOURCE_BLOCKS) 'RUN/training_latest.pt': expected two Teacher block indices such as 1,52; "
     "positionals: [RUN_DIR] [SOURCE_BLOCKS] [RESUME]"),
    ("launch_predictor_disca_training.sh", ["", "0,53", "RUN/missing.pt"],
     "positional 3 (RESUME) 'RUN/missing.pt': no such file"),
    ("launch_fvtools_dmd2.sh", ["RUN/training_latest.pt"], "positional 1 (RUN_DIR) 'RUN/training_latest.pt': is a file"),
])
def test_a_positional_that_cannot_fill_its_slot_is_refused_in_one_line(tmp_path, launcher, args, message):
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "training_latest.pt").write_bytes(b"")
    result = run_launcher(tmp_path, launcher, *args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{launcher}: error: {message}"), result.stderr
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("slots, args, positional, extra", [
    ("RUN_DIR SOURCE_BLOCKS RESUME", ["", "0,53"], ["", "0,53"], []),
    ("RUN_DIR SOURCE_BLOCKS RESUME", ["RUN", "1,52", "RUN/training_latest.pt", "--fusion_lr", "5e-4"],
     ["RUN", "1,52", "RUN/training_latest.pt"], ["--fusion_lr", "5e-4"]),
    ("RUN_DIR RESUME", ["RUN", "RUN/training_latest.pt"], ["RUN", "RUN/training_latest.pt"], []),
    ("RUN_DIR RESUME", ["new_run_dir", "--max_steps", "6"], ["new_run_dir"], ["--max_steps", "6"]),
])
def test_the_users_positional_forms_still_fill_their_slots(tmp_path, slots, args, positional, extra):
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "training_latest.pt").write_bytes(b"")
    script = (f'PYTHON={fake_python(tmp_path)} source {REPO_ROOT / "tools" / "_launch_common.sh"}; '
              f'split_positional "{slots}" "$@"; printf "P:%s\\n" "${{POSITIONAL[@]}}"; '
              'printf "E:%s\\n" "${EXTRA_ARGS[@]}"')
    result = subprocess.run(["bash", "-c", script, "bash", *args], capture_output=True, text=True, cwd=tmp_path,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line[2:] for line in lines if line.startswith("P:")] == positional
    assert [line[2:] for line in lines if line.startswith("E:") and line != "E:"] == extra


def test_demo_assets_of_another_world_teacher_are_refused_in_one_line(tmp_path):
    """Demo assets whose Teacher is not the shipped one (e.g. made before the shipped Teacher changed) are refused
    before anything runs, with one line naming the folder; assets made with --teacher DIR (teacher_source) are the
    user's choice and pass this check."""
    assets = tmp_path / "demo" / "assets"
    (assets / "teacher").mkdir(parents=True)
    (assets / "teacher" / "diffusion_pytorch_model.safetensors").write_bytes(b"another teacher")
    (assets / "demo_config.json").write_text('{"kind": "world", "teacher": "teacher"}')
    result = run_launcher(tmp_path, "launch_predictor_v4_training.sh")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"{assets}/teacher is not the shipped world Teacher" in result.stderr
    assert not (tmp_path / "demo" / "dataset").exists()
    (assets / "demo_config.json").write_text('{"kind": "world", "teacher": "teacher", "teacher_source": "/x"}')
    assert "is not the shipped world Teacher" not in run_launcher(tmp_path, "launch_predictor_v4_training.sh").stderr
