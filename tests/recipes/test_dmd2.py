"""The DMD2 + Self-Forcing step and build of predictor_training/recipes/dmd2.py on tiny models (CPU, single process):
which roles each step trains, the one rollout shared by critic and generator, and the DMD gradient's sign and
normaliser at the generator's sample.

World: tests/helpers/method_world.py `write_dmd2_world` (the demo Teacher config, three procedural clips of 8 latents,
a v4 Predictor on blocks 1, 2 as `--init_from`, the Teacher folder as the real score); each step is built by the
recipe's own `build` from fvtools/train_dmd2.py's flags (`build_dmd2_step`). The script's own runs (cadence, resume,
checkpoints, 2 ranks, dry run, flags) are tested in tests/recipes/test_train_dmd2.py; the DMD losses and their sign on
1-D Gaussians in tests/methods/test_dmd2.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from predictor_training.data.video_latents import VideoLatentDataset
from predictor_training.methods.dmd2_models import FAKE
from predictor_training.methods.flow_matching import add_noise
from predictor_training.methods.score_models import ScoreClip
from tests.helpers.method_world import build_dmd2_step, write_dmd2_world


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: tiny models run faster on one thread


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    return write_dmd2_world(tmp_path_factory.mktemp("dmd2"))


def _frozen_grads(module: torch.nn.Module, trained: list) -> list[str]:
    """Names of parameters of `module` that are not in `trained` but hold a gradient."""
    trained_ids = {id(param) for param in trained}
    return [name for name, param in module.named_parameters()
            if id(param) not in trained_ids and param.grad is not None]


def _check_role_grads(role) -> None:
    grads = [param.grad for param in role.parameters if param.grad is not None]
    assert grads, f"{role.name}: no gradient"
    assert all(torch.isfinite(grad).all() for grad in grads), role.name
    assert sum(float(grad.abs().sum()) for grad in grads) > 0, f"{role.name}: zero gradients"


@pytest.mark.parametrize("extra", [
    ("--rollout", "self"),
    ("--rollout", "data", "--fake_score_train", "lora", "--lora_rank", "4", "--lora_alpha", "4"),
    ("--generator", "student", "--rollout", "data", "--train", "lora", "--lora_rank", "4", "--lora_alpha", "4",
     "--fake_score_train", "lora", "--real_score", "REAL_LORA", "--anchor_weight", "1"),
    ("--generator", "student", "--rollout", "self", "--train", "full", "--student_steps", "2"),
], ids=["predictor-self", "predictor-data-fake-lora", "student-lora-data", "student-full-self"])
def test_one_step_gives_gradients_only_to_the_trainable_roles(world, tmp_path, extra):
    extra = tuple(str(world["real_lora"]) if value == "REAL_LORA" else value for value in extra)
    args, step, generator_role, fake_role, teacher, real = build_dmd2_step(world, tmp_path, *extra)
    dataset = VideoLatentDataset(world["videos"], "train")
    # The fake score starts equal to the real score (a DMD gradient of 0): one critic update first, as a run has
    # before its first generator step.
    step(dataset[1], sync=True, due=frozenset({FAKE}))
    fake_role.step()
    fake_role.zero_grad()
    step.run_state.micro_step += 1
    metrics = step(dataset[0], sync=True, due=frozenset({generator_role.name, FAKE}))
    for key in ("critic_loss", "generator_loss", "dmd_loss", "dmd/grad_rms"):
        assert metrics[key] == metrics[key] and metrics[key] > 0, (key, metrics)
    if args.generator == "predictor":
        assert metrics["anchor_loss"] > 0  # the composite's Predictor-vs-Teacher loss
    elif args.anchor_weight > 0:
        assert metrics["anchor_loss"] == 0  # a fresh LoRA student is the Teacher: same x0 at the same state
    _check_role_grads(generator_role)
    _check_role_grads(fake_role)
    trained = generator_role.parameters + fake_role.parameters
    assert _frozen_grads(teacher, trained) == []  # the Teacher (and adapters on it that do not train)
    assert _frozen_grads(real.model, trained) == []  # the real score


def test_a_step_without_the_generator_trains_only_the_critic(world, tmp_path):
    _, step, generator_role, fake_role, _, _ = build_dmd2_step(world, tmp_path)
    metrics = step(VideoLatentDataset(world["videos"], "train")[0], sync=True, due=frozenset({FAKE}))
    assert generator_role.parameters_with_grad() == []  # its rollout ran without a graph
    _check_role_grads(fake_role)
    assert "generator_loss" not in metrics and metrics["loss"] == metrics["critic_loss"]


def test_critic_and_generator_use_the_one_rollout(world, tmp_path):
    """Per step the composite is rolled out once (3 Predictor calls per chunk after chunk 0), and the critic's noisy
    input is exactly that rollout's chunk, as the generator handed it over, noised."""
    _, step, generator_role, _, _, _ = build_dmd2_step(world, tmp_path)
    calls = []
    hook = generator_role.raw_module.register_forward_hook(lambda *_: calls.append(1))
    step.trace = []
    step(VideoLatentDataset(world["videos"], "train")[0], sync=True, due=frozenset({"predictor", FAKE}))
    hook.remove()
    assert len(step.trace) == 1  # 8 latents: chunk 0 (Teacher) + 1 generated chunk
    assert len(calls) == 3  # F-P-P-P: one rollout, not a second one for the critic
    for trace in step.trace:
        sample = trace["generator_sample"].detach()
        assert torch.equal(trace["sample"], sample)
        expected = add_noise(sample, trace["critic_noise"], trace["critic_sigma"][None])
        assert torch.equal(trace["critic_input"], expected)


