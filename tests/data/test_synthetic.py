"""The synthetic dataset and step inputs (predictor_training/data/synthetic.py) that the reader tests, the memory
rehearsal and the benchmarks read: what is written is what is returned, byte for byte the same for a seed, in the
builder's layout with per-tensor checksums; the damage and old-manifest helpers; the turning camera; the context
indices; the LoRA file's stand-in."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from predictor_training.data.shards import TENSOR_CHECKSUM_FIELD, read_jsonl
from predictor_training.data.synthetic import (
    FRAMES_PER_CHUNK,
    SyntheticSpec,
    context_indices,
    damage_tensor,
    lora_file_stand_in,
    strip_tensor_checksums,
    tensor_byte_range,
    trajectory_row,
    turning_camera_row,
    write_synthetic_dataset,
)

SPEC = SyntheticSpec(cases={"c000": "train", "c001": "holdout25"}, actions=(0, 2), num_chunks=3)


def files(root) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_what_is_written_is_what_is_returned_and_the_same_for_a_seed(tmp_path):
    written = write_synthetic_dataset(tmp_path / "a", SPEC)
    assert sorted(written) == ["cases/c000.safetensors", "cases/c001.safetensors",
                               "trajectories/c000__a0.safetensors", "trajectories/c000__a2.safetensors",
                               "trajectories/c001__a0.safetensors", "trajectories/c001__a2.safetensors"]
    for name, tensors in written.items():
        stored = load_file(tmp_path / "a" / name)
        assert stored.keys() == tensors.keys() and all(torch.equal(stored[key], tensors[key]) for key in tensors)
    write_synthetic_dataset(tmp_path / "b", SPEC)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    write_synthetic_dataset(tmp_path / "c", SyntheticSpec(**{**SPEC.__dict__, "seed": 1}))
    assert files(tmp_path / "c")["cases/c000.safetensors"] != files(tmp_path / "a")["cases/c000.safetensors"]


def test_the_layout_config_and_manifest_of_the_builder(tmp_path):
    written = write_synthetic_dataset(tmp_path, SPEC)
    config = json.loads((tmp_path / "dataset_config.json").read_text())
    assert config["num_latents"] == 3 * FRAMES_PER_CHUNK == SPEC.num_latents and config["num_chunks"] == 3
    assert config["splits"] == ["holdout25", "train"] and config["prefeature_layers"] == [0, 2]
    entries = read_jsonl(tmp_path / "manifest.jsonl")
    assert [entry["file"] for entry in entries] == list(written)  # case, then its trajectories, case by case
    assert {entry["split"] for entry in entries if entry["case_id"] == "c001"} == {"holdout25"}
    assert all(set(entry[TENSOR_CHECKSUM_FIELD]) == set(written[entry["file"]]) for entry in entries)
    trajectory = written["trajectories/c000__a0.safetensors"]
    assert trajectory["chunk0.step0.latent_in"].shape == (SPEC.channels, FRAMES_PER_CHUNK, SPEC.height, SPEC.width)
    assert trajectory["chunk2.step3.final_hidden"].shape == (SPEC.tokens_per_chunk, SPEC.hidden)
    assert "chunk0.ctx_indices" not in trajectory and trajectory["chunk1.ctx_indices"].tolist() == [0, 1, 2, 3]
    assert trajectory["chunk2.ctx_prefeature.layer2"].shape == (8 * SPEC.height * SPEC.width, SPEC.hidden)
    assert written["cases/c001.safetensors"]["text_k"].shape[2] == 5  # text lengths differ between cases
    cases_only = write_synthetic_dataset(tmp_path / "cases_only", SyntheticSpec(with_trajectories=False))
    assert all(name.startswith("cases/") for name in cases_only)


def test_damage_changes_only_the_tensor_and_an_old_manifest_has_no_checksums(tmp_path):
    write_synthetic_dataset(tmp_path, SPEC)
    path = tmp_path / "trajectories/c000__a2.safetensors"
    before = path.read_bytes()
    start, end = damage_tensor(path, "chunk1.step2.velocity", num_bytes=16)
    assert (start, end) == (tensor_byte_range(path, "chunk1.step2.velocity")[0],
                            tensor_byte_range(path, "chunk1.step2.velocity")[0] + 16)
    after = path.read_bytes()
    assert len(after) == len(before) and after[:start] == before[:start] and after[end:] == before[end:]
    assert all(a != b for a, b in zip(after[start:end], before[start:end]))  # every damaged byte changed
    strip_tensor_checksums(tmp_path)
    assert all(TENSOR_CHECKSUM_FIELD not in entry for entry in read_jsonl(tmp_path / "manifest.jsonl"))


def test_context_indices_keep_frame_zero_and_respect_the_cap():
    generator = torch.Generator().manual_seed(0)
    assert context_indices(2, 8, generator).tolist() == list(range(8))  # 8 earlier frames fit the cap
    drawn = [context_indices(5, 8, torch.Generator().manual_seed(seed)) for seed in range(40)]
    for capped in drawn:  # frame 0, then 7 distinct later frames of the 20 before chunk 5, ascending
        assert capped.numel() == 8 and capped[0] == 0 and bool((capped[1:] > 0).all())
        assert capped.tolist() == sorted(set(capped.tolist())) and int(capped.max()) < 5 * FRAMES_PER_CHUNK
    assert {int(index) for capped in drawn for index in capped[1:]} == set(range(1, 20))  # every one can be drawn


def test_the_turning_camera_turns_and_steps_back():
    row = turning_camera_row(9, seed=3, turn=1.0, step_back=0.5)
    assert row["seed"] == 3 and row["viewmats"].dtype == torch.float64 and row["action"].tolist() == [0] * 9
    rotation = row["viewmats"][:, :3, :3]
    assert torch.allclose(rotation @ rotation.transpose(1, 2), torch.eye(3, dtype=torch.float64).expand(9, 3, 3))
    angles = torch.atan2(row["viewmats"][:, 0, 2], row["viewmats"][:, 0, 0])
    assert torch.allclose(angles, torch.linspace(0, 1.0, 9, dtype=torch.float64))
    assert torch.allclose(row["viewmats"][:, 2, 3], -0.5 * torch.arange(9, dtype=torch.float64))
    chunks_row, condition = trajectory_row(2, (2, 3), 4)
    assert chunks_row["viewmats"].shape == (8, 4, 4) and condition.shape == (1, 4, 1, 2, 3)
    assert not condition.any()
    _, drawn = trajectory_row(2, (2, 3), 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(drawn, torch.randn(1, 4, 1, 2, 3, generator=torch.Generator().manual_seed(0)))


def test_the_lora_file_stand_in_adds_a_fresh_adapter_of_the_files_shape():
    """`load_lora`'s signature, no file read: the adapter has the given rank and alpha, frozen unless trainable."""
    from predictor_training.teacher import WorldPlayTransformer
    from predictor_training.teacher.adapters import adapter_spec, lora_parameters

    teacher = WorldPlayTransformer.from_preset("tiny")
    load = lora_file_stand_in(2, 4.0)
    load(teacher, "no/such/file.safetensors", "real")
    load(teacher, "no/such/file.safetensors", "fake", trainable=True)
    assert (adapter_spec(teacher, "real").rank, adapter_spec(teacher, "real").alpha) == (2, 4.0)
    assert not any(param.requires_grad for param in lora_parameters(teacher, "real"))
    assert all(param.requires_grad for param in lora_parameters(teacher, "fake"))
