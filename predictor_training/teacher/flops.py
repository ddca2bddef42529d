"""Analytic FLOP counts of the Teacher's AR calls and of a Predictor step, from the configs alone.

Used for the speed bound of an accelerated schedule: a schedule cannot run faster than the ratio of the FLOPs the
reference does to the FLOPs it does (the VAE decode, which every schedule runs identically, is outside this count).

Counting rules: 2 FLOPs per multiply-add of every matmul (linear layers, attention scores and weighted sums, the
ProPE 4x4 maps); element-wise work (norms, activations, RoPE, gates, softmax) is not counted. Symbols: D hidden
size, r MLP ratio, HW latent tokens per frame, T frames of a chunk (4), N = T*HW chunk tokens, n context frames,
S = n*HW context tokens, L the text tokens kept by the text prefill.

    image block (queries Q over T frames, K keys)   2*T*D*6D (img_mod) + 3*2*Q*D^2 (q, k, v) + 4*8*Q*D (ProPE on
                                                    q, k, v, output) + 2*(2*Q*K*D)*2 (two branches, QK^T and AV)
                                                    + 2*2*Q*D^2 (attn_proj, prope_proj) + 2*2*Q*D*rD (MLP)
    chunk step      embed(N) + depth * block(N, K = L + S + N) + final layer
    context prefill embed(S) + (depth - 1) * block(S, K = L + S) + K/V path of the last block
    context cache   (context modes other than exact; predictor_training/teacher/frame_kv_cache.py) placing cached K/V:
                    depth * 2 * 8*S*D (ProPE on K and V); incremental also runs, after every chunk but the last,
                    one chunk step on its final latents (a chunk step's FLOPs)
    Predictor step  embed(N) + fusion Linear(streams*D -> D) + 2 * block(N, K = L [+ S for v4] + N) + residual
                    head (2 Linear D -> D) + final layer
    hidden reuse    frame vec + final layer;   velocity reuse: 0
    forecast        (a TaylorSeer-style forecast of the hidden) frame vec + final layer, as hidden reuse
    cache residual  (a TeaCache-style skipped step) embed(N) + the first block's modulation + final layer; on a Full
                    step the same probe is the start of the forward, so it is not counted twice
    block residual  (a block-residual cache step, Delta-DiT / FORA style) embed(N) + b * block(N, K = L + S + N) +
                    final layer, b the Teacher blocks it runs (the Predictor's 2); the cached residuals of the
                    skipped spans are added element-wise (not counted). A v4 Predictor step is this plus its fusion
                    Linear and residual head: 2N*streams*D*D + 2*2N*D*D more
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from predictor_training.teacher.config import DISTILLED_STEPS
from predictor_training.teacher.frame_kv_cache import check_context_mode

SINUSOID_DIM = 256  # frequency features of time_in / action_in
REFINER_DEPTH = 2  # txt_in.individual_token_refiner blocks
# The real 480p config's chunk and text sizes (tools/print_flop_bounds.py, the leaderboard's real-config axis):
# 480 x 832 pixels / 16 = 30 x 52 latent tokens per frame; SigLIP's 729 tokens plus a prompt
REAL_LATENT_GRID = (30, 52)
REAL_TEXT_TOKENS = 1000
STEP_KINDS = ("full", "predictor", "reuse_velocity", "reuse_hidden", "forecast", "cache_residual", "block_residual")


@dataclass(frozen=True)
class TeacherShape:
    """The Teacher sizes the counts need (from `teacher.config` or its config.json)."""

    hidden_size: int
    heads_num: int
    mlp_width_ratio: float
    depth: int
    in_channels: int
    out_channels: int
    text_states_dim: int
    byt5_states_dim: int
    byt5_hidden_dim: int
    vision_states_dim: int

    @classmethod
    def from_config(cls, config: Mapping) -> "TeacherShape":
        needed = ("hidden_size", "heads_num", "mlp_width_ratio", "mm_double_blocks_depth", "in_channels",
                  "out_channels", "text_states_dim", "byt5_states_dim", "byt5_hidden_dim", "vision_states_dim")
        missing = [key for key in needed if key not in config]
        if missing:
            raise KeyError(f"teacher config lacks {missing} needed for the FLOP count")
        # upstream semantics: out_channels None means "same as in_channels"
        out_channels = config["in_channels"] if config["out_channels"] is None else config["out_channels"]
        return cls(
            hidden_size=int(config["hidden_size"]),
            heads_num=int(config["heads_num"]),
            mlp_width_ratio=float(config["mlp_width_ratio"]),
            depth=int(config["mm_double_blocks_depth"]),
            in_channels=int(config["in_channels"]),
            out_channels=int(out_channels),
            text_states_dim=int(config["text_states_dim"]),
            byt5_states_dim=int(config["byt5_states_dim"]),
            byt5_hidden_dim=int(config["byt5_hidden_dim"]),
            vision_states_dim=int(config["vision_states_dim"]),
        )

    @property
    def mlp_width(self) -> int:
        return int(self.hidden_size * self.mlp_width_ratio)


# ---------------------------------------------------------------------------------------------------------------
# 1. Pieces
# ---------------------------------------------------------------------------------------------------------------
def linear_flops(tokens: int, in_features: int, out_features: int) -> int:
    return 2 * tokens * in_features * out_features


def frame_vec_flops(shape: TeacherShape, frames: int) -> int:
    """time_in + action_in, each sinusoid(256) -> Linear -> SiLU -> Linear, one row per frame."""
    hidden = shape.hidden_size
    one = linear_flops(frames, SINUSOID_DIM, hidden) + linear_flops(frames, hidden, hidden)
    return 2 * one


def embed_flops(shape: TeacherShape, tokens: int, frames: int) -> int:
    """img_in on 2C+1 input channels plus the per-frame conditioning vector."""
    return linear_flops(tokens, 2 * shape.in_channels + 1, shape.hidden_size) + frame_vec_flops(shape, frames)


def final_layer_flops(shape: TeacherShape, tokens: int, frames: int) -> int:
    """adaLN modulation per frame (D -> 2D) and the output Linear (D -> C_out)."""
    return linear_flops(frames, shape.hidden_size, 2 * shape.hidden_size) + linear_flops(
        tokens, shape.hidden_size, shape.out_channels
    )


def image_block_flops(shape: TeacherShape, frames: int, queries: int, keys: int, kv_only: bool = False) -> int:
    """One double block's image stream: `queries` tokens over `frames` frames attending to `keys` keys."""
    hidden = shape.hidden_size
    modulation = linear_flops(frames, hidden, 6 * hidden)
    prope_per_tensor = 8 * queries * hidden  # one 4x4 map per 4 channels: 16 MACs per 4 values
    k_and_v = 2 * linear_flops(queries, hidden, hidden) + 2 * prope_per_tensor
    if kv_only:
        return modulation + k_and_v
    q = linear_flops(queries, hidden, hidden) + 2 * prope_per_tensor  # ProPE on q and on the ProPE output
    attention = 2 * (2 * queries * keys * hidden) * 2  # two branches x (QK^T + AV)
    projections = 2 * linear_flops(queries, hidden, hidden)  # img_attn_proj + img_attn_prope_proj
    mlp = linear_flops(queries, hidden, shape.mlp_width) + linear_flops(queries, shape.mlp_width, hidden)
    return modulation + k_and_v + q + attention + projections + mlp


