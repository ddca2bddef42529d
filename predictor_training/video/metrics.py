"""Video quality metrics between a reference video and a test video (torch, batched, CPU or GPU).

All pixel metrics work on frames scaled to [0, 1] (uint8 / 255, or float input already in [0, 1]); the data range
is therefore 1. With ``e_t = test_t - ref_t`` (one frame, [H, W, 3]) and ``N = H * W * 3``:

    mse_t                = sum(e_t^2) / N                         per frame
    mse                  = mean_t mse_t                           (= MSE over every pixel of the whole video)
    rmse                 = sqrt(mse)
    mae                  = mean_t (sum |e_t| / N)
    psnr_full            = 10 log10(1 / mse)                      full-resolution PSNR, whole video at once
    psnr_frame_mean      = mean_t 10 log10(1 / mse_t)             mean of per-frame PSNR
    ssim                 = mean_t SSIM(ref_t, test_t)             Wang et al. 2004: Gaussian window sigma 1.5
                                                                  (11 taps, truncate 3.5), K1 0.01, K2 0.03,
                                                                  population covariance, per RGB channel, mean
                                                                  over the valid (uncropped) area and channels
    temporal_delta_mse   = mean_{t>=1} sum(((test_t - test_{t-1}) - (ref_t - ref_{t-1}))^2) / N
                         = mean_{t>=1} sum((e_t - e_{t-1})^2) / N
    lpips_alex           = mean_t LPIPS-AlexNet(ref_t, test_t)    inputs mapped to [-1, 1], lpips v0.1 linear heads

A PSNR is ``inf`` where the MSE is exactly 0 (identical frames); ``identical_frames`` counts such frames so a
frame-mean PSNR of ``inf`` is never a mystery. The temporal-delta value of frame 0 is NaN (no previous frame).

LPIPS with a randomly initialised AlexNet is NOT LPIPS; such a scorer reports under the key
``lpips_random_backbone_NOT_LPIPS`` so it can never be mistaken for the real metric.
"""

from __future__ import annotations

import inspect
import math
import re
import warnings
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import sha256_file

LPIPS_METRIC_NAME = "lpips_alex"
LPIPS_RANDOM_BACKBONE_METRIC_NAME = "lpips_random_backbone_NOT_LPIPS"
LPIPS_METRIC_NAMES = (LPIPS_METRIC_NAME, LPIPS_RANDOM_BACKBONE_METRIC_NAME)
ALEXNET_CHECKPOINT_NAME = "alexnet-owt-7be5be79.pth"  # torchvision's ImageNet AlexNet (IMAGENET1K_V1)

SSIM_SIGMA = 1.5
SSIM_TRUNCATE = 3.5  # scipy.ndimage / skimage default truncation -> radius int(3.5 * 1.5 + 0.5) = 5
SSIM_K1 = 0.01
SSIM_K2 = 0.03

# Whole-video metrics, in report order (the LPIPS key, when present, comes right after ssim).
PIXEL_METRIC_KEYS = ("psnr_full", "psnr_frame_mean", "ssim", "mse", "rmse", "mae", "temporal_delta_mse")
COUNT_KEYS = ("num_frames", "identical_frames")
# Per-frame series returned with per_frame=True (plus the LPIPS key when a scorer is given).
PER_FRAME_KEYS = ("mse", "mae", "psnr", "ssim", "temporal_delta_mse")

STATS_DTYPE = torch.float64  # pixel statistics; LPIPS runs in float32 like the reference package


# ----------------------------------------------------------------------------------------------------------------
# LPIPS (AlexNet) with an explicit weight policy: real backbone from a local file, or a clearly labelled random one.
# ----------------------------------------------------------------------------------------------------------------
class LpipsWeightsError(UserInputError):
    """The AlexNet backbone weights for LPIPS are missing, corrupt or of the wrong layout."""


def default_alexnet_weights_path() -> Path:
    """Where torchvision caches its AlexNet: ``torch.hub.get_dir()/checkpoints/alexnet-owt-7be5be79.pth``.

    ``torch.hub.get_dir()`` is ``$TORCH_HOME/hub`` (``~/.cache/torch/hub`` when TORCH_HOME is unset).
    """
    return Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_CHECKPOINT_NAME


