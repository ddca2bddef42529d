"""Read and write videos as uint8 frames [T, H, W, 3]: mp4 (and other ffmpeg containers) or a folder of PNG frames.

mp4 goes through the ffmpeg binary bundled with ``imageio-ffmpeg`` (no network, no system ffmpeg needed).
The default mp4 is H.264 yuv420p, i.e. lossy; ``write_video(..., lossless=True)`` writes H.264 RGB with qp 0,
which reads back bit-exactly. Compute metrics on decoded tensors or PNG folders when exact pixels matter.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFont, UnidentifiedImageError

from predictor_training.runtime.errors import MissingFileError, UserInputError, one_line
from predictor_training.runtime.io import atomic_write

VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".avi", ".webm")
FRAME_SUFFIX = ".png"


def is_video_file(path: str | Path) -> bool:
    path = Path(path)
    return path.is_file() and path.suffix.lower() in VIDEO_SUFFIXES


def list_frame_files(folder: str | Path) -> list[Path]:
    """PNG files directly inside ``folder``, in natural order (frame_2 before frame_10)."""
    files = [path for path in Path(folder).iterdir() if path.is_file() and path.suffix.lower() == FRAME_SUFFIX]
    def natural_key(path: Path) -> list:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]

    return sorted(files, key=natural_key)


def ffmpeg_exe() -> str:
    """Path of imageio-ffmpeg's bundled ffmpeg; raises with advice when it is missing."""
    import imageio_ffmpeg

    try:
        return imageio_ffmpeg.get_ffmpeg_exe()
    except RuntimeError as error:
        raise RuntimeError(f"imageio-ffmpeg has no ffmpeg binary ({error}); reinstall imageio-ffmpeg") from error


# ----------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------
def _read_png_folder(folder: Path) -> np.ndarray:
    frames = []
    for path in list_frame_files(folder):
        try:
            image = Image.open(path)
        except (UnidentifiedImageError, OSError) as error:
            raise UserInputError(f"{path}: not a readable image ({one_line(error)}); expected an RGB PNG frame") from None
        with image:
            if image.mode != "RGB":
                raise UserInputError(f"{path}: PNG mode is {image.mode}, expected RGB (8-bit, no alpha)")
            frame = np.asarray(image, dtype=np.uint8)
        if frames and frame.shape != frames[0].shape:
            raise UserInputError(f"{path}: frame shape {frame.shape} differs from the first frame's {frames[0].shape}")
        frames.append(frame)
    if not frames:
        raise UserInputError(f"{folder}: no {FRAME_SUFFIX} frames in this folder")
    return np.stack(frames)


def _read_ffmpeg_video(path: Path) -> np.ndarray:
    import imageio_ffmpeg

    ffmpeg_exe()
    reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    try:
        meta = next(reader)
        width, height = meta["size"]
        frames = [np.frombuffer(raw, dtype=np.uint8).reshape(height, width, 3) for raw in reader]
    finally:
        reader.close()
    if not frames:
        raise UserInputError(f"{path}: the video holds no frames")
    return np.stack(frames)


def read_video(path: str | Path) -> np.ndarray:
    """Read an mp4 (or other ffmpeg video) or a folder of PNG frames. -> uint8 [T, H, W, 3]."""
    path = Path(path)
    if path.is_dir():
        return _read_png_folder(path)
    if not path.exists():
        raise MissingFileError(f"{path}: no such video file or frame folder")
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        raise UserInputError(f"{path}: unknown video suffix {path.suffix!r}; expected one of {VIDEO_SUFFIXES} or a folder")
    return _read_ffmpeg_video(path)


# ----------------------------------------------------------------------------------------------------------------
# Writing (atomic: a temp file/folder next to the target, then a rename)
# ----------------------------------------------------------------------------------------------------------------
def _as_uint8_video(frames) -> np.ndarray:
    if hasattr(frames, "detach"):  # torch tensor
        frames = frames.detach().cpu().numpy()
    frames = np.asarray(frames)
    if frames.dtype != np.uint8:
        raise TypeError(f"frames must be uint8, got {frames.dtype} (scale and round float frames first)")
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"frames must have shape [T, H, W, 3] with T >= 1, got {frames.shape}")
    return np.ascontiguousarray(frames)


