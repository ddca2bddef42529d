#!/usr/bin/env python
"""The first hour on a GPU node: one command that proves the toolkit at real size, with no data and no weights.

    python benchmarks/gpu_acceptance.py                                   # one GPU, budget 480 s
    python benchmarks/gpu_acceptance.py --memory_estimates est.json      # + the fake-tensor estimate's error
    python benchmarks/gpu_acceptance.py --tiny --out_dir /tmp/acc         # the same code, tiny, on the CPU (tests)
    python benchmarks/gpu_acceptance.py --shapes                          # no GPU: real-size shapes on fake tensors

On the real `worldplay_480p_i2v` Teacher with random BF16 weights (`teacher/source.py random_teacher`), within
`--budget_s` (each section planned as its FLOP count, `teacher/flops.py`, at the Full step's measured rate; one that
does not fit is skipped with a line saying so), in this order: 1. the environment and the SDPA kernel; 2. per-call
times (Full step, context prefill, incremental K/V pass, Predictor step; `eval/timing.py chunk_calls`) against the
measured matmul peak; 3. memory of one loop step of v4, disca and the rollout recipe, each built by its own build
(`recipes/offline.py build_offline`, `recipes/rollout.py build_rollout`) at its real_size preset's values on this
Teacher and `data/synthetic.py`'s inputs; 4. rollouts F-F-F-F / F-P-P-P by the eval's `TimedRollout`: measured DiT
speedup against the FLOP bound; 5. BF16 against FP32 (`conformance/calls.py`). Every time is taken by
`runtime/timing.py interleaved` (warm-up excluded). docs/cluster.md says what each figure is and what to compare it
with. Writes `<out_dir>/gpu_acceptance.json` and `.md` (atomically); refuses to start without CUDA unless --tiny.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from predictor_training.conformance import SET_A
from predictor_training.conformance.calls import bf16_vs_fp32, bf16_vs_fp32_rollout
from predictor_training.data.synthetic import case_text_kv, offline_batch, trajectory_row
from predictor_training.eval.methods import PredictorMethod, ReferenceMethod, make_step_fn
from predictor_training.eval.timing import CONTEXT_TIMESTEP, Stopwatch, TimedRollout, chunk_call_flops, chunk_calls
from predictor_training.predictor.model import as_trained_, build_predictor
from predictor_training.recipes.offline import OfflineSettings, build_offline
from predictor_training.recipes.rollout import RolloutSettings, build_rollout
from predictor_training.rollout.ar_rollout import RolloutConfig, RolloutInputs
from predictor_training.rollout.schedule import StepPlan
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.flags import add_check_only_arg, at_least, positive, report_check_only
from predictor_training.runtime.io import write_json_atomic, write_text_atomic
from predictor_training.runtime.loop import grad_norm_and_clip
from predictor_training.runtime.memory_rehearsal import Rehearsal, estimate_columns, read_estimates
from predictor_training.runtime.memory_tracker import GIB
from predictor_training.runtime.precision import autocast, precision_policy
from predictor_training.runtime.timing import Budget, device_environment, interleaved, matmul_peak, sdpa_kernels
from predictor_training.teacher import TextKV
from predictor_training.teacher.flops import (TeacherShape, flop_speedup_bound, memory_context_frames,
                                              recipe_micro_batch_flops, replacement_rollout_flops)
from predictor_training.teacher.source import TeacherSource, random_teacher

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFORMANCE_SET = SET_A  # the golden set the package ships (predictor_training/conformance/golden/)
RECIPES = ("v4", "disca", "rollout")
ROLLOUTS = {  # name: (replace_steps, context mode)
    "F-F-F-F exact": ((), "exact"),
    "F-P-P-P exact": ((1, 2, 3), "exact"),
    "F-P-P-P incremental": ((1, 2, 3), "incremental"),
}
REFERENCE_ROLLOUT = "F-F-F-F exact"
CALL_OUTPUT = {  # the tensor of each call's output whose shape --shapes reports
    "full_step": lambda output: output,  # the velocity [1, C, 4, H, W]
    "context_prefill": lambda output: output.layer(0).stacked()[0],  # layer 0's stacked K
    "cache_pass": lambda output: output[0][0],  # layer 0's raw K of the chunk
    "predictor_step": lambda output: output[1],  # the velocity
}
OWN_TEACHER = TeacherSource(Path("random weights"), None, "gpu_acceptance's own Teacher", None)
read_memory_estimates = partial(read_estimates, recipes=RECIPES)  # tools/estimate_memory.py --json's reports
# The memory step's recipe values: the offline scripts' and the rollout script's defaults at their real_size preset
# (tests/tools/test_gpu_acceptance.py holds them equal to what the scripts parse). The memory depends on the blocks,
# checkpointing, precision, batch and schedule; the learning rates and schedule lengths are the scripts' defaults.
REAL_SIZE_PRECISION = "fp32master"
REAL_SIZE_REPLACE_STEPS = (1, 2, 3)
REAL_SIZE_CONTEXT_MODE = "exact"
REAL_SIZE_VALUES = dict(
    gradient_checkpointing=True, fusion_lr=1e-4, blocks_lr=1e-5, adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.01,
    scheduler_warmup_steps=100, max_steps=2000, block_warmup_steps=100, grad_clip=1.0, velocity_weight=1.0,
    hidden_weight=0.1, dataset_root=Path("unused"), val_every=0, val_split=None, val_videos=4, val_vae=None,
    val_ground_truth=None)


@dataclasses.dataclass(frozen=True)
class Size:
    """What is built and run: the Teacher preset, the latent grid, text tokens, context frames of the per-call
    timings, chunks of a rollout, the offline batch, the Predictor's source blocks and the matmul of the peak."""

    preset: str
    height: int
    width: int
    text_tokens: int
    context_frames: int
    chunks: int
    offline_batch: int
    source_blocks: tuple[int, int]
    matmul: int