# ---- the DMD gradient reaches the generator through its own output, with the right roles and signs -------------
def _critic_update(step, fake_role, item) -> None:
    """One critic update (the fake score starts equal to the real score: a DMD gradient of 0), as a run has before
    its first generator step; grads cleared, the micro-step advanced."""
    step(item, sync=True, due=frozenset({FAKE}))
    fake_role.step()
    fake_role.zero_grad()
    step.run_state.micro_step += 1


def _generator_grads(step, roles, item) -> tuple[dict, list[torch.Tensor]]:
    """(metrics, the generator's gradients) of one step with every role due, from zeroed gradients; the weights are
    not stepped, so a second call with the same micro-step repeats the same draws."""
    generator_role = roles[0]
    for role in roles:
        role.zero_grad()
    metrics = step(item, sync=True, due=frozenset(role.name for role in roles))
    return metrics, [torch.zeros_like(param) if param.grad is None else param.grad.clone()
                     for param in generator_role.parameters]


def test_dmd_reaches_the_predictor_when_the_chunk_ends_on_a_full_step(world, tmp_path):
    """F-P-P-F (--replace_steps 1,2): the trajectory detaches the latent at the Full step 3, so the composite's final
    latent has no graph; the sample is recomputed through the (frozen) Teacher's step 3. The Predictor's gradient
    with DMD differs from the one without (the fake score still equal to the real one: g = 0), DMD alone
    (--anchor_weight 0) back-propagates, and the Teacher gets no gradient."""
    args, step, generator_role, fake_role, teacher, real = build_dmd2_step(world, tmp_path, "--replace_steps", "1,2")
    dataset = VideoLatentDataset(world["videos"], "train")
    roles = (generator_role, fake_role)
    step.run_state.micro_step = 1  # the draws of the steps with DMD below
    metrics, without_dmd = _generator_grads(step, roles, dataset[0])
    assert metrics["dmd/grad_rms"] == 0 and metrics["anchor_loss"] > 0
    step.run_state.micro_step = 0
    fake_role.zero_grad()
    _critic_update(step, fake_role, dataset[1])
    metrics, with_dmd = _generator_grads(step, roles, dataset[0])
    assert metrics["dmd/grad_rms"] > 0 and metrics["anchor_loss"] > 0
    assert _frozen_grads(teacher, generator_role.parameters + fake_role.parameters) == []
    difference = sum(float((a - b).abs().sum()) for a, b in zip(with_dmd, without_dmd))
    assert difference > 1e-6 * sum(float(grad.abs().sum()) for grad in without_dmd), difference
    step.args.anchor_weight = 0.0  # DMD alone: a graph to back-propagate (it crashed: "does not require grad")
    metrics, dmd_only = _generator_grads(step, roles, dataset[0])
    assert "anchor_loss" in metrics and metrics["generator_loss"] == metrics["dmd_loss"]
    scale = max(float(grad.abs().max()) for grad in with_dmd)
    for grad, expected in zip(dmd_only, (a - b for a, b in zip(with_dmd, without_dmd))):
        torch.testing.assert_close(grad, expected, rtol=1e-3, atol=1e-5 * scale)
    assert all(torch.isfinite(grad).all() for grad in dmd_only)


