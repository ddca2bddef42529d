"""Video I/O (predictor_training/video/io.py): PNG-frame folders and lossless mp4 round trips."""

import numpy as np
import pytest

from predictor_training.video.io import read_video, side_by_side, write_video


def random_video_pair(seed: int, frames: int = 4, height: int = 48, width: int = 64):
    """A uint8 reference [T, H, W, 3] and a noisy, clipped copy of it (noise level grows with the frame index)."""
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    noise = rng.normal(0.0, 1.0, size=ref.shape) * np.linspace(5.0, 40.0, frames)[:, None, None, None]
    test = np.clip(ref.astype(np.float64) + noise, 0, 255).round().astype(np.uint8)
    return ref, test


# ---------------------------------------------------------------------------------------------------------------
# Video I/O
# ---------------------------------------------------------------------------------------------------------------
def test_video_io_round_trips(tmp_path):
    ref, _ = random_video_pair(seed=8, frames=3, height=32, width=48)
    np.testing.assert_array_equal(read_video(write_video(tmp_path / "frames", ref, fps=8)), ref)
    np.testing.assert_array_equal(read_video(write_video(tmp_path / "exact.mp4", ref, fps=8, lossless=True)), ref)
    smooth = np.repeat(np.linspace(0, 255, 48, dtype=np.uint8)[None, None, :, None], 32, axis=1)
    smooth = np.broadcast_to(smooth, (3, 32, 48, 3)).copy()
    lossy = read_video(write_video(tmp_path / "lossy.mp4", smooth, fps=8))
    assert lossy.shape == smooth.shape and np.abs(lossy.astype(int) - smooth).mean() < 3
    write_video(tmp_path / "frames", ref[:2], fps=8)  # overwrite replaces the whole folder
    assert read_video(tmp_path / "frames").shape[0] == 2
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(TypeError, match="uint8"):
        write_video(tmp_path / "bad.mp4", ref.astype(np.float32), fps=8)
    panel = side_by_side([ref, ref[:, :, :20]], ["reference", "predictor"], label_height=12, gap=2)
    assert panel.shape == (3, 12 + 32, 48 + 2 + 20, 3) and panel.dtype == np.uint8
    np.testing.assert_array_equal(panel[:, 12:, :48], ref)
    assert panel[:, :12, :48].max() > 128  # white label text on the black strip
