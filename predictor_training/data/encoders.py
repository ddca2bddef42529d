"""Encoder stage: (source image, caption) -> the per-case encoder outputs the Teacher is conditioned on.

The encoders are the HunyuanVideo-1.5 image-to-video ones, loaded from a local diffusers-format folder and called
through diffusers' own `HunyuanVideo15ImageToVideoPipeline` methods (its chat template, crop index, glyph
extraction and image preprocessing are used as they are; nothing here re-implements them):

    encode_prompt   Qwen2.5-VL text states (hidden state -3, template prefix cropped) + ByT5 glyph states
    encode_image    SigLIP last_hidden_state
    _get_image_latents  AutoencoderKLHunyuanVideo15 latent_dist.mode() * scaling_factor

The pipeline is built without its transformer, scheduler and guider. Folder layout (what `save_pretrained` of the
pipeline writes; a full HunyuanVideo-1.5 i2v diffusers folder also works, its transformer is never loaded):

    model_index.json  text_encoder/  tokenizer/  text_encoder_2/  tokenizer_2/  image_encoder/  feature_extractor/  vae/

Output: one `{case_id}.pt` per case in the upstream trainer's `.pt` layout, every tensor with batch dim 1:

    prompt_embeds     [1, L, text_dim]      L = 1000 (the pipeline's tokenizer_max_length), right padded
    prompt_mask       [1, L]       int64
    byt5_text_states  [1, Lb, byt5_dim]     Lb = 256; all zeros when the caption has no quoted text
    byt5_text_mask    [1, Lb]      int64
    vision_states     [1, Nv, vis_dim]      Nv = SigLIP tokens (729 for the real 384px / patch 14 model)
    image_cond        [1, C, 1, H/16, W/16]

Each float tensor keeps the dtype of the encoder that produced it. The same files made by the upstream trainer's
own producer are accepted by `load_encoded_case` (an extra `latent` key is ignored).
"""

from __future__ import annotations

import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from PIL import Image
from tqdm import tqdm

from predictor_training.runtime.errors import MissingFileError, UserInputError
from predictor_training.runtime.io import write_bytes_atomic

ENCODED_FIELDS = ("prompt_embeds", "prompt_mask", "byt5_text_states", "byt5_text_mask", "vision_states", "image_cond")
IGNORED_FIELDS = ("latent",)  # written by the upstream trainer's producer (video latent), not needed here
ENCODER_COMPONENTS = (
    "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "image_encoder", "feature_extractor", "vae",
)
VISION_CROPS = ("bucket", "target")
ENCODE_CONFIG_NAME = "encode_config.json"
# The chat-template marker after which the user's text starts (upstream `calculate_crop_start` looks for it).
_USER_TURN_MARKER = "<|im_start|>user\n"


class EncodedCaseError(UserInputError):
    """Bad encoder input or output; the message names the file, the field and the expected value."""


# =============================================================================================================
# 1. What a valid encoded case looks like
# =============================================================================================================
@dataclass(frozen=True)
class EncodedCaseSpec:
    """Expected widths of one encoded case (sequence lengths are free; masks must match their states).

    text_states_dim: last dim of prompt_embeds; byt5_states_dim: of byt5_text_states; vision_states_dim: of
    vision_states; latent_channels: C of image_cond; grid: latent (H, W) of image_cond, or None = not checked.
    """

    text_states_dim: int
    byt5_states_dim: int
    vision_states_dim: int
    latent_channels: int
    grid: tuple[int, int] | None

    @classmethod
    def from_teacher_config(cls, teacher_config: Mapping, grid: Sequence[int] | None) -> "EncodedCaseSpec":
        """From a WorldPlayTransformer config (`teacher.config` or its config.json as a dict)."""
        needed = ("text_states_dim", "byt5_states_dim", "vision_states_dim", "in_channels")
        missing = [name for name in needed if name not in teacher_config]
        if missing:
            raise KeyError(f"teacher config lacks {missing} (expected a WorldPlayTransformer config with {list(needed)})")
        return cls(
            text_states_dim=int(teacher_config["text_states_dim"]),
            byt5_states_dim=int(teacher_config["byt5_states_dim"]),
            vision_states_dim=int(teacher_config["vision_states_dim"]),
            latent_channels=int(teacher_config["in_channels"]),
            grid=_as_grid(grid),
        )