REAL = Size("worldplay_480p_i2v", 30, 52, 1000, 20, 8, 16, (1, 52), 8192)
TINY = Size("tiny", 4, 6, 8, 8, 8, 16, (0, 1), 256)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget_s", type=positive(float), default=480.0,
                        help="wall-clock budget of the measurements (default %(default)s); a section that does not "
                             "fit in what is left is skipped with a line saying so")
    parser.add_argument("--out_dir", type=Path, default=Path("gpu_acceptance"),
                        help="folder for gpu_acceptance.json and gpu_acceptance.md (default %(default)s)")
    parser.add_argument("--memory_estimates", type=Path, default=None,
                        help="the output of `tools/estimate_memory.py --json` (JSON lines, or a JSON list / object) "
                             "for the same configurations: the memory table's estimate column")
    parser.add_argument("--tiny", action="store_true", help="the same code at tiny size on the CPU (no CUDA needed)")
    parser.add_argument("--shapes", action="store_true",
                        help="no GPU needed: run the per-call code at real size on fake tensors and print the output "
                             "shapes, FLOPs, FLOP bounds and the plan at an assumed 400 TFLOP/s as JSON, then exit")
    parser.add_argument("--repeats", type=at_least(int, 1), default=3,
                        help="timed repeats of each per-call timing after one warm-up (default %(default)s)")
    parser.add_argument("--offline_batch", type=at_least(int, 1), default=None,
                        help="v4 / disca offline batch to try first (default: 16, the recipe's per-GPU batch); "
                             "halved until a step fits")
    parser.add_argument("--chunks", type=at_least(int, 2, " (chunk 0 plus one replaced chunk)"), default=None,
                        help="chunks of the rollouts (default 8)")
    parser.add_argument("--skip", type=str, default="",
                        help="comma-separated sections not to run: speed_calls, rollouts, memory, numerics")
    add_check_only_arg(parser, what="the sections it would measure and the files it would write (CUDA is not "
                       "needed for the check)")
    args = parser.parse_args(argv)
    sections = {"speed_calls", "rollouts", "memory", "numerics"}
    args.skip = {part for part in args.skip.split(",") if part}
    if args.skip - sections:
        parser.error(f"--skip: unknown {sorted(args.skip - sections)}; expected among {sorted(sections)}")
    if args.memory_estimates is not None and not args.memory_estimates.is_file():
        parser.error(f"--memory_estimates {args.memory_estimates}: no such file")
    if not args.tiny and not args.shapes and not args.check_only and not torch.cuda.is_available():
        parser.error("CUDA is not available: this command measures a GPU. Run it on a GPU node, or pass --tiny to "
                     "run the same code at tiny size on the CPU")
    return args


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- 1. Models and inputs -----------------------------------------------------------------------------------------
def make_predictor(teacher, size: Size):
    """A v4 `build_predictor` (FP32 copies of the source blocks, gradient checkpointing as the recipes), as trained."""
    torch.manual_seed(2)
    return as_trained_(build_predictor(teacher, "v4", size.source_blocks, gradient_checkpointing=True))


