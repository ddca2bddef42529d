"""Per-GPU memory of a recipe's training step at real size, without a GPU: the recipe's own `build` and step on fake
tensors (docs/memory.md).

    python tools/estimate_memory.py --recipe v4                          # 8.6B config, batch 16, 20 context frames
    python tools/estimate_memory.py --recipe v4 --context_frames 0 4 8 12 16 20 --json
    python tools/estimate_memory.py --recipe rollout --replace_steps 1,2,3 --context_mode incremental
    python tools/estimate_memory.py --recipe v4 --fit                    # largest batch on 80 GB / 141 GB cards
    python tools/estimate_memory.py --recipe kd --train full --world_size 8
    python tools/estimate_memory.py --recipe dmd2 --generator student --real_score model

One loop for every recipe (`rehearse`): the recipe's flags at its `real_size` preset (plus the rows' flags below),
then its `build(args, env, policy, ...)` - the Teacher built from its config (`--config`, no weights) in BF16, the
trained models, optimizers, schedules and step function, exactly as its `main()` builds them - then one loop step
(`--optimizer_steps`) with every role due: the step function on a synthetic micro-batch at the largest shapes the
data gives (`data/synthetic.py`), DDP's gradient buckets (`--world_size` > 1), each role's clip and AdamW (foreach,
as on CUDA). All under FakeTensorMode with CUDA's autocast rules: nothing of real size is allocated
(predictor_training/runtime/memory_rehearsal.py says what is modelled and what is not). It prints the per-rank peak
by category, the phase where it happens, per-phase peaks and the 10 largest tensors alive at the peak; `--json`.

A rehearsal passes the recipe's `build` keywords instead of patching it: `load_teacher` (the Teacher from its
config), the data's stand-ins, and what a recipe names as seams (the real score's LoRA file, the reward functions,
the chunk draw). `RECIPES` below is the whole list: a new recipe is rehearsable once it has `build`, a `real_size`
preset and a row here. The eval (`--recipe eval`) rehearses tools/eval_predictor.py's own rollout, inference only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from predictor_training.data.synthetic import clip_item, offline_batch, trajectory_row
from predictor_training.predictor.memory_cuts import CUTS, cuts_undone
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.schedule import Schedule
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import parse_recipe_args
from predictor_training.runtime.loop import _grad_norm_and_clip
from predictor_training.runtime.memory_rehearsal import (
    DDPBuckets,
    MemoryReport,
    Rehearsal,
    card_gib,
    fake_process_group,
    fsdp_storage_accounting,
    largest_batches,
    module_to_unless_unchanged,
    needed_gib,
    patched,
    peak_groups,
    real_values,
    use_foreach,
)
from predictor_training.runtime.precision import precision_policy
from predictor_training.teacher import flops
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.source import TeacherSource, preset_teacher_loader
from predictor_training.eval.rehearsal import rehearse_eval_rollout

CONTEXT_TIMESTEP = 14.0
MAX_CONTEXT_FRAMES = RolloutConfig.memory_frames  # the AR loop's memory window: no chunk sees more context
MAX_TEXT_TOKENS = 1000  # the pipeline's tokenizer_max_length (data/encoders.py)
UNUSED = TeacherSource(Path("unused"), None, "--teacher", None)  # no folder: `load_teacher` builds from --config
# The user's GPUs (seconds per micro-batch; train notes § 5 and § 8.10).
USER_SECONDS_PER_MICRO_BATCH = {"v4": 4.49, "disca": 1.66}


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--recipe", required=True, choices=[*RECIPES, "eval"], help="the recipe to rehearse")
    add("--config", default="worldplay_480p_i2v", help="Teacher preset (teacher/config.py; default %(default)s)")
    add("--batch_size", type=int, default=16, help="per-GPU batch of the offline recipes (v4, disca, adversarial)")
    add("--context_frames", type=int, nargs="+", default=[20],
        help=f"v4: context frames of the batch, multiples of 4 in 0..{MAX_CONTEXT_FRAMES} (default 20, the peak)")
    add("--source_blocks", type=lambda text: _ints(text, "--source_blocks", 2, ","), default=(1, 52),
        help="Predictor blocks (1,52)")
    add("--text_tokens", type=int, default=MAX_TEXT_TOKENS,
        help=f"text tokens of the longest case, 1..{MAX_TEXT_TOKENS} (the text encoder's limit; default 1000)")
    add("--latent_grid", type=lambda text: _ints(text.lower(), "--latent_grid", 2, "x"), default=(30, 52),
        help="latent HxW (480x832 -> 30x52)")
    add("--chunks", type=int, default=8, help="rollout, the fvtools methods, eval: chunks of one trajectory (8)")
    add("--replace_steps", type=lambda text: _ints(text, "--replace_steps", None, ","), default=(1, 2, 3),
        help="rollout, eval, adversarial --data rollout, dmd2 --generator predictor: Predictor steps (1,2,3)")
    add("--context_mode", choices=("exact", "incremental"), default="exact",
        help="rollout, eval: how each chunk's context K/V are built")
    add("--data", choices=("offline", "rollout"), default="offline",
        help="adversarial: its --data (offline pairs at --batch_size, or one F-P-P-P trajectory of --chunks)")
    add("--world_size", type=int, default=8,
        help="ranks (> 1: DDP's gradient buckets; df_sft / kd --train full: FSDP2's per-rank shard; default 8)")
    add("--train", choices=("lora", "full"), default="lora",
        help="df_sft, kd, dmd2 --generator student: a LoRA on the Teacher (default) or every parameter")
    add("--generator", choices=("predictor", "student"), default="predictor", help="dmd2: its --generator")
    add("--real_score", choices=("lora", "model", "teacher"), default="lora",
        help="dmd2: the kind of its --real_score (a df_sft LoRA file, a model folder, the raw Teacher)")
    add("--samples_per_group", type=int, default=None, help="nft: K samples per step (default: the recipe's)")
    add("--chunks_per_sample", type=int, default=None, help="nft: chunks trained per sample (default: the recipe's)")
    add("--optimizer_steps", type=int, default=1, help="optimizer steps (2 shows a step with AdamW moments)")
    add("--no_cuda_autocast", action="store_true", help="CPU autocast's own rules (for comparison)")
    add("--fit", action="store_true", help="v4, disca: also the largest per-GPU batch on 80 GB and 141 GB cards")
    add("--json", action="store_true", help="one JSON object per estimate")
    add("--undo_cuts", nargs="+", choices=CUTS, default=[],
        help="rehearse the code as the user measured it: these memory cuts undone (predictor/memory_cuts.py)")
    args = parser.parse_args(argv)
    checks = [(args.fit and args.recipe not in ("v4", "disca"), f"--fit: for v4 and disca only, not {args.recipe}"),
              (args.data != "offline" and args.recipe != "adversarial", f"--data {args.data}: an adversarial mode"),
              (args.batch_size < 1, f"--batch_size {args.batch_size}: expected >= 1"),
              (any(not 0 <= n <= MAX_CONTEXT_FRAMES or n % 4 for n in args.context_frames),
               f"--context_frames {args.context_frames}: expected multiples of 4 in 0..{MAX_CONTEXT_FRAMES}"),
              (not 1 <= args.text_tokens <= MAX_TEXT_TOKENS, f"--text_tokens {args.text_tokens}: expected 1..1000"),
              (args.chunks < 2, f"--chunks {args.chunks}: expected >= 2 (chunk 0 plus a trained chunk)"),
              (args.world_size < 1 or args.optimizer_steps < 1, "--world_size, --optimizer_steps: expected >= 1"),
              (not args.replace_steps or not all(1 <= s <= 3 for s in args.replace_steps),
               f"--replace_steps {args.replace_steps}: expected steps within 1..3")]
    for failed, message in checks:
        if failed:
            parser.error(message)
    return args


def _ints(text: str, flag: str, count: int | None, sep: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(sep))
    except ValueError:
        values = ()
    if not values or (count is not None and len(values) != count) or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected {count or 'some'} integers joined by {sep!r}")
    return values


# ---- the recipes -----------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What one rehearsal gives a recipe: its name, `build`'s keywords (beyond args, env, policy and load_teacher),
    the micro-batch, and the options of the loop step."""

    name: str
    build: dict
    item: Callable[[], dict]
    ddp: bool = True  # the first role is DDP-wrapped on a real job (its buckets counted when --world_size > 1)
    sharded: bool = False  # FSDP2 over --world_size ranks in a fake process group
    notes: Callable[[SimpleNamespace], dict] = lambda parts: {}  # noqa: E731
    prepare: Callable[[SimpleNamespace], None] = lambda parts: None  # noqa: E731


