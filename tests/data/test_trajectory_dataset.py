"""TrajectoryTableDataset: sample-table rows + camera inputs; case tensors on demand; no teacher state read."""

from __future__ import annotations

import re
import shutil
import warnings
from dataclasses import replace

import pytest
import torch
from torch.utils.data import DistributedSampler

from predictor_training.data.manifest import UncheckedTensorsWarning
from predictor_training.data.sample_table import standard_pose_relpath
from predictor_training.data.shards import TensorChecksumError
from predictor_training.data.synthetic import (
    SyntheticSpec,
    damage_tensor,
    strip_tensor_checksums,
    write_synthetic_dataset,
    write_synthetic_sample_tables,
)
from predictor_training.data.trajectory_dataset import ENCODED_TENSORS, TrajectoryTableDataset
from predictor_training.rollout.camera import pose_to_input


TRAIN_CASES = [f"c{i:03d}" for i in range(12)]
HOLDOUT_CASES = ["h000", "h001"]


# 32 latents like the real tables; no trajectories/ folder at all: the rollout dataset must not need it
SPEC = SyntheticSpec(
    cases={**{c: "train" for c in TRAIN_CASES}, **{c: "holdout25" for c in HOLDOUT_CASES}},
    num_chunks=8,
    with_trajectories=False,
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout")
    written = write_synthetic_dataset(root / "dataset", SPEC)
    tables = write_synthetic_sample_tables(root / "samples", {"train": TRAIN_CASES, "holdout25": HOLDOUT_CASES})
    assert not (root / "dataset" / "trajectories").exists()
    return root, written, tables


def test_items_are_rows_with_camera_inputs(setup):
    root, _, tables = setup
    dataset = TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset")
    assert len(dataset) == len(TRAIN_CASES) * 4
    keys = dataset.keys()
    assert len(set(keys)) == len(keys)
    for index, key in enumerate(keys):
        item = dataset[index]
        assert item["key"] == key == (item["case_id"], item["action_id"])
        assert item["caption"] == f"caption of {item['case_id']}"
        viewmats, intrinsics, action = pose_to_input(root / "samples" / standard_pose_relpath(item["action_id"]), 32)
        assert item["viewmats"].shape == (32, 4, 4) and item["viewmats"].dtype == torch.float64
        assert torch.equal(item["viewmats"], viewmats)
        assert torch.equal(item["Ks"], intrinsics)
        assert torch.equal(item["action"], action)
    # items hand out copies: editing one must not change the next
    dataset[0]["viewmats"].zero_()
    assert not torch.all(dataset[0]["viewmats"] == 0)


def test_load_case_reads_the_case_file_only(setup):
    root, written, tables = setup
    dataset = TrajectoryTableDataset([tables["train"], tables["holdout25"]], dataset_root=root / "dataset")
    assert len(dataset) == (len(TRAIN_CASES) + len(HOLDOUT_CASES)) * 4
    case = dataset.load_case("h001")
    assert sorted(case) == ["image_cond", "text_k", "text_v"]
    for name, tensor in case.items():
        assert torch.equal(tensor, written["cases/h001.safetensors"][name])
    with pytest.raises(KeyError, match="'nope'"):
        dataset.load_case("nope")


def test_load_case_checks_every_tensor_against_the_manifest(setup, tmp_path):
    root, written, tables = setup
    copy = tmp_path / "dataset"
    shutil.copytree(root / "dataset", copy)
    victim = copy / "cases" / "c002.safetensors"
    damage_tensor(victim, "text_v", 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a current manifest: no warning
        dataset = TrajectoryTableDataset(tables["train"], dataset_root=copy)  # no verify: nothing hashed up front
    assert torch.equal(dataset.load_case("c001")["text_v"], written["cases/c001.safetensors"]["text_v"])
    pattern = rf"{re.escape(str(victim))}: tensor 'text_v': field 'tensor_crc32': expected [0-9a-f]{{8}}, found "
    for _ in range(2):
        with pytest.raises(TensorChecksumError, match=pattern):
            dataset.load_case("c002")

    strip_tensor_checksums(copy)  # as an older builder wrote it: loads, says so once, cannot check tensors
    with pytest.warns(UncheckedTensorsWarning, match="no per-tensor checksums") as caught:
        old = TrajectoryTableDataset(tables["train"], dataset_root=copy)
    assert len(caught) == 1
    assert sorted(old.load_case("c002")) == ["image_cond", "text_k", "text_v"]


def test_ranks_read_different_keys(setup):
    root, _, tables = setup
    dataset = TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset")
    seen = []
    for rank in range(8):
        sampler = DistributedSampler(dataset, num_replicas=8, rank=rank, shuffle=True, seed=0, drop_last=True)
        sampler.set_epoch(1)
        seen.append([dataset.keys()[index] for index in sampler])
    assert len({len(keys) for keys in seen}) == 1
    flat = [key for keys in seen for key in keys]
    assert len(flat) == len(set(flat)) == len(dataset)


def test_subset_cases_is_a_seeded_choice(setup):
    root, _, tables = setup
    first = TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset", subset_cases=8, subset_seed=0)
    again = TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset", subset_cases=8, subset_seed=0)
    other = TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset", subset_cases=8, subset_seed=1)
    assert first.keys() == again.keys()
    assert len(first.case_ids) == 8 and set(first.case_ids) <= set(TRAIN_CASES)
    assert first.case_ids != other.case_ids
    assert len(first) == 8 * 4  # every action of a chosen case stays
    named = TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset", subset_cases=["c003", "c007"])
    assert named.case_ids == ["c003", "c007"] and len(named) == 8
    with pytest.raises(ValueError, match="'zzz'"):
        TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset", subset_cases=["zzz"])
    with pytest.raises(ValueError, match="subset_cases=13"):
        TrajectoryTableDataset(tables["train"], dataset_root=root / "dataset", subset_cases=13)


def test_duplicate_keys_across_tables_are_refused(setup):
    root, _, tables = setup
    with pytest.raises(ValueError, match=r"\('c000', 0\).*train\.jsonl"):
        TrajectoryTableDataset([tables["train"], tables["train"]], dataset_root=root / "dataset")


def test_dataset_problems_are_named(setup, tmp_path):
    root, _, tables = setup
    short = tmp_path / "short"
    write_synthetic_dataset(short, replace(SPEC, num_chunks=4))
    with pytest.raises(ValueError, match="num_latents=16, this dataset was asked for num_latents=32"):
        TrajectoryTableDataset(tables["train"], dataset_root=short)
    with pytest.raises(ValueError, match=r"action0_forward\.json.*num_latents=16"):
        TrajectoryTableDataset(tables["train"], dataset_root=short, num_latents=16)  # the poses have 32
    partial = tmp_path / "partial"
    write_synthetic_dataset(partial, replace(SPEC, cases={"c000": "train"}))
    with pytest.raises(ValueError, match=r"no case entry for case_id\(s\) \['c001'"):
        TrajectoryTableDataset(tables["train"], dataset_root=partial)
    with pytest.raises(ValueError, match="exactly one case source"):
        TrajectoryTableDataset(tables["train"])


def test_encoded_dir_source(setup, tmp_path):
    root, _, tables = setup
    generator = torch.Generator().manual_seed(3)
    expected = {}
    for case_id in HOLDOUT_CASES:
        outputs = {name: torch.randn(1, 3, 2, generator=generator) for name in ENCODED_TENSORS}
        torch.save(outputs, tmp_path / f"{case_id}.pt")
        expected[case_id] = outputs
    dataset = TrajectoryTableDataset(tables["holdout25"], encoded_dir=tmp_path)
    loaded = dataset.load_case("h000")
    assert all(torch.equal(loaded[name], expected["h000"][name]) for name in ENCODED_TENSORS)
    broken = dict(expected["h001"])
    del broken["vision_states"]
    torch.save(broken, tmp_path / "h001.pt")
    with pytest.raises(KeyError, match=r"h001\.pt.*vision_states"):
        dataset.load_case("h001")
    (tmp_path / "h001.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"h001\.pt"):
        TrajectoryTableDataset(tables["holdout25"], encoded_dir=tmp_path)