def text_block_flops(shape: TeacherShape, tokens: int, kv_only: bool = False) -> int:
    """One double block's text stream in the text prefill (text-only attention)."""
    hidden = shape.hidden_size
    modulation = linear_flops(1, hidden, 6 * hidden)
    k_and_v = 2 * linear_flops(tokens, hidden, hidden)
    if kv_only:
        return modulation + k_and_v
    q = linear_flops(tokens, hidden, hidden)
    attention = 2 * (2 * tokens * tokens * hidden)
    proj = linear_flops(tokens, hidden, hidden)
    mlp = linear_flops(tokens, hidden, shape.mlp_width) + linear_flops(tokens, shape.mlp_width, hidden)
    return modulation + k_and_v + q + attention + proj + mlp


# ---------------------------------------------------------------------------------------------------------------
# 2. Whole calls
# ---------------------------------------------------------------------------------------------------------------
def teacher_chunk_step_flops(
    shape: TeacherShape, tokens_per_frame: int, text_tokens: int, context_frames: int, chunk_frames: int = 4
) -> int:
    """One Full step on a chunk of `chunk_frames` frames with `context_frames` frames of context K/V."""
    queries = chunk_frames * tokens_per_frame
    keys = text_tokens + context_frames * tokens_per_frame + queries
    blocks = shape.depth * image_block_flops(shape, chunk_frames, queries, keys)
    return embed_flops(shape, queries, chunk_frames) + blocks + final_layer_flops(shape, queries, chunk_frames)