@dataclass
class Row:
    module: str  # the recipe's entry module (its build_parser, PRESETS["real_size"], build)
    flags: Callable[[argparse.Namespace], list[str]]  # the rehearsal's flags in the recipe's own names
    plan: Callable[..., Plan]  # plan(args, flags, config, host, n_ctx)
    extra: dict = field(default_factory=dict)


def blocks(args) -> list[str]:
    return ["--source_blocks", ",".join(map(str, args.source_blocks))]


def steps(args) -> list[str]:
    return ["--replace_steps", ",".join(map(str, args.replace_steps))]


def letters(replace_steps) -> str:
    return "-".join(Schedule(tuple(replace_steps)).letters())


def offline_plan(variant: str):
    def plan(args, flags, config, host, n_ctx) -> Plan:
        context = f", {n_ctx} context frames" if variant == "v4" else ""
        return Plan(f"{variant} offline, blocks {list(args.source_blocks)}, batch {args.batch_size}{context}",
                    {"teacher_source": UNUSED, "context_timestep": CONTEXT_TIMESTEP},
                    partial(offline_batch, variant, config, batch_size=args.batch_size, n_ctx=n_ctx,
                            text_tokens=args.text_tokens, grid=args.latent_grid, source_blocks=args.source_blocks,
                            device=host),
                    notes=lambda parts: flop_notes(args, variant, n_ctx if variant == "v4" else None))
    return plan