def random_text_kv(teacher, size: Size, device: torch.device) -> TextKV:
    case = case_text_kv(teacher.config, text_tokens=size.text_tokens, host=device,
                        generator=torch.Generator(device=device).manual_seed(3))
    return TextKV.from_layer_stack(case["text_k"], case["text_v"], device, teacher.dtype)


def camera_row(size: Size, chunks: int, teacher):
    """A sample-table row of `chunks` chunks whose camera turns and steps back, and its image condition."""
    return trajectory_row(chunks, (size.height, size.width), teacher.config.out_channels,
                          generator=torch.Generator().manual_seed(4))


# ---- 2. Speed -----------------------------------------------------------------------------------------------------
def speed_calls(teacher, predictor, text_kv, size: Size, device: torch.device, repeats: int) -> dict:
    """Per-call times of `eval/timing.py chunk_calls`, side by side; FLOPs (teacher/flops.py) and TFLOP/s of each."""
    calls = chunk_calls(teacher, predictor, text_kv, size.context_frames, (size.height, size.width), device)
    with torch.no_grad(), autocast(device, torch.bfloat16):
        kernels = sdpa_kernels(calls["full_step"])
        results = interleaved(calls, repeats, device=device)
    flops = chunk_call_flops(TeacherShape.from_config(teacher.config), predictor.predictor_config(),
                             size.height * size.width, size.text_tokens, size.context_frames)
    for name, record in results.items():
        record["flops"] = flops[name]
        record["tflops"] = flops[name] / record["min_s"] / 1e12
    return {"context_frames": size.context_frames, "text_tokens": size.text_tokens, "calls": results,
            "sdpa_kernels": kernels}