def context_prefill_flops(shape: TeacherShape, tokens_per_frame: int, text_tokens: int, context_frames: int) -> int:
    """The context prefill of `context_frames` frames (0 frames: nothing runs)."""
    if context_frames == 0:
        return 0
    queries = context_frames * tokens_per_frame
    keys = text_tokens + queries
    full = image_block_flops(shape, context_frames, queries, keys)
    last = image_block_flops(shape, context_frames, queries, keys, kv_only=True)
    return embed_flops(shape, queries, context_frames) + (shape.depth - 1) * full + last


def context_assembly_flops(shape: TeacherShape, tokens_per_frame: int, context_frames: int) -> int:
    """Placing `context_frames` cached frames: the ProPE map on K and V of every layer (RoPE is element-wise)."""
    return shape.depth * 2 * 8 * context_frames * tokens_per_frame * shape.hidden_size


def frame_kv_pass_flops(
    shape: TeacherShape, tokens_per_frame: int, text_tokens: int, context_frames: int, chunk_frames: int = 4
) -> int:
    """The incremental mode's pass over a finished chunk: one chunk step (its velocity is not used)."""
    return teacher_chunk_step_flops(shape, tokens_per_frame, text_tokens, context_frames, chunk_frames)


def text_prefill_flops(
    shape: TeacherShape, llm_tokens: int, byt5_tokens: int, vision_tokens: int, kept_tokens: int
) -> int:
    """Text prefill: txt_in refiner on all `llm_tokens` (padding included), byt5_in on `byt5_tokens`, vision_in on
    `vision_tokens`, then the text stream of every block on the `kept_tokens` (last block: K/V only)."""
    hidden, text_dim = shape.hidden_size, shape.text_states_dim
    refiner_block = (
        linear_flops(1, hidden, 2 * hidden)  # adaLN
        + linear_flops(llm_tokens, hidden, 3 * hidden)
        + 2 * (2 * llm_tokens * llm_tokens * hidden)
        + linear_flops(llm_tokens, hidden, hidden)
        + linear_flops(llm_tokens, hidden, shape.mlp_width) + linear_flops(llm_tokens, shape.mlp_width, hidden)
    )
    txt_in = (
        linear_flops(llm_tokens, text_dim, hidden)
        + linear_flops(1, text_dim, hidden) + linear_flops(1, hidden, hidden)  # c_embedder
        + linear_flops(1, SINUSOID_DIM, hidden) + linear_flops(1, hidden, hidden)  # t_embedder
        + REFINER_DEPTH * refiner_block
    )
    byt5_in = (
        linear_flops(byt5_tokens, shape.byt5_states_dim, shape.byt5_hidden_dim)
        + linear_flops(byt5_tokens, shape.byt5_hidden_dim, shape.byt5_hidden_dim)
        + linear_flops(byt5_tokens, shape.byt5_hidden_dim, hidden)
    )
    vision_in = linear_flops(vision_tokens, shape.vision_states_dim, shape.vision_states_dim) + linear_flops(
        vision_tokens, shape.vision_states_dim, hidden
    )
    blocks = (shape.depth - 1) * text_block_flops(shape, kept_tokens) + text_block_flops(shape, kept_tokens, True)
    vec_txt = linear_flops(1, SINUSOID_DIM, hidden) + linear_flops(1, hidden, hidden)  # time_in(0) of the text stream
    return vec_txt + txt_in + byt5_in + vision_in + blocks