class RecordedScore:
    """A score as the step calls it (`build(wrap_score=...)`): its clips append every velocity / x0 call to
    `calls` as (method, score label, noisy input, output)."""

    def __init__(self, score, calls: list):
        self.score, self.calls, self.label = score, calls, score.label

    def clip(self, *args, **kwargs) -> "RecordedClip":
        return RecordedClip(self.score.clip(*args, **kwargs), self.label, self.calls)


class RecordedClip:
    def __init__(self, clip: ScoreClip, label: str, calls: list):
        self.clip, self.label, self.calls = clip, label, calls

    def copy_history(self, history, chunk_index):
        self.clip.copy_history(history, chunk_index)

    def velocity(self, chunk_index, noisy, sigma):
        return self._record("velocity", noisy, self.clip.velocity(chunk_index, noisy, sigma))

    def x0(self, chunk_index, noisy, sigma):
        return self._record("x0", noisy, self.clip.x0(chunk_index, noisy, sigma))

    def _record(self, method, noisy, out):
        self.calls.append((method, self.label, noisy.detach().clone(), out.detach().clone()))
        return out


def _recorded_step(world, tmp_path, *extra):
    """(score calls, step, generator role, fake role): a dmd2 step whose score calls are recorded."""
    calls = []
    _, step, generator_role, fake_role, _, _ = build_dmd2_step(
        world, tmp_path, *extra, wrap_score=lambda score: RecordedScore(score, calls))
    return calls, step, generator_role, fake_role


@pytest.mark.parametrize("replace_steps,truth_weight", [("1,2,3", 0.0), ("1,2", 0.0), ("1,2,3", 0.5)],
                         ids=["F-P-P-P", "F-P-P-F", "F-P-P-P-truth"])
def test_the_generator_sample_gets_the_dmd_gradient_of_fake_minus_real(world, tmp_path, replace_steps, truth_weight):
    """The gradient the generator's sample receives is exactly (x0_fake - x0_real) / mean|x̂ - x0_real| / numel per
    chunk (DMD2's sign and normaliser), with x0_fake from the fake score and x0_real from the real score at the same
    noisy input, plus --truth_weight x 2 (x̂ - the clip's latents of that chunk) / numel: swapping the scores,
    flipping a sign, letting the critic's loss reach the sample or regressing onto the wrong frames breaks it."""
    calls, step, generator_role, fake_role = _recorded_step(world, tmp_path, "--replace_steps", replace_steps,
                                                            "--truth_weight", str(truth_weight))
    dataset = VideoLatentDataset(world["videos"], "train")
    _critic_update(step, fake_role, dataset[1])
    calls.clear()
    step.trace = []
    step(dataset[0], sync=True, due=frozenset({generator_role.name, FAKE}))
    x0_calls = {label: (noisy, out) for method, label, noisy, out in calls if method == "x0"}
    assert len([call for call in calls if call[0] == "x0"]) == 2 and sorted(x0_calls) == ["fake_score", "real_score"]
    (real_input, x0_real), (fake_input, x0_fake) = x0_calls["real_score"], x0_calls["fake_score"]
    assert torch.equal(real_input, fake_input)  # one noisy input for both scores
    (trace,) = step.trace
    sample, generator_sample = trace["sample"], trace["generator_sample"]
    assert torch.equal(generator_sample.detach(), sample)
    assert not torch.equal(x0_fake, x0_real)
    expected = (x0_fake - x0_real) / (sample - x0_real).abs().mean() / sample.numel()
    if truth_weight:
        frames = slice(4 * trace["chunk"], 4 * trace["chunk"] + 4)
        truth = dataset[0]["latents"][None, :, frames].float()
        expected = expected + truth_weight * 2 * (sample - truth) / sample.numel()
        assert float((truth_weight * 2 * (sample - truth)).abs().max()) > 10 * float((x0_fake - x0_real).abs().max()
                                                                                  / (sample - x0_real).abs().mean())
    torch.testing.assert_close(generator_sample.grad, expected, rtol=1e-4, atol=1e-5 * float(expected.abs().max()))


