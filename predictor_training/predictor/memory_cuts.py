"""The memory cuts of issue 20 (docs/memory.md), each of which can be undone to rehearse the code as the user measured
it on his GPUs (`tools/estimate_memory.py --undo_cuts`, `benchmarks/check_real_size_memory.py`). Values are the same
either way: only the tensors' lifetimes (or, for the RMSNorm cast, the dtype of q and k) differ.

    rms_norm_dtype       RMSNorm multiplies by its weight cast to the input's dtype (undone: the FP32 weight
                         promotes q and k to float32)
    attention_inputs     image_forward drops its attention inputs right after the attention
                         (`teacher.double_stream_block.RELEASE_ATTENTION_INPUTS`; undone: alive to the end of the call)
    rollout_context      a rollout chunk's context K/V of every layer are released once the Teacher steps are done
                         (`ChunkGraph.release_context`; undone: alive through the chunk's backward)
    offline_prefeatures  pair_step releases the batch's pre-features once the context is built; undone by the
                         caller, whose batch stays on the device for the whole step (the rehearsal's host "cpu")
"""

from __future__ import annotations

import contextlib

import torch

from predictor_training.predictor.self_rollout import ChunkGraph
from predictor_training.runtime.memory_tracker import patched
from predictor_training.teacher import layers
from predictor_training.teacher import double_stream_block

CUTS = ("rms_norm_dtype", "attention_inputs", "rollout_context", "offline_prefeatures")


def _rms_forward_as_the_user_ran(self, x):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    return normed.type_as(x) * self.weight


@contextlib.contextmanager
def cuts_undone(undo=CUTS):
    """The cuts named in `undo` (default all) undone inside the block, restored on exit (`offline_prefeatures` is
    the caller's: see the module docstring)."""
    unknown = set(undo) - set(CUTS)
    if unknown:
        raise ValueError(f"cuts_undone: unknown cuts {sorted(unknown)}; expected some of {CUTS}")
    switches = {"rms_norm_dtype": (layers.RMSNorm, "forward", _rms_forward_as_the_user_ran),
                "attention_inputs": (double_stream_block, "RELEASE_ATTENTION_INPUTS", False),
                "rollout_context": (ChunkGraph, "release_context", lambda self: None)}
    with patched(*(switch for cut, switch in switches.items() if cut in undo)):
        yield
