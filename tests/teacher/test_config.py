"""Teacher presets (predictor_training/teacher/config.py): the 480p preset matches the released
keys on the meta device; unknown presets and overrides are refused, and so are sizes the implementation does not
support."""

from __future__ import annotations

import json

import pytest
import torch

from predictor_training.conformance import GOLDEN_DIR
from predictor_training.teacher import TEACHER_PRESETS, WorldPlayTransformer


KEYS_JSON = GOLDEN_DIR / "worldplay_480p_i2v_keys.json"


# ---------------------------------------------------------------------------------------------------------------
# Construction and configuration
# ---------------------------------------------------------------------------------------------------------------
def test_real_config_on_meta_device_matches_released_keys():
    reference = json.loads(KEYS_JSON.read_text())
    assert TEACHER_PRESETS["worldplay_480p_i2v"] == {
        **reference["config"], "byt5_states_dim": 1472, "byt5_hidden_dim": 2048
    }
    with torch.device("meta"):
        model = WorldPlayTransformer.from_preset("worldplay_480p_i2v")
    shapes = {key: list(value.shape) for key, value in model.state_dict().items()}
    assert shapes == reference["keys"]
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    assert num_parameters == reference["num_parameters"]
    assert num_parameters == 8_557_933_856
    assert list(model.buffers()) == []


def test_unknown_preset_and_override_raise():
    with pytest.raises(KeyError, match="unknown teacher preset"):
        WorldPlayTransformer.from_preset("huge")
    with pytest.raises(KeyError, match="hidden_dim"):
        WorldPlayTransformer.from_preset("tiny", hidden_dim=8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 65}, "divisible by heads_num"),
        ({"rope_dim_list": [8, 12, 10]}, "summing to head_dim"),
        ({"hidden_size": 36, "rope_dim_list": [6, 6, 6]}, "divisible by 4"),
        ({"mm_single_blocks_depth": 2}, "mm_single_blocks_depth"),
    ],
)
def test_constructor_rejects_bad_sizes(overrides, message):
    with pytest.raises(ValueError, match=message):
        WorldPlayTransformer.from_preset("tiny", **overrides)
