"""The double-stream block (predictor_training/teacher/double_stream_block.py), batch-general for the Predictor:
padded text under a mask equals unpadded single calls, and releasing the attention inputs early changes no value."""

from __future__ import annotations

import pytest
import torch

from predictor_training.teacher import LayerContextKV
from tests.helpers.tiny_teacher import GRID, camera_inputs, image_inputs, make_model, text_inputs

CHUNK_FRAMES = 4


@pytest.fixture(scope="module")
def tiny():
    model = make_model("tiny")
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        text_kv = model.text_prefill(**text_inputs(model, generator))
    context = image_inputs(model, 5, generator, 14.0)
    chunk = image_inputs(model, CHUNK_FRAMES, generator, 833.3333)
    return model, text_kv, context, chunk


def test_image_forward_with_padded_text_mask_matches_unpadded_calls(tiny):
    """A batch of 2 with right-padded text K/V and a mask equals two B=1 calls on the valid text only."""
    model, _, _, _ = tiny
    block = model.double_blocks[0]
    generator = torch.Generator().manual_seed(9)
    heads, head_dim, hidden = model.heads_num, model.head_dim, model.config.hidden_size
    frames, tokens_per_frame = 2, GRID[0] * GRID[1]
    text_lengths = (7, 4)
    x = torch.randn(2, frames * tokens_per_frame, hidden, generator=generator)
    vec = torch.randn(2, frames, hidden, generator=generator)
    text_k = torch.randn(2, heads, max(text_lengths), head_dim, generator=generator)
    text_v = torch.randn(2, heads, max(text_lengths), head_dim, generator=generator)
    text_mask = torch.arange(max(text_lengths))[None] < torch.tensor(text_lengths)[:, None]
    context_shape = (2, heads, 2 * tokens_per_frame, head_dim)
    context = LayerContextKV.from_branches(*(torch.randn(context_shape, generator=generator) for _ in range(4)))
    viewmats, Ks = zip(*(camera_inputs(frames, generator) for _ in range(2)))
    camera = model.camera_projection(torch.cat(viewmats), torch.cat(Ks))
    rope = model.rope_table(frames, *GRID, start=2)
    with torch.no_grad():
        batched, own = block.image_forward(
            x, vec, tokens_per_frame, rope, camera, text_k, text_v, text_mask, context, return_kv=True
        )
        for index, length in enumerate(text_lengths):
            single_camera = type(camera)(camera.P[index : index + 1], camera.P_inv[index : index + 1])
            single_context = LayerContextKV.from_branches(
                *(t[index : index + 1] for t in (context.rope_k, context.rope_v, context.prope_k, context.prope_v))
            )
            single = block.image_forward(
                x[index : index + 1], vec[index : index + 1], tokens_per_frame, rope, single_camera,
                text_k[index : index + 1, :, :length], text_v[index : index + 1, :, :length], None, single_context,
            )
            torch.testing.assert_close(batched[index : index + 1], single, rtol=1e-5, atol=1e-6)
        kv_only = block.image_kv(x, vec, tokens_per_frame, rope, camera)
    torch.testing.assert_close(kv_only.prope_v, own.prope_v, rtol=0, atol=0)
    torch.testing.assert_close(kv_only.rope_k, own.rope_k, rtol=0, atol=0)


def test_image_forward_release_changes_no_value():
    """Releasing image_forward's attention inputs early changes lifetimes only: same output and same gradients."""
    from predictor_training.teacher import WorldPlayTransformer, double_stream_block
    from predictor_training.teacher.layers import (
        build_camera_projection,
        build_rope_table,
    )

    results = []
    for release in (True, False):
        double_stream_block.RELEASE_ATTENTION_INPUTS = release
        try:
            torch.manual_seed(0)
            teacher = WorldPlayTransformer.from_preset("tiny").eval().requires_grad_(False)
            block = teacher.double_blocks[0].requires_grad_(True)
            generator = torch.Generator().manual_seed(1)
            x = torch.randn(2, 24, teacher.config.hidden_size, generator=generator, requires_grad=True)
            vec = torch.randn(2, 4, teacher.config.hidden_size, generator=generator)
            rope = build_rope_table(4, 2, 3, 0, teacher.rope_dim_list, teacher.rope_theta)
            camera = build_camera_projection(torch.eye(4).repeat(2, 4, 1, 1), torch.eye(3).repeat(2, 4, 1, 1))
            heads, head_dim = teacher.heads_num, teacher.config.hidden_size // teacher.heads_num
            text = torch.randn(2, heads, 8, head_dim, generator=generator)
            out = block.image_forward(x, vec, 6, rope, camera, text, text)
            out.square().sum().backward()
            results.append((out.detach(), x.grad.clone(), block.img_attn_q.weight.grad.clone()))
        finally:
            double_stream_block.RELEASE_ATTENTION_INPUTS = True
    for released, kept in zip(*results):
        assert torch.equal(released, kept)
