"""The demo's tiny assets (predictor_training/world/demo_assets.py): distinct, seeded scenes
and captions in the tiny vocabulary."""

import pytest

from predictor_training.teacher import preset_config
from predictor_training.world.demo_assets import (
    DEMO_SOURCE_SIZE,
    TinyEncoderSizes,
    build_tiny_encoder_pipeline,
    make_demo_scenes,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_scenes_are_distinct_and_seeded():
    scenes = make_demo_scenes(24, seed=0)
    assert len({scene.caption for scene in scenes}) == 24
    assert len({scene.image.tobytes() for scene in scenes}) == 24
    assert all(scene.image.size == DEMO_SOURCE_SIZE[::-1] for scene in scenes)
    assert any('"' in scene.caption for scene in scenes) and any('"' not in scene.caption for scene in scenes)
    again = make_demo_scenes(24, seed=0)
    assert [(s.caption, s.image.tobytes()) for s in again] == [(s.caption, s.image.tobytes()) for s in scenes]
    other = make_demo_scenes(24, seed=1)
    assert [s.caption for s in other] != [s.caption for s in scenes]


TEACHER_CONFIG = preset_config("demo")
SIZES = TinyEncoderSizes.for_teacher_config(TEACHER_CONFIG)


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_encoder_pipeline(SIZES, seed=0)


def test_demo_captions_are_in_the_tiny_vocabulary(pipeline):
    tokenizer = pipeline.tokenizer
    unknown = tokenizer.convert_tokens_to_ids("<|unk|>")
    for scene in make_demo_scenes(60, seed=7):
        assert unknown not in tokenizer(scene.caption)["input_ids"], scene.caption
