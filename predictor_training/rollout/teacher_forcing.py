"""Chunk predictions of an AR world model on a known history (teacher forcing), for the generic methods.

Diffusion-forcing SFT and causal KD both train a model (the Teacher with a LoRA, or all parameters of a model of the
Teacher's architecture) to denoise chunk c of a clip whose earlier frames are known: the clean data latents (SFT) or
the many-step teacher's final latents (KD). The context of chunk c is built exactly as in the AR loop
(`ar_rollout.ARRollout`): memory selection on the clip's cameras, the selected frames with their condition channels
prefilled at the context timestep 14 with compacted RoPE positions 0..n-1, the chunk at RoPE start n. Only the
chunk's own latents differ: here they are a noised version of the chunk at a noise level the method chooses, one
per chunk (the model's `chunk_step` takes a timestep per frame).

The context is clean by default (teacher forcing: the known history itself, labelled with the context timestep 14, as
the AR loop prefills it). `NoisyContext` gives the diffusion-forcing variant instead: every chunk of the clip noised
at its own level, `(1 - sigma_j) x_j + sigma_j n_j`, and the context prefill sees each selected frame at its own
chunk's timestep `1000 sigma_j` (the Teacher's `context_prefill` takes a timestep per frame). Memory selection is the
same in both: it depends on the cameras and the memory points only.

Gradients flow through the chunk step and, with `context_grad`, through the context prefill too (a model trained
from scratch must learn to encode its context). The text K/V come from the clip: stored text K/V (a Teacher-sample
clip: fixed), or encoder outputs that the model prefills itself (under grad when the text stream trains, recomputed
for every chunk so that each chunk's backward frees its own graph).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.rollout.policy import ChunkContext
from predictor_training.runtime.precision import autocast
from predictor_training.teacher import TextKV

TEXT_ENCODER_FIELDS = ("prompt_embeds", "prompt_mask", "byt5_text_states", "byt5_text_mask", "vision_states")
STORED_TEXT_FIELDS = ("text_k", "text_v")
CONTEXT_NOISE_MODES = ("clean", "independent")


def text_source(item: Mapping) -> str:
    """"encoder" when the clip carries encoder outputs, "stored" when it carries text K/V (ValueError if neither)."""
    if all(name in item for name in TEXT_ENCODER_FIELDS):
        return "encoder"
    if all(name in item for name in STORED_TEXT_FIELDS):
        return "stored"
    raise ValueError(f"a clip needs either the encoder outputs {list(TEXT_ENCODER_FIELDS)} or the stored text K/V "
                     f"{list(STORED_TEXT_FIELDS)}; it has {sorted(item)}")


def clip_text_kv(model, item: Mapping, device: torch.device, autocast_dtype: torch.dtype | None, *,
                 grad: bool) -> TextKV:
    """The text K/V of every layer for one clip: the model's own text prefill of the encoder outputs (mask type
    i2v, under `autocast_dtype`), or the stored K/V cast to the model's dtype."""
    if text_source(item) == "stored":
        return TextKV.from_layer_stack(item["text_k"], item["text_v"], device, model.dtype)
    inputs = []
    for name in TEXT_ENCODER_FIELDS:
        tensor = item[name].to(device)
        inputs.append(tensor.to(model.dtype) if tensor.is_floating_point() else tensor)
    with torch.set_grad_enabled(grad), autocast(device, autocast_dtype):
        return model.text_prefill(*inputs, mask_type="i2v")


