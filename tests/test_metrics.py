"""Video metrics against their reference implementations (skimage, the lpips package), the LPIPS weight policy,
video I/O, the folder comparison and the compute_video_metrics command line."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lpips
import numpy as np
import pytest
import torch
import torchvision
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from predictor_training.video import metrics as M
from predictor_training.video.folder_metrics import compare_video_folders, pair_videos
from predictor_training.video.io import read_video, side_by_side, write_video

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI_PATH = REPO_ROOT / "tools" / "compute_video_metrics.py"


def random_video_pair(seed: int, frames: int = 4, height: int = 48, width: int = 64):
    """A uint8 reference [T, H, W, 3] and a noisy, clipped copy of it (noise level grows with the frame index)."""
    rng = np.random.default_rng(seed)
    ref = rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    noise = rng.normal(0.0, 1.0, size=ref.shape) * np.linspace(5.0, 40.0, frames)[:, None, None, None]
    test = np.clip(ref.astype(np.float64) + noise, 0, 255).round().astype(np.uint8)
    return ref, test


def alexnet_shapes() -> dict:
    with torch.device("meta"):  # shapes only, no parameter init
        return {key: value.shape for key, value in torchvision.models.alexnet(weights=None).state_dict().items()}


def alexnet_trunk_state(seed: int) -> dict:
    """Random features.* tensors of torchvision's AlexNet layout (drawn directly: cheaper than a model init)."""
    generator = torch.Generator().manual_seed(seed)
    return {key: torch.randn(shape, generator=generator) * 0.05
            for key, shape in alexnet_shapes().items() if key.startswith("features.")}


def full_alexnet_state(seed: int) -> dict:
    """A complete torchvision AlexNet state dict whose (unused) classifier tensors are stride-0 views of one zero,
    so the saved file stays ~10 MB instead of 240 MB."""
    state = alexnet_trunk_state(seed)
    for key, shape in alexnet_shapes().items():
        if key.startswith("classifier."):
            state[key] = torch.zeros(1).expand(shape)
    return state


@pytest.fixture(scope="module")
def random_alexnet_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "alexnet_random.pth"
    torch.save(full_alexnet_state(seed=3), path)
    return path


@pytest.fixture(scope="module")
def scorer_from_file(random_alexnet_file):
    return M.LpipsScorer.from_policy(random_alexnet_file)