def run_rollouts(teacher, predictor, text_kv, size: Size, device: torch.device) -> dict:
    """One `size.chunks`-chunk rollout of each of ROLLOUTS with the eval's TimedRollout and step functions,
    interleaved after a warm-up rollout of each; DiT seconds, FLOPs, measured speedup vs the reference and the FLOP
    bound."""
    row, image_cond = camera_row(size, size.chunks, teacher)
    base = RolloutConfig(state_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)
    checkpoint = SimpleNamespace(method="predictor", panel="random v4", predictor_config=predictor.predictor_config())
    methods = {False: ReferenceMethod(), True: PredictorMethod(predictor.eval(), checkpoint)}
    last = {}  # name: (context frames, the stopwatch's per-call summary) of its last rollout

    def rollout(name: str) -> None:
        replace_steps, mode = ROLLOUTS[name]
        config, stopwatch = dataclasses.replace(base, context_mode=mode), Stopwatch(device)
        inputs = RolloutInputs.from_seed(row["seed"], image_cond, row["viewmats"], row["Ks"], row["action"],
                                         state_dtype=config.state_dtype)
        loop = TimedRollout(teacher, text_kv, inputs, config, device=device, stopwatch=stopwatch)
        plan = StepPlan.from_steps(replace_steps, (), config.num_steps)
        with torch.no_grad():
            loop.run(make_step_fn(methods[bool(replace_steps)], plan, stopwatch,
                                  lambda: autocast(device, torch.bfloat16)))
        last[name] = (loop.context_frames, stopwatch.summary())

    times = interleaved({name: partial(rollout, name) for name in ROLLOUTS}, 1, device=device)
    shape, context_frames, records = TeacherShape.from_config(teacher.config), last[REFERENCE_ROLLOUT][0], {}
    for name, (replace_steps, mode) in ROLLOUTS.items():
        if last[name][0] != context_frames:
            raise RuntimeError(f"{name} selected context sizes {last[name][0]}, the reference {context_frames}: the "
                               "memory selection must not depend on the schedule")
        flops = replacement_rollout_flops(shape, size.height * size.width, size.text_tokens, context_frames,
                                          replace_steps, num_steps=base.num_steps, chunk_frames=base.chunk_latents,
                                          predictor_config=predictor.predictor_config(), context_mode=mode)
        records[name] = {"dit_s": times[name]["min_s"], "flops": flops, "context_frames": context_frames,
                         "calls": last[name][1]}
    reference, speedups = records[REFERENCE_ROLLOUT], {}
    for name, record in records.items():
        measured = reference["dit_s"] / record["dit_s"]
        bound = flop_speedup_bound(reference["flops"]["total"], record["flops"]["total"])
        speedups[name] = {"measured": measured, "flop_bound": bound, "fraction_of_bound": measured / bound}
    return {"chunks": size.chunks, "rollouts": records, "speedups": speedups}


# ---- 3. Memory of one training step: the recipes' own builds ------------------------------------------------------
def recipe_step(recipe: str, teacher, size: Size, batch_size: int, device: torch.device):
    """(RecipeParts, micro-batch): `recipe` built by its own build (`build_offline`, `build_rollout`) at the values of
    its real_size preset (`REAL_SIZE_VALUES`) on `teacher` (the `load_teacher` seam), and its synthetic micro-batch
    (`data/synthetic.py`): an offline batch, or one trajectory of `size.chunks` chunks."""
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device, backend=None, is_main=True)
    policy = precision_policy(REAL_SIZE_PRECISION, device)
    values = {**REAL_SIZE_VALUES, "source_blocks": size.source_blocks}
    seams = {"teacher_source": OWN_TEACHER, "load_teacher": lambda source, device, dtype: teacher}
    if recipe == "rollout":
        row, image_cond = camera_row(size, size.chunks, teacher)
        case = {**case_text_kv(teacher.config, text_tokens=size.text_tokens, host=device), "image_cond": image_cond}
        config = RolloutConfig(state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype,
                               context_mode=REAL_SIZE_CONTEXT_MODE)
        settings = RolloutSettings(**values, init_from=None, plan=StepPlan.from_steps(REAL_SIZE_REPLACE_STEPS),
                                   revisit_weight=0.0)
        parts = build_rollout(settings, env, policy, dataset=SimpleNamespace(load_case=lambda case_id: case),
                              rollout_config=config, resuming=True, **seams)  # resuming: no --init_from to read
        return parts, {**row, "case_id": "acceptance", "key": ("acceptance", 0)}
    parts = build_offline(OfflineSettings(**values, seed=0), env, policy, variant=recipe,
                          context_timestep=CONTEXT_TIMESTEP, run_dir=None, **seams)
    return parts, offline_batch(recipe, teacher.config, batch_size=batch_size, n_ctx=size.context_frames,
                                text_tokens=size.text_tokens, grid=(size.height, size.width),
                                source_blocks=size.source_blocks, device=device,
                                generator=torch.Generator(device=device).manual_seed(9))