def _as_grid(grid: Sequence[int] | None) -> tuple[int, int] | None:
    if grid is None:
        return None
    grid = tuple(int(item) for item in grid)
    if len(grid) != 2 or min(grid) < 1:
        raise ValueError(f"grid must be the latent (H, W) as two positive ints, got {grid}")
    return grid


def validate_encoded_case(payload, spec: EncodedCaseSpec, source: str) -> dict[str, torch.Tensor]:
    """Check an encoded case (names, ranks, widths, mask values, finiteness) and return its six tensors.

    payload: the dict read from a `.pt` file (upstream layout). source: the file name used in error messages.
    Returns the six ENCODED_FIELDS (`latent` dropped) with both masks as int64; float tensors keep their dtype.
    """
    # 1. the container and its keys
    if not isinstance(payload, Mapping):
        raise EncodedCaseError(f"{source}: expected a dict of tensors, got {type(payload).__name__}")
    for name in ENCODED_FIELDS:
        if name not in payload:
            raise EncodedCaseError(f"{source}: field '{name}' is missing (expected fields {list(ENCODED_FIELDS)})")
        if not isinstance(payload[name], torch.Tensor):
            raise EncodedCaseError(f"{source}: field '{name}' is a {type(payload[name]).__name__}, expected a tensor")
    unknown = sorted(set(payload) - set(ENCODED_FIELDS) - set(IGNORED_FIELDS))
    if unknown:
        raise EncodedCaseError(
            f"{source}: unknown field '{unknown[0]}' (expected {list(ENCODED_FIELDS)}, optionally {list(IGNORED_FIELDS)})"
        )

    # 2. states: [1, L, width], floating point, finite
    widths = {
        "prompt_embeds": spec.text_states_dim,
        "byt5_text_states": spec.byt5_states_dim,
        "vision_states": spec.vision_states_dim,
    }
    for name, width in widths.items():
        tensor = payload[name]
        if tensor.dim() != 3 or tensor.shape[0] != 1 or tensor.shape[1] < 1 or tensor.shape[2] != width:
            raise EncodedCaseError(f"{source}: field '{name}' has shape {list(tensor.shape)}, expected [1, L, {width}]")
        _check_float_finite(tensor, name, source)

    # 3. masks: [1, L] matching their states, values 0/1; the LLM text must have at least one valid token
    masks = {}
    for mask_name, states_name in (("prompt_mask", "prompt_embeds"), ("byt5_text_mask", "byt5_text_states")):
        mask = payload[mask_name]
        length = payload[states_name].shape[1]
        if list(mask.shape) != [1, length]:
            raise EncodedCaseError(
                f"{source}: field '{mask_name}' has shape {list(mask.shape)}, expected [1, {length}] (the length of "
                f"'{states_name}')"
            )
        if mask.is_floating_point() or mask.is_complex():
            raise EncodedCaseError(f"{source}: field '{mask_name}' has dtype {mask.dtype}, expected an integer or bool mask")
        mask = mask.to(torch.int64)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise EncodedCaseError(f"{source}: field '{mask_name}' has values other than 0 and 1")
        masks[mask_name] = mask
    if int(masks["prompt_mask"].sum()) == 0:
        raise EncodedCaseError(f"{source}: field 'prompt_mask' has no valid token, expected at least one")

    # 4. image condition: [1, C, 1, H, W]
    image_cond = payload["image_cond"]
    height, width = ("H", "W") if spec.grid is None else spec.grid
    expected = f"[1, {spec.latent_channels}, 1, {height}, {width}]"
    if image_cond.dim() != 5 or list(image_cond.shape[:3]) != [1, spec.latent_channels, 1]:
        raise EncodedCaseError(f"{source}: field 'image_cond' has shape {list(image_cond.shape)}, expected {expected}")
    if spec.grid is not None and tuple(image_cond.shape[3:]) != spec.grid:
        raise EncodedCaseError(f"{source}: field 'image_cond' has shape {list(image_cond.shape)}, expected {expected}")
    _check_float_finite(image_cond, "image_cond", source)

    return {
        "prompt_embeds": payload["prompt_embeds"],
        "prompt_mask": masks["prompt_mask"],
        "byt5_text_states": payload["byt5_text_states"],
        "byt5_text_mask": masks["byt5_text_mask"],
        "vision_states": payload["vision_states"],
        "image_cond": image_cond,
    }


