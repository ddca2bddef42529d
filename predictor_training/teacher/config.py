"""Constructor presets of the WorldPlay-1.5 teacher transformer.

Every preset is a complete set of constructor arguments of `WorldPlayTransformer`, with the upstream argument
names (the released `transformer/480p_i2v/config.json` uses the same names), plus our own `byt5_states_dim` and
`byt5_hidden_dim` (hard-coded to 1472 / 2048 upstream).

* `worldplay_480p_i2v`: the real 480p image-to-video sizes (8,557,933,856 parameters with the WorldPlay extras).
* `tiny`: the sizes of conformance set A (`predictor_training/conformance/golden/worldplay_tiny_A/config.json`) with 2 double
  blocks.
* `demo`: a small CPU demo model (a few MB), every width small, ByT5 sizes shrunk as well.
"""

from __future__ import annotations

import copy

# The distilled Teacher's sampling schedule, the one home of these numbers: 4 Euler steps per chunk at shift 5
# (`rollout.scheduler`), and 4 latent frames per chunk.
DISTILLED_STEPS = 4
DISTILLED_SHIFT = 5.0

_COMMON_UPSTREAM_FLAGS = {
    "patch_size": [1, 1, 1],
    "concat_condition": True,
    "mlp_width_ratio": 4.0,
    "mlp_act_type": "gelu_tanh",
    "mm_single_blocks_depth": 0,
    "qkv_bias": True,
    "qk_norm": True,
    "qk_norm_type": "rms",
    "guidance_embed": False,
    "use_meanflow": False,
    "text_projection": "single_refiner",
    "use_attention_mask": True,
    "text_states_dim_2": None,
    "text_pool_type": None,
    "rope_theta": 256,
    "attn_param": None,
    "glyph_byT5_v2": True,
    "vision_projection": "linear",
    "is_reshape_temporal_channels": False,
    "use_cond_type_embedding": True,
    "ideal_resolution": "480p",
    "ideal_task": "i2v",
}

TEACHER_PRESETS: dict[str, dict] = {
    "worldplay_480p_i2v": {
        **_COMMON_UPSTREAM_FLAGS,
        "in_channels": 32,
        "out_channels": 32,
        "hidden_size": 2048,
        "heads_num": 16,
        "mm_double_blocks_depth": 54,
        "rope_dim_list": [16, 56, 56],
        "text_states_dim": 3584,
        "attn_mode": "flash",
        "vision_states_dim": 1152,
        "byt5_states_dim": 1472,
        "byt5_hidden_dim": 2048,
    },
    "tiny": {
        **_COMMON_UPSTREAM_FLAGS,
        "in_channels": 4,
        "out_channels": 4,
        "hidden_size": 64,
        "heads_num": 2,
        "mm_double_blocks_depth": 2,
        "rope_dim_list": [8, 12, 12],
        "text_states_dim": 32,
        "attn_mode": "torch",
        "vision_states_dim": 16,
        "byt5_states_dim": 1472,
        "byt5_hidden_dim": 2048,
    },
    "demo": {
        **_COMMON_UPSTREAM_FLAGS,
        "in_channels": 4,
        "out_channels": 4,
        "hidden_size": 64,
        "heads_num": 2,
        "mm_double_blocks_depth": 4,
        "rope_dim_list": [8, 12, 12],
        "text_states_dim": 32,
        "attn_mode": "torch",
        "vision_states_dim": 16,
        "byt5_states_dim": 32,
        "byt5_hidden_dim": 64,
    },
}


def preset_config(name: str, **overrides) -> dict:
    """Return a deep copy of preset `name` with `overrides` applied (each override must name a preset key)."""
    if name not in TEACHER_PRESETS:
        raise KeyError(f"unknown teacher preset {name!r}; expected one of {sorted(TEACHER_PRESETS)}")
    config = copy.deepcopy(TEACHER_PRESETS[name])
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise KeyError(f"unknown override(s) {unknown} for teacher preset {name!r}; valid keys: {sorted(config)}")
    config.update(copy.deepcopy(overrides))
    return config


# ---------------------------------------------------------------------------------------------------------------
# What the implementation supports
# ---------------------------------------------------------------------------------------------------------------
_REQUIRED_VALUES = {
    "concat_condition": True,
    "mlp_act_type": "gelu_tanh",
    "mm_single_blocks_depth": 0,
    "qk_norm": True,
    "qk_norm_type": "rms",
    "guidance_embed": False,
    "use_meanflow": False,
    "text_projection": "single_refiner",
    "text_states_dim_2": None,
    "text_pool_type": None,
    "glyph_byT5_v2": True,
    "vision_projection": "linear",
    "is_reshape_temporal_channels": False,
    "use_cond_type_embedding": True,
}


def check_supported_config(args: dict) -> None:
    """Raise a clear error for sizes that cannot work and for upstream options this implementation does not cover."""
    hidden, heads = args["hidden_size"], args["heads_num"]
    if heads <= 0 or hidden % heads:
        raise ValueError(f"hidden_size ({hidden}) must be divisible by heads_num ({heads})")
    head_dim = hidden // heads
    rope_dims = list(args["rope_dim_list"])
    if len(rope_dims) != 3 or sum(rope_dims) != head_dim:
        raise ValueError(
            f"rope_dim_list {rope_dims} must have 3 entries (t, h, w) summing to head_dim = hidden_size / heads_num "
            f"= {head_dim}"
        )
    if any(dim % 2 for dim in rope_dims):
        raise ValueError(f"every rope_dim_list entry must be even (channel pairs), got {rope_dims}")
    if head_dim % 4:
        raise ValueError(f"head_dim ({head_dim}) must be divisible by 4 for the ProPE 4x4 blocks")
    if list(args["patch_size"]) != [1, 1, 1]:
        raise ValueError(f"patch_size must be [1, 1, 1] (the WorldPlay model), got {list(args['patch_size'])}")
    if args["mm_double_blocks_depth"] < 1:
        raise ValueError(f"mm_double_blocks_depth must be >= 1, got {args['mm_double_blocks_depth']}")
    for name, expected in _REQUIRED_VALUES.items():
        if args[name] != expected:
            raise ValueError(f"unsupported {name}={args[name]!r}: this implementation covers only {name}={expected!r}")
