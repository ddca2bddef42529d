"""The offline step on stored pairs (predictor_training/predictor/pair_step.py) on the tiny offline dataset: v4's context
comes from the stored pre-features of its source layers through the frozen projector, disca has none; the step's
metrics are the loss of that forward, its gradients reach every trained parameter, the caller's batch keeps its
pre-features, and a role other than the Predictor is refused."""

from __future__ import annotations

import functools

import pytest
import torch

from predictor_training.data.pair_dataset import collate_pairs, disca_pair_dataset, v4_pair_dataset
from predictor_training.predictor.loss import predictor_loss
from predictor_training.predictor.model import build_predictor, text_kv_from_stacked
from predictor_training.predictor.pair_step import move_batch, pair_step, predict_pairs, predict_pairs_with_context
from predictor_training.runtime.precision import precision_policy
from predictor_training.teacher import WorldPlayTransformer
from tests.helpers.offline_dataset import write_tiny_dataset

CPU = torch.device("cpu")
POLICY = precision_policy("fp32", CPU)
SOURCE_BLOCKS = (0, 1)
PAIRS = ((0, 1), (1, 2))
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def dataset_root(tmp_path_factory):
    return write_tiny_dataset(tmp_path_factory.mktemp("pair_step"))


def trained_looking(predictor, seed: int = 3):
    """Random values in the zero-initialised output layers, so the Predictor is no longer plain hidden reuse."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in predictor.parameters():
            if param.requires_grad and not param.abs().sum() > 0:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return predictor


def setup(dataset_root, variant: str):
    teacher = WorldPlayTransformer.from_pretrained(str(dataset_root.parent / "teacher")).eval().requires_grad_(False)
    torch.manual_seed(0)
    predictor = trained_looking(build_predictor(teacher, variant, SOURCE_BLOCKS))
    if variant == "v4":
        dataset = v4_pair_dataset(dataset_root, split="train", pairs=PAIRS, source_layers=SOURCE_BLOCKS)
    else:
        dataset = disca_pair_dataset(dataset_root, split="train", pairs=PAIRS, source_layers=SOURCE_BLOCKS,
                                     include_chunk0=False)
    n_ctx = dataset.n_ctx_list()
    indices = [index for index, count in enumerate(n_ctx) if count == max(n_ctx)][:2]  # one context length
    return predictor, collate_pairs([dataset[index] for index in indices])


def test_the_v4_context_is_built_from_the_stored_prefeatures(dataset_root):
    predictor, batch = setup(dataset_root, "v4")
    assert batch["n_ctx"] > 0 and sorted(batch["ctx_prefeatures"]) == list(SOURCE_BLOCKS)
    hidden, velocity, context = predict_pairs_with_context(batch, model=predictor, predictor=predictor,
                                                           policy=POLICY, context_timestep=14.0)
    assert context.num_layers == len(SOURCE_BLOCKS) and context.num_frames == batch["n_ctx"]
    size, _, frames, height, width = batch["noisy_input"].shape
    assert hidden.shape[:2] == (size, frames * height * width) and hidden.dtype == torch.float32
    assert velocity.shape == batch["target_velocity"].shape
    # the same forward with the context of other pre-features predicts something else
    other = {**batch, "ctx_prefeatures": {layer: torch.randn_like(tensor)
                                          for layer, tensor in batch["ctx_prefeatures"].items()}}
    other_hidden, _ = predict_pairs(other, model=predictor, predictor=predictor, policy=POLICY, context_timestep=14.0)
    assert not torch.allclose(other_hidden, hidden)
    # and it is the projector's context at the dataset's context timestep
    ctx_timestep = torch.full((size, batch["n_ctx"]), 14.0)
    direct = predictor.context_from_prefeatures(batch["ctx_prefeatures"], ctx_timestep, batch["ctx_action"],
                                                batch["ctx_viewmats"], batch["ctx_Ks"], height=height, width=width)
    for mine, theirs in zip(context.layers, direct.layers):
        assert torch.equal(mine.stacked()[0], theirs.stacked()[0])
    text_kv = text_kv_from_stacked(batch["text_k"], batch["text_v"], batch["text_mask"])
    timestep = batch["timestep"][:, None].expand(size, frames)
    expected_hidden, expected_velocity = predictor(
        batch["noisy_input"], batch["anchor_hidden"], timestep, batch["action"], batch["viewmats"], batch["Ks"],
        text_kv, context=direct, prev_chunk_hidden=batch["prev_chunk_hidden"])
    assert torch.equal(hidden, expected_hidden) and torch.equal(velocity, expected_velocity)


def test_disca_has_no_context(dataset_root):
    predictor, batch = setup(dataset_root, "disca")
    assert "ctx_prefeatures" not in batch
    _, velocity, context = predict_pairs_with_context(batch, model=predictor, predictor=predictor, policy=POLICY,
                                                      context_timestep=14.0)
    assert context is None and velocity.shape == batch["target_velocity"].shape


def test_the_step_returns_its_loss_and_trains_every_parameter_of_the_predictor(dataset_root):
    predictor, batch = setup(dataset_root, "v4")
    with torch.no_grad():
        hidden, velocity = predict_pairs(batch, model=predictor, predictor=predictor, policy=POLICY,
                                         context_timestep=14.0)
        _, expected = predictor_loss(hidden, velocity, batch["target_hidden"], batch["target_velocity"],
                                     velocity_weight=1.0, hidden_weight=0.1)
    step = functools.partial(pair_step, model=predictor, predictor=predictor, policy=POLICY, context_timestep=14.0,
                             velocity_weight=1.0, hidden_weight=0.1)
    metrics = step(batch, sync=True, due=frozenset({"predictor"}))
    assert metrics == {name: float(value) for name, value in expected.items()}
    assert metrics["loss"] == pytest.approx(metrics["velocity_mse"] + 0.1 * metrics["hidden_mse"], rel=1e-6)
    assert all(param.requires_grad for param in predictor.parameters())  # the frozen Teacher parts are not its own
    assert all(param.grad is not None and bool(param.grad.abs().sum() > 0) for param in predictor.parameters())
    assert sorted(batch["ctx_prefeatures"]) == list(SOURCE_BLOCKS)  # released from the step's own copy only
    with pytest.raises(ValueError, match=r"trains the role 'predictor' every step; the loop says \['critic'\]"):
        step(batch, sync=True, due=frozenset({"critic"}))


def test_moving_a_batch_copies_the_dict_and_its_prefeatures():
    batch = {"x": torch.zeros(2), "ctx_prefeatures": {0: torch.ones(1)}, "n_ctx": 4}
    moved = move_batch(batch, CPU)
    assert moved is not batch and moved["ctx_prefeatures"] is not batch["ctx_prefeatures"]
    assert moved["n_ctx"] == 4 and torch.equal(moved["x"], batch["x"])
    del moved["ctx_prefeatures"]
    assert "ctx_prefeatures" in batch
