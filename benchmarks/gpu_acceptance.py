#!/usr/bin/env python
"""The first hour on a GPU node: one command that proves the toolkit at real size, with no data and no weights.

    python benchmarks/gpu_acceptance.py                                   # one GPU, budget 480 s
    python benchmarks/gpu_acceptance.py --memory_estimates est.json      # + the fake-tensor estimate's error
    python benchmarks/gpu_acceptance.py --tiny --out_dir /tmp/acc         # the same code, tiny, on the CPU (tests)
    python benchmarks/gpu_acceptance.py --shapes                          # no GPU: real-size shapes on fake tensors

It builds the real `worldplay_480p_i2v` Teacher (8.6B parameters) with random BF16 weights on the device
(`teacher/source.py random_teacher`) and measures, within `--budget_s` (a section that does not fit in what is left
is skipped with a line saying so; the plan is each section's FLOP count, `teacher/flops.py`, at the Full step's
measured rate), in this order (docs/cluster.md says what each figure is and what to compare it with):

1. the environment, and the SDPA kernel a Full step ran (`runtime/timing.py device_environment`, `sdpa_kernels`);
2. per call: a Full step with a full context, the exact context prefill, the incremental K/V pass and a v4 Predictor
   step; FLOPs, TFLOP/s and the fraction of the measured BF16 matmul peak;
3. memory: one loop step (step function, each role's clip and AdamW) of v4 offline (batch --offline_batch, halved
   until it fits), disca offline and the rollout recipe, each built by the recipe's own build
   (`recipes/offline.py build_offline`, `recipes/rollout.py build_rollout`, with the flags of its real_size preset)
   on this process's Teacher (their `load_teacher` seam), on `data/synthetic.py`'s inputs: max allocated / reserved,
   and the `comparable` figure (less the Teacher an offline recipe frees) against `--memory_estimates`;
4. rollouts of --chunks chunks, F-F-F-F, F-P-P-P exact and incremental, by the eval's `TimedRollout` and step
   functions: measured DiT speedup next to the FLOP bound of the same context sizes (goal >= 0.9 for F-P-P-P);
5. numerics: the conformance Teacher in BF16 against FP32 on the device (`conformance/calls.py bf16_vs_fp32`), and a
   2-chunk rollout of the real-size Teacher in BF16 against the same weights in FP32 (`bf16_vs_fp32_rollout`).

Every time is taken by `runtime/timing.py interleaved` (warm-up rounds excluded). Writes `<out_dir>/gpu_acceptance.json`
and `.md` (atomically). Refuses to start without CUDA unless given --tiny: the same code with the tiny Teacher on the
CPU (memory not measured there: no caching allocator), which only keeps the code working.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from predictor_training.conformance.calls import bf16_vs_fp32, bf16_vs_fp32_rollout
from predictor_training.data.synthetic import case_text_kv, offline_batch, trajectory_row
from predictor_training.eval.methods import PredictorMethod, ReferenceMethod, make_step_fn
from predictor_training.eval.timing import (
    CONTEXT_TIMESTEP,
    Stopwatch,
    TimedRollout,
    chunk_call_flops,
    chunk_calls,
)
from predictor_training.predictor.model import as_trained_, build_predictor
from predictor_training.recipes.offline import REAL_SIZE as OFFLINE_REAL_SIZE
from predictor_training.recipes.offline import OfflineSettings, add_offline_args, build_offline
from predictor_training.recipes.rollout import REAL_SIZE as ROLLOUT_REAL_SIZE
from predictor_training.recipes.rollout import add_rollout_args, build_rollout
from predictor_training.rollout.ar_rollout import RolloutConfig, RolloutInputs
from predictor_training.rollout.schedule import Schedule
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.flags import parse_recipe_args, settings_from_flags
from predictor_training.runtime.io import write_json_atomic, write_text_atomic
from predictor_training.runtime.loop import _grad_norm_and_clip
from predictor_training.runtime.memory_rehearsal import GIB, estimate_columns, read_estimates
from predictor_training.runtime.precision import autocast, precision_policy
from predictor_training.runtime.timing import Budget, device_environment, interleaved, matmul_peak, sdpa_kernels
from predictor_training.teacher import TextKV
from predictor_training.teacher.flops import (
    TeacherShape,
    flop_speedup_bound,
    memory_context_frames,
    recipe_micro_batch_flops,
    replacement_rollout_flops,
)
from predictor_training.teacher.source import TeacherSource, random_teacher

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFORMANCE_SET = REPO_ROOT / "tests" / "data" / "conformance" / "worldplay_tiny_A"
RECIPES = ("v4", "disca", "rollout")
ROLLOUTS = {  # name: (replace_steps, context mode)
    "F-F-F-F exact": ((), "exact"),
    "F-P-P-P exact": ((1, 2, 3), "exact"),
    "F-P-P-P incremental": ((1, 2, 3), "incremental"),
}
REFERENCE_ROLLOUT = "F-F-F-F exact"
OWN_TEACHER = TeacherSource(Path("random weights"), None, "gpu_acceptance's own Teacher", None)
read_memory_estimates = partial(read_estimates, recipes=RECIPES)  # tools/estimate_memory.py --json's reports


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
    parser.add_argument("--budget_s", type=float, default=480.0,
                        help="wall-clock budget of the measurements (default %(default)s); a section that does not "
                             "fit in what is left is skipped with a line saying so")
    parser.add_argument("--out_dir", type=Path, default=Path("gpu_acceptance"),
                        help="folder for gpu_acceptance.json and gpu_acceptance.md (default %(default)s)")
    parser.add_argument("--memory_estimates", type=Path, default=None,
                        help="the output of `tools/estimate_memory.py --json` (one JSON object per line, or a JSON "
                             "list / object) for the same configurations: filled into the memory table's estimate "
                             "column")
    parser.add_argument("--tiny", action="store_true", help="the same code at tiny size on the CPU (no CUDA needed)")
    parser.add_argument("--shapes", action="store_true",
                        help="no GPU needed: run the per-call code at real size on fake tensors and print the output "
                             "shapes, FLOPs, FLOP bounds and the plan at an assumed 400 TFLOP/s as JSON, then exit")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each per-call timing after one "
                        "warm-up (default %(default)s)")
    parser.add_argument("--offline_batch", type=int, default=None,
                        help="v4 / disca offline batch to try first (default: 16, the recipe's per-GPU batch); "
                             "halved until a step fits")
    parser.add_argument("--chunks", type=int, default=None, help="chunks of the rollouts (default 8)")
    parser.add_argument("--skip", type=str, default="",
                        help="comma-separated sections not to run: speed_calls, rollouts, memory, numerics")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget_s must be > 0, got {args.budget_s}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.offline_batch is not None and args.offline_batch < 1:
        parser.error(f"--offline_batch must be >= 1, got {args.offline_batch}")
    if args.chunks is not None and args.chunks < 2:
        parser.error(f"--chunks must be >= 2 (chunk 0 plus one replaced chunk), got {args.chunks}")
    sections = {"speed_calls", "rollouts", "memory", "numerics"}
    args.skip = {part for part in args.skip.split(",") if part}
    if args.skip - sections:
        parser.error(f"--skip: unknown {sorted(args.skip - sections)}; expected among {sorted(sections)}")
    if args.memory_estimates is not None and not args.memory_estimates.is_file():
        parser.error(f"--memory_estimates {args.memory_estimates}: no such file")
    if not args.tiny and not args.shapes and not torch.cuda.is_available():
        parser.error("CUDA is not available: this command measures a GPU. Run it on a GPU node, or pass --tiny to "
                     "run the same code at tiny size on the CPU")
    return args


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# 1. Models and inputs
# ---------------------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------------------
# 2. Speed
# ---------------------------------------------------------------------------------------------------------------
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


def run_rollouts(teacher, predictor, text_kv, size: Size, chunks: int, device: torch.device) -> dict:
    """One `chunks`-chunk rollout of each of ROLLOUTS with the eval's TimedRollout and step functions, interleaved
    after a warm-up rollout of each; DiT seconds, FLOPs, measured speedup vs the reference and the FLOP bound."""
    row, image_cond = camera_row(size, chunks, teacher)
    base = RolloutConfig(state_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)
    checkpoint = SimpleNamespace(method="predictor", panel="random v4", predictor_config=predictor.predictor_config())
    predictor_method = PredictorMethod(predictor.eval(), checkpoint)
    last = {}  # name: (context frames, the stopwatch's per-call summary) of its last rollout

    def rollout(name: str) -> None:
        replace_steps, mode = ROLLOUTS[name]
        config = dataclasses.replace(base, context_mode=mode)
        stopwatch = Stopwatch(device)
        inputs = RolloutInputs.from_seed(row["seed"], image_cond, row["viewmats"], row["Ks"], row["action"],
                                         state_dtype=config.state_dtype)
        loop = TimedRollout(teacher, text_kv, inputs, config, device=device, stopwatch=stopwatch)
        step_fn = make_step_fn(predictor_method if replace_steps else ReferenceMethod(),
                               Schedule.for_rollout(replace_steps, config), stopwatch,
                               lambda: autocast(device, torch.bfloat16))
        with torch.no_grad():
            loop.run(step_fn)
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
        if name != REFERENCE_ROLLOUT:
            measured = reference["dit_s"] / record["dit_s"]
            bound = flop_speedup_bound(reference["flops"]["total"], record["flops"]["total"])
            speedups[name] = {"measured": measured, "flop_bound": bound, "fraction_of_bound": measured / bound}
    return {"chunks": chunks, "rollouts": records, "speedups": speedups}


# ---------------------------------------------------------------------------------------------------------------
# 3. Memory of one training step: the recipes' own builds
# ---------------------------------------------------------------------------------------------------------------
def preset_flags(add_args, real_size: list[str], *argv: str) -> argparse.Namespace:
    """A recipe's flags (its flag groups in the package) at its real_size preset plus `argv`; no file is read."""
    return parse_recipe_args(add_args(argparse.ArgumentParser()), ["--preset", "real_size", "--dataset_root",
                                                                   "unused", *argv], {"real_size": real_size})