def _check_float_finite(tensor: torch.Tensor, name: str, source: str) -> None:
    if not tensor.is_floating_point():
        raise EncodedCaseError(f"{source}: field '{name}' has dtype {tensor.dtype}, expected a floating-point tensor")
    if not bool(torch.isfinite(tensor).all()):
        raise EncodedCaseError(f"{source}: field '{name}' has non-finite values (NaN/inf), expected finite values")


# =============================================================================================================
# 2. Reading and writing `.pt` files
# =============================================================================================================
def load_encoded_case(path: str | Path, teacher_config: Mapping, grid: Sequence[int] | None) -> dict[str, torch.Tensor]:
    """Load and validate one encoded case (ours or the upstream trainer's) against the Teacher config.

    teacher_config: `teacher.config` (or the dict of its config.json); grid: expected latent (H, W), or None to
    accept the file's. Returns the six ENCODED_FIELDS (masks int64). Raises EncodedCaseError naming file and field.
    """
    path = Path(path)
    if not path.is_file():
        raise EncodedCaseError(f"encoder output {path} does not exist")
    spec = EncodedCaseSpec.from_teacher_config(teacher_config, grid)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: say which one
        raise EncodedCaseError(f"{path}: cannot be read as a torch .pt file ({type(error).__name__}: {error})") from error
    return validate_encoded_case(payload, spec, source=str(path))


def encoded_case_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The `.pt` bytes of an encoded case; identical tensors give identical bytes (archive name is fixed)."""
    buffer = io.BytesIO()
    torch.save({name: tensors[name] for name in ENCODED_FIELDS}, buffer)
    return buffer.getvalue()


def save_encoded_case(path: str | Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write one encoded case atomically in the upstream `.pt` layout."""
    write_bytes_atomic(path, encoded_case_bytes(tensors))


