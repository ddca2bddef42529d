"""The demo world's VAE: a small `AutoencoderKLHunyuanVideo15` (the real class) trained on rendered clips.

Config (`world_vae_config`): 3 -> `latent_channels` channels, spatial factor 8 (four `block_out_channels`: diffusers
needs four entries for 8x and five for 16x; the last must be divisible by 2 x latent channels), temporal factor 4
(125 frames -> 32 latents, the causal first frame alone), one layer per block. About 1M parameters.

Training (`tools/train_world_vae.py`): `windows_per_item` clip windows of one length per micro-batch. diffusers
0.42.1 builds the mid-block attention's causal mask as [B, S, S] against queries [B, 1, S, C], so a batch > 1 raises
a broadcast error in SDPA (and it builds the mask with a Python loop over S). `build_world_vae` therefore installs
`causal_attention_mask` (one [S, S] mask, built vectorised, broadcast over the batch: the same values) on the class
once. Batches matter on CPU: for a batch of one small video, torch runs Conv3d through its slow im2col path
(`slow_conv3d`) instead of oneDNN; 4 windows of 17 frames cost about what 1 window costs (1 thread, 32 x 48). Windows mix short (17 frames) and long (65-125 frames)
spans, since a VAE trained on short windows only blurs late frames of a full clip. Loss: pixel MSE in [-1, 1] +
`kl_weight` x KL of the posterior.

Latent scale. After training, `scaling_factor` in the saved config is set to 1 / (std of the posterior means over
the training clips), so `latents = mode() * scaling_factor` (the pipeline's convention, which the video-latent
builder uses) have unit variance for the world Teacher.

Quality is reported as PSNR (frames in [0, 1], over all frames) of `decode(mode())` on held-out full clips.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from predictor_training.video.io import read_video


def world_vae_config(latent_channels: int = 16, block_out_channels: Sequence[int] = (8, 16, 32, 32)) -> dict:
    """Constructor arguments of the world VAE (spatial 8x with four blocks, temporal 4x)."""
    blocks = tuple(int(channels) for channels in block_out_channels)
    if len(blocks) != 4:
        raise ValueError(f"block_out_channels {blocks}: spatial factor 8 needs exactly four entries")
    if blocks[-1] % (2 * latent_channels):
        raise ValueError(f"block_out_channels[-1]={blocks[-1]} must be divisible by 2 x latent_channels "
                         f"({2 * latent_channels})")
    return {"in_channels": 3, "out_channels": 3, "latent_channels": int(latent_channels),
            "block_out_channels": blocks, "layers_per_block": 1, "spatial_compression_ratio": 8,
            "temporal_compression_ratio": 4}


def causal_attention_mask(n_frame: int, n_hw: int, dtype, device, batch_size: int | None = None) -> Tensor:
    """The mid-block attention's frame-causal mask, [S, S] with S = n_frame * n_hw (0 where the key's frame <= the
    query's frame, -inf elsewhere): diffusers' values, built without a Python loop and broadcast over any batch."""
    frame = torch.arange(n_frame * n_hw, device=device) // n_hw
    return torch.zeros((), dtype=dtype, device=device).masked_fill(frame[None, :] > frame[:, None], float("-inf"))


def install_batch_safe_attention_mask() -> None:
    """Make diffusers' `HunyuanVideo15AttnBlock` accept batches > 1 (see the module docstring); idempotent."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    HunyuanVideo15AttnBlock.prepare_causal_attention_mask = staticmethod(causal_attention_mask)


def build_world_vae(config: dict, seed: int):
    """A freshly initialised world VAE (seeded; the global RNG is left as it was)."""
    from diffusers import AutoencoderKLHunyuanVideo15

    install_batch_safe_attention_mask()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKLHunyuanVideo15(**config)


def frames_to_tensor(frames: np.ndarray) -> Tensor:
    """uint8 [F, H, W, 3] -> float32 [1, 3, F, H, W] in [-1, 1] (the pipeline's video preprocessing range)."""
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None].float().div(127.5).sub(1.0)


def psnr(reconstruction: Tensor, reference: Tensor) -> float:
    """PSNR in dB of two videos in [-1, 1], measured in [0, 1]."""
    error = ((reconstruction.clamp(-1, 1) - reference) / 2).pow(2).mean().item()
    return float("inf") if error == 0 else -10.0 * math.log10(error)


@dataclass(frozen=True)
class ClipVideo:
    clip_id: str
    video: str


