"""Reward functions of decoded videos for RL methods (fvtools/train_nft.py), listed by name in `REWARDS`.

A reward is a plain function of decoded frames: float RGB in [0, 1], `frames [B, F, H, W, 3]` (B samples), and for
a reward that compares with a reference video, `reference [B, F, H, W, 3]` of the same shape. It returns one scalar
per sample, `[B]` float32, larger = better. Each reward declares which frames it reads (`READS`):

    first_frame      frame 0 only (an image reward; the scorer hands it [B, 1, H, W, 3])
    sampled_frames   `sampled_frames` frames spread evenly over the video, first and last included
    video            every frame (e.g. a temporal reward)

and whether it needs a reference (the scorer refuses to run it without one). Built-ins:

    smoothness              video           -mean (frame[f+1] - frame[f])^2: 0 for a static video, lower the more
                                            the frames jump (a static video is the smoothest; pair it with a
                                            reference reward, or it pulls towards a frozen video)
    reference_agreement     video, ref      -mean (frames - reference)^2: 0 when equal to the reference
    first_frame_agreement   first_frame, ref -mean (frame 0 - reference frame 0)^2
    contrast                sampled_frames  mean over frames of the per-frame pixel std: 0 for a flat colour

`--rewards name:weight,name:weight` (`parse_reward_weights`) picks rewards; `RewardScorer` runs them and returns
each reward and their weighted sum, "total". Adding one: write the function and give it an entry in `REWARDS`
(at the end of this module, or `REWARDS["sharpness"] = ...` from a module imported before the flags are parsed):

    def sharpness(frames, reference=None):
        return (frames[:, :, :, 1:] - frames[:, :, :, :-1]).abs().mean(dim=(1, 2, 3, 4))

    REWARDS["sharpness"] = Reward(sharpness, reads="sampled_frames", description="mean |horizontal gradient|")

`video_to_reward_frames` turns the VAE decoder's uint8 [F, H, W, 3] into the float frames these take;
`VideoRewards` decodes a clip's sampled latents and scores them against the clip's reference video, and
`default_vae_folder` finds the VAE that encoded a video-latent dataset.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from predictor_training.data.video_latents import CONFIG_NAME as VIDEO_CONFIG_NAME
from predictor_training.methods.monitors import temporal_delta_energy
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.fake_tensors import real_values

READS = ("first_frame", "sampled_frames", "video")
TOTAL = "total"
REFERENCE_KINDS = ("data_latents", "ground_truth", "none")


@dataclass(frozen=True)
class Reward:
    """A reward function `fn(frames [B, F, H, W, 3], reference [B, F, H, W, 3] | None) -> [B]`, the frames it reads
    (one of READS), whether it needs a reference, and one line for --help."""

    fn: Callable[[Tensor, Tensor | None], Tensor]
    reads: str
    description: str
    needs_reference: bool = False

    def __post_init__(self):
        if self.reads not in READS:
            raise ValueError(f"reward {self.fn.__name__}: reads={self.reads!r}; expected one of {READS}")


def describe_rewards() -> str:
    """One line per reward in REWARDS (for --help and errors)."""
    return "; ".join(f"{name} ({reward.reads}{', needs a reference' if reward.needs_reference else ''}): "
                     f"{reward.description}" for name, reward in REWARDS.items())


def parse_reward_weights(text: str) -> dict[str, float]:
    """"smoothness:0.5,reference_agreement:1" -> {"smoothness": 0.5, "reference_agreement": 1.0} (a name alone has
    weight 1). ValueError naming the bad entry: unknown name (with the registered ones), repeated name, bad or
    non-finite weight, or nothing at all."""
    weights: dict[str, float] = {}
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        name, _, weight_text = entry.partition(":")
        name = name.strip()
        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r} in {text!r}; registered rewards: {sorted(REWARDS)}")
        if name in weights:
            raise ValueError(f"reward {name!r} appears twice in {text!r}")
        try:
            weight = float(weight_text) if weight_text.strip() else 1.0
        except ValueError:
            raise ValueError(f"reward {name!r}: weight {weight_text!r} is not a number (expected name:weight)"
                             ) from None
        if not math.isfinite(weight):
            raise ValueError(f"reward {name!r}: weight {weight_text!r} is not finite")
        weights[name] = weight
    if not weights:
        raise ValueError(f"no reward in {text!r}; expected name:weight[,name:weight...] from {sorted(REWARDS)}")
    return weights


def select_frames(frames: Tensor, reads: str, sampled_frames: int) -> Tensor:
    """The frames a reward reads, from `frames [B, F, H, W, 3]`: frame 0, `sampled_frames` evenly spaced frames
    (first and last included; all of them when F is not larger), or all."""
    if frames.dim() != 5 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [B, F, H, W, 3], got {tuple(frames.shape)}")
    if reads == "first_frame":
        return frames[:, :1]
    if reads == "video":
        return frames
    if reads == "sampled_frames":
        count = frames.shape[1]
        if sampled_frames >= count:
            return frames
        index = torch.linspace(0, count - 1, sampled_frames).round().long()
        return frames[:, index]
    raise ValueError(f"reads={reads!r}; expected one of {READS}")


def video_to_reward_frames(video: Tensor) -> Tensor:
    """uint8 [F, H, W, 3] (the VAE decoder's output, or a ground-truth video) -> float32 [F, H, W, 3] in [0, 1]."""
    if video.dtype != torch.uint8 or video.dim() != 4 or video.shape[-1] != 3:
        raise ValueError(f"expected a uint8 video [F, H, W, 3], got {video.dtype} {tuple(video.shape)}")
    return video.float() / 255.0


class RewardScorer:
    """Runs the chosen rewards on a batch of decoded videos.

    weights: {reward name: weight} (`parse_reward_weights`). sampled_frames: how many frames a "sampled_frames"
    reward reads. `scorer(frames, reference)` -> {name: [B], ..., "total": [B] = sum of weight * reward}."""

    def __init__(self, weights: dict[str, float], sampled_frames: int = 8):
        unknown = [name for name in weights if name not in REWARDS]
        if unknown:
            raise ValueError(f"unknown rewards {unknown}; registered rewards: {sorted(REWARDS)}")
        if sampled_frames < 1:
            raise ValueError(f"sampled_frames={sampled_frames}; expected >= 1")
        self.weights = dict(weights)
        self.sampled_frames = sampled_frames

    @property
    def needs_reference(self) -> bool:
        return any(REWARDS[name].needs_reference for name in self.weights)

    def __call__(self, frames: Tensor, reference: Tensor | None = None) -> dict[str, Tensor]:
        if reference is not None and reference.shape != frames.shape:
            raise ValueError(f"reference {tuple(reference.shape)} and frames {tuple(frames.shape)} differ in shape")
        scores, total = {}, torch.zeros(frames.shape[0], dtype=torch.float32)
        for name, weight in self.weights.items():
            reward = REWARDS[name]
            if reward.needs_reference and reference is None:
                raise ValueError(f"reward {name!r} compares with a reference video, and none was given")
            selected = select_frames(frames.float(), reward.reads, self.sampled_frames)
            selected_reference = None if reference is None else select_frames(reference.float(), reward.reads,
                                                                               self.sampled_frames)
            value = reward.fn(selected, selected_reference).float().cpu()
            if value.shape != (frames.shape[0],):
                raise ValueError(f"reward {name!r} returned shape {tuple(value.shape)}; expected one value per "
                                 f"sample [{frames.shape[0]}]")
            scores[name] = value
            total = total + weight * value
        scores[TOTAL] = total
        return scores


class VideoRewards:
    """Rewards of latents [K, C, T, H, W] sampled for one dataset clip: decoded by `decoder` (`eval.runtime.
    VaeDecoder`: latents / scaling_factor through the VAE, as the pipeline) and scored by `scorer` against the
    clip's reference video: "data_latents" (the clip's own latents, decoded alike), "ground_truth" (the video
    `<ground_truth>/<clip_id>/` or `.mp4`, `eval.runtime.find_ground_truth_videos`) or "none". References are
    cached per clip. `rewards(latents, item)` -> {reward name: [K], ..., "total": [K]}."""

    def __init__(self, scorer: RewardScorer, decoder, reference_kind: str, ground_truth: Path | None):
        if reference_kind not in REFERENCE_KINDS:
            raise ValueError(f"reference_kind={reference_kind!r}; expected one of {REFERENCE_KINDS}")
        self.scorer = scorer
        self.decoder = decoder
        self.reference_kind = reference_kind
        self.ground_truth = ground_truth
        self._references: dict[str, torch.Tensor] = {}

    def frames(self, latents: torch.Tensor) -> torch.Tensor:
        """[K, C, T, H, W] -> float frames [K, F, H', W', 3] in [0, 1]."""
        return torch.stack([video_to_reward_frames(self.decoder.decode(sample[None])) for sample in latents])

    def reference(self, item: dict, shape: tuple[int, int, int]) -> torch.Tensor | None:
        """The clip's reference frames [F, H', W', 3] (cached per clip), or None."""
        if self.reference_kind == "none":
            return None
        key = item["clip_id"]
        if key not in self._references:
            if self.reference_kind == "data_latents":
                video = self.decoder.decode(item["latents"][None].float())
            else:
                from predictor_training.video.ground_truth import find_ground_truth_videos, load_ground_truth

                path = find_ground_truth_videos(self.ground_truth, [key])[key]
                video = load_ground_truth(path, shape)
            self._references[key] = video_to_reward_frames(video)
        return self._references[key]

    def __call__(self, latents: torch.Tensor, item: dict) -> dict[str, torch.Tensor]:
        frames = self.frames(latents)
        reference = self.reference(item, tuple(frames.shape[1:4]))
        return self.scorer(frames, None if reference is None else reference.expand_as(frames))


def holds_vae(folder: Path) -> bool:
    """Whether `folder` is a VAE folder (config.json) or a pipeline folder with vae/config.json."""
    return (folder / "config.json").is_file() or (folder / "vae" / "config.json").is_file()


def default_vae_folder(dataset_root: Path) -> Path:
    """The encoders folder a video-latent dataset records (its VAE made the latents, so it decodes them)."""
    config_path = dataset_root / VIDEO_CONFIG_NAME
    folder = Path(json.loads(config_path.read_text(encoding="utf-8"))["encoders"]["folder"])
    if not holds_vae(folder):
        raise MissingFileError(f"{config_path} records the encoders folder {folder}, which holds no VAE; pass --vae")
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Built-in rewards, and REWARDS: name -> reward
# ---------------------------------------------------------------------------------------------------------------
def smoothness(frames: Tensor, reference: Tensor | None = None) -> Tensor:
    # temporal_delta_energy takes [B, C, T, H, W] and averages over the batch: one sample at a time.
    return torch.stack([-temporal_delta_energy(video.permute(3, 0, 1, 2)[None]) for video in frames])


def reference_agreement(frames: Tensor, reference: Tensor | None = None) -> Tensor:
    return -((frames - reference) ** 2).mean(dim=(1, 2, 3, 4))


def first_frame_agreement(frames: Tensor, reference: Tensor | None = None) -> Tensor:
    return -((frames - reference) ** 2).mean(dim=(1, 2, 3, 4))


def contrast(frames: Tensor, reference: Tensor | None = None) -> Tensor:
    return frames.flatten(2).std(dim=2).mean(dim=1)


REWARDS: dict[str, Reward] = {
    "smoothness": Reward(smoothness, reads="video",
                         description="-mean squared change between consecutive frames (0 = static)"),
    "reference_agreement": Reward(reference_agreement, reads="video", needs_reference=True,
                                  description="-mean squared pixel error to the reference video (0 = equal)"),
    "first_frame_agreement": Reward(first_frame_agreement, reads="first_frame", needs_reference=True,
                                    description="-mean squared pixel error of frame 0 to the reference's frame 0"),
    "contrast": Reward(contrast, reads="sampled_frames",
                       description="mean per-frame pixel standard deviation (0 = one flat colour)"),
}


class FixedRewards:
    """In place of `VideoRewards` where nothing may be decoded (a memory rehearsal: the VAE and the reward functions
    are outside the DiT's figure): scores 0..1 spread over the K samples, per reward name and in TOTAL, as real CPU
    values (distinct per sample, so the advantages are not all zero)."""

    def __init__(self, names):
        self.names = list(names)

    def __call__(self, samples, item) -> dict:
        with real_values():
            spread = torch.linspace(0.0, 1.0, samples.shape[0])
            return {**{name: spread.clone() for name in self.names}, TOTAL: spread}