def load_source_image(path: str | Path, source: str = "source_image") -> Image.Image:
    """Open an image as RGB; a missing or unreadable file raises naming the path and the field."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"field '{source}': image file {path} does not exist")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Exception as error:
        raise EncodedCaseError(f"field '{source}': {path} cannot be read as an image ({error})") from error


# =============================================================================================================
# 3. The encoders
# =============================================================================================================
class CaseEncoder:
    """The HunyuanVideo-1.5 i2v encoders behind diffusers' pipeline methods (no transformer loaded).

    `pipeline`: a `HunyuanVideo15ImageToVideoPipeline` whose transformer/scheduler/guider are None.
    `vision_crop`: which crop SigLIP sees before its own resize:
        "bucket"  the 480p-bucket crop nearest the image's aspect ratio (`calculate_default_height_width` with the
                  pipeline's target_size 640), as upstream HY-WorldPlay inference does;
        "target"  the same height x width crop as the VAE condition.
    """

    def __init__(self, pipeline, device: torch.device, vision_crop: str = "bucket"):
        if vision_crop not in VISION_CROPS:
            raise ValueError(f"vision_crop={vision_crop!r}; expected one of {VISION_CROPS}")
        for name in ENCODER_COMPONENTS:
            if getattr(pipeline, name) is None:
                raise ValueError(f"the encoder pipeline has no '{name}' component")
        self.pipeline = pipeline
        self.device = torch.device(device)
        self.vision_crop = vision_crop
        check_tokenizer_matches_pipeline(pipeline)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        device: str | torch.device,
        dtype: torch.dtype,
        byt5_dtype: torch.dtype = torch.float32,
        vae_dtype: torch.dtype = torch.float32,
        vision_crop: str = "bucket",
    ) -> "CaseEncoder":
        """Load the seven encoder components from a diffusers-format HunyuanVideo-1.5 i2v folder.

        dtype: Qwen2.5-VL and SigLIP (upstream: float16). byt5_dtype: the ByT5 encoder (upstream: float32; T5 is
        prone to overflow in float16). vae_dtype: the VAE (upstream trainer's producer: float32).
        """
        from diffusers import HunyuanVideo15ImageToVideoPipeline

        folder = Path(folder)
        if not (folder / "model_index.json").is_file():
            raise MissingFileError(f"encoder folder {folder}: model_index.json does not exist (expected a "
                                    "diffusers-format HunyuanVideo-1.5 i2v folder)")
        missing = [name for name in ENCODER_COMPONENTS if not (folder / name).is_dir()]
        if missing:
            raise MissingFileError(f"encoder folder {folder}: missing component folder(s) {missing} "
                                    f"(expected {list(ENCODER_COMPONENTS)})")
        component_dtypes = {"text_encoder": dtype, "image_encoder": dtype, "text_encoder_2": byt5_dtype, "vae": vae_dtype}
        pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(
            str(folder), transformer=None, scheduler=None, guider=None, dtype=component_dtypes
        )
        pipeline.to(torch.device(device))
        for name in ("text_encoder", "text_encoder_2", "image_encoder", "vae"):
            getattr(pipeline, name).eval().requires_grad_(False)
        return cls(pipeline, device=device, vision_crop=vision_crop)

    # ---- sizes ---------------------------------------------------------------------------------------------
    @property
    def spatial_factor(self) -> int:
        return int(self.pipeline.vae_scale_factor_spatial)

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """Latent (H, W) of a height x width image; both must be multiples of the VAE's spatial factor."""
        factor = self.spatial_factor
        for name, value in (("height", height), ("width", width)):
            if value < factor or value % factor:
                raise ValueError(f"{name}={value}: must be a positive multiple of the VAE spatial factor {factor}")
        return height // factor, width // factor

    def output_spec(self, height: int, width: int) -> EncodedCaseSpec:
        """What `encode_case` returns at this resolution (used to validate every output before it is written)."""
        pipe = self.pipeline
        return EncodedCaseSpec(
            text_states_dim=int(pipe.text_encoder.config.hidden_size),
            byt5_states_dim=int(pipe.text_encoder_2.config.d_model),
            vision_states_dim=int(pipe.image_encoder.config.hidden_size),
            latent_channels=int(pipe.vae.config.latent_channels),
            grid=self.latent_grid(height, width),
        )

    def describe(self) -> dict:
        """The settings that determine the outputs (stored next to them, checked on resume)."""
        pipe = self.pipeline
        return {
            "text_encoder_dtype": str(pipe.text_encoder.dtype).removeprefix("torch."),
            "byt5_dtype": str(pipe.text_encoder_2.dtype).removeprefix("torch."),
            "image_encoder_dtype": str(pipe.image_encoder.dtype).removeprefix("torch."),
            "vae_dtype": str(pipe.vae.dtype).removeprefix("torch."),
            "vision_crop": self.vision_crop,
            "tokenizer_max_length": int(pipe.tokenizer_max_length),
            "tokenizer_2_max_length": int(pipe.tokenizer_2_max_length),
            "prompt_template_encode_start_idx": int(pipe.prompt_template_encode_start_idx),
            "vae_scaling_factor": float(pipe.vae.config.scaling_factor),
        }

    # ---- encoding ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_image_caption(self, image: Image.Image, caption: str, height: int, width: int) -> dict[str, torch.Tensor]:
        """Encode a PIL image and its caption; returns the six ENCODED_FIELDS on the CPU (batch dim 1)."""
        pipe = self.pipeline
        self.latent_grid(height, width)
        if not isinstance(caption, str) or not caption.strip():
            raise ValueError(f"caption must be a non-empty string, got {caption!r}")

        # 1. text: Qwen2.5-VL (template + crop) and ByT5 glyphs. dtype=float32 only widens; each output is cast
        #    back to the dtype of the encoder that made it below.
        prompt_embeds, prompt_mask, byt5_states, byt5_mask = pipe.encode_prompt(
            prompt=caption, device=self.device, dtype=torch.float32, batch_size=1, num_videos_per_prompt=1
        )

        # 2. image: resize to cover + centre crop (LANCZOS) for the VAE condition; SigLIP sees the chosen crop
        target_image = pipe.video_processor.resize(image, height=height, width=width, resize_mode="crop")
        if self.vision_crop == "target":
            vision_image = target_image
        else:
            bucket_height, bucket_width = pipe.video_processor.calculate_default_height_width(
                height=image.size[1], width=image.size[0], target_size=pipe.target_size
            )
            vision_image = pipe.video_processor.resize(image, height=bucket_height, width=bucket_width, resize_mode="crop")
        vision_states = pipe.encode_image(
            image=vision_image, batch_size=1, device=self.device, dtype=pipe.image_encoder.dtype
        )
        image_cond = pipe._get_image_latents(
            vae=pipe.vae, image_processor=pipe.video_processor, image=target_image,
            height=height, width=width, device=self.device,
        )

        # 3. compact CPU copies (clone: a cropped view would otherwise save its whole uncropped storage)
        return {
            "prompt_embeds": _cpu_copy(prompt_embeds, pipe.text_encoder.dtype),
            "prompt_mask": _cpu_copy(prompt_mask.round(), torch.int64),
            "byt5_text_states": _cpu_copy(byt5_states, pipe.text_encoder_2.dtype),
            "byt5_text_mask": _cpu_copy(byt5_mask.round(), torch.int64),
            "vision_states": _cpu_copy(vision_states, pipe.image_encoder.dtype),
            "image_cond": _cpu_copy(image_cond, pipe.vae.dtype),
        }

    def encode_case(self, image_path: str | Path, caption: str, height: int, width: int) -> dict[str, torch.Tensor]:
        """Encode one (image file, caption); returns the six ENCODED_FIELDS (see the module docstring)."""
        return self.encode_image_caption(load_source_image(image_path), caption, height, width)


def _cpu_copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().to(device="cpu", dtype=dtype).contiguous().clone()


def template_prefix_length(pipeline) -> int:
    """Number of template tokens before the user's text, found the way upstream does (`calculate_crop_start`).

    Tokenises the pipeline's own conversation (`format_text_input` with its system message) and returns the
    position right after the first `<|im_start|>user\\n` marker.
    """
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import format_text_input

    conversation = format_text_input([" "], pipeline.system_message)
    encoded = pipeline.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=True)
    input_ids = list(encoded["input_ids"][0])
    marker = list(pipeline.tokenizer(_USER_TURN_MARKER, add_special_tokens=False)["input_ids"])
    for start in range(len(input_ids) - len(marker) + 1):
        if input_ids[start : start + len(marker)] == marker:
            return start + len(marker)
    raise ValueError(f"tokenizer: the chat template output has no {_USER_TURN_MARKER!r} marker (expected a "
                     "Qwen2.5-VL style chat template)")


