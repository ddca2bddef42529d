"""PairDataset / collate_pairs against a synthetic dataset written in the data.md layout."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from predictor_training.data.pair_dataset import PairDataset, collate_pairs
from predictor_training.data.samplers import BucketBatchSampler
from predictor_training.data.synthetic import (
    FRAMES_PER_CHUNK,
    SyntheticSpec,
    write_synthetic_dataset,
)


SPEC = SyntheticSpec()
SOURCE_LAYERS = (2, 0)  # deliberately not ascending: the item must keep this order


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    written = write_synthetic_dataset(root, SPEC)
    return root, written


def trajectory_tensors(written, case_id, action_id):
    return written[f"trajectories/{case_id}__a{action_id}.safetensors"]


def test_item_fields_equal_the_stored_tensors(dataset_dir):
    root, written = dataset_dir
    dataset = PairDataset(root, "train", source_layers=SOURCE_LAYERS)
    C = SPEC.channels
    for index in range(len(dataset)):
        item = dataset[index]
        stored = trajectory_tensors(written, item["case_id"], item["action_id"])
        case = written[f"cases/{item['case_id']}.safetensors"]
        c, k, j = item["chunk"], item["step"], item["anchor_step"]
        frames = slice(4 * c, 4 * c + 4)
        assert k == j + 1 and (j, k) in dataset.pairs
        assert torch.equal(item["noisy_input"][:C], stored[f"chunk{c}.step{k}.latent_in"])
        assert item["timestep"].item() == stored["timesteps"][k].item()
        assert torch.equal(item["action"], stored["action"][frames])
        assert torch.equal(item["viewmats"], stored["viewmats"][frames])
        assert torch.equal(item["Ks"], stored["Ks"][frames])
        assert torch.equal(item["anchor_hidden"], stored[f"chunk{c}.step{j}.final_hidden"])
        assert torch.equal(item["target_hidden"], stored[f"chunk{c}.step{k}.final_hidden"])
        assert torch.equal(item["target_velocity"], stored[f"chunk{c}.step{k}.velocity"])
        assert torch.equal(item["prev_chunk_hidden"], stored[f"chunk{c - 1}.step{k}.final_hidden"])
        indices = stored[f"chunk{c}.ctx_indices"]
        assert item["n_ctx"] == indices.numel() == dataset.n_ctx_of(index)
        assert list(item["ctx_prefeatures"]) == list(SOURCE_LAYERS)
        for layer in SOURCE_LAYERS:
            assert torch.equal(item["ctx_prefeatures"][layer], stored[f"chunk{c}.ctx_prefeature.layer{layer}"])
        assert torch.equal(item["ctx_action"], stored["action"][indices])
        assert torch.equal(item["ctx_viewmats"], stored["viewmats"][indices])
        assert torch.equal(item["ctx_Ks"], stored["Ks"][indices])
        assert torch.equal(item["text_k"], case["text_k"][list(SOURCE_LAYERS)])
        assert torch.equal(item["text_v"], case["text_v"][list(SOURCE_LAYERS)])


def test_shapes_of_an_item(dataset_dir):
    root, _ = dataset_dir
    item = PairDataset(root, "train", source_layers=SOURCE_LAYERS)[0]
    C, H, W, D, N = SPEC.channels, SPEC.height, SPEC.width, SPEC.hidden, SPEC.tokens_per_chunk
    n = item["n_ctx"]
    assert item["noisy_input"].shape == (2 * C + 1, FRAMES_PER_CHUNK, H, W)
    assert item["timestep"].shape == () and item["timestep"].dtype == torch.float32
    assert item["anchor_hidden"].shape == item["target_hidden"].shape == item["prev_chunk_hidden"].shape == (N, D)
    assert item["target_velocity"].shape == (C, FRAMES_PER_CHUNK, H, W)
    assert all(t.shape == (n * H * W, D) for t in item["ctx_prefeatures"].values())
    assert item["ctx_viewmats"].shape == (n, 4, 4) and item["ctx_Ks"].shape == (n, 3, 3)
    assert item["text_k"].shape[:2] == (2, SPEC.heads) and item["text_k"].shape[-1] == SPEC.head_dim


def test_chunk_zero_only_without_context_and_previous_chunk(dataset_dir):
    root, _ = dataset_dir
    trajectories = sum(split == "train" for split in SPEC.cases.values()) * len(SPEC.actions)
    pairs = 3
    for prefeatures, previous in [(True, True), (True, False), (False, True)]:
        dataset = PairDataset(root, "train", with_prefeatures=prefeatures, with_prev_chunk_hidden=previous,
                              source_layers=SOURCE_LAYERS)
        assert len(dataset) == trajectories * (SPEC.num_chunks - 1) * pairs
        assert {ref.chunk for ref in dataset.refs} == set(range(1, SPEC.num_chunks))
    disca = PairDataset(root, "train", with_prefeatures=False, with_prev_chunk_hidden=False, source_layers=(0, 1))
    assert len(disca) == trajectories * SPEC.num_chunks * pairs
    item = disca[0]
    assert item["chunk"] == 0
    assert not {"prev_chunk_hidden", "ctx_prefeatures", "ctx_action", "n_ctx"} & set(item)
    upstream_disca = PairDataset(root, "train", with_prefeatures=False, with_prev_chunk_hidden=False,
                                 source_layers=(0, 1), include_chunk0=False)
    assert len(upstream_disca) == trajectories * (SPEC.num_chunks - 1) * pairs
    assert upstream_disca[0]["chunk"] == 1
    with pytest.raises(ValueError, match="include_chunk0=True needs"):
        PairDataset(root, "train", source_layers=SOURCE_LAYERS, include_chunk0=True)


def test_condition_channels_are_rebuilt(dataset_dir):
    root, written = dataset_dir
    dataset = PairDataset(root, "train", with_prefeatures=False, with_prev_chunk_hidden=False, source_layers=(0, 1))
    C = SPEC.channels
    seen_chunks = set()
    for index in range(len(dataset)):
        item = dataset[index]
        cond, mask = item["noisy_input"][C : 2 * C], item["noisy_input"][2 * C]
        seen_chunks.add(item["chunk"])
        if item["chunk"] == 0:
            image_cond = written[f"cases/{item['case_id']}.safetensors"]["image_cond"][0, :, 0]
            assert torch.equal(cond[:, 0], image_cond)
            assert torch.all(mask[0] == 1)
            assert torch.all(cond[:, 1:] == 0) and torch.all(mask[1:] == 0)
        else:
            assert torch.all(cond == 0) and torch.all(mask == 0)
    assert seen_chunks == set(range(SPEC.num_chunks))


def test_split_selects_its_trajectories(dataset_dir):
    root, _ = dataset_dir
    holdout = PairDataset(root, "holdout25", source_layers=SOURCE_LAYERS)
    expected = {case for case, split in SPEC.cases.items() if split == "holdout25"}
    assert {holdout.key_of(i)[0] for i in range(len(holdout))} == expected
    with pytest.raises(ValueError, match="no trajectory of split 'nope'"):
        PairDataset(root, "nope", source_layers=SOURCE_LAYERS)


def test_n_ctx_reads_no_tensor(tmp_path):
    """The context sizes come from the index alone: with every trajectory's tensor file emptied they still read."""
    written = write_synthetic_dataset(tmp_path, SPEC)
    dataset = PairDataset(tmp_path, "train", source_layers=SOURCE_LAYERS)
    for tensor_file in (tmp_path / "trajectories").glob("*.safetensors"):
        tensor_file.write_bytes(b"")
    expected = []
    for ref in dataset.refs:
        trajectory = dataset.trajectories[ref.trajectory]
        stored = trajectory_tensors(written, trajectory.case_id, trajectory.action_id)
        expected.append(stored[f"chunk{ref.chunk}.ctx_indices"].numel())
    assert dataset.n_ctx_list() == expected
    assert len(set(expected)) > 1  # the fixture has more than one bucket
    with pytest.raises(ValueError, match="damaged or not a .safetensors file"):  # a tensor read now fails
        dataset[0]


