"""The DisCa-style adversarial step and build of predictor_training/recipes/adversarial.py on the tiny offline
dataset of tests/helpers/offline_dataset.py (CPU, one process), built by the recipe's own `build` from
fvtools/train_adversarial.py's flags.

Covered: one real step puts finite, non-zero gradients only where each loss may reach (the discriminator's loss
nothing in the Predictor, the generator term nothing in the discriminator, the frozen Teacher blocks inside the
Predictor nothing at all); the discriminator sees every hidden on the BF16 grid of the stored reals; no R1 pass off
its cadence. The script's own runs are tested in tests/recipes/test_train_adversarial.py, the discriminator's toy
separation in tests/methods/test_adversarial.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fvtools.train_adversarial as adversarial
import predictor_training.recipes.adversarial as adversarial_recipe
from predictor_training.data.dataset_config import resolve_teacher_source
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.precision import precision_policy
from predictor_training.runtime.recipe import RecipeParts
from tests.helpers.offline_dataset import adversarial_args, write_tiny_dataset


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    return write_tiny_dataset(tmp_path_factory.mktemp("adversarial"))


def built(argv: list[str]) -> tuple[RecipeParts, dict]:
    """The recipe's parts from its own `build` on these flags (one CPU process, as main() builds them) and the first
    micro-batch of its data."""
    args = adversarial.parse_args(argv)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
    policy = precision_policy(args.precision, env.device)
    data = adversarial.build_data(args, env, policy)
    parts = adversarial_recipe.build(args, env, policy, context_timestep=data.context_timestep,
                                     teacher_source=resolve_teacher_source(args.teacher, args.action_ckpt,
                                                                           args.dataset_root))
    return parts, next(data.batches)


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if param.grad is None else param.grad.clone() for name, param in module.named_parameters()}


def test_one_step_gives_gradients_only_where_each_loss_may_reach(tiny_dataset, tmp_path):
    recipe, batch = built(adversarial_args(tiny_dataset, tmp_path / "run", "--adv_weight", "0.5",
                                           "--adv_warmup_steps", "0", "--r1_every", "1"))
    predictor_role, discriminator_role = recipe.roles
    predictor, discriminator = predictor_role.raw_module, discriminator_role.raw_module
    step_fn = recipe.step_fn
    both, predictor_only = frozenset({"predictor", "discriminator"}), frozenset({"predictor"})
    trained = {name for name, param in predictor.named_parameters() if param.requires_grad}
    assert trained == set(grads(predictor))
    parts = predictor.teacher_frozen  # the Teacher modules the Predictor runs (embeddings, final layer, projector)
    frozen = [param for module in (parts.img_in, parts.time_in, parts.action_in, parts.final_layer,
                                   *parts.context_blocks) for param in module.parameters()]
    assert frozen and not any(param.requires_grad for param in frozen)

    def run(due):
        for role in recipe.roles:
            role.zero_grad()
        metrics = step_fn(batch, sync=True, due=due)
        return metrics, grads(predictor), grads(discriminator)

    metrics, with_d_predictor, with_d_discriminator = run(both)
    assert metrics["adversarial/weight"] == 0.5 and metrics["discriminator/r1_applied"] == 1.0
    assert metrics["loss"] == pytest.approx(metrics["regression_loss"] + 0.5 * metrics["adversarial/generator_loss"])
    # Finite, non-zero gradients in both trained roles; none in the frozen Teacher blocks.
    assert all(param.grad is None for param in frozen)
    for name in trained:
        assert with_d_predictor[name] is not None and torch.isfinite(with_d_predictor[name]).all(), name
    assert sum(float(with_d_predictor[name].abs().sum()) for name in trained) > 0
    for name, grad in with_d_discriminator.items():
        assert grad is not None and torch.isfinite(grad).all(), name
    # (head.bias may get exactly 0: inside the hinge margins its two terms cancel)
    assert all(with_d_discriminator[name].abs().sum() > 0 for name in ("token_in.weight", "head.weight"))

    # The discriminator's loss gives nothing to the Predictor: its gradients are the same without the D update.
    _, alone_predictor, alone_discriminator = run(predictor_only)
    assert all(grad is None for grad in alone_discriminator.values())  # not due: untouched by the generator term
    assert all(torch.equal(with_d_predictor[name], alone_predictor[name]) for name in trained)

    # The generator term gives nothing to the discriminator: D's gradients are the same without it ...
    step_fn.adversary.adv_weight = 0.0
    metrics, regression_predictor, regression_discriminator = run(both)
    assert metrics["adversarial/weight"] == 0.0
    assert all(torch.equal(with_d_discriminator[name], regression_discriminator[name]) for name in with_d_discriminator)
    # ... while it does reach the Predictor.
    assert any(not torch.equal(with_d_predictor[name], regression_predictor[name]) for name in trained)


def test_discriminator_sees_the_fake_on_the_reals_grid(tiny_dataset, tmp_path):
    """The stored real hiddens are BF16, the Predictor's are FP32: every hidden the discriminator is shown (real,
    fake in its own loss, fake in the generator term) is on the BF16 grid, while the generator term still reaches
    the Predictor (test_one_step_gives_gradients_only_where_each_loss_may_reach)."""
    recipe, batch = built(adversarial_args(tiny_dataset, tmp_path / "run", "--adv_weight", "0.5",
                                           "--adv_warmup_steps", "0", "--r1_every", "1"))
    predictor, discriminator = (role.raw_module for role in recipe.roles)
    step_fn = recipe.step_fn
    assert batch["target_hidden"].dtype == torch.bfloat16
    with torch.no_grad():  # a trained-looking head: pred_hidden = anchor + head(x) leaves the BF16 grid
        head = predictor.residual_head.fc2
        head.weight.copy_(1e-3 * torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(0)))
    pred_hiddens, shown = [], []
    predictor.register_forward_hook(lambda module, inputs, output: pred_hiddens.append(output[0].detach().clone()))
    discriminator.register_forward_pre_hook(lambda module, inputs: shown.append(inputs[0].detach().clone()))
    for role in recipe.roles:
        role.zero_grad()
    step_fn(batch, sync=True, due=frozenset({"predictor", "discriminator"}))
    (pred_hidden,) = pred_hiddens
    assert not torch.equal(pred_hidden, pred_hidden.bfloat16().float())  # the raw fake is off the grid
    assert len(shown) == 4  # generator term, D(real), D(fake), R1 on real
    assert all(torch.equal(hidden, hidden.bfloat16().float()) for hidden in shown)
    assert torch.equal(shown[0], pred_hidden.bfloat16().float())  # the generator term's fake, rounded
    assert torch.equal(shown[2], pred_hidden.bfloat16().float())  # D's fake, rounded
    assert all(param.grad is not None for param in head.parameters())  # the term still reaches the Predictor

def test_no_r1_pass_off_its_cadence(tiny_dataset, tmp_path):
    """R1 every 2nd D update: the update on the cadence shows D four inputs (generator term, D(real), D(fake), R1 on
    real), the next one three - no R1 pass is computed where none is applied."""
    recipe, batch = built(adversarial_args(tiny_dataset, tmp_path / "run", "--adv_weight", "0.5",
                                           "--adv_warmup_steps", "0", "--r1_every", "2"))
    shown = []
    recipe.roles[1].raw_module.register_forward_pre_hook(lambda module, inputs: shown.append(inputs[0]))
    applied, passes = [], []
    for _ in range(2):
        shown.clear()
        for role in recipe.roles:
            role.zero_grad()
        metrics = recipe.step_fn(batch, sync=True, due=frozenset({"predictor", "discriminator"}))
        applied.append(metrics["discriminator/r1_applied"])
        passes.append(len(shown))
        for role in recipe.roles:
            role.step()
    assert applied == [1.0, 0.0] and passes == [4, 3]