def check_tokenizer_matches_pipeline(pipeline) -> None:
    """Raise unless the tokenizer pads on the right and its template prefix has the pipeline's crop length.

    diffusers crops a fixed `prompt_template_encode_start_idx` (108) tokens and keeps the first 1000 after it;
    that is only right for a right-padding tokenizer whose template prefix is exactly that long.
    """
    tokenizer = pipeline.tokenizer
    if tokenizer.padding_side != "right":
        raise ValueError(f"tokenizer: padding_side is {tokenizer.padding_side!r}, expected 'right' (the pipeline crops "
                         "the template prefix from the left and upstream pads on the right)")
    prefix = template_prefix_length(pipeline)
    if prefix != pipeline.prompt_template_encode_start_idx:
        raise ValueError(f"tokenizer: the template prefix is {prefix} tokens, but the pipeline crops "
                         f"prompt_template_encode_start_idx={pipeline.prompt_template_encode_start_idx}; the tokenizer "
                         "does not belong to this pipeline")


# =============================================================================================================
# 4. The encoder stage over many cases (resumable, sharded by rank)
# =============================================================================================================
@dataclass(frozen=True)
class EncodeJob:
    """One case to encode."""

    case_id: str
    image_path: Path
    caption: str


@dataclass(frozen=True)
class EncodeReport:
    written: int
    skipped: int