def test_collate_pads_text_and_builds_mask(dataset_dir):
    root, written = dataset_dir
    dataset = PairDataset(root, "train", source_layers=SOURCE_LAYERS)
    # one item per train case with the same n_ctx, so text lengths differ
    picks = {}
    for index in range(len(dataset)):
        case_id = dataset.key_of(index)[0]
        if dataset.n_ctx_of(index) == 4 and case_id not in picks:
            picks[case_id] = index
    items = [dataset[index] for index in picks.values()]
    lengths = [item["text_k"].shape[-2] for item in items]
    assert len(set(lengths)) == len(items) > 1
    batch = collate_pairs(items)
    B, longest = len(items), max(lengths)
    assert batch["text_k"].shape == (B, 2, SPEC.heads, longest, SPEC.head_dim)
    assert batch["text_mask"].shape == (B, longest) and batch["text_mask"].dtype == torch.bool
    for row, (item, length) in enumerate(zip(items, lengths)):
        assert batch["text_mask"][row].tolist() == [True] * length + [False] * (longest - length)
        assert torch.equal(batch["text_k"][row, :, :, :length], item["text_k"])
        assert torch.equal(batch["text_v"][row, :, :, :length], item["text_v"])
        assert torch.all(batch["text_k"][row, :, :, length:] == 0)
    assert batch["n_ctx"] == 4
    assert batch["noisy_input"].shape == (B, *items[0]["noisy_input"].shape)
    assert batch["ctx_prefeatures"][SOURCE_LAYERS[0]].shape == (B, *items[0]["ctx_prefeatures"][SOURCE_LAYERS[0]].shape)
    assert batch["case_id"] == list(picks)


