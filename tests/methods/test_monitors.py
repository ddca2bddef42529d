"""Collapse monitors (predictor_training/methods/monitors.py): a static video and a flat one show at once."""

import pytest
import torch

from predictor_training.methods.monitors import collapse_monitors, temporal_delta_energy
from predictor_training.runtime.random_streams import stream_generator


def teacher_latents():
    return torch.randn(1, 4, 8, 2, 3, generator=stream_generator(0))


def test_healthy_static_and_flat_videos():
    teacher = teacher_latents()
    same = collapse_monitors(teacher.clone(), teacher)
    assert same["monitor/std_ratio"] == pytest.approx(1) and same["monitor/temporal_ratio"] == pytest.approx(1)
    assert same["monitor/chunk1/temporal_ratio"] == pytest.approx(1)

    static = teacher[:, :, :1].expand_as(teacher).clone()  # the first frame held: it does not move
    frozen = collapse_monitors(static, teacher)
    assert frozen["monitor/temporal_ratio"] == 0 and frozen["monitor/chunk0/temporal_ratio"] == 0
    assert frozen["monitor/std_ratio"] > 0.3

    flat = torch.full_like(teacher, 0.7)  # one colour
    collapsed = collapse_monitors(flat, teacher)
    assert collapsed["monitor/std_ratio"] < 1e-6 and collapsed["monitor/temporal_ratio"] == 0


def test_shapes_are_checked():
    teacher = teacher_latents()
    with pytest.raises(ValueError, match="differ"):
        collapse_monitors(teacher[:, :, :4], teacher)
    with pytest.raises(ValueError, match="multiple of 4"):
        collapse_monitors(teacher[:, :, :6], teacher[:, :, :6])
    assert temporal_delta_energy(teacher[:, :, :1]) == 0
