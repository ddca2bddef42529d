"""FLOPs of one recipe's loop step at the real config, measured, for the training cost's table
(predictor_training/eval/step_flops.json; docs/leaderboard.md § Training cost):

    python tools/measure_step_flops.py --run checkpoints/<run>                 # the step key of a run: print it
    python tools/measure_step_flops.py --run checkpoints/<run> --write         # ... and add it to the table
    python tools/measure_step_flops.py --key '{"recipe": "kd", "train": "full", "student_steps": 1, "context_grad": false}'
    python tools/measure_step_flops.py --standard --write                      # every key the table ships with

Each figure is the recipe's own loop step run by the memory rehearsal (tools/estimate_memory.py's rows, recipes/
rehearsal.py: the recipe's `build` at its `real_size` preset - the real Teacher config, its precision and gradient
checkpointing - with the run's flags that change what a step computes, on fake tensors: minutes, under 1.5 GB) with
runtime/flop_count.py counting every matmul and attention FLOP it dispatches: forward, backward and the
checkpointed blocks' recompute, not the optimizer or element-wise work. Shapes: the real config's (30 x 52 latent
tokens per frame, 1000 text tokens, 8 chunks of 4 latent frames, the context the memory rule gives: 0, 4, ..., 20,
20, 20 frames). One item per micro-batch (a pair of v4 / disca at batch 1, one trajectory or clip); the training
cost multiplies by the run's global batch.

What a step computes can depend on draws and cadences; the tool measures the parts and the entry's item model
(eval/training_cost.py ITEM_MODELS) combines them with the run's flags:
    per_item    v4: the mean over the context frames of chunks 1..7 (4, 8, 12, 16, 20, 20, 20: one rehearsal per
                distinct value); disca, rollout: one rehearsal (every trained chunk, no draw)
    chunk_draw  kd: --chunks_per_clip chunks drawn per sample, each equally likely; the sample's own part (its text
                K/V) and one chunk's part come from rehearsals of chunk {6}, chunks {6, 7} (both see the memory
                window's 20 context frames, so they cost the same) and every chunk: fixed = 2 M{6} - M{6,7},
                all_chunks = M{all} - fixed
    cadence     dmd2: a critic-only step, a step with the generator due, and one with the collapse monitor too
                (the recipe's monitor step); a student's at each exit step (every chunk exiting there) and averaged
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import estimate_memory  # noqa: E402  (tools/estimate_memory.py: the rehearsal's rows)

from predictor_training.eval.training_cost import (  # noqa: E402
    REAL_CONFIG,
    STEP_FLOPS_TABLE,
    find_entry,
    key_text,
    load_step_flops,
    locate,
    step_key,
)
from predictor_training.methods.dmd2_models import FAKE  # noqa: E402
from predictor_training.recipes.rehearsal import recipe_flags  # noqa: E402
from predictor_training.runtime.errors import CommandParser, UserInputError, command  # noqa: E402
from predictor_training.runtime.flags import add_check_only_arg, report_check_only  # noqa: E402
from predictor_training.teacher.flops import OFFLINE_CONTEXT_MIX, memory_context_frames  # noqa: E402

# The keys the table ships with: the Predictor recipes the leaderboard's Predictors come from and the students of
# issue 48 (kd and dmd2, 1 and 2 steps per chunk, every parameter as the demo's students train; kd with and without
# the gradient through the context prefill, --context_grad being its default; dmd2 at its defaults and the demo's
# full fake score and renoise sampler).
DMD2_STUDENT = {"recipe": "dmd2", "generator": "student", "rollout": "self", "real_score": "model",
                "fake_score_train": "full", "anchor": False, "recompute_context": True, "train": "full",
                "context_grad": False, "exit_step": "uniform", "student_sampler": "renoise"}
STANDARD_KEYS = [
    {"recipe": "v4"},
    {"recipe": "disca"},
    {"recipe": "rollout", "replace_steps": [1, 2, 3], "reuse_steps": [], "context_mode": "exact"},
    {"recipe": "rollout", "replace_steps": [3], "reuse_steps": [1, 2], "context_mode": "exact"},
    *({"recipe": "kd", "train": "full", "student_steps": steps, "context_grad": context_grad}
      for context_grad in (True, False) for steps in (1, 2)),
    {**DMD2_STUDENT, "student_steps": 1},
    {**DMD2_STUDENT, "student_steps": 2},
]


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--run", type=Path, help="a run directory or trained weights: measure its step key")
    what.add_argument("--key", type=json.loads, help="a step key as JSON (eval/training_cost.py step_key)")
    what.add_argument("--standard", action="store_true", help="every key the table ships with (STANDARD_KEYS)")
    parser.add_argument("--write", action="store_true", help="add the entries to --table (replacing an entry of the "
                                                             "same key)")
    parser.add_argument("--table", type=Path, default=STEP_FLOPS_TABLE, help="the table --write adds to (default "
                        "the one the training cost reads, %(default)s)")
    parser.add_argument("--config", default=REAL_CONFIG["teacher"], help="Teacher preset (default %(default)s; "
                        "another one is for tests and is never written to the table)")
    add_check_only_arg(parser, what="each step key it would measure (with whether the table has it) and the table it "
                                    "would write")
    parser.add_argument("--text_tokens", type=int, default=REAL_CONFIG["text_tokens"], help=argparse.SUPPRESS)
    parser.add_argument("--latent_grid", default="x".join(map(str, REAL_CONFIG["latent_grid"])), help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, default=REAL_CONFIG["chunks"], help=argparse.SUPPRESS)
    parser.add_argument("--source_blocks", default="1,52", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.write and args.config != REAL_CONFIG["teacher"]:
        parser.error(f"--write with --config {args.config}: the table holds the real config's figures only")
    return args


# ---------------------------------------------------------------------------------------------------------------
# 1. A key as the rehearsal's arguments
# ---------------------------------------------------------------------------------------------------------------
def _bool_flag(name: str, value: bool) -> str:
    return f"--{name}" if value else f"--no-{name}"


def rehearsal_inputs(key: dict, sizes: argparse.Namespace) -> tuple[argparse.Namespace, list[str]]:
    """(tools/estimate_memory.py's arguments, the recipe's extra flags) that rehearse `key` at `sizes`' shapes."""
    recipe = key["recipe"]
    common = ["--recipe", recipe, "--config", sizes.config, "--batch_size", "1", "--world_size", "1",
              "--text_tokens", str(sizes.text_tokens), "--latent_grid", sizes.latent_grid,
              "--chunks", str(sizes.chunks), "--source_blocks", sizes.source_blocks]
    extra: list[str] = []
    if recipe in ("v4", "disca"):
        return estimate_memory.parse_args(common), extra
    if recipe == "rollout":
        args = estimate_memory.parse_args([*common, "--replace_steps", ",".join(map(str, key["replace_steps"])),
                                           "--context_mode", key["context_mode"]])
        if key["reuse_steps"]:
            extra = ["--reuse_steps", ",".join(map(str, key["reuse_steps"]))]
        return args, extra
    trained = ["--train", key["train"]]
    lora = ["--lora_rank", str(key["lora_rank"])] if key["train"] == "lora" else []
    if recipe == "kd":
        extra = [*lora, "--student_steps", str(key["student_steps"]), _bool_flag("context_grad", key["context_grad"])]
        return estimate_memory.parse_args([*common, *trained]), extra
    if recipe == "dmd2":
        if key["rollout"] != "self":
            raise UserInputError(f"{key_text(key)}: only the self rollout is measured so far (a data rollout draws "
                                 "chunks as well)")
        args = estimate_memory.parse_args([*common, "--generator", key["generator"], "--real_score", key["real_score"],
                                           *(trained if key["generator"] == "student" else [])])
        extra = ["--rollout", key["rollout"], "--fake_score_train", key["fake_score_train"],
                 "--anchor_weight", "1" if key["anchor"] else "0",
                 _bool_flag("recompute_context", key["recompute_context"])]
        if key["generator"] == "predictor":
            extra += ["--replace_steps", ",".join(map(str, key["replace_steps"]))]
        else:
            extra += [*lora, "--student_steps", str(key["student_steps"]), "--exit_step", key["exit_step"],
                      "--student_sampler", key["student_sampler"], _bool_flag("context_grad", key["context_grad"])]
        return args, extra
    raise UserInputError(f"{key_text(key)}: no measurement for recipe {recipe!r} yet")


