"""TeacherSampleDataset: the Teacher's finished F-F-F-F video latents of the offline dataset, one item per trajectory.

Most tests read the synthetic dataset (``data.synthetic``, random tensors in the builder's layout and manifest); one
reads a real build of two demo trajectories (about 10 s: demo assets, then ``builder.run`` on CPU).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from predictor_training.data import builder
from predictor_training.data.manifest import UncheckedTensorsWarning
from predictor_training.data.shards import ShardVerificationError, TensorChecksumError, load_tensors
from predictor_training.data.synthetic import (
    SyntheticSpec,
    damage_tensor,
    strip_tensor_checksums,
    write_synthetic_dataset,
)
from predictor_training.data.teacher_samples import TeacherSampleDataset, collate_teacher_samples


REPO_ROOT = Path(__file__).resolve().parents[2]


# train: c000, c001 (actions 0 and 2); holdout25: c002; 4 chunks = 16 latents, grid 4 x 2 x 3
SPEC = SyntheticSpec()
TRAIN_KEYS = [("c000", 0), ("c000", 2), ("c001", 0), ("c001", 2)]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher_samples") / "DS"
    return root, write_synthetic_dataset(root, SPEC)


@pytest.fixture
def copy_of(synthetic, tmp_path):
    """A private copy of the synthetic dataset (for tests that damage or edit it)."""
    copy = tmp_path / "DS"
    shutil.copytree(synthetic[0], copy)
    return copy


def _final_latents(tensors: dict, num_chunks: int) -> torch.Tensor:
    return torch.cat([tensors[f"chunk{c}.final_latent"] for c in range(num_chunks)], dim=1)


def test_items_are_whole_trajectories_with_their_case(synthetic):
    root, written = synthetic
    dataset = TeacherSampleDataset(root)
    assert len(dataset) == dataset.num_clips == 4
    assert dataset.keys() == TRAIN_KEYS
    assert dataset.latent_shape == (SPEC.channels, SPEC.num_latents, SPEC.height, SPEC.width)
    for index, (case_id, action_id) in enumerate(TRAIN_KEYS):
        item = dataset[index]
        trajectory = written[f"trajectories/{case_id}__a{action_id}.safetensors"]
        case = written[f"cases/{case_id}.safetensors"]
        assert item["clip_id"] == f"{case_id}__a{action_id}"
        assert (item["case_id"], item["action_id"], item["latent_start"], item["seed"]) == (case_id, action_id, 0, 1234)
        assert item["latents"].shape == (SPEC.channels, SPEC.num_latents, SPEC.height, SPEC.width)
        assert item["latents"].dtype == torch.bfloat16
        assert torch.equal(item["latents"], _final_latents(trajectory, SPEC.num_chunks))
        for name in ("viewmats", "Ks", "action"):
            assert torch.equal(item[name], trajectory[name])
        assert item["viewmats"].shape == (SPEC.num_latents, 4, 4) and item["Ks"].shape == (SPEC.num_latents, 3, 3)
        assert item["action"].shape == (SPEC.num_latents,) and item["action"].dtype == torch.int64
        assert item["image_cond"].shape == (1, SPEC.channels, 1, SPEC.height, SPEC.width)
        for name in ("image_cond", "text_k", "text_v"):
            assert torch.equal(item[name], case[name])
        assert item["text_k"].shape[:2] == (SPEC.depth, SPEC.heads) and item["text_k"].shape[-1] == SPEC.head_dim
    with pytest.raises(IndexError, match="4 trajectories of split 'train'"):
        dataset[4]


def test_item_keys_and_shapes_match_the_video_latent_dataset_where_they_overlap(synthetic):
    """The fields of a whole-clip VideoLatentDataset item that a Teacher trajectory also has, same layout."""
    item = TeacherSampleDataset(synthetic[0])[0]
    shared = {"clip_id", "latent_start", "latents", "viewmats", "Ks", "action", "image_cond"}
    assert shared <= set(item)
    assert item["latents"].dim() == 4 and item["image_cond"].dim() == 5
    assert set(item) - shared == {"text_k", "text_v", "seed", "case_id", "action_id"}


def test_splits_and_unknown_split(synthetic):
    root, written = synthetic
    holdout = TeacherSampleDataset(root, "holdout25")
    assert holdout.keys() == [("c002", 0), ("c002", 2)]
    assert torch.equal(holdout[1]["latents"], _final_latents(written["trajectories/c002__a2.safetensors"], 4))
    assert torch.equal(holdout[1]["text_k"], written["cases/c002.safetensors"]["text_k"])
    present = r"no trajectory of split 'holdout50'; splits present: \['holdout25', 'train'\]"
    with pytest.raises(ValueError, match=present):
        TeacherSampleDataset(root, "holdout50")


def test_float_dtype_collate_and_pickling(synthetic):
    root, written = synthetic
    dataset = TeacherSampleDataset(root, float_dtype=torch.float32)
    item = dataset[1]
    assert item["latents"].dtype == item["text_k"].dtype == item["image_cond"].dtype == torch.float32
    assert item["action"].dtype == torch.int64
    assert torch.equal(item["latents"], _final_latents(written["trajectories/c000__a2.safetensors"], 4).float())

    # a DataLoader worker under spawn gets a pickled copy: no open handles, same items
    clone = pickle.loads(pickle.dumps(dataset))
    assert torch.equal(clone[3]["latents"], dataset[3]["latents"])

    # c000 and c001 have different text lengths (3 and 5 tokens): padded with a mask
    batch = collate_teacher_samples([dataset[1], dataset[2]])
    assert batch["clip_id"] == ["c000__a2", "c001__a0"] and batch["case_id"] == ["c000", "c001"]
    assert batch["latents"].shape == (2, SPEC.channels, SPEC.num_latents, SPEC.height, SPEC.width)
    assert batch["image_cond"].shape == (2, SPEC.channels, 1, SPEC.height, SPEC.width)
    assert batch["action"].shape == (2, SPEC.num_latents) and batch["seed"].tolist() == [1234, 1234]
    assert batch["text_k"].shape == (2, SPEC.depth, SPEC.heads, 5, SPEC.head_dim)
    assert batch["text_mask"].tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert torch.equal(batch["text_v"][0, :, :, :3], dataset[1]["text_v"])
    assert batch["latent_start"].tolist() == [0, 0] and batch["action_id"].tolist() == [2, 0]


@pytest.mark.parametrize(
    "file, tensor",
    [("trajectories/c001__a0.safetensors", "chunk2.final_latent"),
     ("trajectories/c001__a0.safetensors", "viewmats"),
     ("cases/c001.safetensors", "text_k")],
)
def test_a_damaged_tensor_raises_naming_file_and_tensor(copy_of, file, tensor):
    damage_tensor(copy_of / file, tensor, 8)
    dataset = TeacherSampleDataset(copy_of)  # construction reads no tensor: nothing noticed yet
    index = dataset.keys().index(("c001", 0))
    pattern = rf"{re.escape(str(copy_of / file))}: tensor '{re.escape(tensor)}': field 'tensor_crc32': expected"
    with pytest.raises(TensorChecksumError, match=pattern):
        dataset[index]
    with pytest.raises(TensorChecksumError, match=pattern):  # a failed check is not remembered
        dataset[index]
    dataset[0]  # c000 is intact
    # the check is what catches it: without it the damaged bytes come back silently
    assert TeacherSampleDataset(copy_of, check_tensors=False)[index]["clip_id"] == "c001__a0"
    # verify=True finds it up front, by the whole-file sha256
    with pytest.raises(ShardVerificationError, match=rf"{re.escape(str(copy_of / file))}: field 'sha256'"):
        TeacherSampleDataset(copy_of, verify=True)


def test_manifest_without_tensor_checksums_warns_once(copy_of):
    strip_tensor_checksums(copy_of)
    with pytest.warns(UncheckedTensorsWarning, match="6 of 6 dataset files"):
        dataset = TeacherSampleDataset(copy_of)
    assert dataset[0]["clip_id"] == "c000__a0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TeacherSampleDataset(copy_of, verify=True)


def _edit_config(root: Path, edit) -> None:
    path = root / "dataset_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_config_errors_name_file_and_field(copy_of):
    where = re.escape(str(copy_of / "dataset_config.json"))
    original = (copy_of / "dataset_config.json").read_text()
    cases = [
        (lambda c: c.pop("chunk_latents"), KeyError, rf"{where}: missing field 'chunk_latents'"),
        (lambda c: c.pop("num_latents"), KeyError, rf"{where}: missing field 'num_latents'"),
        (lambda c: c.pop("grid"), KeyError, rf"{where}: missing field 'grid'"),
        (lambda c: c["grid"].pop("W"), KeyError, rf"{where}: missing field\(s\) \['grid.W'\]"),
        (lambda c: c.update(num_latents=18), ValueError, rf"{where}: fields 'num_latents'=18 and 'chunk_latents'=4"),
        (lambda c: c.update(num_chunks=3), ValueError, rf"{where}: field 'num_chunks'=3"),
    ]
    for edit, error, pattern in cases:
        (copy_of / "dataset_config.json").write_text(original)
        _edit_config(copy_of, edit)
        with pytest.raises(error, match=pattern):
            TeacherSampleDataset(copy_of)

    # a grid that the stored latents do not have: named by file and tensor
    (copy_of / "dataset_config.json").write_text(original)
    _edit_config(copy_of, lambda c: c["grid"].update(H=5))
    with pytest.raises(ValueError, match=r"cases/c000.safetensors: tensor 'image_cond' has shape \[1, 4, 1, 2, 3\]"):
        TeacherSampleDataset(copy_of)
    # more latents than the trajectories hold: the missing chunk is named
    (copy_of / "dataset_config.json").write_text(original)
    _edit_config(copy_of, lambda c: c.update(num_latents=20, num_chunks=5))
    lacking = r"trajectories/c000__a0.safetensors' lacks tensor\(s\) \['chunk4.final_latent'\]"
    with pytest.raises(ValueError, match=lacking):
        TeacherSampleDataset(copy_of)


def test_missing_files_and_case_entries(copy_of):
    (copy_of / "trajectories" / "c001__a2.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"lists 'trajectories/c001__a2.safetensors' but .* does not exist"):
        TeacherSampleDataset(copy_of)
    TeacherSampleDataset(copy_of, "holdout25")  # another split does not read that file
    manifest = copy_of / "manifest.jsonl"
    lines = [line for line in manifest.read_text().splitlines() if '"file":"cases/c002.safetensors"' not in line]
    manifest.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"no case entry for case_id\(s\) \['c002'\]"):
        TeacherSampleDataset(copy_of, "holdout25")


# ---------------------------------------------------------------------------------------------------------------------
# a real build: two demo trajectories of 8 latents (2 chunks), float32 compute, CPU
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_build(tmp_path_factory, one_thread):
    folder = tmp_path_factory.mktemp("teacher_samples_real")
    demo = folder / "D"
    command = [sys.executable, str(REPO_ROOT / "tools" / "make_demo_assets.py"), "--out", str(demo),
               "--num_train", "1", "--num_holdout25", "1", "--num_holdout50", "1", "--kind", "random"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}  # this checkout's package
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (demo / "samples" / "train.jsonl").read_text().splitlines()]
    tables = folder / "tables"
    (tables / "poses").mkdir(parents=True)
    with open(tables / "train.jsonl", "w") as handle:
        for row in rows[:2]:
            pose = json.loads((demo / "samples" / row["pose"]).read_text())
            (tables / row["pose"]).write_text(json.dumps({str(i): pose[str(i)] for i in range(8)}))
            image = (demo / "samples" / row["source_image"]).resolve()
            handle.write(json.dumps({**row, "source_image": str(image)}) + "\n")
    out = folder / "DS"
    options = builder.BuildOptions(teacher=demo / "teacher", samples=[str(tables / "train.jsonl")],
                                   encoded=demo / "encoded", out=out, dtype="float32", device="cpu", num_latents=8)
    assert builder.run(options) == 0
    return out, rows[:2]


def test_a_real_build_reads_as_teacher_samples(real_build):
    out, rows = real_build
    dataset = TeacherSampleDataset(out, verify=True)
    assert dataset.keys() == sorted((row["case_id"], row["action_id"]) for row in rows)
    for index, row in enumerate(sorted(rows, key=lambda r: (r["case_id"], r["action_id"]))):
        item = dataset[index]
        stored = load_tensors(out / "trajectories" / f"{item['clip_id']}.safetensors")
        case = load_tensors(out / "cases" / f"{row['case_id']}.safetensors")
        assert item["seed"] == row["seed"]
        assert item["latents"].shape == (4, 8, 4, 6)  # demo grid 4 x 6, C = 4
        chunks = [stored["chunk0.final_latent"], stored["chunk1.final_latent"]]
        assert torch.equal(item["latents"], torch.cat(chunks, dim=1))
        # the final latent is the running latent after the last Euler step of the chunk
        last = (stored["chunk1.step3.latent_in"].float()
                + stored["chunk1.step3.velocity"].float() * (stored["sigmas"][4] - stored["sigmas"][3]))
        assert torch.allclose(item["latents"][:, 4:].float(), last, atol=0.05)
        assert torch.equal(item["text_k"], case["text_k"]) and torch.equal(item["image_cond"], case["image_cond"])
        assert item["viewmats"].dtype == torch.float32 and item["action"].shape == (8,)


def test_df_sft_trains_a_real_score_lora_on_teacher_samples(real_build, tmp_path):
    """The "real score" path of fvtools/train_df_sft.py: a LoRA trained on the Teacher's own final latents, with the
    stored text K/V (a full run is refused: its text stream would no longer match them)."""
    import fvtools.train_df_sft as df_sft

    out, _ = real_build
    teacher = out.parent / "D" / "teacher"
    argv = ["--preset", "demo", "--val_every", "0", "--teacher", str(teacher), "--dataset_root", str(out),
            "--data", "teacher_samples",
            "--output_dir", str(tmp_path / "real_score"), "--no_progress"]
    with pytest.raises(SystemExit):
        df_sft.parse_args(argv)  # the demo preset trains every parameter
    assert df_sft.main([*argv, "--train", "lora", "--lora_rank", "2", "--lora_alpha", "2", "--max_steps", "2",
                        "--warmup_steps", "0", "--sigma_min", "0.02"]) == 0
    log = [json.loads(line) for line in (tmp_path / "real_score" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(record["loss"] > 0 for record in log)
    assert (tmp_path / "real_score" / "lora_student.safetensors").is_file()