def rollout_plan(args, flags, config, host, n_ctx) -> Plan:
    row, image_cond = trajectory_row(args.chunks, args.latent_grid, config.out_channels)
    case = case_kv(args, config, host) | {"image_cond": image_cond}  # the dataset's case, read into host memory
    policy = precision_policy(flags.precision, torch.device("cpu"))
    rollout_config = RolloutConfig(state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype,
                                   context_mode=args.context_mode)
    return Plan(f"rollout {letters(args.replace_steps)}, {args.chunks} chunks, context {args.context_mode}, blocks "
                f"{list(args.source_blocks)}, one trajectory",
                {"teacher_source": UNUSED, "dataset": SimpleNamespace(load_case=lambda case_id: case),
                 "rollout_config": rollout_config, "resuming": True},  # as on resume: --init_from is not read
                lambda: {**row, "case_id": "rehearsal", "key": ("rehearsal", 0)},
                notes=lambda parts: flop_notes(args, "rollout", None))


def case_kv(args, config, host) -> dict:
    """A case's stored text K/V of --text_tokens tokens for every double block (BF16), in `host` memory."""
    shape = (config.mm_double_blocks_depth, config.heads_num, args.text_tokens,
             config.hidden_size // config.heads_num)
    with torch.device(host):
        return {"text_k": torch.zeros(shape, dtype=torch.bfloat16), "text_v": torch.zeros(shape, dtype=torch.bfloat16)}


DATA = ["--dataset_root", "unused"]
RECIPES = {
    "v4": Row("train_predictor_v4", lambda a: [*DATA, *blocks(a), "--batch_size", str(a.batch_size)],
              offline_plan("v4")),
    "disca": Row("train_predictor_disca", lambda a: [*DATA, *blocks(a), "--batch_size", str(a.batch_size)],
                 offline_plan("disca")),
    "rollout": Row("train_predictor_v4_rollout",
                   lambda a: [*DATA, *blocks(a), *steps(a), "--context_mode", a.context_mode], rollout_plan),
}


# ---- one loop for every recipe ---------------------------------------------------------------------------------
def recipe_flags(module, argv: list[str]) -> argparse.Namespace:
    """The recipe's flags at its `real_size` preset plus `argv`, without its file checks (nothing is read here)."""
    return parse_recipe_args(module.build_parser(), ["--preset", "real_size", *argv], module.PRESETS)


def rehearse(args, recipe: str | None = None, *, fake: bool = True, host: str | None = None,
             n_ctx: int | None = None) -> MemoryReport:
    """`--optimizer_steps` loop steps of `recipe` (default --recipe) with every role due. fake=False runs the same on
    real CPU tensors (tiny configs only: it allocates). host: where the loader's batch lies before the step moves it
    to the device: "meta" (host memory, not counted; fake runs) or "cpu" (counted for the whole step)."""
    recipe = recipe or args.recipe
    row, module = RECIPES[recipe], importlib.import_module(RECIPES[recipe].module)
    flags = recipe_flags(module, row.flags(args))
    config = SimpleNamespace(**preset_config(args.config))
    plan = row.plan(args, flags, config, host or ("meta" if fake else "cpu"),
                    max(args.context_frames) if n_ctx is None else n_ctx)
    sharded = plan.sharded and fake and args.world_size > 1
    with contextlib.ExitStack() as stack:
        if sharded:
            stack.enter_context(fake_process_group(args.world_size))
        rehearsal = stack.enter_context(Rehearsal(plan.name, cuda_autocast=not args.no_cuda_autocast, fake=fake))
        stack.enter_context(fsdp_storage_accounting(rehearsal.tracker))
        stack.enter_context(patched((torch.nn.Module, "to", module_to_unless_unchanged)))  # torch's own move
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))  # the recipe's log lines: stdout is the report
        env = DistEnv(rank=0, local_rank=0, world_size=args.world_size if sharded else 1, device=torch.device("cpu"),
                      backend="fake" if sharded else None, is_main=True)
        policy = precision_policy(flags.precision, env.device)
        parts = module.build(flags, env, policy, load_teacher=preset_teacher_loader(
            args.config, on_load=lambda teacher: rehearsal.label_parameters([teacher])), **plan.build)
        rehearsal.label_parameters(parts.models)
        for role in parts.roles:
            rehearsal.tracker.label(role.parameters, "parameters")  # adapters, FSDP2's shards
            use_foreach(role.optimizer)
            rehearsal.watch_gradients(role.parameters)
            if role.ema is not None and hasattr(role.ema, "shadow"):  # an FP32 EMA shadow: training state
                rehearsal.tracker.label(role.ema.shadow.values(), "optimizer_state")
        buckets = (DDPBuckets(parts.roles[0].parameters, rehearsal.tracker)
                   if plan.ddp and args.world_size > 1 and not plan.sharded else None)
        plan.prepare(parts)
        due = frozenset(role.name for role in parts.roles)
        for step in range(1, args.optimizer_steps + 1):
            for role in parts.roles:
                role.zero_grad()
            with rehearsal.phase("forward"):
                parts.step_fn(plan.item(), sync=True, due=due)
            optimizer_phase(rehearsal, parts.roles, buckets, step)
            parts.run_state.global_step, parts.run_state.micro_step = step, parts.run_state.micro_step + 1
        rehearsal.notes["configuration"] = configuration(args, recipe, flags, plan.sharded)
        rehearsal.notes.update(plan.notes(parts))
        rehearsal.notes["peak_groups"] = peak_groups(rehearsal.tracker)
        rehearsal.notes["live_after_step"] = rehearsal.tracker.live_by_category()
    return rehearsal.report()


