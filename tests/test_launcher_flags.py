"""The launchers turn environment variables into flags (tools/_launch_common.sh: FLAG_VARIABLES for the Predictor
recipes, METHOD_FLAG_VARIABLES for fvtools): every variable in those lists must be a flag of the scripts it is
passed to, or setting it would stop the run with an argparse error (and a flag missing from the list is ignored)."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
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
