"""The video-latent reader (predictor_training/data/video_latents.py) on a build of the
demo's tiny clips: the documented item shapes and windows, a damaged tensor named, and an exact data resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from predictor_training.data import video_latent_build as vb, video_latents as vl
from predictor_training.data.batches import ResumableBatches
from predictor_training.data.shards import ShardVerificationError, TensorChecksumError
from predictor_training.world import video_latent_demo as vd


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


# =============================================================================================================
# the reader
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