def memory_step(recipe: str, teacher, size: Size, batch_size: int, device: torch.device) -> dict:
    """One loop step of `recipe` (`recipe_step`: a fresh Predictor and AdamW, its outputs as trained): the step
    function with every role due, then each role's clip and AdamW step; peak allocated / reserved on CUDA."""
    parts, item = recipe_step(recipe, teacher, size, batch_size, device)
    as_trained_(parts.models[-1])
    kept = {id(param) for model in parts.models for param in model.parameters()}  # an offline recipe frees the rest
    outside = sum(param.numel() * param.element_size() for param in teacher.parameters() if id(param) not in kept)
    release(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) if cuda else None
    metrics, norms = {}, []

    def step():
        metrics.update(parts.step_fn(item, sync=True, due=frozenset(role.name for role in parts.roles)))
        norms.extend(grad_norm_and_clip(role.parameters, role.grad_clip, 1, role.name) for role in parts.roles)
        for role in parts.roles:
            role.step()
            role.zero_grad()

    step_s = interleaved({recipe: step}, 1, warmup=0, device=device)[recipe]["min_s"]
    allocated = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    record = {"recipe": recipe, "batch_size": batch_size if recipe != "rollout" else 1,
              "chunks": size.chunks if recipe == "rollout" else None, "step_s": step_s, "loss": float(metrics["loss"]),
              "grad_norm": norms[0], "teacher_not_in_recipe_gib": outside / GIB, "max_allocated_gib": allocated,
              "max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if cuda else None,
              "resident_before_gib": resident / GIB if cuda else None,
              "comparable_gib": allocated - outside / GIB if cuda else None}
    if not cuda:
        record["note"] = "CPU: no caching allocator, memory not measured"
    parts = item = None  # the Predictor and AdamW freed before the release
    release(device)
    return record


def memory_rows(teacher, size: Size, device: torch.device, budget: Budget, plan_s: dict, estimates: dict) -> dict:
    """`memory_step` of each recipe that fits the budget, the offline batch halved from `size.offline_batch` until a
    step fits; each row with its estimate's columns."""
    rows = {}
    for recipe in RECIPES:
        batch = size.offline_batch if recipe != "rollout" else 1
        while budget.fits(f"memory {recipe}", plan_s[f"memory {recipe}"]) and recipe not in rows:
            try:
                rows[recipe] = memory_step(recipe, teacher, size, batch, device)
            except torch.cuda.OutOfMemoryError:
                release(device)
                if batch == 1:
                    rows[recipe] = {"recipe": recipe, "error": "out of memory", "batch_size": batch}
                print(f"memory {recipe}: batch {batch} does not fit" + ("" if batch == 1 else f", trying {batch // 2}"),
                      flush=True)
                batch //= 2
        if recipe in rows:
            rows[recipe].update(estimate_columns(estimates.get(recipe), rows[recipe].get("comparable_gib"),
                                                 None if recipe == "rollout" else rows[recipe]["batch_size"]))
    return rows


# ---- 4. The plan, and real size without a GPU: shapes on fake tensors ---------------------------------------------
def rollout_totals(shape: TeacherShape, size: Size, chunks: int, predictor_config: dict) -> dict[str, int]:
    """DiT FLOPs of each rollout of ROLLOUTS over `chunks` chunks with the memory rule's context sizes (what the
    measured run's context sizes are when the selection keeps the cap)."""
    context = memory_context_frames(chunks)
    return {name: replacement_rollout_flops(shape, size.height * size.width, size.text_tokens, context, steps,
                                            predictor_config=predictor_config, context_mode=mode)["total"]
            for name, (steps, mode) in ROLLOUTS.items()}