def optimizer_phase(rehearsal: Rehearsal, roles, buckets, step: int) -> None:
    """The loop after the micro-batches: DDP's bucket views, each role's clip, then each role's AdamW + schedule."""
    if buckets is not None:
        buckets.adopt_gradients()  # the gradients are views of the buckets now
    else:  # FSDP2's sharded gradients are set by its reduce-scatter, not accumulated by autograd: label them here
        for role in roles:
            rehearsal.tracker.label([param.grad for param in role.parameters], "gradients")
    with rehearsal.phase("optimizer"):
        for role in roles:
            _grad_norm_and_clip(role.parameters, role.grad_clip, step, role.name)
        for role in roles:
            role.step()
            rehearsal.label_optimizer(role.optimizer)


def configuration(args, recipe: str, flags, sharded: bool) -> str:
    parts = [f"config {args.config}", f"{flags.precision} (frozen bf16, trainable fp32, bf16 autocast)",
             f"gradient checkpointing {'on' if getattr(flags, 'gradient_checkpointing', True) else 'off'}",
             f"text {args.text_tokens} tokens", f"latents 4x{args.latent_grid[0]}x{args.latent_grid[1]} per chunk",
             f"autocast rules {'CPU' if args.no_cuda_autocast else 'CUDA (emulated)'}"]
    if recipe in ("v4", "disca", "rollout", "adversarial"):
        parts.append(f"DDP buckets {'counted' if args.world_size > 1 else 'none (1 rank)'}")
    if recipe == "rollout":
        parts.append(f"{args.chunks} chunks, replace_steps {list(args.replace_steps)}, context {args.context_mode}")
    if sharded:
        parts.append(f"FSDP2 over {args.world_size} ranks (fake process group), per-rank figures")
    return "; ".join(parts)