def resolve_alexnet_weights(alexnet_path: str | Path | None) -> Path:
    """Return the AlexNet weight file to use: ``alexnet_path`` if given, else torchvision's cache location.

    Raises LpipsWeightsError naming the searched path when the file does not exist. Never downloads.
    """
    if alexnet_path is not None:
        path = Path(alexnet_path)
        if not path.is_file():
            raise LpipsWeightsError(f"--lpips_alexnet {path}: no such file (expected a torchvision AlexNet state dict)")
        return path
    path = default_alexnet_weights_path()
    if not path.is_file():
        raise LpipsWeightsError(
            "LPIPS needs the ImageNet AlexNet backbone and will not download it. Looked for "
            f"{path} (torchvision's cache layout under TORCH_HOME). Either pass --lpips_alexnet PATH (a torchvision "
            f"alexnet state dict, e.g. a copy of {ALEXNET_CHECKPOINT_NAME}), set TORCH_HOME to a folder holding "
            f"hub/checkpoints/{ALEXNET_CHECKPOINT_NAME}, or pass --lpips_random_backbone to report the clearly "
            f"labelled, meaningless '{LPIPS_RANDOM_BACKBONE_METRIC_NAME}' instead."
        )
    return path


def _check_hub_hash(path: Path, sha256: str) -> None:
    """torch.hub names files ``<name>-<first 8+ hex of sha256>.<ext>``; refuse a file whose content disagrees."""
    match = re.fullmatch(r".+-([0-9a-f]{8,})\.pth?", path.name)
    if match is not None and not sha256.startswith(match.group(1)):
        raise LpipsWeightsError(
            f"{path}: sha256 {sha256[:16]}... does not start with the hash prefix {match.group(1)} in its file name "
            "(truncated or foreign file); replace it with the real torchvision AlexNet weights"
        )


def _new_torchvision_alexnet() -> torch.nn.Module:
    import torchvision

    return torchvision.models.alexnet(weights=None)  # weights=None: random init, never touches the network


def load_alexnet_backbone_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Load the AlexNet trunk from ``path`` -> its ``features.*`` tensors.

    The file is a torchvision AlexNet state dict: the full one (checked strictly, classifier included) or exactly
    its ``features.*`` subset (the only part LPIPS uses).
    """
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # re-raised with the file named; torch's own message is kept
        raise LpipsWeightsError(f"{path}: cannot be read as a torch state dict ({error})") from error
    if not isinstance(state, Mapping):
        raise LpipsWeightsError(f"{path}: expected a torchvision AlexNet state dict (a mapping), got {type(state)}")
    with torch.device("meta"):  # only the key/shape check is needed, so skip the random init of 61M parameters
        alexnet = _new_torchvision_alexnet()
    features_only = all(key.startswith("features.") for key in state)
    try:
        if features_only:
            trunk_state = {key.removeprefix("features."): value for key, value in state.items()}
            alexnet.features.load_state_dict(trunk_state, strict=True, assign=True)
        else:
            alexnet.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as error:
        raise LpipsWeightsError(f"{path}: not a torchvision AlexNet state dict: {error}") from error
    return {f"features.{key}": value for key, value in alexnet.features.state_dict().items()}


def random_alexnet_backbone_state(seed: int) -> dict[str, torch.Tensor]:
    """A randomly initialised torchvision AlexNet's ``features.*`` tensors (seeded; the global RNG is untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        alexnet = _new_torchvision_alexnet()
    return {key: value for key, value in alexnet.state_dict().items() if key.startswith("features.")}


def _lpips_linear_weights_path() -> Path:
    import lpips

    return Path(inspect.getfile(lpips)).parent / "weights" / "v0.1" / "alex.pth"