def encoded_path(out_dir: str | Path, case_id: str) -> Path:
    """`out_dir/{case_id}.pt`; the case_id must be usable as a file name."""
    if not case_id or "/" in case_id or "\\" in case_id or case_id in (".", "..") or case_id.startswith("."):
        raise ValueError(f"case_id {case_id!r} cannot be used as a file name (expected no '/', '\\' or leading '.')")
    return Path(out_dir) / f"{case_id}.pt"


def encode_settings(encoder: CaseEncoder, height: int, width: int) -> dict:
    """The settings recorded in `out_dir/encode_config.json`."""
    return {"height": int(height), "width": int(width), "grid": list(encoder.latent_grid(height, width)), **encoder.describe()}


def check_or_write_encode_config(out_dir: str | Path, settings: Mapping, write: bool) -> None:
    """First run: write `encode_config.json`. Later runs: raise if any setting differs from the stored one.

    `write=False` (ranks other than 0) only checks an existing file.
    """
    path = Path(out_dir) / ENCODE_CONFIG_NAME
    if path.is_file():
        stored = json.loads(path.read_text(encoding="utf-8"))
        for key in sorted(set(stored) | set(settings)):
            if stored.get(key) != settings.get(key):
                raise EncodedCaseError(
                    f"{path}: field '{key}' is {stored.get(key)!r}, but this run uses {settings.get(key)!r}; outputs "
                    "in this folder were made with other settings (use another --out, or delete the folder)"
                )
        return
    if write:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(path, (json.dumps(dict(settings), indent=2, sort_keys=True) + "\n").encode("utf-8"))


def encode_cases_to_folder(
    encoder: CaseEncoder,
    jobs: Sequence[EncodeJob],
    out_dir: str | Path,
    height: int,
    width: int,
    rank: int = 0,
    world_size: int = 1,
    show_progress: bool = True,
) -> EncodeReport:
    """Encode this rank's share of `jobs` (jobs[rank::world_size]) into `out_dir/{case_id}.pt`.

    Existing outputs are skipped (resume); each new one is validated against `encoder.output_spec` and written
    atomically, so an error leaves every finished file intact. Call `check_or_write_encode_config` first.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size")
    spec = encoder.output_spec(height, width)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shard = list(jobs)[rank::world_size]
    written = skipped = 0
    for job in tqdm(shard, desc=f"encode (rank {rank})", disable=not show_progress, dynamic_ncols=True):
        path = encoded_path(out_dir, job.case_id)
        if path.is_file():
            skipped += 1
            continue
        try:
            tensors = encoder.encode_case(job.image_path, job.caption, height, width)
        except FileNotFoundError as error:
            raise MissingFileError(f"case '{job.case_id}': {error}") from error
        tensors = validate_encoded_case(tensors, spec, source=f"{path} (case '{job.case_id}', freshly encoded)")
        warn_if_caption_truncated(tensors, f"case '{job.case_id}'", job.caption)
        save_encoded_case(path, tensors)
        written += 1
    return EncodeReport(written=written, skipped=skipped)


def warn_if_caption_truncated(tensors: dict[str, torch.Tensor], case: str, caption: str) -> None:
    """A caption that fills every text token was cut there (as upstream does): one warning line naming the case."""
    length = tensors["prompt_mask"].shape[1]
    if int(tensors["prompt_mask"].sum()) == length:
        tqdm.write(f"warning: {case}: the caption ({len(caption)} characters) fills all {length} text tokens and was "
                   "truncated there (as upstream does); shorten it to keep all of it", file=sys.stderr)


def jobs_from_cases(cases: Iterable) -> list[EncodeJob]:
    """EncodeJobs from `sample_table.Case`s (whose source_image `read_cases` has made absolute)."""
    return [EncodeJob(case.case_id, Path(case.source_image), case.caption) for case in cases]
