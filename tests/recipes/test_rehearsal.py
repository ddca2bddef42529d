"""One loop step of any recipe through its own build, under the memory rehearsal
(predictor_training/recipes/rehearsal.py): a toy recipe whose sizes are known, so the figures can be checked."""

from __future__ import annotations

import argparse
from functools import partial
from types import SimpleNamespace

import pytest
import torch

import fvtools.train_df_sft as df_sft
import train_predictor_v4
from predictor_training.recipes.rehearsal import Plan, last_chunks, recipe_flags, rehearse_recipe
from predictor_training.runtime.checkpoint import RunState
from predictor_training.runtime.optim import WarmupCosineSchedule, build_optimizer
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.runtime.roles import Role

WIDTH, BATCH = 256, 64


def toy_recipe(calls: list, grad_sync: str = "ddp"):
    """A recipe module with one role: a bias-free Linear(WIDTH, WIDTH) in FP32, AdamW, a squared-output loss; its
    step records the loop step and the role's updates it runs at."""
    def build(args, env, policy, *, load_teacher, scale, mark=None):
        calls.append(("build", scale, env.world_size))
        model = torch.nn.Linear(WIDTH, WIDTH, bias=False)
        optimizer = build_optimizer({"toy": list(model.parameters())}, {"toy": 1e-3}, betas=(0.9, 0.999),
                                    weight_decay=0.01)
        schedule = WarmupCosineSchedule(optimizer, warmup_steps=0, max_steps=100)
        role = Role("toy", model, optimizer, schedule, module=model, grad_sync=grad_sync)
        run_state = RunState()

        def step_fn(item, *, sync, due):
            calls.append(("step", sorted(due), run_state.global_step + 1, role.updates))
            if mark is not None:
                mark("toy forward")
            (model(item["x"]) * scale).square().mean().backward()
            return {}
        return RecipeParts(roles=[role], step_fn=step_fn, models=[model], run_state=run_state)
    return SimpleNamespace(build=build)


def rehearse_toy(calls, **plan_options):
    flags = argparse.Namespace(precision="fp32")
    plan = Plan("toy", {"scale": 2.0}, lambda: {"x": torch.zeros(BATCH, WIDTH)}, **plan_options)
    return rehearse_recipe(partial(toy_recipe(calls).build, flags), plan, precision="fp32",
                           gradient_checkpointing=True, preset="tiny", world_size=1)


def test_the_loop_step_counts_parameters_gradients_and_adamw_state():
    """One step with every role due, at the plan's loop step after its updates: the build gets the plan's keywords
    and a 1-rank env; the parameters, their gradient and AdamW's two moments are each WIDTH^2 FP32 at the end."""
    calls = []
    report = rehearse_toy(calls, step=10, updates=3)
    assert calls == [("build", 2.0, 1), ("step", ["toy"], 10, 3)]
    weight = WIDTH * WIDTH * 4
    live = report.notes["live_after_step"]
    assert live["parameters"] == weight and live["gradients"] == weight
    assert live["optimizer_state"] >= 2 * weight
    assert report.peak >= 4 * weight and report.peak_phase in ("optimizer", "backward")
    assert "DDP buckets none" in report.notes["configuration"]


def test_the_step_flops_are_recorded_by_hand():
    """The toy step's FLOPs: forward x @ W^T, 2 x BATCH x WIDTH^2; backward only the weight gradient (x needs none),
    the same again."""
    report = rehearse_toy([])
    (flops,) = report.notes["step_flops"]
    assert flops["forward"] == flops["backward"] == 2 * BATCH * WIDTH * WIDTH
    assert flops["total"] == 4 * BATCH * WIDTH * WIDTH and flops["uncounted"] == {}


def test_a_plan_names_the_roles_due():
    """due: the step gets those roles as due and only they take an optimizer step; a role the recipe lacks is an
    error."""
    calls = []
    report = rehearse_toy(calls, due=frozenset())
    assert calls[1] == ("step", [], 1, 0)
    assert report.notes["live_after_step"]["optimizer_state"] == 0  # AdamW never stepped: no moments
    with pytest.raises(ValueError, match="due roles \\['critic'\\]"):
        rehearse_toy([], due=frozenset({"critic"}))


def test_ddp_buckets_and_the_peak_part():
    """world_size > 1 with a DDP-synchronised first role counts one FP32 bucket of its parameters (an all-reduced
    role none); a build that takes `mark` gets the rehearsal's, and the report names the part where the peak was
    reached."""
    flags = argparse.Namespace(precision="fp32")
    plan = Plan("toy", {"scale": 1.0}, lambda: {"x": torch.zeros(BATCH, WIDTH)}, segments=True)
    report = rehearse_recipe(partial(toy_recipe([]).build, flags), plan, precision="fp32",
                             gradient_checkpointing=True, preset="tiny", world_size=8)
    assert report.notes["live_after_step"]["ddp_buckets"] == WIDTH * WIDTH * 4
    assert report.notes["peak_in"] in ("toy forward", "optimizer")
    assert "DDP buckets counted" in report.notes["configuration"]
    all_reduced = rehearse_recipe(partial(toy_recipe([], grad_sync="all_reduce").build, flags), plan, precision="fp32",
                                  gradient_checkpointing=True, preset="tiny", world_size=8)
    assert all_reduced.notes["live_after_step"]["ddp_buckets"] == 0
    assert "DDP buckets none" in all_reduced.notes["configuration"]


def test_recipe_flags_start_from_the_real_size_preset():
    """The recipe's own flags at its real_size preset, without its file checks (no dataset here); a recipe without
    build_parser is parsed up to --dry_run."""
    flags = recipe_flags(train_predictor_v4, ["--dataset_root", "unused", "--batch_size", "3"])
    assert (flags.source_blocks, flags.precision, flags.batch_size) == ((1, 52), "fp32master", 3)
    flags = recipe_flags(df_sft, ["--train", "full"])
    assert (flags.train, flags.precision, flags.dry_run) == ("full", "fp32master", None)


@pytest.mark.parametrize("chunks, count, expected", [(8, 2, [6, 7]), (3, 5, [0, 1, 2]), (4, 0, [])])
def test_last_chunks_is_the_most_context(chunks, count, expected):
    assert last_chunks(chunks, count, None, None) == expected
