"""The demo world's VAE (predictor_training/world/vae.py, tools/train_world_vae.py): config rules, windows that
resume exactly, a training run through the shared loop that lowers the loss, the latent scale and the export."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from predictor_training.video.io import write_video
from predictor_training.world.vae import ClipVideo, ClipWindows, frames_to_tensor, psnr, world_vae_config


TOOL = Path(__file__).resolve().parents[2] / "tools" / "train_world_vae.py"
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


def test_config_rules():
    assert world_vae_config(16)["spatial_compression_ratio"] == 8
    with pytest.raises(ValueError, match="four entries"):
        world_vae_config(16, (8, 16, 32))
    with pytest.raises(ValueError, match="divisible"):
        world_vae_config(16, (8, 16, 32, 48))


def test_psnr_and_range():
    frames = np.zeros((5, 8, 8, 3), dtype=np.uint8)
    frames[..., 0] = 255
    x = frames_to_tensor(frames)
    assert x.shape == (1, 3, 5, 8, 8) and x.min() == -1 and x.max() == 1
    assert psnr(x, x) == float("inf")
    assert math.isclose(psnr(x * 0, x), -10 * math.log10(0.25), rel_tol=1e-6)  # every value off by 1/2


def _clips(folder: Path, count: int, num_frames: int) -> list[ClipVideo]:
    clips, rows = [], []
    for index in range(count):
        t = np.linspace(0, 1, num_frames)[:, None, None]
        x = np.linspace(0, 1, 48)[None, None, :]
        y = np.linspace(0, 1, 32)[None, :, None]
        red = 0.5 + 0.5 * np.sin(6 * x + 3 * t + index)
        green = 0.5 + 0.5 * np.cos(5 * y - 2 * t)
        frames = (255 * np.stack([red + 0 * y, green + 0 * x, 0.5 + 0 * (x + y + t)], axis=-1)).astype(np.uint8)
        video = folder / "frames" / f"clip{index}"
        write_video(video, frames, fps=24)
        clips.append(ClipVideo(f"clip{index}", str(video)))
        rows.append({"clip_id": f"clip{index}", "video": f"frames/clip{index}"})
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return clips


def test_windows_are_a_pure_function_of_the_index(tmp_path):
    clips = _clips(tmp_path, 2, 21)
    windows = ClipWindows(clips, num_frames=21, short=5, long_min=13, long_fraction=0.5, windows_per_clip=4, seed=3)
    spans = [windows.window(index) for index in range(len(windows))]
    assert spans == [windows.window(index) for index in range(len(windows))]
    assert {length for _, length in spans} <= {5, 13, 17, 21} and len({length for _, length in spans}) > 1
    assert all(start + length <= 21 for start, length in spans)
    item = windows[1]
    assert item["clip_id"] == "clip1" and item["frames"].shape[2] == spans[1][1]


def test_batched_windows_and_the_batch_safe_attention_mask(tmp_path):
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock

    from predictor_training.world.vae import build_world_vae, causal_attention_mask

    original = HunyuanVideo15AttnBlock.prepare_causal_attention_mask
    for frames, hw in ((1, 6), (3, 4)):
        expected = original(frames, hw, torch.float32, torch.device("cpu"))
        assert torch.equal(causal_attention_mask(frames, hw, torch.float32, torch.device("cpu")), expected)
    vae = build_world_vae(world_vae_config(4, (8, 8, 8, 8)), 0).eval()
    x = torch.rand(2, 3, 9, 16, 24) * 2 - 1
    with torch.no_grad():  # a batch of two gives each video's own latents
        batched = vae.encode(x).latent_dist.mode()
        single = torch.cat([vae.encode(x[i:i + 1]).latent_dist.mode() for i in range(2)])
    torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-5)

    clips = _clips(tmp_path, 3, 21)
    windows = ClipWindows(clips, num_frames=21, short=5, long_min=13, long_fraction=0.5, windows_per_clip=4, seed=3,
                          windows_per_item=2, long_windows_per_item=1)
    assert len(windows) == 6
    seen = set()
    for index in range(len(windows)):
        item, again = windows[index], windows[index]
        assert torch.equal(item["frames"], again["frames"])
        start, length = windows.window(index)
        assert item["frames"].shape[:3] == ((2 if length == 5 else 1), 3, length)
        seen.add(item["clip_id"])
    assert seen <= {clip.clip_id for clip in clips} and len(seen) > 1


def test_training_lowers_the_loss_and_exports_a_scaled_vae(tmp_path):
    from diffusers import AutoencoderKLHunyuanVideo15

    spec = importlib.util.spec_from_file_location("train_world_vae", TOOL)
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)

    _clips(tmp_path, 2, 9)
    out = tmp_path / "run"
    argv = ["--clips", str(tmp_path / "train.jsonl"), "--holdout", str(tmp_path / "train.jsonl"), "--num_frames", "9",
            "--short", "5", "--long_min", "9", "--latent_channels", "4", "--block_out_channels", "8,8,8,8",
            "--max_steps", "20", "--warmup_steps", "2", "--grad_accum", "1", "--lr", "3e-3", "--output_dir",
            str(out), "--no_progress", "--log_every", "1", "--ckpt_every", "-1"]
    assert trainer.main(argv) == 0
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert np.mean([r["mse"] for r in log[-5:]]) < 0.75 * np.mean([r["mse"] for r in log[:5]])
    report = json.loads((out / trainer.EVAL_NAME).read_text())
    vae = AutoencoderKLHunyuanVideo15.from_pretrained(str(out / "vae"))
    assert math.isclose(vae.config.scaling_factor, 1 / report["latent_std"], rel_tol=1e-6)
    assert report["holdout_psnr_mean"] > 10
    assert trainer.main(argv) == 0  # finished: nothing to do
    # --init_from: a new run starts from the exported weights (fresh optimizer), so it starts where the first ended.
    warm = tmp_path / "warm"
    assert trainer.main([*argv[:argv.index("--max_steps")], "--max_steps", "2", "--warmup_steps", "0",
                         "--init_from", str(out / "vae"), "--output_dir", str(warm), "--no_progress"]) == 0
    warm_first = json.loads((warm / "train_log.jsonl").read_text().splitlines()[0])["mse"]
    assert warm_first < 0.8 * log[0]["mse"]
