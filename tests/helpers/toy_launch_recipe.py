"""A tiny recipe that starts and ends exactly as the real ones do (runtime/launch.py), for the run-lock and
orphan tests: the ToyPredictor of ddp_toy_train.py, one optimizer step per `--step_seconds` at least.

    bash -c 'source tools/_launch_common.sh; launch_recipe tests/helpers/toy_launch_recipe.py --output_root OUT'

`TOY_PAUSE=N:FILE` in the environment (not a flag, so it is no part of the run's config and a continued run need
not repeat it) holds every rank in its step function after N steps of this process until FILE exists (at most
HOLD_SECONDS a step): a test can act on a live run at a known step (a second launch, kill -9) without sleeping
through the steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ddp_toy_train import ToyPairs, ToyPredictor, collate, toy_step  # noqa: E402

from predictor_training.data.batches import ResumableBatches  # noqa: E402
from predictor_training.runtime.distributed import wrap_ddp  # noqa: E402
from predictor_training.runtime.errors import CommandParser, command  # noqa: E402
from predictor_training.runtime.flags import add_run_args, add_tracker_args, parse_recipe_args  # noqa: E402
from predictor_training.runtime.launch import Launch, Recipe, RunPlan, run_recipe  # noqa: E402
from predictor_training.runtime.optim import TwoGroupLRSchedule, build_optimizer  # noqa: E402
from predictor_training.runtime.roles import Role  # noqa: E402
from predictor_training.runtime.recipe import RecipeData, RecipeParts  # noqa: E402
from predictor_training.runtime.run_directory import run_config  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__)
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--stop_at_step", type=int, default=-1)
    parser.add_argument("--grad_accum", type=int, default=1)
    parser.add_argument("--step_seconds", type=float, default=0.0, help="sleep this long in every step")
    add_run_args(parser, experiment="toy", precision="fp32", ckpt_every=1, keep_last=2, log_every=1, seed=0)
    add_tracker_args(parser, tracker="none", project="toy")
    return parse_recipe_args(parser, argv, {})


HOLD_SECONDS = 300  # a hold ends by itself after this long: a rank orphaned by a broken test still finishes


def pause_from_environment():
    """The hold of `TOY_PAUSE=N:FILE` (module docstring): a function to call before every step (a no-op unset)."""
    setting = os.environ.get("TOY_PAUSE")
    if not setting:
        return lambda: None
    after, release = setting.split(":", 1)
    calls = [0]

    def pause() -> None:
        calls[0] += 1
        deadline = time.monotonic() + HOLD_SECONDS
        while calls[0] > int(after) and not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)

    return pause


def slow_step(batch, *, step_seconds: float, pause, **kwargs):
    pause()
    time.sleep(step_seconds)
    return toy_step(batch, **kwargs)


def toy_data(launch: Launch) -> RecipeData:
    env = launch.env
    dataset = ToyPairs()
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0,
                                 drop_last=True)
    return RecipeData(ResumableBatches(sampler, dataset, collate, batch_size=4, seed=launch.args.seed), dataset)


def toy_build(launch: Launch) -> RecipeParts:
    torch.manual_seed(0)
    model = ToyPredictor()
    groups = {"fusion": list(model.fusion.parameters()), "blocks": list(model.blocks.parameters())}
    optimizer = build_optimizer(groups, {"fusion": 1e-2, "blocks": 1e-3}, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = TwoGroupLRSchedule(optimizer, warmup_steps=1, max_steps=launch.args.max_steps, block_warmup_steps=None)
    ddp_model = wrap_ddp(model, launch.env)
    role = Role("predictor", model, optimizer, schedule, module=ddp_model, grad_clip=1.0)
    step_fn = partial(slow_step, step_seconds=launch.args.step_seconds, pause=pause_from_environment(),
                      ddp_model=ddp_model, seen_indices=[], device=launch.env.device)
    return RecipeParts(roles=[role], step_fn=step_fn, models=[model])


TOY = Recipe(
    plan=lambda args: RunPlan(meta={"recipe": "toy", "precision": args.precision},
                              naming=lambda args, **_: "toy_run"),
    data=toy_data,
    build=toy_build,
    summarize=lambda launch: run_config(launch.args, run_name=launch.start.run_name),
)


@command
def main(argv=None) -> int:
    return run_recipe(parse_args(argv), TOY)


if __name__ == "__main__":
    sys.exit(main())