def test_collate_refuses_mixed_n_ctx(dataset_dir):
    root, _ = dataset_dir
    dataset = PairDataset(root, "train", source_layers=SOURCE_LAYERS)
    by_n_ctx = {}
    for index in range(len(dataset)):
        by_n_ctx.setdefault(dataset.n_ctx_of(index), index)
    small, large = sorted(by_n_ctx)[:2]
    with pytest.raises(ValueError, match=rf"n_ctx values \[{small}, {large}\]"):
        collate_pairs([dataset[by_n_ctx[small]], dataset[by_n_ctx[large]]])
    # without context, mixed chunks batch fine
    disca = PairDataset(root, "train", with_prefeatures=False, with_prev_chunk_hidden=False, source_layers=(0, 1))
    batch = collate_pairs([disca[0], disca[len(disca) - 1]])
    assert "n_ctx" not in batch and batch["chunk"].tolist() == [0, SPEC.num_chunks - 1]


def test_source_layers_must_have_prefeatures(dataset_dir):
    root, _ = dataset_dir
    with pytest.raises(ValueError, match=r"prefeature_layers=\[0, 2\], without layer\(s\) \[1\]"):
        PairDataset(root, "train", source_layers=(0, 1))


def test_float_dtype_and_pickling(dataset_dir):
    root, _ = dataset_dir
    dataset = PairDataset(root, "train", source_layers=SOURCE_LAYERS, float_dtype=torch.float32)
    item = dataset[5]
    assert item["target_hidden"].dtype == torch.float32 and item["action"].dtype == torch.int64
    clone = pickle.loads(pickle.dumps(dataset))  # handles are open in this process; they must not travel
    assert torch.equal(clone[5]["target_hidden"], item["target_hidden"])


def test_dataloader_with_workers_and_buckets(dataset_dir):
    root, _ = dataset_dir
    dataset = PairDataset(root, "train", source_layers=SOURCE_LAYERS)
    sampler = BucketBatchSampler(dataset.n_ctx_list(), batch_size=3, num_replicas=1, rank=0, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_pairs, num_workers=2)
    seen = []
    for batch in loader:
        assert batch["noisy_input"].shape[0] == 3
        ids = (batch["action_id"].tolist(), batch["chunk"].tolist(), batch["step"].tolist())
        seen += list(zip(batch["case_id"], *ids))
    expected = [dataset.key_of(index) for batch in sampler for index in batch]
    assert seen == expected
