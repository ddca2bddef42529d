"""WorldPlay-1.5 teacher transformer: our own, checkpoint-compatible implementation of its AR paths."""

from .cache import CameraProjection, ChunkOutput, ContextKV, LayerContextKV, RecomputedContextKV, RopeTable, TextKV
from .config import TEACHER_PRESETS, preset_config
from .loading import (
    StateDictMismatchError,
    load_checkpoint_strict,
    load_state_dict_strict,
    randomize_zero_initialised_,
    zero_initialised_entries,
)
from .double_stream_block import DoubleStreamBlock
from .model import WorldPlayTransformer

__all__ = [
    "CameraProjection",
    "ChunkOutput",
    "ContextKV",
    "DoubleStreamBlock",
    "LayerContextKV",
    "RecomputedContextKV",
    "RopeTable",
    "StateDictMismatchError",
    "TEACHER_PRESETS",
    "TextKV",
    "WorldPlayTransformer",
    "load_checkpoint_strict",
    "load_state_dict_strict",
    "preset_config",
    "randomize_zero_initialised_",
    "zero_initialised_entries",
]