def plan_seconds(rate: float, shape: TeacherShape, size: Size, predictor_config: dict, tiny: bool) -> dict:
    """Planned seconds of each section from FLOP counts (teacher/flops.py: a recipe's micro-batch, the rollouts) at
    `rate` FLOP/s (the Full step's measured rate, or an assumed one before it is measured), with a margin for what
    the count leaves out (memory selection, allocation, launch overhead) and, on the GPU, a fixed cost per section.
    FP32 runs at 1/12 of BF16 (no TF32)."""
    fixed, margin = (0.0 if tiny else 5.0), 1.3
    micro_batch = {recipe: recipe_micro_batch_flops(
        shape, recipe, tokens_per_frame=size.height * size.width, text_tokens=size.text_tokens,
        batch_size=size.offline_batch, context_frames=size.context_frames if recipe == "v4" else None,
        chunks=size.chunks) for recipe in RECIPES}
    totals = rollout_totals(shape, size, size.chunks, predictor_config)
    two_chunks = rollout_totals(shape, size, 2, predictor_config)[REFERENCE_ROLLOUT]
    return {**{f"memory {recipe}": margin * flops / rate + fixed for recipe, flops in micro_batch.items()},
            "rollouts": margin * 2 * sum(totals.values()) / rate + fixed,  # a warm-up and a timed rollout of each
            "numerics": margin * (1 + 12) * two_chunks / rate + 2 * fixed}


def real_size_shapes(size: Size = REAL) -> dict:
    """The per-call timings' code at `size` on fake tensors (nothing allocated, CPU only; the CUDA autocast rules
    emulated by `runtime/autocast_rules.py`): {call: output shape}, the four calls' FLOPs and the rollout FLOP
    bounds of `size.chunks` chunks with the memory's context sizes, and the plan at an assumed 400 TFLOP/s Full step
    (what a GPU run then measures)."""
    device = torch.device("cpu")
    with Rehearsal(f"gpu_acceptance shapes, {size.preset}"):
        teacher = random_teacher(size.preset, device, torch.bfloat16, randomize=False)
        predictor = make_predictor(teacher, size)
        calls = chunk_calls(teacher, predictor, random_text_kv(teacher, size, device), size.context_frames,
                            (size.height, size.width), device)
        with torch.no_grad(), autocast(device, torch.bfloat16):
            shapes = {name: list(CALL_OUTPUT[name](call()).shape) for name, call in calls.items()}
    shape = TeacherShape.from_config(teacher.config)
    flops = chunk_call_flops(shape, predictor.predictor_config(), size.height * size.width, size.text_tokens,
                             size.context_frames)
    totals = rollout_totals(shape, size, size.chunks, predictor.predictor_config())
    bounds = {name: flop_speedup_bound(totals[REFERENCE_ROLLOUT], total) for name, total in totals.items()
              if name != REFERENCE_ROLLOUT}
    assumed = 400e12
    plan = plan_seconds(assumed, shape, size, predictor.predictor_config(), tiny=False)
    return {"shapes": shapes, "flops": {name: flops[name] for name in ("full_step", "context_prefill")},
            "context_frames": memory_context_frames(size.chunks),
            "flop_bounds": bounds, "assumed_tflops": assumed / 1e12, "plan_s": plan,
            "teacher_parameters": sum(param.numel() for param in teacher.parameters())}