class ClipWindows(Dataset):
    """Training windows of rendered clips: item i = clip i % n with a window length and start drawn from
    (seed, i), so an epoch's items are a pure function of the index (exact resume). Lengths 4k+1: `short` with
    probability 1 - long_fraction, else uniform over the allowed long lengths up to the whole clip.

    An item: {"clip_id", "start", "frames": float32 [1, 3, L, H, W] in [-1, 1]}. Frames are read once per process
    and kept (the demo's clips are small).

    `windows_per_item` k > 1: item i holds k windows of one length (k short ones, or `long_windows_per_item` long
    ones), of the clips perm[(i * k + j) % n] (perm: a fixed permutation of the clips drawn from the seed, so a
    batch mixes scenes and every clip is used alike), each with its own start: "frames" [k, 3, L, H, W],
    "clip_id" the first clip's id; there are n * windows_per_clip // k items."""

    def __init__(self, clips: Sequence[ClipVideo], *, num_frames: int, short: int, long_min: int,
                 long_fraction: float, windows_per_clip: int, seed: int, windows_per_item: int = 1,
                 long_windows_per_item: int | None = None):
        for name, length in (("short", short), ("long_min", long_min)):
            if length < 1 or (length - 1) % 4 or length > num_frames:
                raise ValueError(f"{name}={length}: a window is 4k+1 frames, at most {num_frames}")
        if not 0.0 <= long_fraction <= 1.0:
            raise ValueError(f"long_fraction={long_fraction}: expected in [0, 1]")
        self.clips = list(clips)
        self.num_frames, self.short, self.long_min = num_frames, short, long_min
        self.long_fraction, self.windows_per_clip, self.seed = long_fraction, windows_per_clip, seed
        if windows_per_item < 1:
            raise ValueError(f"windows_per_item={windows_per_item}: expected >= 1")
        self.windows_per_item = windows_per_item
        self.long_windows_per_item = windows_per_item if long_windows_per_item is None else long_windows_per_item
        if not 1 <= self.long_windows_per_item <= windows_per_item:
            raise ValueError(f"long_windows_per_item={long_windows_per_item}: expected in [1, {windows_per_item}]")
        self._order = torch.randperm(len(self.clips), generator=torch.Generator().manual_seed(seed)).tolist()
        self._frames: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return max(1, len(self.clips) * self.windows_per_clip // self.windows_per_item)

    def window(self, index: int) -> tuple[int, int]:
        """(start, length) of item `index`."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        long_lengths = list(range(self.long_min, self.num_frames + 1, 4))
        if torch.rand((), generator=generator).item() < self.long_fraction:
            length = long_lengths[int(torch.randint(len(long_lengths), (), generator=generator))]
        else:
            length = self.short
        start = int(torch.randint(self.num_frames - length + 1, (), generator=generator))
        return start, length

    def frames(self, clip: ClipVideo) -> np.ndarray:
        if clip.clip_id not in self._frames:
            frames = read_video(clip.video)
            if frames.shape[0] != self.num_frames:
                raise ValueError(f"{clip.video}: {frames.shape[0]} frames, expected {self.num_frames}")
            self._frames[clip.clip_id] = frames
        return self._frames[clip.clip_id]

    def __getitem__(self, index: int) -> dict:
        if self.windows_per_item == 1:
            clip = self.clips[index % len(self.clips)]
            start, length = self.window(index)
            return {"clip_id": clip.clip_id, "start": start,
                    "frames": frames_to_tensor(self.frames(clip)[start:start + length])}
        start, length = self.window(index)
        count = self.windows_per_item if length == self.short else self.long_windows_per_item
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 7_777_777)
        clips = [self.clips[self._order[(index * self.windows_per_item + j) % len(self.clips)]] for j in range(count)]
        starts = [start] + [int(torch.randint(self.num_frames - length + 1, (), generator=generator))
                            for _ in range(count - 1)]
        frames = torch.cat([frames_to_tensor(self.frames(clip)[first:first + length])
                            for clip, first in zip(clips, starts)])
        return {"clip_id": clips[0].clip_id, "start": start, "frames": frames}


@torch.no_grad()
def reconstruction_psnr(vae, videos: Sequence[np.ndarray], device: torch.device) -> list[float]:
    """PSNR of `decode(encode(x).mode())` for each whole video (uint8 [F, H, W, 3])."""
    scores = []
    for frames in videos:
        x = frames_to_tensor(frames).to(device)
        scores.append(psnr(vae.decode(vae.encode(x).latent_dist.mode()).sample, x))
    return scores


@torch.no_grad()
def reconstruction_scores(vae, videos: Sequence[np.ndarray], device: torch.device) -> list[dict[str, float]]:
    """For each whole video (uint8 [F, H, W, 3]), figures of `decode(encode(x).mode())`: "psnr" over all frames,
    "first_frame_psnr" of frame 0 (the causal first latent codes it alone; the image condition), "late_psnr" of the
    last quarter of the frames, and "colour_error": the mean over frames of the largest absolute error of a frame's
    mean R, G or B, in [0, 1] (a colour cast shows here even when edges are blurred)."""
    scores = []
    for frames in videos:
        x = frames_to_tensor(frames).to(device)
        y = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
        late = x.shape[2] - max(1, x.shape[2] // 4)
        colour = ((y - x) / 2).mean(dim=(3, 4)).abs().amax(dim=1).mean().item()
        scores.append({"psnr": psnr(y, x), "first_frame_psnr": psnr(y[:, :, :1], x[:, :, :1]),
                       "late_psnr": psnr(y[:, :, late:], x[:, :, late:]), "colour_error": colour})
    return scores


@torch.no_grad()
def latent_std(vae, videos: Sequence[np.ndarray], device: torch.device) -> float:
    """Standard deviation of the posterior means over `videos` (for `scaling_factor = 1 / std`)."""
    values = [vae.encode(frames_to_tensor(frames).to(device)).latent_dist.mode().flatten().cpu() for frames in videos]
    return float(torch.cat(values).std())
