"""Video metrics (predictor_training/video/metrics.py) against their reference implementations
(skimage, the lpips package), chunk ranges, and the LPIPS weight policy."""

import math

import lpips
import numpy as np
import pytest
import torch
import torchvision
from skimage.metrics import peak_signal_noise_ratio, structural_similarity

from predictor_training.video import metrics as M


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