def predictor_step_flops(
    shape: TeacherShape,
    predictor_config: Mapping,
    tokens_per_frame: int,
    text_tokens: int,
    context_frames: int,
    chunk_frames: int = 4,
) -> int:
    """One Predictor step (`Predictor.predictor_config()` layout: variant, fusion_streams, hidden_size, ...)."""
    for key in ("variant", "fusion_streams", "hidden_size"):
        if key not in predictor_config:
            raise KeyError(f"predictor config lacks {key!r} needed for the FLOP count")
    if int(predictor_config["hidden_size"]) != shape.hidden_size:
        raise ValueError(
            f"predictor hidden_size {predictor_config['hidden_size']} differs from the Teacher's {shape.hidden_size}"
        )
    hidden = shape.hidden_size
    queries = chunk_frames * tokens_per_frame
    with_context = predictor_config["variant"] == "v4"
    keys = text_tokens + (context_frames * tokens_per_frame if with_context else 0) + queries
    streams = len(predictor_config["fusion_streams"])
    fusion = linear_flops(queries, streams * hidden, hidden)
    head = 2 * linear_flops(queries, hidden, hidden)
    blocks = 2 * image_block_flops(shape, chunk_frames, queries, keys)
    embed, final = embed_flops(shape, queries, chunk_frames), final_layer_flops(shape, queries, chunk_frames)
    return embed + fusion + blocks + head + final


def block_residual_step_flops(shape: TeacherShape, num_blocks: int, tokens_per_frame: int, text_tokens: int,
                              context_frames: int, chunk_frames: int = 4) -> int:
    """One block-residual cache step: the input embedding, `num_blocks` Teacher double blocks on the chunk with its
    text and context K/V (K = L + S + N keys, as in a Full step), and the final layer."""
    if not 1 <= num_blocks <= shape.depth:
        raise ValueError(f"a block-residual step runs 1..{shape.depth} blocks, got {num_blocks}")
    queries = chunk_frames * tokens_per_frame
    keys = text_tokens + context_frames * tokens_per_frame + queries
    blocks = num_blocks * image_block_flops(shape, chunk_frames, queries, keys)
    return embed_flops(shape, queries, chunk_frames) + blocks + final_layer_flops(shape, queries, chunk_frames)


REUSE_KINDS = ("reuse_velocity", "reuse_hidden", "forecast", "cache_residual")


def reuse_step_flops(shape: TeacherShape, kind: str, tokens_per_frame: int, chunk_frames: int = 4) -> int:
    """Velocity reuse: nothing. Hidden reuse and a forecast of the hidden: the step's frame vec and the final layer.
    A cached residual: the embedded input, the first block's modulation (the skip indicator) and the final layer."""
    queries = chunk_frames * tokens_per_frame
    if kind == "reuse_velocity":
        return 0
    if kind in ("reuse_hidden", "forecast"):
        return frame_vec_flops(shape, chunk_frames) + final_layer_flops(shape, queries, chunk_frames)
    if kind == "cache_residual":
        modulation = linear_flops(chunk_frames, shape.hidden_size, 6 * shape.hidden_size)
        return embed_flops(shape, queries, chunk_frames) + modulation + final_layer_flops(shape, queries, chunk_frames)
    raise ValueError(f"reuse kind must be one of {REUSE_KINDS}, got {kind!r}")