def recipe_step(recipe: str, teacher, size: Size, chunks: int, batch_size: int, device: torch.device):
    """(RecipeParts, micro-batch): `recipe` built by its own build on `teacher` (the `load_teacher` seam) and its
    synthetic micro-batch (`data/synthetic.py`): an offline batch, or one trajectory of `chunks` chunks."""
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device, backend=None, is_main=True)
    seams = {"teacher_source": OWN_TEACHER, "load_teacher": lambda source, device, dtype: teacher}
    blocks, grid = ("--source_blocks", ",".join(map(str, size.source_blocks))), (size.height, size.width)
    if recipe == "rollout":
        flags = preset_flags(add_rollout_args, ROLLOUT_REAL_SIZE, *blocks)
        policy = precision_policy(flags.precision, device)
        row, image_cond = camera_row(size, chunks, teacher)
        case = {**case_text_kv(teacher.config, text_tokens=size.text_tokens, host=device), "image_cond": image_cond}
        config = RolloutConfig(state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype,
                               context_mode=flags.context_mode)
        parts = build_rollout(flags, env, policy, dataset=SimpleNamespace(load_case=lambda case_id: case),
                              rollout_config=config, resuming=True, **seams)  # resuming: no --init_from to read
        return parts, {**row, "case_id": "acceptance", "key": ("acceptance", 0)}
    flags = preset_flags(partial(add_offline_args, experiment=recipe), OFFLINE_REAL_SIZE, *blocks, "--batch_size",
                         str(batch_size))
    parts = build_offline(settings_from_flags(OfflineSettings, flags), env, precision_policy(flags.precision, device),
                          variant=recipe, context_timestep=CONTEXT_TIMESTEP, run_dir=None, **seams)
    return parts, offline_batch(recipe, teacher.config, batch_size=batch_size, n_ctx=size.context_frames,
                                text_tokens=size.text_tokens, grid=grid, source_blocks=flags.source_blocks,
                                device=device, generator=torch.Generator(device=device).manual_seed(9))