# ---- 5. Report ----------------------------------------------------------------------------------------------------
def fmt(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    return ["", "| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1),
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]


def markdown(report: dict) -> str:
    env, config = report["environment"], report["config"]
    lines = [f"# GPU acceptance ({report['mode']}): {env.get('device')}", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, device memory "
             f"{fmt(env.get('memory_gib'), 1, ' GiB')}; config {config['preset']}, latents {config['height']}x"
             f"{config['width']}, {config['text_tokens']} text tokens; {fmt(report['elapsed_s'], 0)} s of --budget_s "
             f"{report['budget_s']:.0f}", "", *(f"- {skip['line']}" for skip in report["skipped"])]
    if speed := report.get("speed_calls"):
        peak, full = report["matmul_peak"], speed["calls"]["full_step"]
        lines += ["", f"## Per call ({speed['context_frames']} context frames; SDPA: "
                      f"{', '.join(speed['sdpa_kernels']) or 'not seen'})"]
        lines += table(["call", "best s", "median s", "GFLOP", "TFLOP/s"], [
            [name, f"{r['min_s']:.4f}", f"{r['median_s']:.4f}", f"{r['flops'] / 1e9:.3f}", f"{r['tflops']:.3f}"]
            for name, r in speed["calls"].items()])
        lines += ["", f"Full step: {full['tflops']:.1f} TFLOP/s = {fmt(report['full_step_fraction_of_peak'], 3)} of "
                      f"the measured BF16 matmul peak ({peak['tflops']:.1f} TFLOP/s at n={peak['n']})."]
    if rollouts := report.get("rollouts"):
        lines += ["", f"## Rollouts ({rollouts['chunks']} chunks)"]
        lines += table(["rollout", "DiT s", "GFLOP", "measured speedup", "FLOP bound", "fraction of bound"], [
            [name, f"{r['dit_s']:.3f}", f"{r['flops']['total'] / 1e9:.1f}", f"{s['measured']:.2f}x",
             f"{s['flop_bound']:.2f}x", f"{s['fraction_of_bound']:.2f}"]
            for name, r in rollouts["rollouts"].items() for s in [rollouts["speedups"][name]]])
    if memory := report.get("memory"):
        lines += ["", "## Memory of one training step (GiB)"]
        lines += table(["recipe", "batch", "max allocated", "max reserved", "Teacher not in recipe", "comparable",
                        "estimate", "estimate error"], [
            [recipe, r["batch_size"], r["error"], "", "", "", "", ""] if isinstance(r.get("error"), str) else
            [recipe, r["batch_size"], fmt(r["max_allocated_gib"]), fmt(r["max_reserved_gib"]),
             fmt(r["teacher_not_in_recipe_gib"]), fmt(r["comparable_gib"]), fmt(r["estimate_gib"]),
             fmt(None if r["estimate_error"] is None else 100 * r["estimate_error"], 1, " %")]
            for recipe, r in memory.items()])
    if numerics := report.get("numerics"):
        conformance = numerics["conformance"]
        lines += ["", "## Numerics: BF16 vs FP32", "",
                  f"Conformance Teacher ({conformance['set']}): worst relative error "
                  f"{conformance['bf16_vs_fp32_worst_rel']:.3e}; FP32 on this device vs the golden vectors: worst "
                  f"abs {fmt(conformance['fp32_device_vs_golden_worst_abs'], 3)}"]
        errors = [("output", conformance["bf16_vs_fp32"]),
                  ("2-chunk rollout", numerics.get("rollout_2chunks", {}).get("chunks"))]
        for title, records in errors:
            if records is not None:
                lines += table([title, "max abs", "max rel"], [
                    [name, f"{r['max_abs']:.3e}", f"{r['max_rel']:.3e}"] for name, r in records.items()])
    return "\n".join(lines) + "\n"


# ---- 6. Main ------------------------------------------------------------------------------------------------------
def numerics(teacher, text_kv, size: Size, device: torch.device, budget: Budget) -> dict:
    """BF16 against FP32: the conformance Teacher, then a 2-chunk rollout of this Teacher when an FP32 copy fits."""
    shown = CONFORMANCE_SET.relative_to(REPO_ROOT) if CONFORMANCE_SET.is_relative_to(REPO_ROOT) else CONFORMANCE_SET
    result = {"conformance": {"set": str(shown),
                              **bf16_vs_fp32(CONFORMANCE_SET, device)}}
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    needed = 2 * sum(param.numel() for param in teacher.parameters()) * 4
    if free is not None and free < needed:
        budget.skip("numerics rollout_2chunks", f"skipped numerics rollout_2chunks: an FP32 copy of the Teacher "
                    f"needs {needed / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
    else:
        result["rollout_2chunks"] = bf16_vs_fp32_rollout(teacher, size.preset, text_kv, *camera_row(size, 2, teacher),
                                                         device)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.check_only:
        read_memory_estimates(args.memory_estimates)
        if args.out_dir.exists() and not args.out_dir.is_dir():
            raise SystemExit(f"gpu_acceptance.py: error: --out_dir {args.out_dir}: a file; expected a folder")
        sections = [name for name in ("speed_calls", "rollouts", "memory", "numerics") if name not in args.skip]
        report_check_only("--shapes: the real-size shapes on fake tensors, printed" if args.shapes else
                          f"{', '.join(sections)} in {args.budget_s:.0f} s -> {args.out_dir}/gpu_acceptance.json, "
                          "gpu_acceptance.md")
        return {}
    if args.shapes:
        shapes = real_size_shapes(REAL)
        print(json.dumps(shapes, indent=2))
        return shapes
    budget, size = Budget(args.budget_s), TINY if args.tiny else REAL
    size = dataclasses.replace(size, offline_batch=args.offline_batch or size.offline_batch,
                               chunks=args.chunks or size.chunks)
    device = torch.device("cpu") if args.tiny else torch.device("cuda", torch.cuda.current_device())
    report = {"mode": "tiny" if args.tiny else "real", "config": dataclasses.asdict(size), "budget_s": args.budget_s,
              "environment": device_environment(device), "skipped": budget.skipped,
              "memory_estimates_file": None if args.memory_estimates is None else str(args.memory_estimates)}
    estimates = read_memory_estimates(args.memory_estimates)
    def say(line: str) -> None:  # progress; the figures come in the closing tables
        print(f"[{budget.elapsed():5.0f} s] {line}", flush=True)

    say(f"gpu_acceptance ({report['mode']}) on {report['environment']['device']}, budget {args.budget_s:.0f} s")

    # 1. Models (every section needs them).
    teacher = random_teacher(size.preset, device, torch.bfloat16)
    predictor, text_kv = make_predictor(teacher, size), random_text_kv(teacher, size, device)
    report.update(build_s=budget.elapsed(), teacher_parameters=sum(param.numel() for param in teacher.parameters()))
    say(f"built the {size.preset} Teacher ({report['teacher_parameters']:,} parameters, bf16)")

    # 2. Per-call speed; the plan is each section's FLOPs at the Full step's measured rate (assumed until measured).
    rate = 1e9 if args.tiny else 300e12
    if "speed_calls" not in args.skip and budget.fits("speed_calls", 1.0 if args.tiny else 30.0):
        report["matmul_peak"] = matmul_peak(size.matmul, device, args.repeats)
        report["speed_calls"] = speed_calls(teacher, predictor, text_kv, size, device, args.repeats)
        calls = report["speed_calls"]["calls"]
        rate = calls["full_step"]["flops"] / calls["full_step"]["min_s"]
        report["full_step_tflops"] = calls["full_step"]["tflops"]
        report["full_step_fraction_of_peak"] = calls["full_step"]["tflops"] / report["matmul_peak"]["tflops"]
        say(f"per-call times: a Full step {calls['full_step']['min_s']:.4f} s")
    plan = report["plan_s"] = plan_seconds(rate, TeacherShape.from_config(teacher.config), size,
                                           predictor.predictor_config(), args.tiny)
    report["plan_rate_tflops"] = rate / 1e12

    # 3. Memory (before the rollouts: the figures a first slot on a GPU most needs).
    if "memory" not in args.skip:
        report["memory"] = memory_rows(teacher, size, device, budget, plan, estimates)
        say(f"memory of one step: {', '.join(report['memory'])}")

    # 4. Rollouts.
    if "rollouts" not in args.skip and budget.fits("rollouts", plan["rollouts"]):
        report["rollouts"] = run_rollouts(teacher, predictor, text_kv, size, device)
        say(f"rollouts: {', '.join(report['rollouts']['rollouts'])}")
    del predictor
    release(device)

    # 5. Numerics.
    if "numerics" not in args.skip and budget.fits("numerics", plan["numerics"]):
        report["numerics"] = numerics(teacher, text_kv, size, device, budget)
        say("numerics: BF16 against FP32")

    report["elapsed_s"] = budget.elapsed()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out_dir / "gpu_acceptance.json", report)
    write_text_atomic(args.out_dir / "gpu_acceptance.md", markdown(report))
    print(markdown(report), flush=True)
    say(f"wrote {args.out_dir / 'gpu_acceptance.json'} and gpu_acceptance.md")
    return report


if __name__ == "__main__":
    main()