# ---------------------------------------------------------------------------------------------------------------
# 3. A whole rollout under a schedule
# ---------------------------------------------------------------------------------------------------------------
def rollout_flops(
    shape: TeacherShape,
    tokens_per_frame: int,
    text_tokens: int,
    context_frames_per_chunk: Sequence[int],
    step_kind: Callable[[int, int], str],
    num_steps: int = DISTILLED_STEPS,
    chunk_frames: int = 4,
    predictor_config: Mapping | None = None,
    text_prefill: int = 0,
    context_mode: str = "exact",
    residual_blocks: int | None = None,
) -> dict[str, int]:
    """FLOPs of one video's DiT work: {"text_prefill", "context_prefill", "full_step", "predictor_step",
    "reuse_step", "block_residual_step", "total"}, plus "context_cache" in the cached context modes.

    context_frames_per_chunk[c]: context frames of chunk c (0 for chunk 0). step_kind(chunk, step) -> one of
    STEP_KINDS. predictor_config: required when a step is "predictor"; residual_blocks: the Teacher blocks a
    "block_residual" step runs (required when one is). text_prefill: the (schedule-independent)
    text prefill FLOPs to include (0 when the text K/V are read from disk). context_mode: "exact" re-prefills the
    context of every chunk; "incremental" and "last_step" place cached K/V instead (context_cache), incremental
    after one K/V pass over every chunk but the last.
    """
    check_context_mode(context_mode)
    parts = {"text_prefill": int(text_prefill), "context_prefill": 0, "full_step": 0, "predictor_step": 0,
             "reuse_step": 0, "block_residual_step": 0, **({} if context_mode == "exact" else {"context_cache": 0})}
    last_chunk = len(context_frames_per_chunk) - 1
    for chunk, context_frames in enumerate(context_frames_per_chunk):
        if context_mode == "exact":
            parts["context_prefill"] += context_prefill_flops(shape, tokens_per_frame, text_tokens, context_frames)
        else:
            parts["context_cache"] += context_assembly_flops(shape, tokens_per_frame, context_frames)
            if context_mode == "incremental" and chunk < last_chunk:
                parts["context_cache"] += frame_kv_pass_flops(shape, tokens_per_frame, text_tokens, context_frames,
                                                              chunk_frames)
        for step in range(num_steps):
            kind = step_kind(chunk, step)
            if kind == "full":
                parts["full_step"] += teacher_chunk_step_flops(
                    shape, tokens_per_frame, text_tokens, context_frames, chunk_frames
                )
            elif kind == "predictor":
                if predictor_config is None:
                    raise ValueError(f"chunk {chunk} step {step} is a Predictor step but no predictor_config was given")
                parts["predictor_step"] += predictor_step_flops(
                    shape, predictor_config, tokens_per_frame, text_tokens, context_frames, chunk_frames
                )
            elif kind in REUSE_KINDS:
                parts["reuse_step"] += reuse_step_flops(shape, kind, tokens_per_frame, chunk_frames)
            elif kind == "block_residual":
                if residual_blocks is None:
                    raise ValueError(f"chunk {chunk} step {step} is a block-residual step but no residual_blocks "
                                     "was given")
                parts["block_residual_step"] += block_residual_step_flops(
                    shape, residual_blocks, tokens_per_frame, text_tokens, context_frames, chunk_frames
                )
            else:
                raise ValueError(f"step kind of chunk {chunk} step {step} is {kind!r}; expected one of {STEP_KINDS}")
    parts["total"] = sum(parts.values())
    return parts


def memory_context_frames(chunks: int, chunk_frames: int = 4, memory_frames: int = 20) -> list[int]:
    """Context frames of chunks 0..chunks-1 under the memory rule: every earlier frame, up to the memory window
    (0, 4, 8, 12, 16, 20, 20, ...; what a rollout's selection gives when it keeps the cap)."""
    return [min(chunk_frames * chunk, memory_frames) for chunk in range(chunks)]


def replacement_rollout_flops(shape: TeacherShape, tokens_per_frame: int, text_tokens: int,
                              context_frames_per_chunk: Sequence[int], replace_steps: Sequence[int], *,
                              predictor_config: Mapping | None = None, **options) -> dict[str, int]:
    """`rollout_flops` of a replacement schedule: chunk 0 all Full steps, every later chunk the Predictor at
    `replace_steps` and Full steps elsewhere (F-P-P-P: (1, 2, 3); F-F-F-F: ()). options: rollout_flops' num_steps,
    chunk_frames, text_prefill, context_mode."""
    return rollout_flops(shape, tokens_per_frame, text_tokens, context_frames_per_chunk,
                         lambda chunk, step: "predictor" if chunk > 0 and step in replace_steps else "full",
                         predictor_config=predictor_config, **options)


def flop_speedup_bound(reference_flops: int, schedule_flops: int) -> float:
    """Upper bound on the speedup of a schedule: reference FLOPs / schedule FLOPs."""
    if schedule_flops <= 0:
        raise ValueError(f"schedule FLOPs must be positive, got {schedule_flops}")
    return reference_flops / schedule_flops


# ---------------------------------------------------------------------------------------------------------------
# 4. One training micro-batch of a Predictor recipe (tools/estimate_memory.py's time figures)
# ---------------------------------------------------------------------------------------------------------------
# Context frames of chunks 1..7 (memory of 20 frames reached at chunk 5): the v4 offline buckets' mix.
OFFLINE_CONTEXT_MIX = (4, 8, 12, 16, 20, 20, 20)
PEAK_BF16_TFLOPS = 989.0  # dense BF16 peak of an H100 SXM / H200 (the same tensor cores), TFLOP/s