def _write_mp4(path: Path, frames: np.ndarray, fps: float, lossless: bool, quality: float) -> None:
    import imageio_ffmpeg

    height, width = frames.shape[1:3]
    if lossless:
        codec, pix_fmt_out, quality_arg, extra = "libx264rgb", "rgb24", None, ["-qp", "0"]
    else:
        if height % 2 or width % 2:
            raise ValueError(f"{path}: H.264 yuv420p needs even frame sizes, got {height}x{width} (or lossless=True)")
        codec, pix_fmt_out, quality_arg, extra = "libx264", "yuv420p", quality, []

    def encode(tmp_path: Path) -> None:
        writer = imageio_ffmpeg.write_frames(
            str(tmp_path),
            (width, height),
            fps=fps,
            codec=codec,
            pix_fmt_out=pix_fmt_out,
            quality=quality_arg,
            macro_block_size=1,  # never let ffmpeg rescale frames
            output_params=extra + ["-f", "mp4"],  # the temp name has no .mp4 suffix
        )
        try:
            writer.send(None)  # start ffmpeg
            for frame in frames:
                writer.send(frame)
        finally:
            writer.close()

    atomic_write(path, encode)


def _write_png_folder(folder: Path, frames: np.ndarray) -> None:
    tmp_folder = folder.with_name(folder.name + ".tmp")
    if tmp_folder.exists():
        shutil.rmtree(tmp_folder)
    tmp_folder.mkdir(parents=True)
    digits = max(5, len(str(len(frames) - 1)))
    try:
        for index, frame in enumerate(frames):
            Image.fromarray(frame).save(tmp_folder / f"{index:0{digits}d}{FRAME_SUFFIX}")
    except BaseException:
        shutil.rmtree(tmp_folder, ignore_errors=True)
        raise
    if folder.exists():  # swap: old aside, new in, then drop the old one
        old_folder = folder.with_name(folder.name + ".old.tmp")
        if old_folder.exists():
            shutil.rmtree(old_folder)
        os.replace(folder, old_folder)
        os.replace(tmp_folder, folder)
        shutil.rmtree(old_folder)
    else:
        os.replace(tmp_folder, folder)


def write_video(path: str | Path, frames, fps: float, *, lossless: bool = False, quality: float = 8.0) -> Path:
    """Write uint8 frames [T, H, W, 3] atomically.

    ``path`` ending in ``.mp4`` -> H.264 (yuv420p, imageio quality 0-10, default 8; or lossless RGB with
    ``lossless=True``); a path without suffix -> folder of PNG frames ``00000.png, 00001.png, ...`` (fps is not
    stored there). Returns the path.
    """
    path = Path(path)
    frames = _as_uint8_video(frames)
    if not fps > 0:
        raise ValueError(f"fps must be positive, got {fps}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".mp4":
        _write_mp4(path, frames, fps, lossless, quality)
    elif path.suffix == "":
        if path.exists() and not path.is_dir():
            raise UserInputError(f"{path}: exists and is not a folder; cannot write PNG frames there")
        _write_png_folder(path, frames)
    else:
        raise ValueError(f"{path}: write_video writes '.mp4' files or PNG folders (no suffix), not {path.suffix!r}")
    return path


# ----------------------------------------------------------------------------------------------------------------
# Side-by-side comparison
# ----------------------------------------------------------------------------------------------------------------
def label_strip(text: str, width: int, height: int) -> np.ndarray:
    """A black strip [height, width, 3] with ``text`` in white (PIL's default font)."""
    strip = Image.new("RGB", (width, height), (0, 0, 0))
    font = ImageFont.load_default(size=max(8, int(height * 0.7)))
    ImageDraw.Draw(strip).text((4, height // 2), text, fill=(255, 255, 255), font=font, anchor="lm")
    return np.asarray(strip)


def side_by_side(videos: Sequence, labels: Sequence[str], *, label_height: int = 24, gap: int = 4) -> np.ndarray:
    """Panels left to right, each with its label above it. -> uint8 [T, label_height + H, sum(W) + gaps, 3].

    All videos need the same frame count and height (widths may differ); gaps are black.
    """
    if len(videos) != len(labels):
        raise ValueError(f"{len(videos)} videos but {len(labels)} labels")
    if not videos:
        raise ValueError("side_by_side needs at least one video")
    videos = [_as_uint8_video(video) for video in videos]
    num_frames, height = videos[0].shape[:2]
    for label, video in zip(labels, videos):
        if video.shape[:2] != (num_frames, height):
            raise ValueError(
                f"panel {label!r} has {video.shape[0]} frames of height {video.shape[1]}, "
                f"panel {labels[0]!r} has {num_frames} frames of height {height}"
            )
    columns = []
    for index, (label, video) in enumerate(zip(labels, videos)):
        strip = label_strip(label, video.shape[2], label_height)  # [label_height, W, 3]
        strip = np.broadcast_to(strip, (num_frames, *strip.shape))
        columns.append(np.concatenate([strip, video], axis=1))
        if gap and index < len(videos) - 1:
            columns.append(np.zeros((num_frames, label_height + height, gap, 3), dtype=np.uint8))
    return np.ascontiguousarray(np.concatenate(columns, axis=2))
