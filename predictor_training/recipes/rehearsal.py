"""One loop step of any recipe through its own `build`, under a memory rehearsal (tools/estimate_memory.py; docs/
memory.md § How a recipe is rehearsed).

A recipe is rehearsable when it has `build(args, env, policy, *, <inputs>, <seams>) -> RecipeParts` (what its
`main()` builds between the run start and the loop; in its entry script, or in recipes/<method>.py for an fvtools
method) and its entry script a `real_size` preset. `rehearse_recipe` builds it
with the Teacher made from its config (`load_teacher`, a seam every recipe has) and the `Plan`'s other keywords
(the data's stand-ins, the recipe's own seams), then runs `optimizer_steps` loop steps with every role due: the step
function on the plan's micro-batch, DDP's bucket views, each role's clip and AdamW (foreach, as on CUDA). Nothing in
the recipe is patched; the only patches are torch's and PEFT's moves of fake parameters. The FLOPs of each loop
step's step function (forward, backward and a checkpointed block's recompute; runtime/flop_count.py) go into the
report's notes (`step_flops`): what tools/measure_step_flops.py reads.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.flop_count import FlopCounter
from predictor_training.runtime.flags import parse_recipe_args
from predictor_training.runtime.loop import grad_norm_and_clip
from predictor_training.runtime.memory_rehearsal import (
    MemoryReport,
    PeakSegments,
    Rehearsal,
    module_to_unless_unchanged,
    peak_groups,
)
from predictor_training.runtime.memory_tracker import (
    DDPBuckets,
    fake_process_group,
    fsdp_storage_accounting,
    patched,
    use_foreach,
)
from predictor_training.runtime.precision import precision_policy
from predictor_training.runtime.recipe import RecipeParts
from predictor_training.teacher.source import preset_teacher_loader


@dataclass
class Plan:
    """What a rehearsal gives a recipe: the report's name, `build`'s keywords (beyond args, env, policy and
    load_teacher), the loader's micro-batch, and the loop step's options (the first role's DDP gradient buckets are
    counted when world_size > 1 and the role is DDP-synchronised: `Role.grad_sync`). sharded: FSDP2 over world_size
    ranks in a fake process group (per-rank figures). segments: `build` takes `mark` (the report names the part of the step where
    the peak is, notes["peak_in"]). Which loop step is rehearsed (e.g. the heaviest of a cadence): step, the loop
    step it is (the run state starts at step - 1: e.g. a monitor step), and updates, the updates every role has taken
    before it (their LR schedules advanced so far); due, the roles due at that step (None: every role; a cadence's
    other steps, e.g. dmd2's critic-only steps, name fewer). notes(parts): extra report notes."""

    name: str
    build: dict
    item: Callable[[], dict]
    sharded: bool = False
    segments: bool = False
    step: int = 1
    updates: int = 0
    due: frozenset[str] | None = None
    notes: Callable[[RecipeParts], dict] = lambda parts: {}  # noqa: E731


def recipe_flags(module: ModuleType, argv: list[str]) -> argparse.Namespace:
    """The recipe's flags at its `real_size` preset plus `argv`, without its file checks (nothing is read: a recipe
    without `build_parser` stops before them at --dry_run)."""
    if hasattr(module, "build_parser"):
        return parse_recipe_args(module.build_parser(), ["--preset", "real_size", *argv], module.PRESETS)
    flags = module.parse_args(["--preset", "real_size", *argv, "--dry_run", "unused"])
    return argparse.Namespace(**{**vars(flags), "dry_run": None})


def last_chunks(num_chunks: int, count: int, rank_generator, shared_generator) -> list[int]:
    """A `draw_chunks` seam: the clip's last `count` chunks (the most context: the worst draw for memory)."""
    return list(range(max(0, num_chunks - count), num_chunks))


def rehearse_recipe(build: Callable[..., RecipeParts], plan: Plan, *, precision: str, gradient_checkpointing: bool,
                    preset: str, world_size: int, optimizer_steps: int = 1, cuda_autocast: bool = True,
                    fake: bool = True) -> MemoryReport:
    """`optimizer_steps` loop steps of a recipe built by `build` (its `build` with the flags given:
    `partial(module.build, recipe_flags(script, argv))`; `precision` and `gradient_checkpointing`: those
    flags' values) with the Teacher of config `preset`. fake=False runs the same on real CPU tensors (tiny presets
    only: it allocates)."""
    sharded = plan.sharded and fake and world_size > 1
    with contextlib.ExitStack() as stack:
        if sharded:
            stack.enter_context(fake_process_group(world_size))
        rehearsal = stack.enter_context(Rehearsal(plan.name, cuda_autocast=cuda_autocast, fake=fake))
        stack.enter_context(fsdp_storage_accounting(rehearsal.tracker))
        # torch's and PEFT's own moves of fake parameters, skipped where they change nothing (the adapters are made
        # on their base layer's device, FP32 as they end)
        stack.enter_context(patched((torch.nn.Module, "to", module_to_unless_unchanged),
                                    (BaseTunerLayer, "_move_adapter_to_device_of_base_layer", lambda *a, **k: None)))
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # the recipe's log lines; stdout is the report
        env = DistEnv(rank=0, local_rank=0, world_size=world_size if sharded else 1, device=torch.device("cpu"),
                      backend="fake" if sharded else None, is_main=True)
        segments = PeakSegments(rehearsal.tracker)
        load_teacher = preset_teacher_loader(preset, on_load=lambda teacher: rehearsal.label_parameters([teacher]))
        parts = build(env, precision_policy(precision, env.device), load_teacher=load_teacher, **plan.build,
                      **({"mark": segments.mark} if plan.segments else {}))
        rehearsal.label_parameters(parts.models)
        for role in parts.roles:
            rehearsal.tracker.label(role.parameters, "parameters")  # adapters, FSDP2's shards
            use_foreach(role.optimizer)
            rehearsal.watch_gradients(role.parameters)
            if role.ema is not None and hasattr(role.ema, "shadow"):  # an FP32 EMA shadow: training state
                rehearsal.tracker.label(role.ema.shadow.values(), "optimizer_state")
        due = frozenset(role.name for role in parts.roles) if plan.due is None else plan.due
        unknown = sorted(due - {role.name for role in parts.roles})
        if unknown:
            raise ValueError(f"plan {plan.name!r}: due roles {unknown} are not among {[r.name for r in parts.roles]}")
        first = parts.roles[0]
        buckets = (DDPBuckets(first.parameters, rehearsal.tracker) if first.grad_sync == "ddp" and world_size > 1
                   and not plan.sharded and first.name in due else None)
        parts.run_state.global_step = plan.step - 1
        for role in parts.roles:
            for _ in range(plan.updates):
                role.lr_schedule.step()
        step_flops = []
        for step in range(1, optimizer_steps + 1):
            for role in parts.roles:
                role.zero_grad()
            with rehearsal.phase("forward"), FlopCounter() as flops:
                parts.step_fn(plan.item(), sync=True, due=due)
            step_flops.append(flops.summary())
            segments.mark("optimizer")
            optimizer_phase(rehearsal, [role for role in parts.roles if role.name in due], buckets, step)
            segments.mark("after the step")
            parts.run_state.global_step, parts.run_state.micro_step = step, parts.run_state.micro_step + 1
        rehearsal.notes["configuration"] = "; ".join([
            f"config {preset}", f"precision {precision}", "gradient checkpointing "
            f"{'on' if gradient_checkpointing else 'off'}",
            f"autocast rules {'CUDA (emulated)' if cuda_autocast else 'CPU'}",
            f"FSDP2 over {world_size} ranks (fake process group), per-rank figures" if sharded else
            f"DDP buckets {'counted' if buckets is not None else 'none'}"])
        rehearsal.notes["step_flops"] = step_flops  # one entry per loop step: forward, backward, total, by op
        rehearsal.notes.update(plan.notes(parts))
        rehearsal.notes.update({"peak_in": segments.at_peak} if plan.segments else {})
        rehearsal.notes.update(peak_groups=peak_groups(rehearsal.tracker),
                               live_after_step=rehearsal.tracker.live_by_category())
    return rehearsal.report()


def optimizer_phase(rehearsal: Rehearsal, roles, buckets: DDPBuckets | None, step: int) -> None:
    """The loop after the micro-batches: DDP's bucket views, each role's clip, then each role's AdamW + schedule."""
    if buckets is not None:
        buckets.adopt_gradients()  # the gradients are views of the buckets now
    else:  # FSDP2's sharded gradients are set by its reduce-scatter, not accumulated by autograd: label them here
        for role in roles:
            rehearsal.tracker.label([param.grad for param in role.parameters], "gradients")
    with rehearsal.phase("optimizer"):
        for role in roles:
            grad_norm_and_clip(role.parameters, role.grad_clip, step, role.name)
        for role in roles:
            role.step()
            rehearsal.label_optimizer(role.optimizer)