def predictor_training_step_flops(shape: TeacherShape, predictor_config: Mapping, tokens_per_frame: int,
                                  text_tokens: int, context_frames: int) -> int:
    """Forward + backward (2x forward) + the gradient-checkpoint recompute of the two blocks, of one Predictor step."""
    forward = predictor_step_flops(shape, predictor_config, tokens_per_frame, text_tokens, context_frames)
    queries = 4 * tokens_per_frame
    keys = text_tokens + (context_frames * tokens_per_frame if predictor_config["variant"] == "v4" else 0) + queries
    return 3 * forward + 2 * image_block_flops(shape, 4, queries, keys)


def recipe_micro_batch_flops(shape: TeacherShape, recipe: str, *, tokens_per_frame: int, text_tokens: int,
                             batch_size: int = 1, context_frames: int | None = None, chunks: int = 8,
                             replace_steps: Sequence[int] = (1, 2, 3), context_mode: str = "exact",
                             reuse_steps: Sequence[int] = ()) -> int:
    """DiT FLOPs of one micro-batch of a Predictor recipe (matmuls only).

    v4 / disca (offline): batch x (context K/V projection of the 2 source layers + the Predictor step's training);
    v4 with context_frames None: the mean over OFFLINE_CONTEXT_MIX. rollout: one trajectory of `chunks` chunks -
    chunk 0 F-F-F-F, then per chunk the context prefill, the Full steps, the Teacher targets of the Predictor steps
    (forward only) and the Predictor steps' training; `reuse_steps` (F-R-R-P) run neither the Teacher nor the
    Predictor after chunk 0."""
    v4 = {"variant": "v4", "hidden_size": shape.hidden_size, "fusion_streams": ["image", "anchor", "prev_chunk"]}
    if recipe in ("v4", "disca"):
        config = v4 if recipe == "v4" else {**v4, "variant": "disca", "fusion_streams": ["image", "anchor"]}
        mix = [0] if recipe == "disca" else (OFFLINE_CONTEXT_MIX if context_frames is None else [context_frames])
        per_item = [(0 if recipe == "disca" else 2 * image_block_flops(
            shape, frames, frames * tokens_per_frame, frames * tokens_per_frame, kv_only=True))
            + predictor_training_step_flops(shape, config, tokens_per_frame, text_tokens, frames) for frames in mix]
        return int(batch_size * sum(per_item) / len(per_item))
    context = memory_context_frames(chunks)
    teacher = rollout_flops(shape, tokens_per_frame, text_tokens, context,
                            lambda chunk, step: "reuse_velocity" if chunk and step in reuse_steps else "full",
                            context_mode=context_mode)["total"]
    return int(teacher + sum(len(replace_steps) * predictor_training_step_flops(
        shape, v4, tokens_per_frame, text_tokens, frames) for frames in context[1:]))


def seconds_at(flop_count: int, utilisation: float) -> float:
    """Seconds of `flop_count` FLOPs at `utilisation` of PEAK_BF16_TFLOPS."""
    return flop_count / (utilisation * PEAK_BF16_TFLOPS * 1e12)


def micro_batch_time_notes(shape: TeacherShape, recipe: str, *, context_frames: int | None,
                           user_seconds: float | None = None, **sizes) -> dict:
    """The time figures of a rehearsal's report: a micro-batch's DiT TFLOPs (`recipe_micro_batch_flops` with
    `sizes`) and its seconds at 40 % of the BF16 peak; with the user's measured seconds per micro-batch (at the
    offline context mix), the utilisation they imply."""
    count = recipe_micro_batch_flops(shape, recipe, context_frames=context_frames, **sizes)
    notes = {"dit_tflops_per_micro_batch": round(count / 1e12, 1),
             "seconds_at_40pct_of_989_tflops": round(seconds_at(count, 0.4), 2)}
    if user_seconds is not None:
        mix = recipe_micro_batch_flops(shape, recipe, context_frames=None, **sizes)
        notes.update(user_seconds_per_micro_batch=user_seconds,
                     utilisation_implied_by_user_time=round(mix / (user_seconds * PEAK_BF16_TFLOPS * 1e12), 3))
    return notes
