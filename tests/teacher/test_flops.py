"""The FLOP model (predictor_training/teacher/flops.py) against torch's own counter (matmuls +
attention): text and context prefill, the chunk step, and a Predictor step of each variant."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from predictor_training.predictor.model import build_predictor
from predictor_training.teacher import TextKV, WorldPlayTransformer
from predictor_training.teacher.flops import (
    TeacherShape,
    context_prefill_flops,
    predictor_step_flops,
    teacher_chunk_step_flops,
    text_prefill_flops,
)
from tests.helpers.eval_world import HEIGHT, WIDTH


# ---------------------------------------------------------------------------------------------------------------
# FLOP counts against torch's own counter (matmuls + attention)
# ---------------------------------------------------------------------------------------------------------------
def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def _counted(function) -> int:
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        function()
    return counter.get_total_flops()


def test_flop_counts_match_torch_flop_counter():
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=3).eval()
    shape = TeacherShape.from_config(teacher.config)
    generator = torch.Generator().manual_seed(1)
    text_len, ctx_frames, heads, head_dim = 5, 4, teacher.heads_num, teacher.head_dim
    text_kv = TextKV([torch.randn(1, heads, text_len, head_dim, generator=generator) for _ in range(3)],
                     [torch.randn(1, heads, text_len, head_dim, generator=generator) for _ in range(3)])

    def inputs(frames: int, timestep: float) -> dict:
        return dict(hidden_states=torch.randn(1, 9, frames, HEIGHT, WIDTH, generator=generator),
                    timestep=torch.full((frames,), timestep), action=torch.zeros(1, frames),
                    viewmats=torch.eye(4).repeat(1, frames, 1, 1), Ks=torch.eye(3).repeat(1, frames, 1, 1))

    tokens = HEIGHT * WIDTH
    close = dict(rel=1e-4)  # the analytic count leaves out the camera matrices' 3x3 products (tens of FLOPs)
    context_kv, _ = teacher.context_prefill(**inputs(ctx_frames, 14.0), text_kv=text_kv)
    assert _counted(lambda: teacher.context_prefill(**inputs(ctx_frames, 14.0), text_kv=text_kv)) == pytest.approx(
        context_prefill_flops(shape, tokens, text_len, ctx_frames), **close)
    chunk = inputs(4, 900.0)
    assert _counted(lambda: teacher.chunk_step(**chunk, text_kv=text_kv, context_kv=context_kv)) == pytest.approx(
        teacher_chunk_step_flops(shape, tokens, text_len, ctx_frames), **close)
    anchor = torch.randn(1, 4 * tokens, teacher.config.hidden_size, generator=generator)
    for variant in ("v4", "disca"):
        predictor = build_predictor(teacher, variant, (0, 2))
        v4 = variant == "v4"
        counted = _counted(lambda: predictor(
            chunk["hidden_states"], anchor, chunk["timestep"][None], chunk["action"], chunk["viewmats"], chunk["Ks"],
            text_kv.select((0, 2)), context=context_kv.select((0, 2)) if v4 else None,
            prev_chunk_hidden=anchor if v4 else None))
        expected = predictor_step_flops(shape, predictor.predictor_config(), tokens, text_len, ctx_frames)
        assert counted == pytest.approx(expected, **close), variant
    text_inputs = (torch.randn(1, 10, 32, generator=generator), torch.tensor([[1] * 6 + [0] * 4]),
                   torch.randn(1, 4, 32, generator=generator), torch.tensor([[1, 1, 0, 0]]),
                   torch.randn(1, 3, 16, generator=generator))
    kept = teacher.text_prefill(*text_inputs).num_tokens
    assert _counted(lambda: teacher.text_prefill(*text_inputs)) == text_prefill_flops(shape, 10, 4, 3, kept)