# ---------------------------------------------------------------------------------------------------------------
# 2. Rehearsals and their parts
# ---------------------------------------------------------------------------------------------------------------
def step_flops(args, extra, *, n_ctx=None, chunks=None, due=None, step=None, exit_step=None) -> dict:
    """One rehearsed loop step's FLOPs ({"rehearsal": what was set, "forward", "backward", "total", "by_op"}). chunks: the chunks a `draw_chunks` seam returns; due: the roles due; step: the loop step;
    exit_step: every chunk's exit step (dmd2's `draw_exit_steps` seam)."""
    def adjust(plan, flags):
        build = dict(plan.build)
        if chunks is not None:
            build["draw_chunks"] = lambda num_chunks, count, rank_generator, shared_generator: list(chunks)
        if exit_step is not None:
            build["draw_exit_steps"] = lambda num_chunks, steps, shared_generator: [exit_step] * num_chunks
        return dataclasses.replace(plan, build=build, due=plan.due if due is None else frozenset(due),
                                   step=plan.step if step is None else step)

    start = time.perf_counter()
    report = estimate_memory.rehearse(args, fake=True, n_ctx=n_ctx, extra_flags=extra, adjust=adjust)
    flops = report.notes["step_flops"][0]
    if flops["uncounted"]:
        raise RuntimeError(f"{report.name}: matmul-like ops without a FLOP formula: {flops['uncounted']}")
    what = ", ".join(f"{name} {value}" for name, value in (("context frames", n_ctx), ("chunks", chunks),
                     ("due", sorted(due) if due else None), ("step", step), ("exit step", exit_step))
                     if value is not None)
    print(f"  {what or 'one step'}: {flops['total']:.4g} FLOPs "
          f"(forward {flops['forward']:.4g}, backward {flops['backward']:.4g}) "
          f"in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return {"rehearsal": what or "one step", "forward": flops["forward"],
            "backward": flops["backward"], "total": flops["total"], "by_op": flops["by_op"]}


