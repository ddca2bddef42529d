"""Folder comparison (predictor_training/video/folder_metrics.py): a round trip with the
random-backbone label, and errors that name files and keep earlier outputs."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from predictor_training.video import metrics as M
from predictor_training.video.folder_metrics import compare_video_folders, pair_videos
from predictor_training.video.io import read_video, write_video


def random_video_pair(seed: int, frames: int = 4, height: int = 48, width: int = 64):
    """A uint8 reference [T, H, W, 3] and a noisy, clipped copy of it (noise level grows with the frame index)."""
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    noise = rng.normal(0.0, 1.0, size=ref.shape) * np.linspace(5.0, 40.0, frames)[:, None, None, None]
    test = np.clip(ref.astype(np.float64) + noise, 0, 255).round().astype(np.uint8)
    return ref, test


@pytest.fixture(scope="module")
def random_backbone_scorer():
    return M.LpipsScorer.from_policy(random_backbone=True, random_seed=0)


# ---------------------------------------------------------------------------------------------------------------
# Folder comparison and its command line
# ---------------------------------------------------------------------------------------------------------------
def make_video_folders(root: Path):
    """ref/: a.mp4 (lossless) + clip_b/ PNG frames; test/: a/ PNG frames + clip_b.mp4 (mixed on purpose)."""
    ref_a, test_a = random_video_pair(seed=9, frames=3, height=32, width=48)
    ref_b, test_b = random_video_pair(seed=10, frames=2, height=32, width=48)
    write_video(root / "ref" / "a.mp4", ref_a, fps=8, lossless=True)
    write_video(root / "ref" / "sub" / "clip_b", ref_b, fps=8)
    write_video(root / "test" / "a", test_a, fps=8)
    write_video(root / "test" / "sub" / "clip_b.mp4", test_b, fps=8, lossless=True)
    return {"a": (ref_a, test_a), "sub/clip_b": (ref_b, test_b)}


def test_folder_round_trip_with_random_backbone_label(tmp_path, capsys, random_backbone_scorer):
    videos = make_video_folders(tmp_path)
    out = tmp_path / "out"
    report = compare_video_folders(tmp_path / "ref", tmp_path / "test", out, device=torch.device("cpu"),
                                   lpips_random_backbone=True, per_frame=True)
    printed = capsys.readouterr().out
    label = M.LPIPS_RANDOM_BACKBONE_METRIC_NAME
    # the label is everywhere and the real name nowhere
    assert label in printed and "NOT LPIPS" in printed
    for name in ("metrics.json", "per_video.csv", "aggregate.csv", "per_frame.csv"):
        text = (out / name).read_text()
        assert label in text, name
        assert "lpips_alex" not in text, name
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["settings"]["lpips"]["metric_name"] == label
    assert [item["name"] for item in saved["videos"]] == ["a", "sub/clip_b"]
    # numbers equal the library on the same frames
    for item in saved["videos"]:
        expected = M.compute_video_metrics(*videos[item["name"]], random_backbone_scorer)
        for key in M.PIXEL_METRIC_KEYS + (label,):
            assert item["metrics"][key] == pytest.approx(expected[key], abs=1e-9), (item["name"], key)
    with open(out / "per_video.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert float(rows[1]["psnr_full"]) == pytest.approx(saved["videos"][1]["metrics"]["psnr_full"])
    assert saved["aggregate"]["num_videos"] == 2 and saved["aggregate"]["num_frames"] == 5
    assert saved["aggregate"]["ssim"] == pytest.approx(np.mean([v["metrics"]["ssim"] for v in saved["videos"]]))
    assert report["aggregate"][label] == pytest.approx(saved["aggregate"][label])


def test_folder_errors_name_files_and_keep_outputs(tmp_path, monkeypatch):
    make_video_folders(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.json").write_text("previous")
    ref, test, cpu = tmp_path / "ref", tmp_path / "test", torch.device("cpu")
    # 1. no AlexNet weights and no opt-in: refuse
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no_weights"))
    with pytest.raises(M.LpipsWeightsError, match="--lpips_random_backbone"):
        compare_video_folders(ref, test, out, device=cpu)
    # 2. a missing partner
    (ref / "extra.mp4").write_bytes((ref / "a.mp4").read_bytes())
    with pytest.raises(ValueError, match=r"extra\.mp4 has no partner"):
        pair_videos(ref, test)
    with pytest.raises(ValueError, match=r"extra\.mp4 has no partner"):
        compare_video_folders(ref, test, out, device=cpu, lpips_random_backbone=True)
    (ref / "extra.mp4").unlink()
    # 3. a shape mismatch names both files and shapes
    ref_a = read_video(ref / "a.mp4")
    write_video(test / "a", ref_a[:2], fps=8)
    with pytest.raises(ValueError, match=r"a\.mp4 is \(3, 32, 48, 3\).*test/a is \(2, 32, 48, 3\)"):
        compare_video_folders(ref, test, out, device=cpu, lpips_random_backbone=True)
    assert (out / "metrics.json").read_text() == "previous"
