"""Per-GPU memory of a recipe's training step at real size, without a GPU (docs/memory.md):

    python tools/estimate_memory.py --recipe v4 --context_frames 4 8 12 16 20 --json   # 8.6B config, batch 16
    python tools/estimate_memory.py --recipe rollout --replace_steps 1,2,3 --context_mode incremental
    python tools/estimate_memory.py --recipe rollout --reuse_steps 1,2 --replace_steps 3              # F-R-R-P
    python tools/estimate_memory.py --recipe kd --train full --world_size 8             # --fit: v4, disca

One loop for every recipe (predictor_training/recipes/rehearsal.py): the recipe's flags at its `real_size` preset,
its own `build` (the Teacher from --config, no weights, BF16), then one loop step with every role due on a synthetic
micro-batch at the data's largest shapes, under FakeTensorMode with CUDA's autocast rules (runtime/
memory_rehearsal.py: what is modelled): the per-rank peak by category, its phase, the largest tensors alive there.
A rehearsal passes `build` keywords (the Teacher loader, the data's stand-ins, the recipe's seams) and patches
nothing: a new recipe needs a `build`, a `real_size` preset and a row in RECIPES.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple, Sequence

import torch

from predictor_training.data.synthetic import case_text_kv, clip_item, lora_file_stand_in, offline_batch, trajectory_row
from predictor_training.eval.rehearsal import rehearse_eval_rollout
from predictor_training.methods.rewards import FixedRewards, parse_reward_weights
from predictor_training.predictor.memory_cuts import CUTS, cuts_undone
from predictor_training.recipes.flags import add_plan_args, check_plan
from predictor_training.recipes.rehearsal import Plan, last_chunks, recipe_flags, rehearse_recipe
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.rollout.scheduler import DISTILLED_SIGMA_FLOOR
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_check_only_arg, report_check_only
from predictor_training.runtime.memory_rehearsal import MemoryReport, card_gib, largest_batches, needed_gib
from predictor_training.runtime.precision import precision_policy
from predictor_training.teacher import flops
from predictor_training.teacher.config import preset_config
from predictor_training.teacher.source import TeacherSource

CONTEXT_TIMESTEP = 14.0
MAX_CONTEXT_FRAMES = RolloutConfig.memory_frames  # the AR loop's memory window: no chunk sees more context
MAX_TEXT_TOKENS = 1000  # the pipeline's tokenizer_max_length (data/encoders.py)
UNUSED = TeacherSource(Path("unused"), None, "--teacher", None)  # no folder: `load_teacher` builds from --config
# The user's GPUs (seconds per micro-batch; train notes § 5 and § 8.10).
USER_SECONDS_PER_MICRO_BATCH = {"v4": 4.49, "disca": 1.66}


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--recipe", required=True, choices=[*RECIPES, "eval"], help="the recipe to rehearse (eval: its rollout)")
    add("--config", default="worldplay_480p_i2v", help="Teacher preset (teacher/config.py; default %(default)s)")
    add("--batch_size", type=int, default=16, help="per-GPU batch of v4, disca, adversarial (16)")
    add("--context_frames", type=int, nargs="+", default=[20], help="v4: context frames, multiples of 4 in 0..20 (20)")
    add("--source_blocks", type=lambda t: _ints(t, "--source_blocks", 2, ","), default=(1, 52), help="blocks (1,52)")
    add("--text_tokens", type=int, default=MAX_TEXT_TOKENS, help="text tokens, 1..1000 (the encoder's limit; 1000)")
    add("--latent_grid", type=lambda t: _ints(t.lower(), "--latent_grid", 2, "x"), default=(30, 52),
        help="latent HxW (480x832 -> 30x52)")
    add("--chunks", type=int, default=8, help="chunks of one trajectory or clip (8)")
    add_plan_args(parser, reuse=True,
                  note=" (rollout, eval, adversarial --data rollout, dmd2 --generator predictor; "
                  "--reuse_steps: rollout only, e.g. --reuse_steps 1,2 --replace_steps 3, its --preset frrp)")
    add("--context_mode", choices=("exact", "incremental"), default="exact", help="rollout, eval: context K/V")
    add("--data", choices=("offline", "rollout"), default="offline", help="adversarial: its --data")
    add("--world_size", type=int, default=8, help="ranks: DDP buckets if > 1; --train full: FSDP2's shard (8)")
    add("--train", choices=("lora", "full"), default="lora", help="df_sft, kd, dmd2 student: a LoRA or every parameter")
    add("--generator", choices=("predictor", "student"), default="predictor", help="dmd2: its --generator")
    add("--real_score", choices=("lora", "model", "teacher"), default="lora",
        help="dmd2: the kind of its --real_score (a df_sft LoRA file, a model folder, the raw Teacher)")
    add("--samples_per_group", type=int, default=None, help="nft: K samples per step (the recipe's)")
    add("--chunks_per_sample", type=int, default=None, help="nft: chunks trained per sample (the recipe's)")
    add("--optimizer_steps", type=int, default=1, help="loop steps (2: one with AdamW's moments present)")
    add("--no_cuda_autocast", action="store_true", help="CPU autocast's own rules (for comparison)")
    add("--fit", action="store_true", help="v4, disca: also the largest per-GPU batch on 80 GB and 141 GB cards")
    add("--json", action="store_true", help="one JSON object per estimate")
    add("--undo_cuts", nargs="+", choices=CUTS, default=[], help="these memory cuts undone (predictor/memory_cuts.py)")
    add_check_only_arg(parser, what="the rehearsals it would run (the recipe's own flags are parsed; nothing runs)")
    args = parser.parse_args(argv)
    check_plan(parser, args.plan)
    checks = [(args.fit and args.recipe not in ("v4", "disca"), f"--fit: for v4 and disca only, not {args.recipe}"),
              (args.data != "offline" and args.recipe != "adversarial", f"--data {args.data}: an adversarial mode"),
              (any(not 0 <= n <= MAX_CONTEXT_FRAMES or n % 4 for n in args.context_frames),
               f"--context_frames {' '.join(map(str, args.context_frames))}: expected multiples of 4 in 0..20"),
              (not 1 <= args.text_tokens <= MAX_TEXT_TOKENS, f"--text_tokens {args.text_tokens}: expected 1..1000"),
              (args.chunks < 2, f"--chunks {args.chunks}: expected >= 2 (chunk 0 plus a trained chunk)"),
              (min(args.batch_size, args.world_size, args.optimizer_steps) < 1,
               "--batch_size, --world_size, --optimizer_steps: expected >= 1"),
              (args.reuse_steps and args.recipe != "rollout", f"--reuse_steps: a rollout setting, not {args.recipe}'s")]
    for message in [message for failed, message in checks if failed][:1]:
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


class Row(NamedTuple):
    module: str  # the recipe's entry module (PRESETS["real_size"], build_parser or parse_args; its build, or `build`'s)
    flags: Callable[[argparse.Namespace], list[str]]  # the rehearsal's flags in the recipe's own names
    plan: Callable[..., Plan]  # plan(args, flags, config, host, n_ctx) -> Plan
    build: str | None = None  # the package module holding the recipe's build (an fvtools method's recipes/<method>)


def blocks(args): return ["--source_blocks", ",".join(map(str, args.source_blocks))]  # noqa: E704
def steps(args): return ["--replace_steps", ",".join(map(str, args.replace_steps))]  # noqa: E704
def pairs(args): return [*DATA, *blocks(args), "--batch_size", str(args.batch_size)]  # noqa: E704 (offline data)


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
    case = {**case_text_kv(config, text_tokens=args.text_tokens, host=host), "image_cond": image_cond}
    policy = precision_policy(flags.precision, torch.device("cpu"))
    rollout_config = RolloutConfig(state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype,
                                   context_mode=args.context_mode)
    return Plan(f"rollout {args.plan.text}, {args.chunks} chunks, context "
                f"{args.context_mode}, blocks {list(args.source_blocks)}, one trajectory",
                {"teacher_source": UNUSED, "dataset": SimpleNamespace(load_case=lambda case_id: case),
                 "rollout_config": rollout_config, "resuming": True},  # as on resume: --init_from is not read
                lambda: {**row, "case_id": "rehearsal", "key": ("rehearsal", 0)},
                notes=lambda parts: flop_notes(args, "rollout", None))


def method_clip(args, config, host, data="latents", states=0, encoder_text=False) -> Callable[[], dict]:
    item = clip_item(config, chunks=args.chunks, grid=args.latent_grid, text_tokens=args.text_tokens, data=data,
                     states=states, host=host, encoder_text=encoder_text)
    if states:  # KD's sample: the noise levels of its stored ODE states
        item["sigmas"] = torch.linspace(1.0, 0.5, states).tolist()
    return lambda: item


def fp32_states(flags) -> RolloutConfig:
    """The methods' AR loop: FP32 running latents, the recipe's autocast."""
    autocast = precision_policy(flags.precision, torch.device("cpu")).autocast_dtype
    return RolloutConfig(state_dtype=torch.float32, autocast_dtype=autocast)


def teacher_forced_plan(recipe: str):
    def plan(args, flags, config, host, n_ctx) -> Plan:
        steps = flags.student_steps if recipe == "kd" else 0
        item = method_clip(args, config, host, "final" if steps else "latents", steps, args.train == "full")
        inputs = {"state_indices": list(range(steps))} if steps else {"rollout_config": fp32_states(flags)}
        what = f"LoRA rank {flags.lora_rank}" if args.train == "lora" else "full parameters"
        shards = f", FSDP2 over {args.world_size} ranks (per rank)" * (args.train == "full" and args.world_size > 1)
        return Plan(f"{recipe} {what}, {args.chunks} chunks{shards}", {**inputs, "draw_chunks": last_chunks}, item,
                    sharded=args.train == "full")
    return plan


def adversarial_plan(args, flags, config, host, n_ctx) -> Plan:
    rollout = args.data == "rollout"
    inputs = (rollout_plan if rollout else offline_plan("v4"))(args, flags, config, host, n_ctx)
    data = (f"rollout {args.plan.text}, {args.chunks} chunks, one trajectory" if rollout else
            f"offline, batch {args.batch_size}, {n_ctx} context frames")

    def notes(parts) -> dict:
        weight, r1 = parts.step_fn.adversary.weight(), "applied" if flags.r1_weight > 0 else "not applied"
        return {"adversarial": f"weight {weight:g} (generator term {'built' if weight > 0 else 'not built'}), "
                f"lazy R1 {r1}", **flop_notes(args, "rollout" if rollout else "v4", n_ctx, user=False)}
    return Plan(f"adversarial {data}, blocks {list(args.source_blocks)}, discriminator width "
                f"{flags.discriminator_width}, both roles due", {**inputs.build, "resuming": True}, inputs.item,
                notes=notes, updates=flags.r1_every)  # the heaviest step: the generator term built, R1 due


def nft_plan(args, flags, config, host, n_ctx) -> Plan:
    rewards = FixedRewards(parse_reward_weights(flags.rewards))
    return Plan(f"nft LoRA rank {flags.lora_rank}, {flags.samples_per_group} samples of {args.chunks} chunks, "
                f"{flags.chunks_per_sample} chunks trained per sample",
                {"vae_folder": Path("unused"), "draw_chunks": last_chunks,
                 "make_rewards": lambda flags, vae_folder, device: rewards}, method_clip(args, config, host))


def dmd2_plan(args, flags, config, host, n_ctx) -> Plan:
    df_sft = recipe_flags(importlib.import_module("fvtools.train_df_sft"), [])  # what a df_sft LoRA file holds
    flags.real_score_kind, flags.real_score_path = args.real_score, {"teacher": None}.get(args.real_score, Path("unused"))
    trained = "full" if args.train == "full" else f"LoRA rank {flags.lora_rank}"
    generator = f"Predictor {flags.plan.text} blocks {list(flags.source_blocks)}" \
        if args.generator == "predictor" else f"{trained} student, {flags.student_steps} steps"
    real = {"teacher": "the raw Teacher", "lora": f"a LoRA rank {df_sft.lora_rank} on the Teacher"}.get(
        args.real_score, "a second BF16 model")
    fake = "LoRA" if flags.fake_score_train == "lora" else "a full copy"
    return Plan(f"dmd2 {generator}, real score {real}, fake score {fake}, {args.chunks} chunks, rollout {flags.rollout}, "
                "both roles due, monitor step", {"rollout_config": fp32_states(flags), "resuming": True,
                "draw_chunks": last_chunks, "load_lora": lora_file_stand_in(df_sft.lora_rank, df_sft.lora_alpha)},
                method_clip(args, config, host), segments=True, step=flags.monitor_every)


DATA = ["--dataset_root", "unused"]
RECIPES = {
    "v4": Row("train_predictor_v4", pairs, offline_plan("v4")),
    "disca": Row("train_predictor_disca", pairs, offline_plan("disca")),
    "rollout": Row("train_predictor_v4_rollout",
                   lambda a: [*DATA, *blocks(a), *steps(a), "--context_mode", a.context_mode,
                              *(["--reuse_steps", ",".join(map(str, a.reuse_steps))] if a.reuse_steps else [])],
                   rollout_plan),
    "df_sft": Row("fvtools.train_df_sft", lambda a: ["--train", a.train], teacher_forced_plan("df_sft"),
                  "predictor_training.recipes.df_sft"),
    "kd": Row("fvtools.train_kd", lambda a: ["--train", a.train], teacher_forced_plan("kd"),
              "predictor_training.recipes.kd"),
    "adversarial": Row("fvtools.train_adversarial", lambda a: [*pairs(a), *steps(a), "--data", a.data],
                       adversarial_plan, "predictor_training.recipes.adversarial"),
    "nft": Row("fvtools.train_nft", lambda a: ["--train", "lora", *[f"--{k}={v}" for k in ("samples_per_group",
               "chunks_per_sample") if (v := getattr(a, k)) is not None]], nft_plan, "predictor_training.recipes.nft"),
    "dmd2": Row("fvtools.train_dmd2", lambda a: [*blocks(a), *steps(a), *(f"--{k}={getattr(a, k)}" for k in (
        "generator", "real_score", "train")), *(["--allow_raw_teacher_score", "--score_sigma_min",
        str(DISTILLED_SIGMA_FLOOR)] if a.real_score == "teacher" else [])], dmd2_plan,
        "predictor_training.recipes.dmd2"),
}


def rehearse(args, recipe: str | None = None, *, fake: bool = True, host: str | None = None,
             n_ctx: int | None = None, extra_flags: Sequence[str] = (),
             adjust: Callable[[Plan, argparse.Namespace], Plan] | None = None) -> MemoryReport:
    """`--optimizer_steps` loop steps of `recipe` (default --recipe) with every role due (predictor_training/recipes/
    rehearsal.py). fake=False: real CPU tensors (tiny configs only). host: where the loader's batch lies before the
    step moves it to the device: "meta" (host memory, not counted; fake runs) or "cpu" (counted throughout).
    extra_flags: more of the recipe's own flags, after the row's (the last of a flag wins: tools/
    measure_step_flops.py passes a run's); adjust(plan, flags) -> the plan rehearsed (its draws, due roles, step)."""
    recipe = recipe or args.recipe
    row, module = RECIPES[recipe], importlib.import_module(RECIPES[recipe].module)
    flags = recipe_flags(module, [*row.flags(args), *extra_flags])
    plan = row.plan(args, flags, SimpleNamespace(**preset_config(args.config)), host or ("meta" if fake else "cpu"),
                    max(args.context_frames) if n_ctx is None else n_ctx)
    if adjust is not None:
        plan = adjust(plan, flags)
    notes = plan.notes
    plan.notes = lambda parts: {"shapes": f"text {args.text_tokens} tokens, latents 4x{args.latent_grid[0]}x"
                                          f"{args.latent_grid[1]} per chunk", **notes(parts)}
    build = importlib.import_module(row.build).build if row.build is not None else module.build
    return rehearse_recipe(partial(build, flags), plan, precision=flags.precision,
                           gradient_checkpointing=getattr(flags, "gradient_checkpointing", True), preset=args.config,
                           world_size=args.world_size, optimizer_steps=args.optimizer_steps,
                           cuda_autocast=not args.no_cuda_autocast, fake=fake)


def flop_notes(args, recipe: str, context_frames: int | None, user: bool = True) -> dict:
    user_seconds = USER_SECONDS_PER_MICRO_BATCH.get(recipe) if user and args.config == "worldplay_480p_i2v" else None
    return flops.micro_batch_time_notes(
        flops.TeacherShape.from_config(preset_config(args.config)), recipe, context_frames=context_frames,
        user_seconds=user_seconds, tokens_per_frame=args.latent_grid[0] * args.latent_grid[1],
        text_tokens=args.text_tokens, batch_size=args.batch_size, chunks=args.chunks,
        replace_steps=args.replace_steps, context_mode=args.context_mode,
        reuse_steps=args.reuse_steps if recipe == "rollout" else ())


def rehearse_eval(args, *, fake: bool = True) -> MemoryReport:  # tools/eval_predictor.py's rollout, inference
    return rehearse_eval_rollout(args.config, chunks=args.chunks, grid=args.latent_grid, text_tokens=args.text_tokens,
                                 replace_steps=args.replace_steps, context_mode=args.context_mode,
                                 source_blocks=args.source_blocks, cuda_autocast=not args.no_cuda_autocast, fake=fake)


def estimate(args) -> list[MemoryReport]:
    with cuts_undone(args.undo_cuts):
        if args.recipe == "eval":
            return [rehearse_eval(args)]
        if args.recipe != "v4":
            return [rehearse(args)]
        host = "cpu" if "offline_prefeatures" in args.undo_cuts else None  # the batch kept on the device, as undone
        return [rehearse(args, host=host, n_ctx=n_ctx) for n_ctx in args.context_frames]


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_only:
        if args.recipe != "eval":  # the recipe's own flags at its real_size preset
            recipe_flags(importlib.import_module(RECIPES[args.recipe].module), RECIPES[args.recipe].flags(args))
        count = len(args.context_frames) if args.recipe == "v4" else 1
        return report_check_only(f"{count} rehearsal(s) of {args.recipe} at the {args.config} config"
                                 + (", then the largest batch per card" if args.fit else ""))
    torch.set_num_threads(1)
    for report in estimate(args):
        print(json.dumps(report.to_json()) if args.json else report.format(), flush=True)
    n_ctx = max(args.context_frames) if args.recipe == "v4" else 0
    run = lambda batch: rehearse(argparse.Namespace(**{**vars(args), "batch_size": batch}), n_ctx=n_ctx)  # noqa
    for card, (batch, report) in largest_batches(run).items() if args.fit else ():
        line = {"recipe": args.recipe, "card_gb": card, "context_frames": n_ctx, "largest_batch": batch,
                "needs_gib": round(needed_gib(report), 2), "card_gib": round(card_gib(card), 2)}
        print(json.dumps(line) if args.json else f"{args.recipe}: largest per-GPU batch on a {card} GB card "
              f"({line['card_gib']} GiB): {batch} (needs {line['needs_gib']} GiB incl. margin and CUDA context)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
