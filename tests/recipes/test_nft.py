"""The DiffusionNFT step and build of predictor_training/recipes/nft.py on tiny models (CPU, single process): one
real step trains only the policy and moves the old policy by its decay, each sample is trained with its own
advantage on the sampler's sigma grid, and sampling is regenerated from its counters.

Data: the video-latent demo of tests/helpers/method_world.py; the step is built by the recipe's own `build` from
fvtools/train_nft.py's flags (`nft_argv`). The script's own runs (flags, resume, 2 ranks, validation) are tested in
tests/recipes/test_train_nft.py; the NFT loss itself and the rewards in tests/methods/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fvtools.train_nft as nft
import predictor_training.recipes.nft as nft_recipe
from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.methods.nft import nft_objective, sampler_sigma_grid
from predictor_training.methods.rewards import default_vae_folder
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.precision import precision_policy
from tests.helpers.method_world import nft_argv, write_method_world


CPU = torch.device("cpu")
ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=CPU, backend=None, is_main=True)
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_method_world(tmp_path_factory.mktemp("nft"))


def _step(world, tmp_path, *extra: str, **seams):
    """(the NFT step, the policy's method model, the policy models) from the recipe's own `build`; `seams`: its
    keywords."""
    args = nft.parse_args(nft_argv(world, tmp_path / "step", *extra))
    parts = nft_recipe.build(args, ENV, precision_policy("fp32", CPU),
                             vae_folder=default_vae_folder(args.dataset_root), **seams)
    return parts.step_fn, parts.objects["method_model"], parts.step_fn.models


@pytest.mark.parametrize("train", ["lora", "full"])
def test_one_step_trains_only_the_policy(world, tmp_path, train):
    step, method_model, models = _step(world, tmp_path, "--train", train, "--kl_weight", "1.0")
    item = VideoLatentDataset(world["videos"], "train")[0]
    policy_params = {id(param) for param in method_model.role.parameters}
    frozen = {(id(module), name): param.detach().clone() for module in set(models.modules.values())
              for name, param in module.named_parameters() if id(param) not in policy_params}
    frozen_old = {name: param.detach().clone() for name, param in models.old_module.named_parameters()}
    method_model.role.zero_grad()
    metrics = step(item, sync=True, due=frozenset({nft_recipe.ROLE}))
    named = dict(method_model.role.raw_module.named_parameters())
    without = [name for name, param in named.items() if param.grad is None]
    last = len(method_model.model.double_blocks) - 1  # the last block's text-stream output feeds nothing
    assert all(name.startswith(f"double_blocks.{last}.txt_") for name in without), without
    grads = [param.grad for param in named.values() if param.grad is not None]
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert sum(float(grad.abs().sum()) for grad in grads) > 0  # policy == old policy, yet a non-zero update
    for module in set(models.modules.values()):  # no gradient outside the policy: old policy, reference, base
        assert all(param.grad is None for param in module.parameters() if id(param) not in policy_params)
    assert all(torch.equal(param, frozen[id(module), name]) for module in set(models.modules.values())
               for name, param in module.named_parameters() if id(param) not in policy_params)
    assert metrics["advantage/abs_mean"] > 0 and metrics["kl"] == 0  # policy == reference before any update
    assert metrics["monitor/std_ratio"] == 1.0  # step 1: policy == reference, the same noise
    method_model.role.step()  # optimizer step, then old <- d old + (1 - d) policy (ramp_slow: d = 0.001)
    for name, param in models.old_module.named_parameters():
        policy_param = dict(method_model.role.raw_module.named_parameters())[name]
        torch.testing.assert_close(param, 0.001 * frozen_old[name] + 0.999 * policy_param.detach(), rtol=0,
                                   atol=1e-7)


def test_step_trains_each_sample_with_its_own_advantage_on_the_sampler_grid(world, tmp_path):
    """The rewards [0, 1] of a group of two: the objective sees sample 0 with A = -0.5/(0.5 + 1e-4) and sample 1 with
    +0.5/(0.5 + 1e-4) (not negated, not swapped), each chunk at one of the sampler's sigmas."""
    seen = []

    def recorded_objective(v_policy, v_old, v_reference, x_t, x0, t, advantage, **kwargs):
        seen.append((float(t), float(advantage), x0.detach().clone()))
        return nft_objective(v_policy, v_old, v_reference, x_t, x0, t, advantage, **kwargs)

    def ranked_rewards(videos, item):  # sample k scores k
        return {"total": torch.arange(videos.shape[0], dtype=torch.float32)}

    step, _, _ = _step(world, tmp_path, objective=recorded_objective,
                       make_rewards=lambda args, vae_folder, device: ranked_rewards)
    item = VideoLatentDataset(world["videos"], "train")[0]
    samples = step.sample(item, "old", range(2))
    step(item, sync=True, due=frozenset({nft_recipe.ROLE}))
    assert len(seen) == 2  # one chunk per sample
    expected = 0.5 / (0.5 + 1e-4)
    assert [advantage for _, advantage, _ in seen] == pytest.approx([-expected, expected])
    grid = set(sampler_sigma_grid(4, 5.0).tolist())
    assert all(sigma in grid for sigma, _, _ in seen)
    for index, (_, _, x0) in enumerate(seen):  # the objective's x0 is a chunk of sample `index`
        chunk = x0.shape[2]
        assert any(torch.equal(x0.cpu(), samples[index:index + 1, :, start:start + chunk])
                   for start in range(0, samples.shape[2], chunk))


def test_sampling_is_regenerated_from_its_counters(world, tmp_path):
    step, _, _ = _step(world, tmp_path)
    item = VideoLatentDataset(world["videos"], "train")[0]
    first = step.sample(item, "old", range(2))
    assert not torch.equal(first[0], first[1])  # the samples of a group differ
    assert torch.equal(step.sample(item, "old", range(2)), first)  # the same counters: the same samples
    step.run_state.micro_step = 1
    assert not torch.equal(step.sample(item, "old", range(2)), first)