class LpipsScorer:
    """LPIPS (AlexNet trunk, v0.1 linear heads of the ``lpips`` package) with our weight-loading policy.

    The ``lpips`` net is built with ``pnet_rand=True`` (so it never fetches AlexNet itself) and
    ``pretrained=True`` (its linear heads load from the package's own ``weights/v0.1/alex.pth``); the AlexNet
    trunk is then copied in from ``backbone_state`` (torchvision ``features.*`` keys).

    Use ``LpipsScorer.from_policy(...)``; ``metric_name`` is ``"lpips_alex"`` for real weights and
    ``"lpips_random_backbone_NOT_LPIPS"`` for a random trunk.
    """

    def __init__(
        self,
        backbone_state: Mapping[str, torch.Tensor],
        *,
        metric_name: str,
        backbone_source: str,
        backbone_sha256: str | None,
        device: str | torch.device = "cpu",
    ):
        if metric_name not in LPIPS_METRIC_NAMES:
            raise ValueError(f"metric_name must be one of {LPIPS_METRIC_NAMES}, got {metric_name!r}")
        import lpips

        # fork_rng: the throwaway random trunk lpips builds must not consume the caller's global RNG
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.filterwarnings("ignore", category=UserWarning, module="torchvision")  # lpips' `pretrained=`
            net = lpips.LPIPS(net="alex", version="0.1", pretrained=True, pnet_rand=True, verbose=False)
        net.net.load_state_dict(self._lpips_trunk_state(net, backbone_state), strict=True)
        net.eval().requires_grad_(False)
        self.net = net.to(device)
        self.device = torch.device(device)
        self.metric_name = metric_name
        self.backbone_source = backbone_source
        self.backbone_sha256 = backbone_sha256

    @staticmethod
    def _lpips_trunk_state(net, backbone_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # The lpips trunk keeps torchvision's layer indices: `slice2.3.weight` is `features.3.weight`.
        trunk_state = {}
        for key in net.net.state_dict():
            _, layer_index, param_name = key.split(".")
            source_key = f"features.{layer_index}.{param_name}"
            if source_key not in backbone_state:
                raise LpipsWeightsError(f"AlexNet backbone state lacks {source_key} (needed for lpips {key})")
            trunk_state[key] = backbone_state[source_key]
        return trunk_state

    @classmethod
    def from_policy(
        cls,
        alexnet_path: str | Path | None = None,
        *,
        random_backbone: bool = False,
        random_seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> "LpipsScorer":
        """Real AlexNet from ``alexnet_path`` or torchvision's cache, or (only if asked) a labelled random trunk."""
        if random_backbone:
            if alexnet_path is not None:
                raise ValueError("--lpips_alexnet and --lpips_random_backbone exclude each other; pass one")
            return cls(
                random_alexnet_backbone_state(random_seed),
                metric_name=LPIPS_RANDOM_BACKBONE_METRIC_NAME,
                backbone_source=f"random torchvision AlexNet init, seed {random_seed}",
                backbone_sha256=None,
                device=device,
            )
        path = resolve_alexnet_weights(alexnet_path)
        sha256 = sha256_file(path)
        _check_hub_hash(path, sha256)
        return cls(
            load_alexnet_backbone_state(path),
            metric_name=LPIPS_METRIC_NAME,
            backbone_source=str(path),
            backbone_sha256=sha256,
            device=device,
        )

    def describe(self) -> dict:
        """Provenance for reports: metric name, trunk source and hash, linear-head file."""
        return {
            "metric_name": self.metric_name,
            "backbone_source": self.backbone_source,
            "backbone_sha256": self.backbone_sha256,
            "linear_heads": str(_lpips_linear_weights_path()),
            "input_range": "[-1, 1] (frames in [0, 1] mapped by 2x - 1)",
        }

    @torch.no_grad()
    def __call__(self, ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
        """ref, test [N, 3, H, W] in [0, 1] -> per-image LPIPS [N] (float32, on self.device)."""
        ref = ref.to(self.device, torch.float32) * 2.0 - 1.0
        test = test.to(self.device, torch.float32) * 2.0 - 1.0
        return self.net(ref, test).reshape(ref.shape[0])


# ----------------------------------------------------------------------------------------------------------------
# Pixel metrics on batches of frames
# ----------------------------------------------------------------------------------------------------------------
def as_unit_frames(frames, name: str) -> torch.Tensor:
    """Check a video and return it as a tensor [T, H, W, 3] (uint8 kept as is; float checked to lie in [0, 1])."""
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(np.ascontiguousarray(frames))
    if not isinstance(frames, torch.Tensor):
        raise TypeError(f"{name}: expected a numpy array or torch tensor [T, H, W, 3], got {type(frames)}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"{name}: expected shape [T, H, W, 3], got {tuple(frames.shape)}")
    if frames.shape[0] == 0:
        raise ValueError(f"{name}: video has no frames")
    if frames.dtype != torch.uint8:
        if not frames.is_floating_point():
            raise TypeError(f"{name}: expected uint8 or float frames, got {frames.dtype}")
        low, high = float(frames.min()), float(frames.max())
        if not (0.0 <= low and high <= 1.0):
            raise ValueError(
                f"{name}: float frames must lie in [0, 1], got min {low:.6g}, max {high:.6g} (clamp first)"
            )
    return frames


def _to_unit_nchw(frames: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[N, H, W, 3] uint8 or [0, 1] float -> [N, 3, H, W] float in [0, 1] on device."""
    frames = frames.to(device)
    frames = frames.to(dtype) / 255.0 if frames.dtype == torch.uint8 else frames.to(dtype)
    return frames.permute(0, 3, 1, 2)


def psnr_from_mse(mse: torch.Tensor) -> torch.Tensor:
    """PSNR in dB for data range 1; inf where mse == 0."""
    return 10.0 * torch.log10(1.0 / mse)


def gaussian_window_1d(sigma: float = SSIM_SIGMA, truncate: float = SSIM_TRUNCATE, dtype=STATS_DTYPE) -> torch.Tensor:
    """Normalised 1-D Gaussian taps [2r + 1], r = int(truncate * sigma + 0.5) (scipy.ndimage's truncation)."""
    radius = int(truncate * sigma + 0.5)
    offsets = torch.arange(-radius, radius + 1, dtype=dtype)
    taps = torch.exp(-0.5 * (offsets / sigma) ** 2)
    return taps / taps.sum()


def ssim_per_frame(ref: torch.Tensor, test: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """SSIM per image, Wang et al. settings (Gaussian sigma 1.5, population covariance). -> [N].

    ref, test [N, C, H, W]. Matches ``skimage.metrics.structural_similarity(..., gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False, data_range=data_range, channel_axis=-1)``: skimage filters with reflect padding
    and then crops the window radius from every border, which equals a 'valid' convolution here.
    """
    taps = gaussian_window_1d(dtype=ref.dtype).to(ref.device)
    window = taps.numel()
    batch, channels, height, width = ref.shape
    if height < window or width < window:
        raise ValueError(f"SSIM needs frames of at least {window}x{window} pixels, got {height}x{width}")
    # 1. stack the five maps of every channel and blur them with one separable depthwise convolution
    maps = torch.cat([ref, test, ref * ref, test * test, ref * test], dim=1)  # [N, 5C, H, W]
    groups = maps.shape[1]
    blurred = F.conv2d(maps, taps.view(1, 1, 1, window).expand(groups, 1, 1, window), groups=groups)
    blurred = F.conv2d(blurred, taps.view(1, 1, window, 1).expand(groups, 1, window, 1), groups=groups)
    mu_x, mu_y, e_xx, e_yy, e_xy = blurred.split(channels, dim=1)  # each [N, C, H - 10, W - 10]
    # 2. SSIM map and its mean over channels and the valid area
    var_x, var_y, cov_xy = e_xx - mu_x * mu_x, e_yy - mu_y * mu_y, e_xy - mu_x * mu_y
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov_xy + c2)
    denominator = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    return (numerator / denominator).mean(dim=(1, 2, 3))


def compute_per_frame_metrics(
    ref,
    test,
    lpips_model: LpipsScorer | None = None,
    *,
    device: str | torch.device | None = None,
    frame_batch: int = 16,
) -> dict[str, torch.Tensor]:
    """Per-frame series (float64 [T], on CPU): mse, mae, psnr, ssim, temporal_delta_mse (NaN at t=0), + LPIPS key.

    ref, test: [T, H, W, 3] uint8 or float in [0, 1] (numpy or torch). ``device`` defaults to the device of
    ``ref`` (CPU for numpy); LPIPS runs on ``lpips_model.device`` (frames are moved there). Frames are processed
    ``frame_batch`` at a time.
    """
    # 1. validate
    ref, test = as_unit_frames(ref, "reference video"), as_unit_frames(test, "test video")
    if ref.shape != test.shape:
        raise ValueError(f"shape mismatch: reference video {tuple(ref.shape)} vs test video {tuple(test.shape)}")
    if frame_batch < 1:
        raise ValueError(f"frame_batch must be >= 1, got {frame_batch}")
    device = ref.device if device is None else torch.device(device)
    num_frames = ref.shape[0]
    series: dict[str, list[torch.Tensor]] = {key: [] for key in ("mse", "mae", "ssim", "temporal_delta_mse")}
    if lpips_model is not None:
        series[lpips_model.metric_name] = []
    previous_error = None  # e_{t-1} of the last frame of the previous batch, [1, 3, H, W]

    # 2. batches of frames
    for start in range(0, num_frames, frame_batch):
        ref_batch = _to_unit_nchw(ref[start : start + frame_batch], device, STATS_DTYPE)
        test_batch = _to_unit_nchw(test[start : start + frame_batch], device, STATS_DTYPE)
        error = test_batch - ref_batch  # [n, 3, H, W]
        series["mse"].append(error.square().mean(dim=(1, 2, 3)))
        series["mae"].append(error.abs().mean(dim=(1, 2, 3)))
        series["ssim"].append(ssim_per_frame(ref_batch, test_batch))
        # temporal delta: (test_t - test_{t-1}) - (ref_t - ref_{t-1}) = e_t - e_{t-1}
        with_previous = error if previous_error is None else torch.cat([previous_error, error])
        delta_mse = (with_previous[1:] - with_previous[:-1]).square().mean(dim=(1, 2, 3))
        if previous_error is None:
            delta_mse = torch.cat([delta_mse.new_full((1,), math.nan), delta_mse])
        series["temporal_delta_mse"].append(delta_mse)
        previous_error = error[-1:]
        if lpips_model is not None:
            series[lpips_model.metric_name].append(lpips_model(ref_batch, test_batch).to(device, STATS_DTYPE))

    # 3. collect on CPU
    per_frame = {key: torch.cat(values).cpu() for key, values in series.items()}
    per_frame["psnr"] = psnr_from_mse(per_frame["mse"])
    ordered = {key: per_frame[key] for key in PER_FRAME_KEYS}
    if lpips_model is not None:
        ordered[lpips_model.metric_name] = per_frame[lpips_model.metric_name]
    return ordered


def lpips_key_of(per_frame_or_metrics: Mapping) -> str | None:
    """The LPIPS key present in a metrics / per-frame dict (at most one), or None."""
    keys = [key for key in LPIPS_METRIC_NAMES if key in per_frame_or_metrics]
    if len(keys) > 1:
        raise ValueError(f"both {keys} present; a report must use one LPIPS backbone")
    return keys[0] if keys else None


def aggregate_per_frame(per_frame: Mapping[str, Sequence[float] | torch.Tensor]) -> dict[str, float | int]:
    """Whole-range metrics from per-frame series (same definitions as the module docstring). -> dict of floats."""
    series = {key: torch.as_tensor(values, dtype=STATS_DTYPE) for key, values in per_frame.items()}
    mse = series["mse"].mean()
    deltas = series["temporal_delta_mse"]
    valid_deltas = deltas[~torch.isnan(deltas)]
    metrics: dict[str, float | int] = {
        "psnr_full": float(psnr_from_mse(mse)),
        "psnr_frame_mean": float(psnr_from_mse(series["mse"]).mean()),
        "ssim": float(series["ssim"].mean()),
    }
    lpips_key = lpips_key_of(series)
    if lpips_key is not None:
        metrics[lpips_key] = float(series[lpips_key].mean())
    metrics.update(
        {
            "mse": float(mse),
            "rmse": float(mse.sqrt()),
            "mae": float(series["mae"].mean()),
            "temporal_delta_mse": float(valid_deltas.mean()) if valid_deltas.numel() else math.nan,
            "num_frames": int(series["mse"].numel()),
            "identical_frames": int((series["mse"] == 0).sum()),
        }
    )
    return metrics


def compute_video_metrics(
    ref,
    test,
    lpips_model: LpipsScorer | None = None,
    *,
    per_frame: bool = False,
    device: str | torch.device | None = None,
    frame_batch: int = 16,
) -> dict:
    """Metrics of ``test`` against ``ref`` (both [T, H, W, 3], uint8 or float in [0, 1]).

    Returns floats for psnr_full, psnr_frame_mean, ssim, <LPIPS key if a scorer is given>, mse, rmse, mae,
    temporal_delta_mse, and ints num_frames, identical_frames. With ``per_frame=True`` also ``"per_frame"``: a dict of
    lists of floats [T] (mse, mae, psnr, ssim, temporal_delta_mse with NaN at frame 0, LPIPS key), which
    ``summarize_frame_range`` turns into per-chunk numbers.
    """
    series = compute_per_frame_metrics(ref, test, lpips_model, device=device, frame_batch=frame_batch)
    metrics = aggregate_per_frame(series)
    if per_frame:
        metrics["per_frame"] = {key: values.tolist() for key, values in series.items()}
    return metrics


def summarize_frame_range(per_frame: Mapping[str, Sequence[float]], start: int, stop: int) -> dict:
    """Metrics of frames [start, stop) from a ``per_frame`` dict (e.g. one AR chunk, for drift curves).

    The temporal delta of frame ``start`` (its change from frame start - 1) belongs to the range, so chunk values
    weighted by their frame counts give back the whole-video value.
    """
    num_frames = len(per_frame["mse"])
    if not 0 <= start < stop <= num_frames:
        raise ValueError(f"frame range [{start}, {stop}) is not inside a {num_frames}-frame video")
    return aggregate_per_frame({key: list(values)[start:stop] for key, values in per_frame.items()})


def chunk_frame_ranges(num_latent_frames: int, latents_per_chunk: int = 4, temporal_compression: int = 4):
    """Decoded-frame ranges [start, stop) of each AR chunk for a causal video VAE.

    Latent 0 decodes to frame 0 and latent i >= 1 to frames (i-1)*c + 1 .. i*c (c = temporal_compression), so 32
    latents -> 125 frames, chunk 0 = frames [0, 13), later chunks 16 frames each.
    """
    if num_latent_frames % latents_per_chunk:
        raise ValueError(f"{num_latent_frames} latent frames do not split into chunks of {latents_per_chunk}")

    def first_frame(latent_index: int) -> int:
        return 0 if latent_index == 0 else (latent_index - 1) * temporal_compression + 1

    ranges = []
    for chunk_start in range(0, num_latent_frames, latents_per_chunk):
        last_latent = chunk_start + latents_per_chunk - 1
        ranges.append((first_frame(chunk_start), last_latent * temporal_compression + 1))
    return ranges


def aggregate_videos(per_video: Sequence[Mapping]) -> dict[str, float | int]:
    """Across videos: mean of every metric (psnr_full is the mean of per-video values), sum of the counts."""
    if not per_video:
        raise ValueError("no videos to aggregate")
    metric_keys = [key for key in per_video[0] if key not in COUNT_KEYS and key != "per_frame"]
    for index, metrics in enumerate(per_video):
        keys = [key for key in metrics if key not in COUNT_KEYS and key != "per_frame"]
        if keys != metric_keys:
            raise ValueError(f"video {index} has metric keys {keys}, video 0 has {metric_keys}")
    aggregate: dict[str, float | int] = {"num_videos": len(per_video)}
    for key in metric_keys:
        aggregate[key] = float(np.mean([metrics[key] for metrics in per_video]))
    for key in COUNT_KEYS:
        aggregate[key] = int(sum(metrics[key] for metrics in per_video))
    return aggregate


def jsonable(value):
    """Recursively make metrics JSON-safe: non-finite floats become the strings "inf", "-inf", "nan".

    (Plain JSON has no inf/NaN; the same tokens appear in the CSV files, and ``float()`` reads them back.)
    """
    if isinstance(value, Mapping):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
