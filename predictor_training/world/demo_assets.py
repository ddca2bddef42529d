"""Demo ingredients: tiny random HunyuanVideo-1.5 encoders and procedural source images with captions.

Everything here is deterministic from a seed and runs in seconds on a CPU. `tools/make_demo_assets.py` assembles
it (with the demo Teacher and the sample tables) into the demo folder; the tests use the same builders.

Tiny encoders: random weights in tiny configs of the real classes, so the real code path (diffusers'
`HunyuanVideo15ImageToVideoPipeline.encode_prompt` / `encode_image` / `_get_image_latents`) runs unchanged:

    text_encoder    Qwen2_5_VLTextModel, hidden = teacher text_states_dim (32), 3 layers (the pipeline reads
                    hidden state -3)
    tokenizer       word-level `tokenizers` tokenizer with the Qwen2 pre-tokenizer regex and a ChatML chat
                    template. With one token per pre-token its template prefix is 108 tokens, the same as the real
                    Qwen2.5-VL tokenizer, so the pipeline's fixed crop index is right for it too.
    text_encoder_2  T5EncoderModel, d_model = teacher byt5_states_dim (32); tokenizer_2 = ByT5Tokenizer (no files)
    image_encoder   SiglipVisionModel, hidden = teacher vision_states_dim (16), 24 px / patch 8 -> 9 tokens;
                    feature_extractor = SiglipImageProcessor resizing to 24 x 24
    vae             AutoencoderKLHunyuanVideo15, latent channels = teacher in_channels (4), spatial factor 16
                    (5 blocks of 8 channels), temporal factor 4

Procedural scenes: a background (sky over ground, gradient, stripes, checkerboard), one shape (circle, square,
triangle, diamond) of a colour, size and position, and sometimes a sign with a word; the caption says exactly that
(a quoted sign word also exercises the ByT5 glyph path). Source images are 96 x 160, wider than the 64 x 96 demo
resolution, so the resize + centre-crop path runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

DEMO_HEIGHT = 64
DEMO_WIDTH = 96
DEMO_NUM_LATENTS = 32
DEMO_TEACHER_PRESET = "demo"
DEMO_SOURCE_SIZE = (96, 160)  # (height, width) of the procedural source images

# Qwen2's pre-tokenizer split (letters with one leading non-letter, single digits, punctuation runs, whitespace).
QWEN2_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ChatML, as rendered by Qwen2.5's template for plain-text messages.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PAD_TOKEN, IM_START, IM_END, UNK_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END, UNK_TOKEN)


# =============================================================================================================
# 1. Tiny encoder sizes
# =============================================================================================================
@dataclass(frozen=True)
class TinyEncoderSizes:
    """Widths of the tiny encoders; the first four must equal the Teacher's input widths."""

    text_states_dim: int = 32
    byt5_states_dim: int = 32
    vision_states_dim: int = 16
    latent_channels: int = 4
    text_layers: int = 3
    text_heads: int = 2
    vision_image_size: int = 24
    vision_patch_size: int = 8
    vae_block_out_channels: tuple[int, ...] = (8, 8, 8, 8, 8)

    @classmethod
    def for_teacher_config(cls, teacher_config: Mapping) -> "TinyEncoderSizes":
        """Sizes whose outputs fit a Teacher config (text_states_dim, byt5_states_dim, vision_states_dim, in_channels)."""
        return cls(
            text_states_dim=int(teacher_config["text_states_dim"]),
            byt5_states_dim=int(teacher_config["byt5_states_dim"]),
            vision_states_dim=int(teacher_config["vision_states_dim"]),
            latent_channels=int(teacher_config["in_channels"]),
        )

    @property
    def vision_tokens(self) -> int:
        return (self.vision_image_size // self.vision_patch_size) ** 2


# =============================================================================================================
# 2. Procedural scenes and captions
# =============================================================================================================
COLOURS = {
    "red": (220, 40, 40), "orange": (245, 140, 30), "yellow": (240, 220, 50), "green": (50, 170, 70),
    "teal": (30, 160, 160), "blue": (40, 80, 220), "purple": (130, 60, 190), "pink": (240, 120, 180),
    "white": (245, 245, 245), "black": (20, 20, 20), "grey": (128, 128, 128), "brown": (130, 80, 40),
}
BACKGROUNDS = ("sky", "gradient", "stripes", "checkerboard")
SHAPES = ("circle", "square", "triangle", "diamond")
POSITIONS = ("left", "centre", "right")
SIZES = ("small", "large")
SIGN_WORDS = ("OPEN", "EXIT", "STOP", "CAFE", "NORTH", "HOTEL")


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclass(frozen=True)
class SceneSpec:
    """One procedural scene: background kind and its two colours, one shape, an optional sign word."""

    background: str
    background_colours: tuple[str, str]
    shape: str
    shape_colour: str
    position: str
    size: str
    sign_word: str | None

    def caption(self) -> str:
        first, second = self.background_colours
        where = "in the centre" if self.position == "centre" else f"on the {self.position}"
        subject = f"A {self.size} {self.shape_colour} {self.shape} {where}"
        if self.background == "sky":
            text = f"{subject}, under {_article(first)} {first} sky above {second} ground."
        elif self.background == "gradient":
            text = f"{subject} in front of {_article(first)} {first} to {second} gradient."
        elif self.background == "stripes":
            text = f"{subject} over {first} and {second} stripes."
        elif self.background == "checkerboard":
            text = f"{subject} over {_article(first)} {first} and {second} checkerboard."
        else:
            raise ValueError(f"unknown background {self.background!r}; expected one of {BACKGROUNDS}")
        if self.sign_word is not None:
            text += f' A sign says "{self.sign_word}".'
        return text


@dataclass(frozen=True)
class DemoScene:
    case_id: str
    spec: SceneSpec
    caption: str
    image: Image.Image


def sample_scene_specs(count: int, seed: int) -> list[SceneSpec]:
    """`count` distinct scene specs (distinct captions), deterministic from `seed`."""
    rng = random.Random(seed)
    colours = sorted(COLOURS)
    specs, captions = [], set()
    attempts = 0
    while len(specs) < count:
        attempts += 1
        if attempts > 100 * count + 1000:
            raise RuntimeError(f"could not draw {count} distinct demo scenes")
        first, second, shape_colour = rng.sample(colours, 3)
        spec = SceneSpec(
            background=rng.choice(BACKGROUNDS),
            background_colours=(first, second),
            shape=rng.choice(SHAPES),
            shape_colour=shape_colour,
            position=rng.choice(POSITIONS),
            size=rng.choice(SIZES),
            sign_word=rng.choice(SIGN_WORDS) if rng.random() < 0.35 else None,
        )
        if spec.caption() not in captions:
            captions.add(spec.caption())
            specs.append(spec)
    return specs


def render_scene(spec: SceneSpec, height: int, width: int) -> Image.Image:
    """Draw a scene as an RGB image of height x width."""
    first, second = (np.array(COLOURS[name], dtype=np.float32) for name in spec.background_colours)
    rows = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    # 1. background [H, W, 3]
    if spec.background == "sky":
        horizon = int(height * 0.6)
        sky = first * (1.0 - 0.5 * rows[:horizon]) + 0.5 * rows[:horizon] * 255.0
        ground = np.broadcast_to(second * 0.8, (height - horizon, 1, 3))
        canvas = np.concatenate([sky, ground], axis=0).repeat(width, axis=1)
    elif spec.background == "gradient":
        canvas = (first * (1.0 - rows) + second * rows).repeat(width, axis=1)
    elif spec.background == "stripes":
        band = (np.arange(height) // max(1, height // 6)) % 2
        canvas = np.where(band[:, None, None] == 0, first, second).repeat(width, axis=1)
    elif spec.background == "checkerboard":
        cell = max(1, height // 6)
        parity = (np.arange(height)[:, None] // cell + np.arange(width)[None, :] // cell) % 2
        canvas = np.where(parity[:, :, None] == 0, first, second)
    else:
        raise ValueError(f"unknown background {spec.background!r}; expected one of {BACKGROUNDS}")
    image = Image.fromarray(np.clip(canvas, 0, 255).astype(np.uint8), "RGB")

    # 2. the shape
    draw = ImageDraw.Draw(image)
    radius = int(height * (0.18 if spec.size == "small" else 0.32))
    centre_x = {"left": width * 0.25, "centre": width * 0.5, "right": width * 0.75}[spec.position]
    centre_y = height * 0.55
    box = (centre_x - radius, centre_y - radius, centre_x + radius, centre_y + radius)
    colour = COLOURS[spec.shape_colour]
    if spec.shape == "circle":
        draw.ellipse(box, fill=colour)
    elif spec.shape == "square":
        draw.rectangle(box, fill=colour)
    elif spec.shape == "triangle":
        draw.polygon([(centre_x, box[1]), (box[2], box[3]), (box[0], box[3])], fill=colour)
    elif spec.shape == "diamond":
        draw.polygon([(centre_x, box[1]), (box[2], centre_y), (centre_x, box[3]), (box[0], centre_y)], fill=colour)
    else:
        raise ValueError(f"unknown shape {spec.shape!r}; expected one of {SHAPES}")

    # 3. the sign, top left
    if spec.sign_word is not None:
        font = ImageFont.load_default(size=max(8, height // 8))
        left, top = width * 0.05, height * 0.05
        text_box = draw.textbbox((left + 3, top + 2), spec.sign_word, font=font)
        draw.rectangle((left, top, text_box[2] + 3, text_box[3] + 3), fill=(250, 250, 235), outline=(40, 40, 40))
        draw.text((left + 3, top + 2), spec.sign_word, fill=(20, 20, 20), font=font)
    return image


def make_demo_scenes(count: int, seed: int, size: tuple[int, int] = DEMO_SOURCE_SIZE) -> list[DemoScene]:
    """`count` distinct scenes `demo000`, `demo001`, ... with images of `size` = (height, width)."""
    height, width = size
    return [
        DemoScene(case_id=f"demo{index:03d}", spec=spec, caption=spec.caption(), image=render_scene(spec, height, width))
        for index, spec in enumerate(sample_scene_specs(count, seed))
    ]


def caption_vocabulary_texts() -> list[str]:
    """Texts whose pre-tokens cover every caption `SceneSpec.caption` can produce (for the tiny tokenizer)."""
    base = SceneSpec("sky", ("red", "blue"), "circle", "green", "left", "small", SIGN_WORDS[0])
    texts = []
    for background in BACKGROUNDS:
        for colour in COLOURS:
            for shape in SHAPES:
                texts.append(SceneSpec(background, (colour, colour), shape, colour, "left", "small", None).caption())
    for position in POSITIONS:
        for size in SIZES:
            for word in SIGN_WORDS:
                texts.append(SceneSpec(base.background, base.background_colours, base.shape, base.shape_colour,
                                       position, size, word).caption())
    return texts


# =============================================================================================================
# 3. Tiny encoders
# =============================================================================================================
def build_tiny_tokenizer(texts: Iterable[str]):
    """A word-level fast tokenizer: one token per Qwen2 pre-token of `texts`, ChatML template, right padding."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre_tokenizer = pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated")
    pieces = set()
    for text in texts:
        pieces.update(piece for piece, _ in pre_tokenizer.pre_tokenize_str(text))
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *sorted(pieces - set(SPECIAL_TOKENS))])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizer
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=IM_END, unk_token=UNK_TOKEN,
        padding_side="right", chat_template=CHATML_TEMPLATE,
    )


def _seeded(seed: int, build):
    """Run `build()` with the global torch RNG seeded (HF models initialise from it) and restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def build_tiny_encoder_pipeline(sizes: TinyEncoderSizes, seed: int, extra_texts: Sequence[str] = ()):
    """A `HunyuanVideo15ImageToVideoPipeline` with tiny random encoders (no transformer, scheduler or guider).

    The tokenizer knows every word of the demo captions and of `extra_texts` (e.g. the demo world's captions)."""
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15ImageToVideoPipeline
    from transformers import (
        ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, SiglipImageProcessor, SiglipVisionConfig,
        SiglipVisionModel, T5Config, T5EncoderModel,
    )

    from predictor_training.data.encoders import check_tokenizer_matches_pipeline

    # 1. everything but the Qwen tokenizer/model (its vocabulary needs the pipeline's system message)
    byt5_tokenizer = ByT5Tokenizer()
    byt5 = _seeded(seed + 1, lambda: T5EncoderModel(T5Config(
        vocab_size=len(byt5_tokenizer), d_model=sizes.byt5_states_dim, d_kv=8, d_ff=2 * sizes.byt5_states_dim,
        num_layers=1, num_heads=max(1, sizes.byt5_states_dim // 8), relative_attention_num_buckets=8,
        relative_attention_max_distance=32, feed_forward_proj="gated-gelu", is_encoder_decoder=False,
        use_cache=False, pad_token_id=byt5_tokenizer.pad_token_id, eos_token_id=byt5_tokenizer.eos_token_id,
    )))
    siglip = _seeded(seed + 2, lambda: SiglipVisionModel(SiglipVisionConfig(
        hidden_size=sizes.vision_states_dim, intermediate_size=2 * sizes.vision_states_dim, num_hidden_layers=1,
        num_attention_heads=2, image_size=sizes.vision_image_size, patch_size=sizes.vision_patch_size,
    )))
    feature_extractor = SiglipImageProcessor(size={"height": sizes.vision_image_size, "width": sizes.vision_image_size})
    vae = _seeded(seed + 3, lambda: AutoencoderKLHunyuanVideo15(
        latent_channels=sizes.latent_channels, block_out_channels=sizes.vae_block_out_channels, layers_per_block=1,
        spatial_compression_ratio=16, temporal_compression_ratio=4,
    ))
    pipeline = HunyuanVideo15ImageToVideoPipeline(
        text_encoder=None, tokenizer=None, transformer=None, vae=vae, scheduler=None, text_encoder_2=byt5,
        tokenizer_2=byt5_tokenizer, guider=None, image_encoder=siglip, feature_extractor=feature_extractor,
    )

    # 2. the tokenizer covers the template and every demo caption; then the text model sized to it
    tokenizer = build_tiny_tokenizer(
        ["system\nuser\nassistant\n \n", pipeline.system_message, *caption_vocabulary_texts(), *extra_texts]
    )
    head_dim = sizes.text_states_dim // sizes.text_heads
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"text_states_dim={sizes.text_states_dim} / {sizes.text_heads} heads: head dim must be even, >= 6")
    half = head_dim // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]  # three axes summing to head_dim / 2
    text_encoder = _seeded(seed, lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=sizes.text_states_dim, intermediate_size=2 * sizes.text_states_dim,
        num_hidden_layers=sizes.text_layers, num_attention_heads=sizes.text_heads, num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )))
    pipeline.register_modules(text_encoder=text_encoder, tokenizer=tokenizer)
    for module in (text_encoder, byt5, siglip, vae):
        module.eval().requires_grad_(False)
    check_tokenizer_matches_pipeline(pipeline)
    return pipeline


def save_tiny_encoders(folder, sizes: TinyEncoderSizes, seed: int, extra_texts: Sequence[str] = ()) -> None:
    """Write the tiny encoders as a diffusers-format folder (model_index.json + seven component folders).

    The encoder folder deliberately has no transformer, scheduler or guider: they are declared optional for this
    save, so diffusers records them as absent instead of warning that it cannot save None."""
    pipeline = build_tiny_encoder_pipeline(sizes, seed, extra_texts)
    absent = [name for name, component in pipeline.components.items() if component is None]
    pipeline._optional_components = [*pipeline._optional_components, *absent]
    pipeline.save_pretrained(str(folder))