def teacher_bytes_outside(teacher, models) -> int:
    """Bytes of Teacher parameters the recipe's models do not hold (what an offline recipe frees after its build)."""
    kept = {id(param) for model in models for param in model.parameters()}
    return sum(param.numel() * param.element_size() for param in teacher.parameters() if id(param) not in kept)


def memory_step(recipe: str, teacher, size: Size, chunks: int, batch_size: int, device: torch.device) -> dict:
    """One loop step of `recipe` (`recipe_step`: a fresh Predictor and AdamW, its outputs as trained): the step
    function with every role due, then each role's clip and AdamW step; peak allocated / reserved on CUDA."""
    parts, item = recipe_step(recipe, teacher, size, chunks, batch_size, device)
    as_trained_(parts.models[-1])
    outside = teacher_bytes_outside(teacher, parts.models)
    release(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    metrics, norms = {}, []

    def step():
        metrics.update(parts.step_fn(item, sync=True, due=frozenset(role.name for role in parts.roles)))
        norms.extend(_grad_norm_and_clip(role.parameters, role.grad_clip, 1, role.name) for role in parts.roles)
        for role in parts.roles:
            role.step()
            role.zero_grad()

    step_s = interleaved({recipe: step}, 1, warmup=0, device=device)[recipe]["min_s"]
    record = {"recipe": recipe, "batch_size": batch_size if recipe != "rollout" else 1,
              "chunks": chunks if recipe == "rollout" else None, "step_s": step_s, "loss": float(metrics["loss"]),
              "grad_norm": norms[0], "teacher_not_in_recipe_gib": outside / GIB}
    if device.type == "cuda":
        record.update({"max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                       "max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
                       "resident_before_gib": resident / GIB})
        record["comparable_gib"] = record["max_allocated_gib"] - record["teacher_not_in_recipe_gib"]
    else:
        record.update({"max_allocated_gib": None, "max_reserved_gib": None, "resident_before_gib": None,
                       "comparable_gib": None, "note": "CPU: no caching allocator, memory not measured"})
    parts = item = None  # the Predictor and AdamW freed before the release
    release(device)
    return record


def memory_rows(teacher, size: Size, chunks: int, first_batch: int, device: torch.device, budget: Budget,
                plan_s: dict, estimates: dict) -> dict:
    rows = {}
    for recipe in RECIPES:
        if not budget.fits(f"memory {recipe}", plan_s[f"memory {recipe}"]):
            continue
        batch = first_batch
        while True:
            try:
                rows[recipe] = memory_step(recipe, teacher, size, chunks, batch, device)
                break
            except torch.cuda.OutOfMemoryError:
                release(device)
                if recipe == "rollout" or batch == 1:
                    rows[recipe] = {"recipe": recipe, "error": "out of memory", "batch_size": batch}
                    print(f"memory {recipe}: out of memory at batch {batch}", flush=True)
                    break
                print(f"memory {recipe}: batch {batch} does not fit, trying {batch // 2}", flush=True)
                batch //= 2
        rows[recipe].update(estimate_columns(estimates.get(recipe), rows[recipe].get("comparable_gib"),
                                             None if recipe == "rollout" else rows[recipe]["batch_size"]))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# 4. The plan, and real size without a GPU: shapes on fake tensors
# ---------------------------------------------------------------------------------------------------------------
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
    emulated by `runtime/memory_rehearsal.py`): {call: output shape}, the four calls' FLOPs and the rollout FLOP
    bounds of `size.chunks` chunks with the memory's context sizes, and the plan at an assumed 400 TFLOP/s Full step
    (what a GPU run then measures)."""
    from predictor_training.runtime.memory_rehearsal import Rehearsal

    device = torch.device("cpu")
    with Rehearsal(f"gpu_acceptance shapes, {size.preset}"):
        teacher = random_teacher(size.preset, device, torch.bfloat16, randomize=False)
        predictor = build_predictor(teacher, "v4", size.source_blocks, gradient_checkpointing=True)
        text_kv = random_text_kv(teacher, size, device)
        shapes = {}
        with torch.no_grad(), autocast(device, torch.bfloat16):
            for name, call in chunk_calls(teacher, predictor, text_kv, size.context_frames,
                                          (size.height, size.width), device).items():
                output = call()
                output = {"full_step": lambda: output,  # velocity [1, C, 4, H, W]
                          "context_prefill": lambda: output.layer(0).stacked()[0],  # layer 0's stacked K
                          "cache_pass": lambda: output[0][0],  # layer 0's raw K of the chunk
                          "predictor_step": lambda: output[1]}[name]()  # the velocity
                shapes[name] = list(output.shape)
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


# ---------------------------------------------------------------------------------------------------------------
# 5. Report
# ---------------------------------------------------------------------------------------------------------------
def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return str(value)
    return f"{value:.{digits}f}{suffix}"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU acceptance ({report['mode']}): {env.get('device')}", "",
             f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, device memory "
             f"{fmt(env.get('memory_gib'), 1, ' GiB')}; config {report['config']['preset']}, latents "
             f"{report['config']['height']}x{report['config']['width']}, {report['config']['text_tokens']} text "
             f"tokens; {fmt(report['elapsed_s'], 0)} s of --budget_s {report['budget_s']:.0f}", ""]
    for skip in report["skipped"]:
        lines.append(f"- {skip['line']}")
    speed = report.get("speed_calls")
    if speed:
        lines += ["", f"## Per call ({speed['context_frames']} context frames; SDPA: "
                      f"{', '.join(speed['sdpa_kernels']) or 'not seen'})", "",
                  "| call | best s | median s | GFLOP | TFLOP/s |", "| --- | ---: | ---: | ---: | ---: |"]
        for name, record in speed["calls"].items():
            lines.append(f"| {name} | {record['min_s']:.4f} | {record['median_s']:.4f} | {record['flops'] / 1e9:.3f} "
                         f"| {record['tflops']:.3f} |")
        peak = report["matmul_peak"]
        lines += ["", f"Full step: {speed['calls']['full_step']['tflops']:.1f} TFLOP/s = "
                      f"{fmt(report['full_step_fraction_of_peak'], 3)} of the measured BF16 matmul peak "
                      f"({peak['tflops']:.1f} TFLOP/s at n={peak['n']})."]
    rollouts = report.get("rollouts")
    if rollouts:
        lines += ["", f"## Rollouts ({rollouts['chunks']} chunks)", "",
                  "| rollout | DiT s | GFLOP | measured speedup | FLOP bound | fraction of bound |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, record in rollouts["rollouts"].items():
            speedup = rollouts["speedups"].get(name, {"measured": 1.0, "flop_bound": 1.0, "fraction_of_bound": 1.0})
            lines.append(f"| {name} | {record['dit_s']:.3f} | {record['flops']['total'] / 1e9:.1f} | "
                         f"{speedup['measured']:.2f}x | {speedup['flop_bound']:.2f}x | "
                         f"{speedup['fraction_of_bound']:.2f} |")
    memory = report.get("memory")
    if memory:
        lines += ["", "## Memory of one training step (GiB)", "",
                  "| recipe | batch | max allocated | max reserved | Teacher not in recipe | comparable | estimate | "
                  "estimate error |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for recipe, row in memory.items():
            if "error" in row and isinstance(row["error"], str):
                lines.append(f"| {recipe} | {row['batch_size']} | {row['error']} | | | | | |")
                continue
            lines.append(f"| {recipe} | {row['batch_size']} | {fmt(row['max_allocated_gib'])} | "
                         f"{fmt(row['max_reserved_gib'])} | {fmt(row['teacher_not_in_recipe_gib'])} | "
                         f"{fmt(row['comparable_gib'])} | {fmt(row['estimate_gib'])} | "
                         f"{fmt(None if row['estimate_error'] is None else 100 * row['estimate_error'], 1, ' %')} |")
    numerics = report.get("numerics")
    if numerics:
        conformance = numerics["conformance"]
        lines += ["", "## Numerics: BF16 vs FP32", "",
                  f"Conformance Teacher ({conformance['set']}): worst relative error "
                  f"{conformance['bf16_vs_fp32_worst_rel']:.3e}; FP32 on this device vs the golden vectors: worst "
                  f"abs {fmt(conformance['fp32_device_vs_golden_worst_abs'], 3)}", "",
                  "| output | max abs | max rel |", "| --- | ---: | ---: |"]
        for name, record in conformance["bf16_vs_fp32"].items():
            lines.append(f"| {name} | {record['max_abs']:.3e} | {record['max_rel']:.3e} |")
        if "rollout_2chunks" in numerics:
            lines += ["", "| 2-chunk rollout | max abs | max rel |", "| --- | ---: | ---: |"]
            for name, record in numerics["rollout_2chunks"]["chunks"].items():
                lines.append(f"| {name} | {record['max_abs']:.3e} | {record['max_rel']:.3e} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# 6. Main
# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.shapes:
        shapes = real_size_shapes(REAL)
        print(json.dumps(shapes, indent=2))
        return shapes
    budget = Budget(args.budget_s)
    size = TINY if args.tiny else REAL
    size = dataclasses.replace(size, offline_batch=args.offline_batch or size.offline_batch,
                               chunks=args.chunks or size.chunks)
    device = torch.device("cpu") if args.tiny else torch.device("cuda", torch.cuda.current_device())
    estimates = read_memory_estimates(args.memory_estimates)
    report = {"mode": "tiny" if args.tiny else "real", "config": dataclasses.asdict(size), "budget_s": args.budget_s,
              "environment": device_environment(device), "skipped": budget.skipped,
              "memory_estimates_file": None if args.memory_estimates is None else str(args.memory_estimates)}
    print(f"gpu_acceptance ({report['mode']}): {report['environment']['device']}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; budget {args.budget_s:.0f} s", flush=True)

    # 1. Models (always: every section needs them).
    start = budget.elapsed()
    teacher = random_teacher(size.preset, device, torch.bfloat16)
    predictor = make_predictor(teacher, size)
    text_kv = random_text_kv(teacher, size, device)
    report["build_s"] = budget.elapsed() - start
    report["teacher_parameters"] = sum(param.numel() for param in teacher.parameters())
    print(f"built the {size.preset} Teacher ({report['teacher_parameters']:,} parameters, bf16) in "
          f"{report['build_s']:.1f} s", flush=True)

    # 2. Per-call speed (its times plan the rest).
    unit = None  # seconds of one Full step at this size
    if "speed_calls" not in args.skip and budget.fits("speed_calls", 30.0 if not args.tiny else 1.0):
        report["matmul_peak"] = matmul_peak(size.matmul, device, args.repeats)
        report["speed_calls"] = speed_calls(teacher, predictor, text_kv, size, device, args.repeats)
        calls = report["speed_calls"]["calls"]
        unit = calls["full_step"]["min_s"]
        prefill = calls["context_prefill"]["min_s"]
        report["full_step_tflops"] = calls["full_step"]["tflops"]
        report["full_step_fraction_of_peak"] = calls["full_step"]["tflops"] / report["matmul_peak"]["tflops"]
        print(f"full step {unit:.4f} s ({calls['full_step']['tflops']:.1f} TFLOP/s, "
              f"{report['full_step_fraction_of_peak']:.2f} of the matmul peak), prefill {prefill:.4f} s, "
              f"SDPA {report['speed_calls']['sdpa_kernels']}", flush=True)
    # The plan: FLOPs of each section at the Full step's measured rate (an assumed rate if it was not measured).
    shape = TeacherShape.from_config(teacher.config)
    rate = (report["speed_calls"]["calls"]["full_step"]["flops"] / unit if unit is not None
            else (300e12 if not args.tiny else 1e9))
    plan = plan_seconds(rate, shape, size, predictor.predictor_config(), args.tiny)
    report["plan_s"] = plan
    report["plan_rate_tflops"] = rate / 1e12

    # 3. Memory (before the rollouts: the figures a first slot on a GPU most needs).
    if "memory" not in args.skip:
        report["memory"] = memory_rows(teacher, size, size.chunks, size.offline_batch, device, budget, plan,
                                       estimates)
        for recipe, row in report["memory"].items():
            print(f"memory {recipe}: batch {row.get('batch_size')}, max allocated {fmt(row.get('max_allocated_gib'))}"
                  f" GiB, reserved {fmt(row.get('max_reserved_gib'))} GiB, estimate {fmt(row.get('estimate_gib'))}",
                  flush=True)

    # 4. Rollouts.
    if "rollouts" not in args.skip and budget.fits("rollouts", plan["rollouts"]):
        report["rollouts"] = run_rollouts(teacher, predictor, text_kv, size, size.chunks, device)
        for name, speedup in report["rollouts"]["speedups"].items():
            print(f"{name}: {speedup['measured']:.2f}x measured, FLOP bound {speedup['flop_bound']:.2f}x "
                  f"({speedup['fraction_of_bound']:.2f} of it)", flush=True)
    del predictor
    release(device)

    # 5. Numerics.
    if "numerics" not in args.skip and budget.fits("numerics", plan["numerics"]):
        report["numerics"] = {"conformance": {"set": str(CONFORMANCE_SET.relative_to(REPO_ROOT)),
                                              **bf16_vs_fp32(CONFORMANCE_SET, device)}}
        free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
        needed = 2 * report["teacher_parameters"] * 4
        if free is not None and free < needed:
            budget.skip("numerics rollout_2chunks", f"skipped numerics rollout_2chunks: an FP32 copy of the Teacher "
                        f"needs {needed / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
        else:
            report["numerics"]["rollout_2chunks"] = bf16_vs_fp32_rollout(teacher, size.preset, text_kv,
                                                                         *camera_row(size, 2, teacher), device)
        print(f"numerics: conformance bf16 vs fp32 worst relative "
              f"{report['numerics']['conformance']['bf16_vs_fp32_worst_rel']:.3e}", flush=True)

    report["elapsed_s"] = budget.elapsed()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out_dir / "gpu_acceptance.json", report)
    write_text_atomic(args.out_dir / "gpu_acceptance.md", markdown(report))
    print(f"wrote {args.out_dir / 'gpu_acceptance.json'} and gpu_acceptance.md ({report['elapsed_s']:.0f} s)",
          flush=True)
    return report


if __name__ == "__main__":
    main()