@pytest.fixture(scope="module")
def random_backbone_scorer():
    return M.LpipsScorer.from_policy(random_backbone=True, random_seed=0)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """tools/compute_video_metrics.py as a subprocess, on this checkout's package (installed or not)."""
    return subprocess.run([sys.executable, str(CLI_PATH), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, cwd=REPO_ROOT, timeout=120)


# ---------------------------------------------------------------------------------------------------------------
# Pixel metrics vs skimage and vs their written definitions
# ---------------------------------------------------------------------------------------------------------------
def test_psnr_and_ssim_match_skimage():
    ref, test = random_video_pair(seed=0)
    result = M.compute_video_metrics(ref, test, per_frame=True, frame_batch=3)  # batches straddle frames
    per_frame = result["per_frame"]
    for t in range(ref.shape[0]):
        expected_psnr = peak_signal_noise_ratio(ref[t], test[t], data_range=255)
        expected_ssim = structural_similarity(
            ref[t], test[t], gaussian_weights=True, sigma=1.5, use_sample_covariance=False, data_range=255,
            channel_axis=-1,
        )
        assert abs(per_frame["psnr"][t] - expected_psnr) < 1e-4
        assert abs(per_frame["ssim"][t] - expected_ssim) < 1e-4
    whole_video_psnr = peak_signal_noise_ratio(ref, test, data_range=255)
    assert abs(result["psnr_full"] - whole_video_psnr) < 1e-4
    frame_psnrs = [peak_signal_noise_ratio(r, x, data_range=255) for r, x in zip(ref, test)]
    assert abs(result["psnr_frame_mean"] - np.mean(frame_psnrs)) < 1e-4
    assert result["psnr_frame_mean"] > result["psnr_full"] + 1e-3  # Jensen: differ when the error varies by frame


def test_float_input_matches_uint8_and_rejects_out_of_range():
    ref, test = random_video_pair(seed=1, frames=3)
    from_uint8 = M.compute_video_metrics(ref, test)
    from_float = M.compute_video_metrics(torch.from_numpy(ref) / 255.0, torch.from_numpy(test).double() / 255.0)
    for key in M.PIXEL_METRIC_KEYS:
        assert abs(from_uint8[key] - from_float[key]) < 1e-5, key
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        M.compute_video_metrics(torch.from_numpy(ref) / 127.0, test)
    with pytest.raises(ValueError, match="shape mismatch"):
        M.compute_video_metrics(ref, test[:2])


def test_error_and_temporal_delta_metrics_follow_their_definitions():
    ref, test = random_video_pair(seed=2, frames=5, height=16, width=20)
    result = M.compute_video_metrics(ref, test, per_frame=True, frame_batch=2)
    r, x = ref.astype(np.float64) / 255.0, test.astype(np.float64) / 255.0
    assert result["mse"] == pytest.approx(np.mean((x - r) ** 2), abs=1e-12)
    assert result["rmse"] == pytest.approx(np.sqrt(np.mean((x - r) ** 2)), abs=1e-12)
    assert result["mae"] == pytest.approx(np.mean(np.abs(x - r)), abs=1e-12)
    # ((x_t - x_{t-1}) - (r_t - r_{t-1}))^2, averaged over t = 1..T-1 and all pixels
    deltas = (x[1:] - x[:-1]) - (r[1:] - r[:-1])
    assert result["temporal_delta_mse"] == pytest.approx(np.mean(deltas**2), abs=1e-12)
    per_frame_delta = result["per_frame"]["temporal_delta_mse"]
    assert math.isnan(per_frame_delta[0])
    np.testing.assert_allclose(per_frame_delta[1:], np.mean(deltas**2, axis=(1, 2, 3)), atol=1e-12)
    # a constant offset changes every frame but not the frame-to-frame motion
    offset_test = np.clip(ref.astype(np.int32) + 7, 0, 255).astype(np.uint8)
    flat_ref = np.full_like(ref, 100)
    still = M.compute_video_metrics(flat_ref, flat_ref + 7)
    assert still["temporal_delta_mse"] == 0.0 and still["mse"] > 0
    assert M.compute_video_metrics(ref, offset_test)["temporal_delta_mse"] > 0  # clipping breaks the pure offset


def test_identical_frames_give_infinite_psnr_and_are_counted():
    ref, test = random_video_pair(seed=4, frames=3, height=16, width=16)
    test[0] = ref[0]
    result = M.compute_video_metrics(ref, test, per_frame=True)
    assert result["identical_frames"] == 1
    assert math.isinf(result["per_frame"]["psnr"][0]) and math.isinf(result["psnr_frame_mean"])
    assert math.isfinite(result["psnr_full"])
    assert M.jsonable(result)["psnr_frame_mean"] == "inf"


def test_chunk_ranges_and_range_summaries_recombine():
    assert M.chunk_frame_ranges(32) == [(0, 13)] + [(13 + 16 * k, 29 + 16 * k) for k in range(7)]
    ref, test = random_video_pair(seed=5, frames=9, height=16, width=16)
    result = M.compute_video_metrics(ref, test, per_frame=True)
    ranges = [(0, 3), (3, 9)]
    chunks = [M.summarize_frame_range(result["per_frame"], a, b) for a, b in ranges]
    assert chunks[0]["num_frames"] == 3 and chunks[1]["num_frames"] == 6
    mse = (3 * chunks[0]["mse"] + 6 * chunks[1]["mse"]) / 9
    delta = (2 * chunks[0]["temporal_delta_mse"] + 6 * chunks[1]["temporal_delta_mse"]) / 8
    assert mse == pytest.approx(result["mse"], rel=1e-12)
    assert delta == pytest.approx(result["temporal_delta_mse"], rel=1e-12)
    with pytest.raises(ValueError, match="not inside"):
        M.summarize_frame_range(result["per_frame"], 5, 12)


# ---------------------------------------------------------------------------------------------------------------
# LPIPS: same numbers as the lpips package, weight policy, labelling
# ---------------------------------------------------------------------------------------------------------------
def reference_lpips_per_frame(backbone_state: dict, ref: np.ndarray, test: np.ndarray) -> list[float]:
    """The lpips package called per frame with [-1, 1] inputs; its AlexNet trunk copied conv by conv."""
    model = lpips.LPIPS(net="alex", pretrained=True, pnet_rand=True, verbose=False).eval()
    targets = [m for m in model.net.modules() if isinstance(m, torch.nn.Conv2d)]
    conv_indices = sorted({int(key.split(".")[1]) for key in backbone_state if key.startswith("features.")})
    assert len(targets) == len(conv_indices) == 5
    for target, index in zip(targets, conv_indices):  # the i-th conv of the trunk <- the i-th conv of AlexNet
        target.weight.data.copy_(backbone_state[f"features.{index}.weight"])
        target.bias.data.copy_(backbone_state[f"features.{index}.bias"])
    values = []
    with torch.no_grad():
        for r, x in zip(ref, test):
            r_in = torch.from_numpy(r).permute(2, 0, 1)[None].float() / 127.5 - 1.0
            x_in = torch.from_numpy(x).permute(2, 0, 1)[None].float() / 127.5 - 1.0
            values.append(float(model(r_in, x_in)))
    return values


@pytest.mark.filterwarnings("ignore:.*(pretrained|weight enum).*:UserWarning")  # lpips' own torchvision call
def test_lpips_matches_lpips_package_with_same_backbone(random_alexnet_file, scorer_from_file):
    ref, test = random_video_pair(seed=6, frames=4)
    result = M.compute_video_metrics(ref, test, scorer_from_file, per_frame=True, frame_batch=3)
    expected = reference_lpips_per_frame(torch.load(random_alexnet_file), ref, test)
    assert scorer_from_file.metric_name == M.LPIPS_METRIC_NAME
    np.testing.assert_allclose(result["per_frame"]["lpips_alex"], expected, atol=1e-4)
    assert abs(result["lpips_alex"] - np.mean(expected)) < 1e-4
    assert result["lpips_alex"] > 0
    same = M.compute_video_metrics(ref, ref, scorer_from_file)
    assert same["lpips_alex"] == pytest.approx(0.0, abs=1e-6)


def test_lpips_refuses_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty_torch_home"))
    with pytest.raises(M.LpipsWeightsError, match="will not download") as error:
        M.LpipsScorer.from_policy(None)
    assert str(tmp_path / "empty_torch_home") in str(error.value)
    with pytest.raises(M.LpipsWeightsError, match="no such file"):
        M.LpipsScorer.from_policy(tmp_path / "missing.pth")
    not_alexnet = tmp_path / "not_alexnet.pth"
    torch.save({"features.0.weight": torch.zeros(1)}, not_alexnet)
    with pytest.raises(M.LpipsWeightsError, match="not a torchvision AlexNet"):
        M.LpipsScorer.from_policy(not_alexnet)
    assert not (tmp_path / "empty_torch_home").exists()  # nothing was fetched into the cache


def test_lpips_looks_in_torch_home_and_checks_the_hash(tmp_path, monkeypatch):
    cache_file = tmp_path / "hub" / "checkpoints" / M.ALEXNET_CHECKPOINT_NAME
    cache_file.parent.mkdir(parents=True)
    torch.save(alexnet_trunk_state(seed=0), cache_file)  # right layout, wrong content for that name
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    assert M.default_alexnet_weights_path() == cache_file
    with pytest.raises(M.LpipsWeightsError, match="hash prefix 7be5be79"):
        M.LpipsScorer.from_policy(None)


def test_random_backbone_is_labelled_and_never_downloads(monkeypatch, random_backbone_scorer):
    def no_download(*args, **kwargs):
        raise AssertionError("a download was attempted")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_download)
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_download)
    torch.manual_seed(11)
    expected_draw = torch.rand(3)
    torch.manual_seed(11)
    scorer = M.LpipsScorer.from_policy(random_backbone=True, random_seed=0)
    assert torch.equal(torch.rand(3), expected_draw)  # building a scorer leaves the global RNG alone
    again = random_backbone_scorer
    assert scorer.metric_name == M.LPIPS_RANDOM_BACKBONE_METRIC_NAME
    assert "NOT_LPIPS" in scorer.metric_name
    ref, test = random_video_pair(seed=7, frames=2)
    result = M.compute_video_metrics(ref, test, scorer, per_frame=True)
    assert "lpips_alex" not in result and "lpips_alex" not in result["per_frame"]
    assert result[scorer.metric_name] == M.compute_video_metrics(ref, test, again)[scorer.metric_name]
    with pytest.raises(ValueError, match="exclude each other"):
        M.LpipsScorer.from_policy("weights.pth", random_backbone=True)


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