def draw_training_chunks(num_chunks: int, count: int, rank_generator: torch.Generator,
                         shared_generator: torch.Generator) -> list[int]:
    """`min(count, num_chunks)` distinct chunk indices of a clip, ascending, each chunk equally likely.

    Whether chunk 0 (the only chunk without context, so without a context prefill) is among them comes from
    `shared_generator`, which must be the same on every rank; the other chunks come from `rank_generator`. Under
    FSDP every rank then calls the model's blocks in the same order (a prefill for every chunk but chunk 0); ranks
    that disagree there wait on different all-gathers and fail. That holds when every rank's clip has the same
    number of chunks (clips of one length, as the AR loop's datasets are).
    """
    if num_chunks < 1:
        raise ValueError(f"a clip needs at least one chunk, got {num_chunks}")
    count = min(count, num_chunks)
    with_first = bool(torch.rand((), generator=shared_generator) < count / num_chunks)
    others = (torch.randperm(num_chunks - 1, generator=rank_generator) + 1)[: count - int(with_first)]
    return sorted(([0] if with_first else []) + others.tolist())


@dataclass(frozen=True)
class NoisyContext:
    """The context of diffusion forcing: every chunk of the clip at its own noise level.

    latents [1, C, T, H, W]: chunk j of the history noised to `(1 - sigma_j) x_j + sigma_j n_j` (the caller draws
    the levels and the noise); sigma [T] float32: that level per latent frame (constant inside a chunk). A chunk's
    context prefill reads the selected frames from `latents` at timestep `1000 sigma` per frame, instead of the clean
    history at the context timestep.
    """

    latents: Tensor
    sigma: Tensor

    def __post_init__(self):
        if self.latents.dim() != 5 or self.latents.shape[0] != 1:
            raise ValueError(f"NoisyContext latents must be [1, C, T, H, W], got {tuple(self.latents.shape)}")
        if tuple(self.sigma.shape) != (self.latents.shape[2],):
            raise ValueError(f"NoisyContext sigma must be [T] = [{self.latents.shape[2]}] (one level per latent "
                             f"frame), got {tuple(self.sigma.shape)}")


