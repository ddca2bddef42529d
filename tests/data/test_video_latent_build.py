"""Video-latent dataset builds (predictor_training/data/video_latent_build.py): 1 and 2
ranks, latent scaling, resume, other settings refused, bad input, the command line's frame-count check.

Every build uses the demo's tiny procedural clips (29 frames at 40 x 64 -> 8 latents at 2 x 3, five clips: three
train, two holdout, the last of each an mp4) and its tiny random encoders, one CPU thread per process. In-process
builds call ``video_latent_build.run``; the command line runs under torchrun as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from predictor_training.data import video_latent_build as vb, video_latents as vl
from predictor_training.data.builder import MANIFEST_FILE, PARTS_DIR
from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    file_tensor_crc32,
    load_tensors,
    read_jsonl,
    verify_file,
)
from predictor_training.video.io import read_video, write_video
from predictor_training.world import video_latent_demo as vd


REPO_ROOT = Path(__file__).resolve().parents[2]
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


def test_a_final_clip_table_is_refused(tmp_path):
    """The split nothing is chosen on (the demo's clips/final.jsonl) never goes into a video-latent dataset."""
    tables = [tmp_path / "train.jsonl", tmp_path / "final.jsonl"]  # refused before either is read
    with pytest.raises(vl.VideoDatasetInputError, match=r"final\.jsonl: split 'final' is the split nothing is chosen"):
        vb.read_clip_plan(tables, 29)