def flop_notes(args, recipe: str, context_frames: int | None) -> dict:
    shape = flops.TeacherShape.from_config(preset_config(args.config))
    count = partial(flops.recipe_micro_batch_flops, shape, recipe, tokens_per_frame=args.latent_grid[0] *
                    args.latent_grid[1], text_tokens=args.text_tokens, batch_size=args.batch_size, chunks=args.chunks,
                    replace_steps=args.replace_steps, context_mode=args.context_mode)
    notes = {"dit_tflops_per_micro_batch": round(count(context_frames=context_frames) / 1e12, 1),
             "seconds_at_40pct_of_989_tflops": round(flops.seconds_at(count(context_frames=context_frames), 0.4), 2)}
    if recipe in USER_SECONDS_PER_MICRO_BATCH and args.config == "worldplay_480p_i2v":
        measured = USER_SECONDS_PER_MICRO_BATCH[recipe]
        notes["user_seconds_per_micro_batch"] = measured
        notes["utilisation_implied_by_user_time"] = round(
            count(context_frames=None) / (measured * flops.PEAK_BF16_TFLOPS * 1e12), 3)
    return notes


def rehearse_eval(args, *, fake: bool = True) -> MemoryReport:
    """tools/eval_predictor.py's rollout (predictor_training/eval/rehearsal.py), inference only."""
    return rehearse_eval_rollout(args.config, chunks=args.chunks, grid=args.latent_grid, text_tokens=args.text_tokens,
                                 replace_steps=args.replace_steps, context_mode=args.context_mode,
                                 source_blocks=args.source_blocks, cuda_autocast=not args.no_cuda_autocast, fake=fake)


def estimate(args) -> list[MemoryReport]:
    with cuts_undone(args.undo_cuts):
        if args.recipe == "eval":
            return [rehearse_eval(args)]
        if args.recipe != "v4":
            return [rehearse(args)]
        # The undone pre-feature cut: the loop's batch stays on the device for the whole step, as the user's dict
        # kept it.
        host = "cpu" if "offline_prefeatures" in args.undo_cuts else None
        return [rehearse(args, host=host, n_ctx=n_ctx) for n_ctx in args.context_frames]


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    for report in estimate(args):
        print(json.dumps(report.to_json()) if args.json else report.format(), flush=True)
    if args.fit:
        n_ctx = max(args.context_frames) if args.recipe == "v4" else 0
        run = lambda batch: rehearse(argparse.Namespace(**{**vars(args), "batch_size": batch}), n_ctx=n_ctx)  # noqa
        for card, (batch, report) in largest_batches(run).items():
            line = {"recipe": args.recipe, "card_gb": card, "context_frames": n_ctx, "largest_batch": batch,
                    "needs_gib": round(needed_gib(report), 2), "card_gib": round(card_gib(card), 2)}
            print(json.dumps(line) if args.json else
                  f"{args.recipe}: largest per-GPU batch on a {card} GB card ({card_gib(card):.1f} GiB): {batch} "
                  f"(needs {needed_gib(report):.1f} GiB incl. margin and CUDA context)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
