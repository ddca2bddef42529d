"""Score models for distribution matching (DMD2): a model's x0 estimate of one chunk, given a history, as the AR loop
would build its inputs.

A *score model* is a flow-matching model of the AR world (a Teacher-shaped `WorldPlayTransformer`), optionally with
one named LoRA adapter active (`adapters.py`: the real score, the fake score and a student can be adapters on one
frozen base). Its x0 estimate of chunk c at noise level sigma,

    x0 = x_sigma - sigma * v(x_sigma, sigma | context of the history, the chunk's camera/action, text),

is the posterior mean E[x0 | x_sigma] when the model was trained by flow matching at that sigma (df_sft), which is
what DMD's gradient assumes (reference: the distilled 4-step Teacher is no such model below sigma = 0.625).

`ScoreClip` is a score model on one clip: the clip's conditioning (image condition, cameras, actions, text) and a
history [1, C, T, H, W] whose earlier chunks give chunk c's context, exactly as the AR loop builds it
(`teacher_forcing.TeacherForcedClip`: memory selection on the clip's cameras, context prefill at timestep 14,
compacted RoPE). The history is the clip's data latents (teacher forcing) or, chunk by chunk, what a generator made
(`write_chunk`, Self-Forcing). The same class runs a few-step student on its own history.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from predictor_training.teacher.adapters import adapter
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.methods.flow_matching import x0_from_velocity
from predictor_training.rollout.teacher_forcing import TeacherForcedClip


@dataclass
class ScoreModel:
    """model: a Teacher-shaped model; adapter_name: the LoRA adapter that runs while this score is called (None:
    the model without adapters); label: its role in logs and errors (real_score, fake_score, student)."""

    model: torch.nn.Module
    adapter_name: str | None
    label: str

    def active(self):
        """Context manager: the model with this score's adapter (and only it) active."""
        return adapter(self.model, self.adapter_name)

    def clip(self, history: Tensor, item: Mapping, config: RolloutConfig, device: torch.device, *,
             memory_seed: int, context_grad: bool = False, recompute_context: bool = False) -> "ScoreClip":
        """This score on one clip (see `ScoreClip`)."""
        return ScoreClip(self, history, item, config, device, memory_seed=memory_seed, context_grad=context_grad,
                         recompute_context=recompute_context)


class ScoreClip:
    """A score model on one clip: velocity / x0 estimate of chunk c given the clip's history.

    history [1, C, T, H, W] (float32; only chunks before c are read for chunk c); item: the clip's image_cond
    [1, C, 1, H, W], viewmats [T, 4, 4], Ks [T, 3, 3], action [T] and text encoder outputs (or stored text K/V);
    memory_seed: the memory-retrieval points (use the generator's, so every model sees the same context frames);
    context_grad: whether the context prefill keeps a graph (when the score trains and learns its context);
    recompute_context: a context without a graph is released after the forward and prefilled again in the backward
    (`TeacherForcedClip`). The text K/V are computed once, without a graph (a trained score's text stream does not train).
    """

    def __init__(self, score: ScoreModel, history: Tensor, item: Mapping, config: RolloutConfig,
                 device: torch.device, *, memory_seed: int, context_grad: bool, recompute_context: bool = False):
        self.score = score
        with score.active():
            self.forced = TeacherForcedClip(score.model, history, item, config, device, memory_seed=memory_seed,
                                            text_grad=False, context_grad=context_grad,
                                            recompute_context=recompute_context)

    @property
    def num_chunks(self) -> int:
        return self.forced.num_chunks

    @property
    def history(self) -> Tensor:
        """The running history [1, C, T, H, W] (float32)."""
        return self.forced.rollout.latents

    def write_chunk(self, chunk_index: int, latent: Tensor) -> None:
        """Put `latent` [1, C, 4, H, W] (detached) into the history as chunk `chunk_index`'s final latents."""
        self.forced.rollout.write_chunk(chunk_index, latent.detach())

    def copy_history(self, history: Tensor, chunk_index: int) -> None:
        """Copy the frames before chunk `chunk_index` of `history` [1, C, T, H, W] into this clip's history (a
        Self-Forcing generator's own history, which becomes the context of chunk `chunk_index`)."""
        rollout = self.forced.rollout
        end = chunk_index * rollout.config.chunk_latents
        if end:
            with torch.no_grad():
                rollout.latents[:, :, :end] = history[:, :, :end].detach().to(rollout.latents.dtype)

    def velocity(self, chunk_index: int, noisy: Tensor, sigma: Tensor) -> Tensor:
        """v [1, C, 4, H, W] (float32) for chunk `chunk_index` whose latents are `noisy` [1, C, 4, H, W] at noise
        level `sigma` (per frame [4], timestep 1000 sigma). A graph is kept where grad is enabled."""
        with self.score.active():
            return self.forced.predict_velocity(chunk_index, noisy, sigma)

    def x0(self, chunk_index: int, noisy: Tensor, sigma: Tensor) -> Tensor:
        """The x0 estimate `noisy - sigma v` [1, C, 4, H, W] (float32) of chunk `chunk_index`."""
        velocity = self.velocity(chunk_index, noisy, sigma)
        return x0_from_velocity(noisy, velocity, sigma[None].to(noisy.device))