def test_cli_runs_as_a_script_and_reports_usage_errors(tmp_path):
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert "--lpips_random_backbone" in result.stdout and "NOT_LPIPS" in result.stdout
    make_video_folders(tmp_path)
    ref, test, out = str(tmp_path / "ref"), str(tmp_path / "test"), tmp_path / "out"
    result = run_cli(ref, test, "--out", str(out), "--device", "cpu", "--lpips_random_backbone")
    assert result.returncode == 0, result.stderr
    assert "NOT LPIPS" in result.stdout and f"wrote {out / 'metrics.json'}" in result.stdout
    # folders that do not pair up, an unknown device: one line, exit code 2, nothing written
    (tmp_path / "ref" / "extra.mp4").write_bytes((tmp_path / "ref" / "a.mp4").read_bytes())
    for args, message in (((ref, test), "has no partner"), ((ref, ref, "--device", "nodevice"), "--device nodevice")):
        result = run_cli(*args, "--out", str(tmp_path / "not_written"), "--lpips_random_backbone")
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        errors = [line for line in result.stderr.splitlines() if "cpu threads:" not in line]
        assert len(errors) == 1 and errors[0].startswith("compute_video_metrics.py: error: ") and message in errors[0]
    assert not (tmp_path / "not_written").exists()