def measure(key: dict, sizes: argparse.Namespace) -> dict:
    """The table entry of `key`: {"key", "item", "model", "parts", "rehearsals", "config", "torch"} (module
    docstring: what is rehearsed for each model)."""
    args, extra = rehearsal_inputs(key, sizes)
    recipe = key["recipe"]
    rehearsals = []

    def run(**options) -> int:
        rehearsals.append(step_flops(args, extra, **options))
        return rehearsals[-1]["total"]

    if recipe == "v4":
        counts = Counter(OFFLINE_CONTEXT_MIX)
        per_context = {frames: run(n_ctx=frames) for frames in sorted(counts)}
        item, model = {"item": sum(per_context[f] * n for f, n in counts.items()) / sum(counts.values())}, "per_item"
        parts, unit = item, "pair"
    elif recipe in ("disca", "rollout"):
        parts, model, unit = {"item": run()}, "per_item", "pair" if recipe == "disca" else "trajectory"
    elif recipe == "kd":
        # Two chunks that see the same context (the memory window's) cost the same: M{a, b} - M{a} is one chunk.
        a, b = sizes.chunks - 2, sizes.chunks - 1
        context = memory_context_frames(sizes.chunks)
        if context[a] != context[b]:
            raise UserInputError(f"--chunks {sizes.chunks}: chunks {a} and {b} see {context[a]} and {context[b]} "
                                 "context frames; kd's parts need two chunks at the memory window (>= 7 chunks)")
        one_chunk, two_chunks, every = run(chunks=[a]), run(chunks=[a, b]), run(chunks=list(range(sizes.chunks)))
        fixed = 2 * one_chunk - two_chunks
        parts = {"fixed": fixed, "all_chunks": every - fixed, "chunks": sizes.chunks}
        model, unit = "chunk_draw", "sample"
    elif recipe == "dmd2":
        generator_role = "predictor" if key["generator"] == "predictor" else "student"
        exits = [None] if key["generator"] == "predictor" else (
            [key["student_steps"] - 1] if key["exit_step"] == "last" else list(range(key["student_steps"])))
        critic, both = [], []
        for exit_step in exits:
            critic.append(run(due=[FAKE], step=1, exit_step=exit_step))
            both.append(run(due=[FAKE, generator_role], step=1, exit_step=exit_step))
        monitor_step = recipe_flags(importlib.import_module(estimate_memory.RECIPES["dmd2"].module), []).monitor_every
        monitored = run(due=[FAKE, generator_role], step=monitor_step, exit_step=exits[-1])
        parts = {"critic": sum(critic) / len(critic), "generator": (sum(both) - sum(critic)) / len(exits),
                 "monitor": monitored - both[-1]}
        model, unit = "cadence", "clip"
    else:
        raise UserInputError(f"{key_text(key)}: no measurement for recipe {recipe!r} yet")
    return {"key": key, "item": unit, "model": model, "parts": parts, "rehearsals": rehearsals,
            "config": {**REAL_CONFIG, "teacher": sizes.config, "text_tokens": sizes.text_tokens,
                       "latent_grid": [int(v) for v in sizes.latent_grid.split("x")], "chunks": sizes.chunks},
            "torch": torch.__version__}


def write_entries(entries: list[dict], path: Path = STEP_FLOPS_TABLE) -> None:
    """Add `entries` to the table (an entry of the same key is replaced), keys in a stable order."""
    table = {entry_key(entry): entry for entry in load_step_flops(path)}
    table.update({entry_key(entry): entry for entry in entries})
    ordered = [table[name] for name in sorted(table)]
    text = json.dumps({"about": "per-item FLOPs of each recipe's loop step at the real config, measured by "
                                "tools/measure_step_flops.py; read by predictor_training/eval/training_cost.py",
                       "entries": ordered}, indent=1)
    path.write_text(text + "\n", encoding="utf-8")


def entry_key(entry: dict) -> str:
    return json.dumps(entry["key"], sort_keys=True)


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.run is not None:
        trained = locate(args.run)
        if trained.config is None:
            raise UserInputError(f"--run {args.run}: no run config recorded there; expected a run directory or "
                                 "weights written by a recipe")
        keys = [step_key(trained.config)]
    else:
        keys = STANDARD_KEYS if args.standard else [args.key]
    if args.check_only:
        known = load_step_flops(args.table) if args.table.is_file() else []
        return report_check_only(*(f"{key_text(key)} ({'in' if find_entry(key, known) else 'not in'} the table)"
                                   for key in keys), f"--write: {args.table}" if args.write else "nothing written")
    entries = []
    for key in keys:
        print(f"{key_text(key)}:", file=sys.stderr, flush=True)
        entry = measure(key, args)
        entries.append(entry)
        print(json.dumps({"key": entry["key"], "item": entry["item"], "model": entry["model"],
                          "parts": entry["parts"]}), flush=True)
        if args.write:
            write_entries([entry], args.table)  # one at a time: a long --standard run keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