class TeacherForcedClip:
    """One clip of a teacher-forced batch: a known history and the model that predicts its chunks.

    history [1, C, T, H, W] (clean data, or a teacher's final latents); item: the clip's image_cond
    [1, C, 1, H, W], viewmats [T, 4, 4], Ks [T, 3, 3], action [T] and its text (`text_source`); memory_seed: seed of
    the memory-retrieval points (`make_retrieval_points`); a clip whose history a rollout made (an ODE-cache sample,
    a Teacher sample) passes that rollout's own seed, so it selects the context frames the rollout selected.
    text_grad: the text prefill runs under grad (the text stream trains); context_grad: the context prefill runs
    under grad. noisy_context: None = the clean history as context (teacher forcing, the AR loop's own context), or
    the diffusion-forcing context (`NoisyContext`; needs the "exact" context mode). recompute_context: a clean context
    read without a graph by a call under grad is released once the chunk step's forward is done and prefilled again
    when its backward recomputes the block checkpoints (`RecomputedContextKV`: the same values; one more context
    prefill per backward, the context K/V of every layer not held between the forward and the backward).
    """

    def __init__(self, model, history: Tensor, item: Mapping, config: RolloutConfig, device: torch.device, *,
                 memory_seed: int, text_grad: bool, context_grad: bool, noisy_context: NoisyContext | None = None,
                 recompute_context: bool = False):
        self.model = model
        self.device = device
        self.text_grad = bool(text_grad) and text_source(item) == "encoder"
        self.context_grad = bool(context_grad)
        self.item = item
        self.autocast_dtype = config.autocast_dtype
        text_kv = clip_text_kv(model, item, device, config.autocast_dtype, grad=False)
        # The running latents of the AR loop start as the known history: every chunk is already final.
        inputs = RolloutInputs.from_clip(item, history.float(), memory_seed)
        self.rollout = ARRollout(model, text_kv, inputs, config, device=device)
        self._fixed_text = None if self.text_grad else self.rollout.text_kv
        if noisy_context is not None:
            if config.context_mode != "exact":
                raise ValueError(f"a noisy (diffusion-forcing) context is prefilled from its noisy latents; the "
                                 f"{config.context_mode!r} context mode re-uses stored clean K/V (use 'exact')")
            if tuple(noisy_context.latents.shape) != tuple(history.shape):
                raise ValueError(f"NoisyContext latents {list(noisy_context.latents.shape)} must have the history's "
                                 f"shape {list(history.shape)}")
        self.noisy_context = noisy_context
        self.recompute_context = bool(recompute_context)

    @property
    def num_chunks(self) -> int:
        return self.rollout.num_chunks

    def chunk_latents(self, chunk_index: int) -> Tensor:
        """The known latents of chunk ``chunk_index`` [1, C, 4, H, W] (float32)."""
        return self.rollout.latents[:, :, self.rollout.chunk_frames(chunk_index)].float()

    def text_kv(self) -> TextKV:
        """This chunk's text K/V (a fresh graph per call when the text stream trains)."""
        if self._fixed_text is not None:
            return self._fixed_text
        return clip_text_kv(self.model, self.item, self.device, self.autocast_dtype, grad=True)

    def predict_velocity(self, chunk_index: int, noisy: Tensor, sigma: Tensor) -> Tensor:
        """The model's velocity [1, C, 4, H, W] (float32) for chunk ``chunk_index`` whose latents are ``noisy``
        [1, C, 4, H, W] at noise level ``sigma`` (per frame [4], timestep 1000 sigma), given the clip's history."""
        rollout = self.rollout
        frames = rollout.chunk_frames(chunk_index)
        text_kv = self.text_kv()
        if self.noisy_context is None:
            context = rollout.prefill_context(chunk_index, grad=self.context_grad, text_kv=text_kv)
        else:
            context = self.prefill_noisy_context(chunk_index, text_kv)
        context_kv = context.kv
        recompute = (self.recompute_context and context_kv is not None and torch.is_grad_enabled()
                     and not self.context_grad and self.noisy_context is None and rollout.frame_cache is None)
        if recompute:
            context_kv = rollout.recomputed_context(context, text_kv)
        cond = rollout.cond[:, :, frames].to(rollout.model_dtype)
        model_input = torch.cat([noisy.to(rollout.model_dtype), cond], dim=1)
        action, viewmats, Ks = rollout.frame_inputs(range(frames.start, frames.stop))
        timestep = (1000.0 * sigma).to(device=self.device, dtype=torch.float32)
        with rollout.autocast():
            velocity = self.model.chunk_step(model_input, timestep, action, viewmats, Ks, text_kv,
                                             context_kv=context_kv, rope_start=context.num_frames)
        if recompute:
            context_kv.release()
        return velocity.float()

    def prefill_noisy_context(self, chunk_index: int, text_kv: TextKV) -> ChunkContext:
        """The diffusion-forcing context of chunk ``chunk_index``: the frames the AR loop selects (same memory rule,
        same points), read from the noisy latents and prefilled at their own timesteps ``1000 sigma`` [n] (compacted
        RoPE 0..n-1, as `ARRollout.prefill_context`)."""
        rollout = self.rollout
        indices = rollout.select_context(chunk_index)
        if not indices:
            return ChunkContext(indices=[])
        index = torch.as_tensor(indices, dtype=torch.long)
        noisy = self.noisy_context.latents[:, :, index].to(device=self.device, dtype=rollout.model_dtype)
        cond = rollout.cond[:, :, index.to(rollout.cond.device)].to(rollout.model_dtype)
        model_input = torch.cat([noisy, cond], dim=1)  # [1, 2C+1, n, H, W]
        action, viewmats, Ks = rollout.frame_inputs(indices)
        timestep = (1000.0 * self.noisy_context.sigma[index]).to(device=self.device, dtype=torch.float32)  # [n]
        with torch.set_grad_enabled(self.context_grad), rollout.autocast():
            kv, _ = self.model.context_prefill(model_input, timestep, action, viewmats, Ks, text_kv)
        return ChunkContext(indices=indices, model_input=model_input, kv=kv)
