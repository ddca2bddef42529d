"""Encoder stage (predictor_training/data/encoders.py): tiny encoders through diffusers' pipeline
methods, the image condition, the tokenizer check, `.pt` validation errors, rank shares and the saved folder."""

import pytest
import torch
from PIL import Image

from predictor_training.data.encoders import (
    CaseEncoder,
    EncodedCaseError,
    EncodeJob,
    check_tokenizer_matches_pipeline,
    encode_cases_to_folder,
    load_encoded_case,
    save_encoded_case,
)
from predictor_training.teacher import preset_config
from predictor_training.world.demo_assets import (
    TinyEncoderSizes,
    build_tiny_encoder_pipeline,
    build_tiny_tokenizer,
    make_demo_scenes,
)


TEACHER_CONFIG = preset_config("demo")
SIZES = TinyEncoderSizes.for_teacher_config(TEACHER_CONFIG)
HEIGHT, WIDTH = 64, 96
GRID = (HEIGHT // 16, WIDTH // 16)
GLYPH_CAPTION = 'A small red circle on the left over blue and white stripes. A sign says "OPEN".'
PLAIN_CAPTION = "A large green square in the centre in front of a grey to black gradient."


def random_image(height: int, width: int, seed: int) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pipeline():
    return build_tiny_encoder_pipeline(SIZES, seed=0)


@pytest.fixture(scope="module")
def encoder(pipeline):
    return CaseEncoder(pipeline, device="cpu", vision_crop="target")


@pytest.fixture(scope="module")
def encoders_folder(tmp_path_factory, pipeline):
    folder = tmp_path_factory.mktemp("encoders")
    pipeline.save_pretrained(str(folder))
    return folder


def good_case() -> dict:
    generator = torch.Generator().manual_seed(0)
    prompt_mask = torch.zeros(1, 12, dtype=torch.int64)
    prompt_mask[:, :7] = 1
    return {
        "prompt_embeds": torch.randn(1, 12, 32, generator=generator),
        "prompt_mask": prompt_mask,
        "byt5_text_states": torch.zeros(1, 5, 32),
        "byt5_text_mask": torch.zeros(1, 5, dtype=torch.int64),
        "vision_states": torch.randn(1, 9, 16, generator=generator),
        "image_cond": torch.randn(1, 4, 1, *GRID, generator=generator),
    }


# ---- the tiny encoders -------------------------------------------------------------------------------------
def test_tiny_encoder_output_shapes_masks_and_dtypes(encoder, pipeline):
    glyph = encoder.encode_image_caption(random_image(96, 160, seed=1), GLYPH_CAPTION, HEIGHT, WIDTH)
    plain = encoder.encode_image_caption(random_image(96, 160, seed=2), PLAIN_CAPTION, HEIGHT, WIDTH)
    tokens = pipeline.tokenizer_max_length
    glyph_tokens = pipeline.tokenizer_2_max_length
    for out in (glyph, plain):
        assert tuple(out["prompt_embeds"].shape) == (1, tokens, SIZES.text_states_dim)
        assert tuple(out["prompt_mask"].shape) == (1, tokens)
        assert tuple(out["byt5_text_states"].shape) == (1, glyph_tokens, SIZES.byt5_states_dim)
        assert tuple(out["byt5_text_mask"].shape) == (1, glyph_tokens)
        assert tuple(out["vision_states"].shape) == (1, SIZES.vision_tokens, SIZES.vision_states_dim)
        assert tuple(out["image_cond"].shape) == (1, SIZES.latent_channels, 1, *GRID)
        assert out["prompt_mask"].dtype == torch.int64 and out["byt5_text_mask"].dtype == torch.int64
        assert out["prompt_embeds"].dtype == torch.float32
        # right padding: the valid tokens come first
        valid = int(out["prompt_mask"].sum())
        assert out["prompt_mask"][0, :valid].eq(1).all() and out["prompt_mask"][0, valid:].eq(0).all()
        # compact storage: the cropped template prefix is not saved along with the view
        assert out["prompt_embeds"].untyped_storage().nbytes() == out["prompt_embeds"].numel() * 4

    # valid LLM tokens = the templated conversation minus the cropped prefix
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import format_text_input

    conversation = format_text_input([GLYPH_CAPTION], pipeline.system_message)
    templated = pipeline.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"][0]
    assert int(glyph["prompt_mask"].sum()) == len(templated) - pipeline.prompt_template_encode_start_idx
    # ByT5: the quoted text, formatted as 'Text "OPEN". ', plus EOS; nothing for a caption without quotes
    assert int(glyph["byt5_text_mask"].sum()) == len(pipeline.tokenizer_2('Text "OPEN". ').input_ids)
    assert glyph["byt5_text_states"].abs().sum() > 0
    assert int(plain["byt5_text_mask"].sum()) == 0 and plain["byt5_text_states"].abs().sum() == 0
    # different inputs give different states
    assert not torch.equal(glyph["prompt_embeds"], plain["prompt_embeds"])
    assert not torch.equal(glyph["image_cond"], plain["image_cond"])
    assert not torch.equal(glyph["vision_states"], plain["vision_states"])


def test_image_condition_is_the_centre_crop(encoder):
    """A source already 64 px high is not rescaled; the 8 extra columns each side must be cut away."""
    centre = random_image(HEIGHT, WIDTH, seed=3)
    wide = random_image(HEIGHT, WIDTH + 16, seed=4)
    wide.paste(centre, (8, 0))
    from_centre = encoder.encode_image_caption(centre, PLAIN_CAPTION, HEIGHT, WIDTH)
    from_wide = encoder.encode_image_caption(wide, PLAIN_CAPTION, HEIGHT, WIDTH)
    torch.testing.assert_close(from_wide["image_cond"], from_centre["image_cond"], rtol=0, atol=0)
    shifted = random_image(HEIGHT, WIDTH + 16, seed=4)
    shifted.paste(centre, (0, 0))
    assert not torch.equal(encoder.encode_image_caption(shifted, PLAIN_CAPTION, HEIGHT, WIDTH)["image_cond"],
                           from_centre["image_cond"])


def test_resolution_must_be_a_multiple_of_the_vae_factor(encoder):
    with pytest.raises(ValueError, match="width=100.*multiple of the VAE spatial factor 16"):
        encoder.encode_image_caption(random_image(64, 100, seed=5), PLAIN_CAPTION, HEIGHT, 100)


def test_tokenizer_check_rejects_left_padding_and_a_foreign_template(pipeline):
    left = build_tiny_tokenizer(["system\nuser\nassistant\n", pipeline.system_message])
    left.padding_side = "left"
    original = pipeline.tokenizer
    try:
        pipeline.register_modules(tokenizer=left)
        with pytest.raises(ValueError, match="padding_side is 'left', expected 'right'"):
            check_tokenizer_matches_pipeline(pipeline)
        # a template that puts an extra turn before the system message makes the prefix longer than the crop
        extra_turn = "<|im_start|>note\nextra<|im_end|>"
        other = build_tiny_tokenizer(["system\nuser\nassistant\n", pipeline.system_message])
        other.chat_template = extra_turn + original.chat_template
        pipeline.register_modules(tokenizer=other)
        prefix = pipeline.prompt_template_encode_start_idx + len(other(extra_turn, add_special_tokens=False)["input_ids"])
        with pytest.raises(ValueError, match=f"template prefix is {prefix} tokens.*prompt_template_encode_start_idx=108"):
            check_tokenizer_matches_pipeline(pipeline)
    finally:
        pipeline.register_modules(tokenizer=original)
    check_tokenizer_matches_pipeline(pipeline)


# ---- .pt validation ----------------------------------------------------------------------------------------
def test_load_encoded_case_accepts_the_upstream_layout(tmp_path):
    payload = good_case()
    payload["prompt_mask"] = payload["prompt_mask"].to(torch.int32)
    payload["latent"] = torch.zeros(1, 4, 8, *GRID, dtype=torch.bfloat16)  # upstream trainer's extra key
    torch.save(payload, tmp_path / "upstream.pt")
    loaded = load_encoded_case(tmp_path / "upstream.pt", TEACHER_CONFIG, GRID)
    assert sorted(loaded) == sorted(good_case())
    assert loaded["prompt_mask"].dtype == torch.int64
    torch.testing.assert_close(loaded["prompt_embeds"], payload["prompt_embeds"])
    assert load_encoded_case(tmp_path / "upstream.pt", TEACHER_CONFIG, None)["image_cond"].shape[3:] == GRID


@pytest.mark.parametrize(
    "field, change, expected",
    [
        ("prompt_embeds", lambda t: t[..., :31], r"field 'prompt_embeds' has shape \[1, 12, 31\], expected \[1, L, 32\]"),
        ("vision_states", lambda t: t[0], r"field 'vision_states' has shape \[9, 16\], expected \[1, L, 16\]"),
        ("byt5_text_mask", lambda t: t[:, :4], r"field 'byt5_text_mask' has shape \[1, 4\], expected \[1, 5\]"),
        ("image_cond", lambda t: t[..., :5], r"field 'image_cond' has shape \[1, 4, 1, 4, 5\], expected \[1, 4, 1, 4, 6\]"),
        ("image_cond", lambda t: t[:, :3], r"field 'image_cond' has shape \[1, 3, 1, 4, 6\], expected \[1, 4, 1, 4, 6\]"),
        ("prompt_mask", lambda t: t * 2, r"field 'prompt_mask' has values other than 0 and 1"),
        ("prompt_mask", lambda t: t.float(), r"field 'prompt_mask' has dtype torch.float32, expected an integer"),
        ("prompt_mask", lambda t: t * 0, r"field 'prompt_mask' has no valid token"),
        ("vision_states", lambda t: t * float("nan"), r"field 'vision_states' has non-finite values"),
        ("vision_states", None, r"field 'vision_states' is missing"),
    ],
)
def test_bad_encoded_case_names_file_field_and_expectation(tmp_path, field, change, expected):
    payload = good_case()
    if change is None:
        del payload[field]
    else:
        payload[field] = change(payload[field])
    path = tmp_path / "case.pt"
    torch.save(payload, path)
    with pytest.raises(EncodedCaseError, match=expected) as error:
        load_encoded_case(path, TEACHER_CONFIG, GRID)
    assert str(path) in str(error.value)


def test_unknown_field_missing_file_and_garbage_file(tmp_path):
    payload = good_case()
    payload["negative_prompt_embeds"] = torch.zeros(1)
    torch.save(payload, tmp_path / "extra.pt")
    with pytest.raises(EncodedCaseError, match="extra.pt: unknown field 'negative_prompt_embeds'"):
        load_encoded_case(tmp_path / "extra.pt", TEACHER_CONFIG, GRID)
    with pytest.raises(EncodedCaseError, match="missing.pt does not exist"):
        load_encoded_case(tmp_path / "missing.pt", TEACHER_CONFIG, GRID)
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(EncodedCaseError, match="garbage.pt: cannot be read"):
        load_encoded_case(tmp_path / "garbage.pt", TEACHER_CONFIG, GRID)


def test_saved_case_round_trips_with_identical_bytes(tmp_path):
    save_encoded_case(tmp_path / "a.pt", good_case())
    save_encoded_case(tmp_path / "b.pt", good_case())
    assert (tmp_path / "a.pt").read_bytes() == (tmp_path / "b.pt").read_bytes()
    assert not list(tmp_path.glob("*.tmp"))
    loaded = load_encoded_case(tmp_path / "a.pt", TEACHER_CONFIG, GRID)
    for name, tensor in good_case().items():
        assert torch.equal(loaded[name], tensor), name


def test_missing_image_in_a_job_names_case_and_field(tmp_path, encoder):
    jobs = [EncodeJob("gone", tmp_path / "gone.png", PLAIN_CAPTION)]
    with pytest.raises(FileNotFoundError, match=r"case 'gone': field 'source_image': image file .*gone.png does not exist"):
        encode_cases_to_folder(encoder, jobs, tmp_path / "out", HEIGHT, WIDTH, show_progress=False)
    assert not list((tmp_path / "out").glob("*"))


def test_ranks_encode_disjoint_shares(tmp_path, encoder):
    scenes = make_demo_scenes(3, seed=5)
    for scene in scenes:
        scene.image.save(tmp_path / f"{scene.case_id}.png")
    jobs = [EncodeJob(scene.case_id, tmp_path / f"{scene.case_id}.png", scene.caption) for scene in scenes]
    rank0 = encode_cases_to_folder(encoder, jobs, tmp_path / "r0", HEIGHT, WIDTH, rank=0, world_size=2,
                                   show_progress=False)
    rank1 = encode_cases_to_folder(encoder, jobs, tmp_path / "r1", HEIGHT, WIDTH, rank=1, world_size=2,
                                   show_progress=False)
    assert (rank0.written, rank1.written) == (2, 1)
    assert sorted(p.stem for p in (tmp_path / "r0").glob("*.pt")) == ["demo000", "demo002"]
    assert sorted(p.stem for p in (tmp_path / "r1").glob("*.pt")) == ["demo001"]


def test_case_encoder_loads_the_saved_folder(encoders_folder, encoder):
    loaded = CaseEncoder.from_pretrained(encoders_folder, "cpu", torch.float32, vision_crop="target")
    image = random_image(96, 160, seed=9)
    expected = encoder.encode_image_caption(image, GLYPH_CAPTION, HEIGHT, WIDTH)
    actual = loaded.encode_image_caption(image, GLYPH_CAPTION, HEIGHT, WIDTH)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=name)
    with pytest.raises(FileNotFoundError, match="model_index.json does not exist"):
        CaseEncoder.from_pretrained(encoders_folder / "vae", "cpu", torch.float32)
