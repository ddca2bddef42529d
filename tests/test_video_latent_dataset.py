"""Video-latent dataset: builds on 1 and 2 ranks, resume, damaged tensors, reader shapes, exact data resume, bad input.

Every build uses the demo's tiny procedural clips (29 frames at 40 x 64 -> 8 latents at 2 x 3, five clips: three
train, two holdout, the last of each an mp4) and its tiny random encoders, one CPU thread per process. In-process
builds call ``video_latent_build.run``; the command line runs under torchrun as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.data import video_latent_build as vb
from predictor_training.world import video_latent_demo as vd
from predictor_training.data import video_latents as vl
from predictor_training.data.builder import MANIFEST_FILE, PARTS_DIR
from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    ShardVerificationError,
    TensorChecksumError,
    file_tensor_crc32,
    load_tensors,
    read_jsonl,
    verify_file,
)
from predictor_training.data.batches import ResumableBatches
from predictor_training.video.io import read_video, write_video

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOL = REPO_ROOT / "tools" / "build_video_latent_dataset.py"
ONE_THREAD_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
NUM_CLIPS, NUM_HOLDOUT = 5, 2


def _options(demo_dir: Path, out: Path, /, **changes) -> vb.VideoBuildOptions:
    """What ``--demo DEMO_DIR --demo_clips 5 --out OUT --device cpu`` makes of the flags, with ``changes`` applied
    (e.g. ``clips=[table], demo=None``: the demo's encoders and settings on other clips)."""
    options = vb.VideoBuildOptions(
        clips=vd.demo_tables(demo_dir), encoders=demo_dir / vd.DEMO_ENCODERS_DIR, out=out, height=vd.DEMO_HEIGHT,
        width=vd.DEMO_WIDTH, num_frames=vd.DEMO_NUM_FRAMES, dtype="float32", device="cpu", demo=demo_dir,
        demo_clips=NUM_CLIPS, demo_holdout=NUM_HOLDOUT,
    )
    for name, value in changes.items():
        setattr(options, name, value)
    return options


def _snapshot(root: Path) -> dict[str, tuple[bytes, int, int]]:
    """{relative path: (bytes, inode, mtime_ns)} of every file under root."""
    return {str(path.relative_to(root)): (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime_ns)
            for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def demo(tmp_path_factory, one_thread):
    """The demo inputs (tiny encoders, clips, tables), made once."""
    root = tmp_path_factory.mktemp("video_demo") / "D"
    vd.prepare_demo_inputs(root, NUM_CLIPS, NUM_HOLDOUT, seed=0)
    return root


@pytest.fixture(scope="module")
def single_build(demo, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("single") / "VDS"
    assert vb.run(_options(demo, out), prepare_demo=vd.prepare_demo_inputs) == 0
    return out


@pytest.fixture(scope="module")
def torchrun_build(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "VDS"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TOOL),
               "--demo", str(demo), "--demo_clips", str(NUM_CLIPS), "--demo_holdout", str(NUM_HOLDOUT),
               "--device", "cpu", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, env=ONE_THREAD_ENV, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout + result.stderr


# =============================================================================================================
# 1. builds
# =============================================================================================================
def test_one_rank_and_two_ranks_write_byte_identical_datasets(single_build, torchrun_build):
    out, log = torchrun_build
    assert "[rank 0] clips built 3, skipped 0" in log and "[rank 1] clips built 2, skipped 0" in log
    assert (out / MANIFEST_FILE).read_bytes() == (single_build / MANIFEST_FILE).read_bytes()
    assert (out / vl.CONFIG_NAME).read_bytes() == (single_build / vl.CONFIG_NAME).read_bytes()
    assert {path: data for path, (data, _, _) in _snapshot(out).items()} == {
        path: data for path, (data, _, _) in _snapshot(single_build).items()}
    assert not (out / PARTS_DIR).exists()

    manifest = read_jsonl(out / MANIFEST_FILE)
    assert [entry["file"] for entry in manifest] == [f"clips/clip{i:03d}.safetensors" for i in range(NUM_CLIPS)]
    assert [entry["split"] for entry in manifest] == ["train"] * 3 + ["holdout"] * 2
    for entry in manifest:
        verify_file(entry, out)
        assert entry[TENSOR_CHECKSUM_FIELD] == file_tensor_crc32(out / entry["file"])
        assert sorted(entry["tensors"]) == sorted(vl.CLIP_TENSORS)
    config = json.loads((out / vl.CONFIG_NAME).read_text())
    assert config["latent_shape"] == {"C": 4, "T": 8, "H": 2, "W": 3} and config["num_frames"] == 29
    assert config["splits"] == {"holdout": 2, "train": 3} and config["num_chunks"] == 2
    assert config["vae"]["scaling_factor"] == pytest.approx(1.03682) and len(config["vae"]["config_sha256"]) == 64


def test_latents_follow_the_pipeline_scaling(single_build, demo):
    """The stored latents are the VAE's posterior mean times scaling_factor: the causal VAE's first latent equals the
    image condition made by diffusers' own ``_get_image_latents`` (argmax = mode, * scaling_factor), and re-encoding
    the frames with ``latent_dist.mean`` gives the same numbers."""
    encoder = vb.load_video_encoder(_options(demo, single_build), "cpu")
    vae = encoder.pipeline.vae
    for clip_id in ("clip000", "clip002"):  # a PNG folder and the train split's mp4
        tensors = load_tensors(single_build / f"clips/{clip_id}.safetensors")
        latents, image_cond = tensors["latents"], tensors["image_cond"]
        assert latents.shape == (4, 8, 2, 3) and image_cond.shape == (1, 4, 1, 2, 3)
        torch.testing.assert_close(latents[:, 0], image_cond[0, :, 0], atol=1e-5, rtol=0)
        job = next(job for job in vb.read_clip_plan(vd.demo_tables(demo), 29).clips if job.clip_id == clip_id)
        frames = [encoder.pipeline.video_processor.resize(frame, height=32, width=48, resize_mode="crop")
                  for frame in vb.read_clip_frames(job, 29)]
        video = encoder.pipeline.video_processor.preprocess_video(frames, height=32, width=48)
        with torch.no_grad():
            mean = vae.encode(video).latent_dist.mean[0]
        torch.testing.assert_close(latents, mean * vae.config.scaling_factor, atol=0, rtol=0)


def test_interrupted_build_resumes_and_skips_finished_clips(demo, single_build, tmp_path, capsys):
    out = tmp_path / "VDS"
    assert vb.run(_options(demo, out, stop_after=2), prepare_demo=vd.prepare_demo_inputs) == 0
    assert "clips built 2, skipped 0" in capsys.readouterr().out
    assert not (out / MANIFEST_FILE).exists()
    assert sorted(path.name for path in (out / "clips").iterdir()) == ["clip000.safetensors", "clip001.safetensors"]
    finished = {name: value for name, value in _snapshot(out).items() if name.startswith("clips/")}
    # what a kill leaves: a torn last manifest line, a half-written temp file
    with open(out / PARTS_DIR / "rank0.jsonl", "a") as handle:
        handle.write('{"file":"clips/clip002.safetens')
    (out / "clips" / "clip002.safetensors.tmp").write_bytes(b"partial")

    assert vb.run(_options(demo, out), prepare_demo=vd.prepare_demo_inputs) == 0
    assert "clips built 3, skipped 2" in capsys.readouterr().out
    after = _snapshot(out)
    for name, value in finished.items():
        assert after[name] == value, f"{name} was rewritten"  # same bytes, inode and mtime: skipped
    assert (out / MANIFEST_FILE).read_bytes() == (single_build / MANIFEST_FILE).read_bytes()
    assert not list(out.rglob("*.tmp")) and not (out / PARTS_DIR).exists()

    # a finished dataset: everything is skipped
    assert vb.run(_options(demo, out), prepare_demo=vd.prepare_demo_inputs) == 0
    assert "clips built 0, skipped 5" in capsys.readouterr().out


def test_resume_refuses_a_folder_built_with_other_settings(demo, single_build):
    before = _snapshot(single_build)
    with pytest.raises(vl.VideoDatasetInputError) as error:
        vb.run(_options(demo, single_build, storage_dtype="bfloat16", vision_crop="target"),
               prepare_demo=vd.prepare_demo_inputs)
    message = str(error.value)
    assert str(single_build / vl.CONFIG_NAME) in message
    assert "storage_dtype: existing 'keep', requested 'bfloat16'" in message
    assert "encoders.vision_crop: existing 'bucket', requested 'target'" in message
    assert _snapshot(single_build) == before


# =============================================================================================================
# 2. bad input: a clear message, nothing written for the clip
# =============================================================================================================
def _bad_table(folder: Path, demo: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    table = folder / "train.jsonl"
    table.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return table


def _good_row(demo: Path, clip: str = "clip000") -> dict:
    clips = demo / vd.DEMO_CLIPS_DIR
    row = next(json.loads(line) for line in (clips / "train.jsonl").read_text().splitlines()
               if json.loads(line)["clip_id"] == clip)
    return {**row, "video": str(clips / row["video"]), "pose": str(clips / row["pose"])}


def test_bad_inputs_fail_with_a_clear_message_before_anything_is_written(demo, tmp_path):
    good = _good_row(demo)
    frames = read_video(good["video"])

    # 1. a PNG folder of 28 frames (not 4k+1): refused while planning, so nothing at all is written
    short = tmp_path / "short_frames"
    write_video(short, frames[:28], fps=24)
    table = _bad_table(tmp_path / "t1", demo, [good, {**good, "clip_id": "short", "video": str(short)}])
    out = tmp_path / "out1"
    with pytest.raises(vl.VideoDatasetInputError) as error:
        vb.run(_options(demo, out, clips=[table], demo=None))
    message = str(error.value)
    assert str(short) in message and "field 'video'" in message and "has 28 frames, expected 29" in message
    assert "28 is not of the form 4k+1" in message and f"{table} line 2" in message
    assert not out.exists()

    # 2. a pose with 7 latents for a 29-frame (8-latent) clip
    pose = json.loads(Path(good["pose"]).read_text())
    bad_pose = tmp_path / "pose7.json"
    bad_pose.write_text(json.dumps({str(i): pose[str(i)] for i in range(7)}))
    table = _bad_table(tmp_path / "t2", demo, [{**good, "pose": str(bad_pose)}])
    with pytest.raises(vl.VideoDatasetInputError) as error:
        vb.run(_options(demo, tmp_path / "out2", clips=[table], demo=None))
    message = str(error.value)
    assert str(bad_pose) in message and "field 'pose'" in message and "expected num_latents=8" in message
    assert not (tmp_path / "out2").exists()

    # 3. a missing video, a missing field
    table = _bad_table(tmp_path / "t3", demo, [{**good, "video": str(tmp_path / "nowhere.mp4")}])
    with pytest.raises(vl.VideoDatasetInputError, match=r"nowhere\.mp4: field 'video' .* does not exist"):
        vb.read_clip_plan([table], 29)
    table = _bad_table(tmp_path / "t4", demo, [{key: value for key, value in good.items() if key != "caption"}])
    with pytest.raises(vl.VideoDatasetInputError, match=r"line 1: missing field 'caption'"):
        vb.read_clip_plan([table], 29)

    # 4. an mp4 of 25 frames after a good clip: found when it is decoded, before its file or entry is written
    mp4 = tmp_path / "short.mp4"
    write_video(mp4, frames[:25], fps=24, lossless=True)
    table = _bad_table(tmp_path / "t5", demo, [good, {**good, "clip_id": "short", "video": str(mp4)}])
    with pytest.raises(vl.VideoDatasetInputError) as error:
        vb.run(_options(demo, tmp_path / "out5", clips=[table], demo=None, check_only=True))
    assert f"{mp4}: field 'video'" in str(error.value) and "has 25 frames, expected 29" in str(error.value)
    assert not (tmp_path / "out5").exists()  # --check_only writes nothing
    out = tmp_path / "out5"
    with pytest.raises(vl.VideoDatasetInputError, match=r"short\.mp4: field 'video' .* has 25 frames, expected 29"):
        vb.run(_options(demo, out, clips=[table], demo=None))
    assert sorted(path.name for path in (out / "clips").iterdir()) == ["clip000.safetensors"]
    assert [entry["clip_id"] for entry in read_jsonl(out / PARTS_DIR / "rank0.jsonl")] == ["clip000"]
    assert not (out / MANIFEST_FILE).exists()


def test_command_line_refuses_a_frame_count_that_is_not_4k_plus_1(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--demo", str(tmp_path / "D"), "--out", str(tmp_path / "O"),
                             "--num_frames", "30"], capture_output=True, text=True, env=ONE_THREAD_ENV, timeout=120)
    assert result.returncode == 2 and "--num_frames must be 4k+1" in result.stderr
    assert not (tmp_path / "D").exists() and not (tmp_path / "O").exists()


# =============================================================================================================
# 3. the reader
# =============================================================================================================
def test_reader_items_have_the_documented_shapes(single_build):
    dataset = vl.VideoLatentDataset(single_build, "train", verify=True)
    assert len(dataset) == 3 and [entry.clip_id for entry in dataset.clips] == ["clip000", "clip001", "clip002"]
    item = dataset[1]
    shapes = {name: tuple(value.shape) for name, value in item.items() if isinstance(value, torch.Tensor)}
    assert shapes == {
        "latents": (4, 8, 2, 3), "image_cond": (1, 4, 1, 2, 3), "viewmats": (8, 4, 4), "Ks": (8, 3, 3),
        "action": (8,), "prompt_embeds": (1, 1000, 32), "prompt_mask": (1, 1000), "byt5_text_states": (1, 256, 32),
        "byt5_text_mask": (1, 256), "vision_states": (1, 9, 16),
    }
    assert item["clip_id"] == "clip001" and item["latent_start"] == 0
    assert item["action"].dtype == torch.int64 and item["prompt_mask"].dtype == torch.int64
    assert item["viewmats"].dtype == torch.float32 and item["latents"].dtype == torch.float32
    assert item["action"].tolist() == [0] + [9 * 1 + 2] * 7  # forward + yaw left, every latent after the first
    holdout = vl.VideoLatentDataset(single_build, "holdout", float_dtype=torch.bfloat16)
    assert holdout[0]["latents"].dtype == torch.bfloat16 and holdout[0]["action"].dtype == torch.int64
    with pytest.raises(ValueError, match=r"no clip of split 'test'; splits present: \['holdout', 'train'\]"):
        vl.VideoLatentDataset(single_build, "test")

    windows = vl.VideoLatentDataset(single_build, "train", window_chunks=1)
    assert windows.num_windows == 2 and len(windows) == 6
    second = windows[windows.index_of(1, 1)]
    assert second["latent_start"] == 4 and second["latents"].shape == (4, 4, 2, 3)
    torch.testing.assert_close(second["latents"], item["latents"][:, 4:8], atol=0, rtol=0)
    torch.testing.assert_close(second["viewmats"], item["viewmats"][4:8], atol=0, rtol=0)
    torch.testing.assert_close(second["image_cond"], item["image_cond"], atol=0, rtol=0)
    unchecked = vl.VideoLatentDataset(single_build, "train", window_chunks=1, check_tensors=False)
    for name in ("latents", "viewmats", "action"):  # sliced reads (no first whole, checked read)
        torch.testing.assert_close(unchecked[unchecked.index_of(1, 1)][name], second[name], atol=0, rtol=0)
    with pytest.raises(ValueError, match="window_chunks=3: the clips have 2 whole chunks"):
        vl.VideoLatentDataset(single_build, "train", window_chunks=3)

    batch = vl.collate_video_clips([windows[0], second])
    assert batch["latents"].shape == (2, 4, 4, 2, 3) and batch["image_cond"].shape == (2, 4, 1, 2, 3)
    assert batch["prompt_embeds"].shape == (2, 1000, 32) and batch["viewmats"].shape == (2, 4, 4, 4)
    assert batch["clip_id"] == ["clip000", "clip001"] and batch["latent_start"].tolist() == [0, 4]


def _damage_tensor(path: Path, name: str) -> None:
    """Flip one byte inside tensor ``name``'s data (the file keeps its size)."""
    data = bytearray(path.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(bytes(data[8 : 8 + header_size]))[name]["data_offsets"]
    data[8 + header_size + begin + 3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_tensor_raises_naming_file_and_tensor(single_build, tmp_path):
    root = tmp_path / "VDS"
    shutil.copytree(single_build, root)
    damaged = root / "clips" / "clip001.safetensors"
    _damage_tensor(damaged, "latents")
    dataset = vl.VideoLatentDataset(root, "train", window_chunks=1)
    dataset[dataset.index_of(0, 1)]  # other clips read fine
    with pytest.raises(TensorChecksumError) as error:
        dataset[dataset.index_of(1, 1)]  # a window: the first read still checks the whole tensor
    assert str(damaged) in str(error.value) and "tensor 'latents'" in str(error.value)
    with pytest.raises(ShardVerificationError, match=r"clip001\.safetensors: field 'sha256'"):
        vl.VideoLatentDataset(root, "train", verify=True)


def _items(batches: ResumableBatches, count: int) -> list[tuple]:
    items = []
    for _ in range(count):
        batch = next(batches)
        items += [(clip, start, latents) for clip, start, latents in
                  zip(batch["clip_id"], batch["latent_start"].tolist(), batch["latents"])]
    return items


def test_resumable_batches_resume_gives_the_same_items(single_build):
    def stream(state=None):
        dataset = vl.VideoLatentDataset(single_build, "train", window_chunks=1)
        sampler = vl.ClipWindowSampler(dataset, seed=11)
        batches = ResumableBatches(sampler, dataset, vl.collate_video_clips, batch_size=1, seed=11)
        if state is not None:
            batches.load_state_dict(state)
        return batches

    uninterrupted = _items(stream(), 12)  # 4 epochs of 3 clips
    first = stream()
    head = _items(first, 5)  # stop inside epoch 1
    tail = _items(stream(first.state_dict()), 7)
    assert [item[:2] for item in head + tail] == [item[:2] for item in uninterrupted]
    for (_, _, resumed), (_, _, straight) in zip(head + tail, uninterrupted):
        torch.testing.assert_close(resumed, straight, atol=0, rtol=0)
    for epoch in range(4):  # every clip once per epoch
        assert sorted(item[0] for item in uninterrupted[3 * epoch : 3 * epoch + 3]) == ["clip000", "clip001", "clip002"]
    assert {item[1] for item in uninterrupted} == {0, 4}  # both windows are drawn

    dataset = vl.VideoLatentDataset(single_build, "train", window_chunks=1)
    ranks = [vl.ClipWindowSampler(dataset, seed=11, num_replicas=2, rank=rank) for rank in (0, 1)]
    assert [len(sampler) for sampler in ranks] == [2, 2]
    assert sorted(list(ranks[0]) + list(ranks[1])) == sorted(ranks[0].epoch_items(0))