def test_the_critic_regresses_the_fake_score_onto_noise_minus_sample(world, tmp_path):
    """The critic's loss is flow matching of the FAKE score's velocity at the noised sample onto noise - x̂
    (`critic_loss(velocity, noise, sample)`), on every step, due generator or not."""
    calls, step, generator_role, _ = _recorded_step(world, tmp_path)
    item = VideoLatentDataset(world["videos"], "train")[0]
    for due in (frozenset({FAKE}), frozenset({generator_role.name, FAKE})):
        calls.clear()
        step.trace = []
        metrics = step(item, sync=True, due=due)
        (trace,) = step.trace
        velocity_calls = [call for call in calls if call[0] == "velocity" and torch.equal(call[2],
                                                                                          trace["critic_input"])]
        assert [label for _, label, _, _ in velocity_calls] == ["fake_score"]
        assert torch.equal(trace["sample"], trace["generator_sample"].detach())
        target = trace["critic_noise"] - trace["sample"]
        velocity = velocity_calls[0][3]
        assert metrics["critic_loss"] == pytest.approx(float(((velocity - target) ** 2).mean()), rel=1e-6)


def test_roles_real_frozen_fake_every_step_generator_at_its_cadence(world, tmp_path):
    """The real score is frozen (no parameter requires grad or sits in an optimizer) for a model-folder and a LoRA
    real score; the fake score is due every step; the generator every --generator_every steps, its schedule and EMA
    counted in its own updates."""
    for extra in ((), ("--real_score", str(world["real_lora"]), "--fake_score_train", "lora", "--lora_rank", "4",
                       "--lora_alpha", "4")):
        args, _, generator_role, fake_role, teacher, real = build_dmd2_step(
            world, tmp_path, "--generator_every", "3", "--ema_start_step", "7", *extra)
        trained = {id(param) for role in (generator_role, fake_role) for param in role.parameters}
        real_parameters = ([param for name, param in real.model.named_parameters() if ".real_score" in name]
                           if real.adapter_name else list(real.model.parameters()))
        assert real_parameters and not any(param.requires_grad for param in real_parameters)
        assert not any(id(param) in trained for param in real_parameters)
        assert fake_role.every == 1 and all(fake_role.is_due(step) for step in range(1, 7))
        assert generator_role.every == 3 and [generator_role.is_due(s) for s in range(1, 7)] == [0, 0, 1, 0, 0, 1]
        assert generator_role.lr_schedule.max_steps == args.max_steps // 3
        assert generator_role.ema.decay == 0.99 and generator_role.ema.start_update == 7 // 3
        assert fake_role.ema is None


def test_the_generator_loss_is_applied_only_when_due(world, tmp_path):
    """Not due: its rollout runs without a graph and the DMD loss is never formed (no score's x0 asked for); due:
    once per chunk."""
    calls, step, generator_role, _ = _recorded_step(world, tmp_path)
    item = VideoLatentDataset(world["videos"], "train")[0]
    step.trace = []
    metrics = step(item, sync=True, due=frozenset({FAKE}))
    (trace,) = step.trace
    assert [call for call in calls if call[0] == "x0"] == [] and "generator_loss" not in metrics
    assert not trace["generator_sample"].requires_grad and generator_role.parameters_with_grad() == []
    calls.clear()
    step.trace = []
    metrics = step(item, sync=True, due=frozenset({generator_role.name, FAKE}))
    (trace,) = step.trace
    assert sorted(label for method, label, _, _ in calls if method == "x0") == ["fake_score", "real_score"]
    assert "generator_loss" in metrics and trace["generator_sample"].requires_grad
    assert generator_role.parameters_with_grad() != []
