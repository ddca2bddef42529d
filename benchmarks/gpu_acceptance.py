#!/usr/bin/env python
"""The first hour on a GPU node: one command that proves the toolkit at real size, with no data and no weights.

    python benchmarks/gpu_acceptance.py                                   # one GPU, budget 480 s
    python benchmarks/gpu_acceptance.py --memory_estimates est.json      # + the fake-tensor estimate's error
    python benchmarks/gpu_acceptance.py --tiny --out_dir /tmp/acc         # the same code, tiny, on the CPU (tests)
    python benchmarks/gpu_acceptance.py --shapes                          # no GPU: real-size shapes on fake tensors

It builds the real `worldplay_480p_i2v` Teacher (8.6B parameters) with random BF16 weights on the device and the v4
/ disca Predictors on it (`predictor/model.py build_predictor`), then measures, within `--budget_s` (sections that
do not fit in what is left are skipped with a line saying so; the plan is each section's FLOP count at the Full
step's measured rate; sections run in the order per-call speed, memory, rollouts, numerics):

1. environment: device, memory, torch / CUDA / cuDNN versions, and which SDPA kernel a Full step ran (read from the
   profiler's op names: flash, memory-efficient, cuDNN or math);
2. speed, per call (best and median of --repeats after one warm-up, the calls interleaved so load hits them alike):
   a Full step on a chunk with a full context, the exact context prefill, the incremental mode's K/V pass over a
   finished chunk, and a v4 Predictor step (the Teacher's own methods and the Predictor's forward); the Full step's
   TFLOP/s (`teacher/flops.py`) and its fraction of the device's BF16 peak, measured on a large matmul;
3. speed, rollouts: one --chunks-chunk rollout each of F-F-F-F (exact context), F-P-P-P (exact) and F-P-P-P
   (incremental context), run by the eval's own `TimedRollout` (`rollout/ar_rollout.py ARRollout`) and step
   functions (`eval/methods.py`), side by side after a one-chunk warm-up of each; the measured DiT speedup next to
   the FLOP bound of the same context sizes (`rollout_flops`) and their ratio (the goal: >= 0.9 for F-P-P-P);
4. memory: one training step each of v4 offline (batch --offline_batch, halved until it fits), disca offline (the
   recipes' `pair_step`) and the rollout recipe (`self_rollout.trajectory_for_row` + `train_trajectory`, F-P-P-P,
   --chunks chunks), each with the loop's clip and AdamW step: `torch.cuda.max_memory_allocated` /
   `max_memory_reserved`, next to the fake-tensor estimate of `tools/estimate_memory.py --json` when
   `--memory_estimates FILE` is given (its relative error). This process also holds the whole Teacher, which the
   offline recipes do not (they keep only the Predictor's frozen parts): its bytes are reported apart
   (`teacher_not_in_recipe_gib`) and subtracted in `comparable_gib`, the figure compared with the estimate;
5. numerics: the conformance Teacher (`tests/data/conformance/worldplay_tiny_A`, `conformance/calls.py`) on the
   device in BF16 against FP32 on the stored inputs (context prefill and every stored chunk step: max abs and
   relative error per output, relative = max |bf16 - fp32| / max |fp32|), plus FP32 on the device against the golden
   vectors; and a 2-chunk rollout of the real-size Teacher in BF16 (BF16 state and autocast, as the eval runs it)
   against the same weights in FP32.

Writes `<out_dir>/gpu_acceptance.json` and `<out_dir>/gpu_acceptance.md` (atomically). Refuses to start without
CUDA unless given --tiny, which runs the same code with the tiny Teacher preset on the CPU (float32 weights made BF16
as on the GPU; the memory figures are then not measured: CPU has no caching allocator). What only a GPU run shows:
every real-size figure; --tiny only keeps the code working.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import platform
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from predictor_training.conformance.calls import (
    build_model as build_conformance_model,
    load_conformance_set,
    reference_context_kv,
    reference_text_kv,
)
from predictor_training.data.synthetic import offline_batch, trajectory_row
from predictor_training.eval.methods import PredictorMethod, ReferenceMethod, make_step_fn
from predictor_training.eval.timing import Stopwatch, TimedRollout
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.pair_step import pair_step
from predictor_training.predictor.self_rollout import (
    SelfRolloutSettings,
    train_trajectory,
    trajectory_for_row,
)
from predictor_training.rollout.ar_rollout import RolloutConfig, RolloutInputs
from predictor_training.rollout.schedule import Schedule
from predictor_training.runtime.io import write_json_atomic, write_text_atomic
from predictor_training.runtime.optim import BLOCKS_GROUP, FUSION_GROUP, build_optimizer
from predictor_training.runtime.precision import autocast, precision_policy, synchronize
from predictor_training.runtime.timing import interleaved
from predictor_training.teacher import (
    ContextKV,
    LayerContextKV,
    TextKV,
    WorldPlayTransformer,
    randomize_zero_initialised_,
)
from predictor_training.teacher.flops import (
    TeacherShape,
    context_prefill_flops,
    flop_speedup_bound,
    frame_kv_pass_flops,
    predictor_step_flops,
    rollout_flops,
    teacher_chunk_step_flops,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFORMANCE_SET = REPO_ROOT / "tests" / "data" / "conformance" / "worldplay_tiny_A"
GIB = 2 ** 30
CHUNK_FRAMES = 4
CONTEXT_TIMESTEP = 14.0
RECIPES = ("v4", "disca", "rollout")
ROLLOUTS = {  # name: (replace_steps, context mode)
    "F-F-F-F exact": ((), "exact"),
    "F-P-P-P exact": ((1, 2, 3), "exact"),
    "F-P-P-P incremental": ((1, 2, 3), "incremental"),
}
REFERENCE_ROLLOUT = "F-F-F-F exact"


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


# ---------------------------------------------------------------------------------------------------------------
# 0. Budget, timing helpers
# ---------------------------------------------------------------------------------------------------------------
class Budget:
    """Wall time left for the measurements; `fits(section, estimate_s)` says whether to run it and records a skip."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()
        self.skipped: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def fits(self, section: str, estimate_s: float) -> bool:
        if estimate_s <= self.left():
            return True
        line = (f"skipped {section}: planned {estimate_s:.0f} s, {max(self.left(), 0):.0f} s of --budget_s "
                f"{self.seconds:.0f} left")
        print(line, flush=True)
        self.skipped.append({"section": section, "planned_s": estimate_s, "left_s": max(self.left(), 0.0),
                             "line": line})
        return False


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# 1. Models and inputs
# ---------------------------------------------------------------------------------------------------------------
def build_teacher(size: Size, device: torch.device, dtype: torch.dtype, randomize: bool = True) -> WorldPlayTransformer:
    """The preset's Teacher made directly on `device` in `dtype`, random weights (the upstream zero-initialised
    layers randomised too, so every path affects the output), frozen, eval."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            teacher = WorldPlayTransformer.from_preset(size.preset)
    finally:
        torch.set_default_dtype(previous)
    if randomize:
        with torch.no_grad():
            randomize_zero_initialised_(teacher, torch.Generator(device=device).manual_seed(1))
    return teacher.eval().requires_grad_(False)


def make_predictor(teacher, variant: str, size: Size):
    """`build_predictor` (FP32 copies of the source blocks, gradient checkpointing as the recipes), its zero-
    initialised outputs made non-zero as after training."""
    torch.manual_seed(2)
    predictor = build_predictor(teacher, variant, size.source_blocks, gradient_checkpointing=True)
    with torch.no_grad():
        for module in (predictor.fusion.proj, predictor.residual_head.fc2):
            for param in module.parameters():
                param.normal_(0.0, 0.02)
    return predictor


def random_text_kv(teacher, size: Size, device: torch.device) -> TextKV:
    generator = torch.Generator(device=device).manual_seed(3)
    shape = (teacher.num_layers, teacher.heads_num, size.text_tokens, teacher.head_dim)
    k = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    v = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return TextKV.from_layer_stack(k, v, device, teacher.dtype)


def frame_inputs(teacher, frames: int, size: Size, device: torch.device, dtype: torch.dtype, seed: int):
    """Model input [1, 2C+1, frames, H, W], timestep [frames], action [1, frames], viewmats, Ks (as the AR loop
    passes them)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    channels = teacher.config.in_channels
    hidden_states = torch.randn(1, 2 * channels + 1, frames, size.height, size.width, generator=generator,
                                device=device, dtype=torch.float32).to(dtype)
    viewmats = torch.eye(4, device=device).repeat(1, frames, 1, 1)
    viewmats[0, :, 2, 3] = -0.1 * torch.arange(frames, device=device)
    Ks = torch.tensor([[0.5, 0, 0.5], [0, 0.9, 0.5], [0, 0, 1.0]], device=device).repeat(1, frames, 1, 1)
    action = torch.zeros(1, frames, dtype=torch.long, device=device)
    return hidden_states, torch.full((frames,), 500.0, device=device), action, viewmats, Ks


def camera_row(size: Size, chunks: int, channels: int):
    """A sample-table row (seed, poses, actions) of `chunks` chunks whose camera turns and advances, so the memory
    selection has work to do, and its image condition (`data/synthetic.py`)."""
    return trajectory_row(chunks, (size.height, size.width), channels, generator=torch.Generator().manual_seed(4))


def rollout_inputs(item: dict, image_cond: torch.Tensor, state_dtype: torch.dtype) -> RolloutInputs:
    return RolloutInputs.from_seed(item["seed"], image_cond, item["viewmats"], item["Ks"], item["action"],
                                   state_dtype=state_dtype)


# ---------------------------------------------------------------------------------------------------------------
# 2. Environment
# ---------------------------------------------------------------------------------------------------------------
SDPA_KERNELS = {  # profiler op name fragment -> kernel
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "memory-efficient",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_attention_math": "math",
}


def sdpa_kernels(call) -> list[str]:
    """The SDPA kernels `call()` dispatched to, read from the profiler's op names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        call()
    names = {event.name for event in profile.events()}
    found = []
    for fragment, kernel in SDPA_KERNELS.items():
        if any(name.endswith(fragment) or name == f"aten::{fragment}" for name in names) and kernel not in found:
            found.append(kernel)
    if "flash (CPU)" in found and "flash" in found:
        found.remove("flash")
    return found


def environment(device: torch.device) -> dict:
    record = {"device_type": device.type, "torch": torch.__version__, "python": platform.python_version(),
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
              else None}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        record.update({"device": properties.name, "memory_gib": properties.total_memory / GIB,
                       "capability": f"{properties.major}.{properties.minor}",
                       "multiprocessors": properties.multi_processor_count,
                       "driver_visible_devices": torch.cuda.device_count()})
        record["sdpa_enabled"] = {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                  "memory_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                  "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                  "math": torch.backends.cuda.math_sdp_enabled()}
    else:
        record.update({"device": platform.processor() or platform.machine(), "memory_gib": None,
                       "threads": torch.get_num_threads()})
    return record


# ---------------------------------------------------------------------------------------------------------------
# 3. Speed
# ---------------------------------------------------------------------------------------------------------------
def measured_matmul_peak(size: Size, device: torch.device, repeats: int) -> dict:
    """BF16 TFLOP/s of an n x n x n matmul (best of `repeats` after a warm-up): the device's achievable peak."""
    n = size.matmul
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    loops = 10 if device.type == "cuda" else 1
    result = interleaved({"matmul": lambda: [a @ b for _ in range(loops)]}, repeats, device=device)["matmul"]
    seconds = result["min_s"] / loops
    return {"n": n, "seconds": seconds, "tflops": 2 * n ** 3 / seconds / 1e12}


def timed_calls(teacher, predictor, text_kv, size: Size, device: torch.device) -> dict:
    """{name: call} of the four per-call timings (inputs made once): the Full step with size.context_frames of
    context, the context prefill of those frames, the incremental K/V pass over a finished chunk, a v4 Predictor
    step. Each call returns its output (for the shape check)."""
    dtype = teacher.dtype
    n = size.context_frames
    context = frame_inputs(teacher, n, size, device, dtype, seed=5)
    chunk = frame_inputs(teacher, CHUNK_FRAMES, size, device, dtype, seed=6)
    context_timestep = torch.full((n,), CONTEXT_TIMESTEP, device=device)
    blocks = predictor.source_blocks
    tokens = CHUNK_FRAMES * size.height * size.width
    run_autocast = autocast(device, torch.bfloat16)
    with torch.no_grad(), run_autocast:
        context_kv, _ = teacher.context_prefill(context[0], context_timestep, *context[2:], text_kv)
        anchor = torch.randn(1, tokens, teacher.config.hidden_size, device=device, dtype=torch.float32).to(dtype)
        previous_hidden = torch.randn_like(anchor)

    def full_step():
        return teacher.chunk_step(*chunk, text_kv, context_kv=context_kv)

    def prefill():
        return teacher.context_prefill(context[0], context_timestep, *context[2:], text_kv)[0]

    def cache_pass():
        return teacher.frame_kv_pass(chunk[0], torch.full((CHUNK_FRAMES,), CONTEXT_TIMESTEP, device=device),
                                     *chunk[2:], text_kv, context_kv=context_kv)

    def predictor_step():
        return predictor(chunk[0], anchor, chunk[1][None], chunk[2], chunk[3], chunk[4], text_kv.select(blocks),
                         context=context_kv.select(blocks), prev_chunk_hidden=previous_hidden)

    return {"full_step": full_step, "context_prefill": prefill, "cache_pass": cache_pass,
            "predictor_step": predictor_step}


def speed_calls(teacher, predictor, text_kv, size: Size, device: torch.device, repeats: int) -> dict:
    """Per-call times of `timed_calls`, side by side; FLOPs (teacher/flops.py) and TFLOP/s of each."""
    n = size.context_frames
    calls = timed_calls(teacher, predictor, text_kv, size, device)
    with torch.no_grad(), autocast(device, torch.bfloat16):
        kernels = sdpa_kernels(calls["full_step"])
        results = interleaved(calls, repeats, device=device)
    shape = TeacherShape.from_config(teacher.config)
    per_frame = size.height * size.width
    flops = {"full_step": teacher_chunk_step_flops(shape, per_frame, size.text_tokens, n, CHUNK_FRAMES),
             "context_prefill": context_prefill_flops(shape, per_frame, size.text_tokens, n),
             "cache_pass": frame_kv_pass_flops(shape, per_frame, size.text_tokens, n, CHUNK_FRAMES),
             "predictor_step": predictor_step_flops(shape, predictor.predictor_config(), per_frame, size.text_tokens,
                                                    n, CHUNK_FRAMES)}
    for name, record in results.items():
        record["flops"] = flops[name]
        record["tflops"] = flops[name] / record["min_s"] / 1e12
    return {"context_frames": n, "text_tokens": size.text_tokens, "calls": results, "sdpa_kernels": kernels}


def run_rollouts(teacher, predictor, text_kv, size: Size, chunks: int, device: torch.device) -> dict:
    """One `chunks`-chunk rollout of each of ROLLOUTS with the eval's TimedRollout and step functions, after an
    untimed one-chunk warm-up of each; DiT seconds, FLOPs, measured speedup vs the reference and the FLOP bound."""
    item, image_cond = camera_row(size, chunks, teacher.config.out_channels)
    base = RolloutConfig(state_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)
    checkpoint = SimpleNamespace(method="predictor", panel="random v4", predictor_config=predictor.predictor_config())
    predictor_method = PredictorMethod(predictor, checkpoint)
    predictor.eval()
    shape = TeacherShape.from_config(teacher.config)
    records, context_frames = {}, None

    def one(name: str, chunk_range=None):
        replace_steps, mode = ROLLOUTS[name]
        config = dataclasses.replace(base, context_mode=mode)
        schedule = Schedule.for_rollout(replace_steps, config)
        method = ReferenceMethod() if not replace_steps else predictor_method
        stopwatch = Stopwatch(device)
        rollout = TimedRollout(teacher, text_kv, rollout_inputs(item, image_cond, config.state_dtype), config,
                               device=device, stopwatch=stopwatch)
        step_fn = make_step_fn(method, schedule, stopwatch, lambda: autocast(device, torch.bfloat16))
        with torch.no_grad(), stopwatch.measure("rollout"):
            rollout.run(step_fn, chunk_range)
        return rollout, stopwatch, schedule

    for name in ROLLOUTS:  # warm-up: one chunk with context of each (kernels, allocator)
        one(name, range(2))
    for name in ROLLOUTS:
        rollout, stopwatch, schedule = one(name)
        summary = stopwatch.summary()
        if context_frames is None:
            context_frames = rollout.context_frames
        elif rollout.context_frames != context_frames:
            raise RuntimeError(f"{name} selected context sizes {rollout.context_frames}, the reference "
                               f"{context_frames}: the memory selection must not depend on the schedule")
        replace_steps, mode = ROLLOUTS[name]
        flops = rollout_flops(shape, size.height * size.width, size.text_tokens, context_frames,
                              lambda chunk, step, schedule=schedule: "predictor" if schedule.replaces(chunk, step)
                              else "full", num_steps=base.num_steps, chunk_frames=base.chunk_latents,
                              predictor_config=predictor.predictor_config(), context_mode=mode)
        records[name] = {"dit_s": summary["rollout"]["total_s"], "flops": flops, "context_frames": context_frames,
                         "calls": {key: value for key, value in summary.items() if key != "rollout"}}
    reference = records[REFERENCE_ROLLOUT]
    speedups = {}
    for name, record in records.items():
        if name == REFERENCE_ROLLOUT:
            continue
        measured = reference["dit_s"] / record["dit_s"]
        bound = flop_speedup_bound(reference["flops"]["total"], record["flops"]["total"])
        speedups[name] = {"measured": measured, "flop_bound": bound, "fraction_of_bound": measured / bound}
    return {"chunks": chunks, "rollouts": records, "speedups": speedups}


# ---------------------------------------------------------------------------------------------------------------
# 4. Memory of one training step
# ---------------------------------------------------------------------------------------------------------------
def predictor_optimizer(predictor):
    groups = predictor.trainable_parameter_groups()
    return build_optimizer(groups, {FUSION_GROUP: 1e-4, BLOCKS_GROUP: 1e-5}, betas=(0.9, 0.999), weight_decay=0.01)


def optimizer_step(predictor, optimizer) -> float:
    """The loop's clip + AdamW step; returns the gradient norm."""
    parameters = [param for group in optimizer.param_groups for param in group["params"]]
    norm = float(torch.nn.utils.clip_grad_norm_(parameters, 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def teacher_bytes_outside(teacher, predictor) -> int:
    """Bytes of Teacher parameters the Predictor does not hold (what an offline recipe frees after building it)."""
    kept = {id(param) for param in predictor.parameters()}
    return sum(param.numel() * param.element_size() for param in teacher.parameters() if id(param) not in kept)


def memory_step(recipe: str, teacher, size: Size, chunks: int, batch_size: int, device: torch.device) -> dict:
    """One training step of `recipe` on a fresh Predictor and AdamW: peak allocated / reserved on CUDA."""
    policy = precision_policy("fp32master", device)
    predictor = make_predictor(teacher, "disca" if recipe == "disca" else "v4", size).train()
    optimizer = predictor_optimizer(predictor)
    outside = teacher_bytes_outside(teacher, predictor)
    release(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    start = time.perf_counter()
    if recipe in ("v4", "disca"):
        batch = offline_batch(recipe, teacher.config, batch_size=batch_size, n_ctx=size.context_frames,
                              text_tokens=size.text_tokens, grid=(size.height, size.width),
                              source_blocks=size.source_blocks, device=device,
                              generator=torch.Generator(device=device).manual_seed(9))
        metrics = pair_step(batch, sync=True, due=frozenset({"predictor"}), model=predictor, predictor=predictor,
                            policy=policy, context_timestep=CONTEXT_TIMESTEP, velocity_weight=1.0, hidden_weight=0.1)
    else:
        item, image_cond = camera_row(size, chunks, teacher.config.out_channels)
        config = RolloutConfig(state_dtype=policy.frozen_dtype, autocast_dtype=policy.autocast_dtype)
        settings = SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1,
                                       predictor_autocast_dtype=policy.autocast_dtype, replace_steps=(1, 2, 3))
        case = {"text_k": None, "text_v": None, "image_cond": image_cond}
        generator = torch.Generator(device=device).manual_seed(3)
        shape = (teacher.num_layers, teacher.heads_num, size.text_tokens, teacher.head_dim)
        case["text_k"] = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        case["text_v"] = torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)
        trajectory = trajectory_for_row(item, case, teacher=teacher, predictor=predictor, config=config,
                                        settings=settings, device=device)
        metrics = train_trajectory(trajectory, sync=True)
        del trajectory
    grad_norm = optimizer_step(predictor, optimizer)
    synchronize(device)
    record = {"recipe": recipe, "batch_size": batch_size if recipe != "rollout" else 1,
              "chunks": chunks if recipe == "rollout" else None, "step_s": time.perf_counter() - start,
              "loss": float(metrics["loss"]), "grad_norm": grad_norm,
              "teacher_not_in_recipe_gib": outside / GIB if recipe != "rollout" else 0.0}
    if device.type == "cuda":
        record.update({"max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
                       "max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
                       "resident_before_gib": resident / GIB})
        record["comparable_gib"] = record["max_allocated_gib"] - record["teacher_not_in_recipe_gib"]
    else:
        record.update({"max_allocated_gib": None, "max_reserved_gib": None, "resident_before_gib": None,
                       "comparable_gib": None, "note": "CPU: no caching allocator, memory not measured"})
    del predictor, optimizer
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
        estimate = estimates.get(recipe)
        row = rows[recipe]
        row["estimate_gib"] = None if estimate is None else estimate["gib"]
        row["estimate_name"] = None if estimate is None else estimate["name"]
        row["estimate_batch_matches"] = None
        row["estimate_error"] = None
        if estimate is not None and row.get("comparable_gib") is not None:
            row["estimate_error"] = (estimate["gib"] - row["comparable_gib"]) / row["comparable_gib"]
            if recipe != "rollout" and estimate.get("batch_size") is not None:
                row["estimate_batch_matches"] = estimate["batch_size"] == row["batch_size"]
    return rows


def read_memory_estimates(path: Path | None) -> dict:
    """{recipe: {"gib", "name", "batch_size"}} from `tools/estimate_memory.py --json` output: JSON lines, a list or
    one object of its report objects (`name` starting with "v4", "disca" or "rollout"; `peak_rounded_gib`, else
    `peak_gib`), or a plain {recipe: GiB} object."""
    if path is None:
        return {}
    text = path.read_text(encoding="utf-8").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise ValueError(f"--memory_estimates {path}: neither JSON nor JSON lines ({error})") from None
    if isinstance(data, dict) and all(key in RECIPES for key in data):
        reports = []
        for recipe, value in data.items():
            reports.append({"name": recipe, "peak_gib": value} if isinstance(value, (int, float))
                           else {"name": recipe, **value})
    else:
        reports = data if isinstance(data, list) else [data]
    estimates = {}
    for report in reports:
        if not isinstance(report, dict) or "name" not in report:
            raise ValueError(f"--memory_estimates {path}: expected report objects with a 'name', got {report!r:.200}")
        recipe = next((name for name in RECIPES if str(report["name"]).startswith(name)), None)
        gib = report.get("peak_rounded_gib", report.get("peak_gib"))
        if recipe is None or gib is None:
            raise ValueError(f"--memory_estimates {path}: report {report['name']!r} names no recipe of {RECIPES} or "
                             "has no peak_rounded_gib / peak_gib")
        batch = None
        if "batch" in str(report["name"]):
            after = str(report["name"]).split("batch", 1)[1].strip().split(",")[0]
            batch = int(after) if after.isdigit() else None
        estimates.setdefault(recipe, {"gib": float(gib), "name": report["name"], "batch_size": batch})
    return estimates


# ---------------------------------------------------------------------------------------------------------------
# 5. Numerics
# ---------------------------------------------------------------------------------------------------------------
def difference(got: torch.Tensor, reference: torch.Tensor) -> dict:
    got, reference = got.detach().double().cpu(), reference.detach().double().cpu()
    error = (got - reference).abs().max().item() if got.numel() else 0.0
    scale = reference.abs().max().item() if reference.numel() else 0.0
    return {"max_abs": error, "max_rel": error / scale if scale > 0 else (0.0 if error == 0 else math.inf),
            "finite": bool(torch.isfinite(got).all())}


def conformance_outputs(model, cset, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The set's context prefill and every stored chunk step (teacher-forced on the stored caches, as
    conformance/calls.py runs them) on `device`: the latents and the K/V caches in `dtype`, timesteps and cameras in
    their stored dtype, under `dtype` autocast (as the AR loop runs a BF16 Teacher): {output name: tensor}."""
    def move(tensor):
        tensor = tensor.to(device)
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != torch.float64 else tensor

    def keep(tensor):
        return tensor.to(device)

    text_kv = reference_text_kv(cset)
    text_kv = TextKV([move(k) for k in text_kv.k], [move(v) for v in text_kv.v], text_kv.mask)
    outputs = {}
    with torch.no_grad(), autocast(device, dtype):
        context_kv, _ = model.context_prefill(
            move(cset.tensor("ctx.hidden_states")), keep(cset.tensor("ctx.timestep")), keep(cset.tensor("ctx.action")),
            keep(cset.tensor("ctx.viewmats")), keep(cset.tensor("ctx.Ks")), text_kv)
        for index in range(context_kv.num_layers):
            k, v = context_kv.layer(index).stacked()
            outputs[f"ctx.layer{index}.k_vision"], outputs[f"ctx.layer{index}.v_vision"] = k, v
        stored_context = reference_context_kv(cset)
        for group, params in cset.info["chunk_steps"].items():
            hidden_states = cset.tensor(f"{group}.hidden_states")
            rope_start = int(params["start_rope_start_idx"])
            context_frames = int(params["rope_temporal_size"]) - hidden_states.shape[2]
            context = None
            if context_frames > 0:
                context = ContextKV([LayerContextKV.from_stacked(*[move(t) for t in layer.stacked()])
                                     for layer in stored_context.layers], num_frames=stored_context.num_frames)
            output = model.chunk_step(
                move(hidden_states), keep(cset.tensor(f"{group}.timestep")), keep(cset.tensor(f"{group}.action")),
                keep(cset.tensor(f"{group}.viewmats")), keep(cset.tensor(f"{group}.Ks")), text_kv,
                context_kv=context, rope_start=rope_start, return_final_hidden=True)
            outputs[f"{group}.velocity"], outputs[f"{group}.final_hidden"] = output.velocity, output.final_hidden
    return outputs


def conformance_numerics(device: torch.device) -> dict:
    """BF16 vs FP32 of the conformance Teacher on the device, and FP32 on the device vs the golden vectors."""
    cset = load_conformance_set(CONFORMANCE_SET)
    fp32 = build_conformance_model(cset).to(device)
    reference = conformance_outputs(fp32, cset, device, torch.float32)
    bf16 = build_conformance_model(cset).to(device=device, dtype=torch.bfloat16)
    lower = conformance_outputs(bf16, cset, device, torch.bfloat16)
    per_output = {name: difference(lower[name], reference[name]) for name in reference}
    golden = {name: difference(reference[name], cset.tensor(name)) for name in reference if name in cset.vectors}
    return {"set": str(CONFORMANCE_SET.relative_to(REPO_ROOT)), "bf16_vs_fp32": per_output,
            "bf16_vs_fp32_worst_rel": max(record["max_rel"] for record in per_output.values()),
            "fp32_device_vs_golden_worst_abs": max((record["max_abs"] for record in golden.values()), default=None),
            "fp32_device_vs_golden": golden}


def rollout_numerics(teacher, text_kv, size: Size, device: torch.device) -> dict:
    """A 2-chunk F-F-F-F rollout of the run's Teacher in BF16 (state and autocast, as the eval runs it) against
    the same weights in FP32 (FP32 state, no autocast): per-chunk max abs / relative error of the final latents."""
    item, image_cond = camera_row(size, 2, teacher.config.out_channels)
    results = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model = teacher
        if dtype != teacher.dtype:  # the same weights in FP32
            model = build_teacher(size, device, dtype)
            model.load_state_dict(teacher.state_dict())
        kv = text_kv if dtype == teacher.dtype else TextKV([k.to(dtype) for k in text_kv.k],
                                                           [v.to(dtype) for v in text_kv.v], text_kv.mask)
        config = RolloutConfig(state_dtype=dtype, autocast_dtype=None if dtype == torch.float32 else dtype)
        rollout = TimedRollout(model, kv, rollout_inputs(item, image_cond, dtype), config, device=device,
                               stopwatch=Stopwatch(device))
        with torch.no_grad():
            results[name] = rollout.run().float().cpu()
        if model is not teacher:
            del model, kv
            release(device)
    chunks = {}
    for chunk in range(2):
        frames = slice(chunk * CHUNK_FRAMES, (chunk + 1) * CHUNK_FRAMES)
        chunks[f"chunk{chunk}"] = difference(results["bf16"][:, :, frames], results["fp32"][:, :, frames])
    return {"chunks": chunks, "whole": difference(results["bf16"], results["fp32"])}


# ---------------------------------------------------------------------------------------------------------------
# 5b. Real size without a GPU: shapes on fake tensors, and the plan
# ---------------------------------------------------------------------------------------------------------------
def rollout_totals(shape: TeacherShape, size: Size, chunks: int, predictor_config: dict) -> dict[str, int]:
    """DiT FLOPs of each rollout of ROLLOUTS over `chunks` chunks, chunk c with min(4c, 20) context frames (the
    memory rule; what the measured run's context sizes are when the selection keeps the cap)."""
    context_frames = [min(CHUNK_FRAMES * chunk, 20) for chunk in range(chunks)]
    totals = {}
    for name, (replace_steps, mode) in ROLLOUTS.items():
        schedule = Schedule(tuple(replace_steps))
        totals[name] = rollout_flops(shape, size.height * size.width, size.text_tokens, context_frames,
                                     lambda chunk, step, schedule=schedule: "predictor" if schedule.replaces(chunk, step)
                                     else "full", predictor_config=predictor_config, context_mode=mode)["total"]
    return totals


def plan_seconds(rate: float, shape: TeacherShape, size: Size, predictor_config: dict, tiny: bool) -> dict:
    """Planned seconds of each section from FLOP counts (teacher/flops.py) at `rate` FLOP/s (the Full step's
    measured rate, or an assumed one before it is measured), with a margin for what the count leaves out (memory
    selection, allocation, launch overhead) and, on the GPU, a fixed cost per section. FP32 runs at 1/12 of BF16
    (no TF32)."""
    fixed = 0.0 if tiny else 5.0
    per_frame, n = size.height * size.width, size.context_frames
    v4_step = predictor_step_flops(shape, predictor_config, per_frame, size.text_tokens, n)
    disca_step = predictor_step_flops(shape, {**predictor_config, "variant": "disca"}, per_frame, size.text_tokens, n)
    totals = rollout_totals(shape, size, size.chunks, predictor_config)
    warm_up = rollout_totals(shape, size, 2, predictor_config)
    two_chunks = warm_up[REFERENCE_ROLLOUT]
    margin = 1.3
    return {
        # forward + recompute + backward (~4 forwards) of the batch, then AdamW
        "memory v4": margin * 4 * size.offline_batch * v4_step / rate + fixed,
        "memory disca": margin * 4 * size.offline_batch * disca_step / rate + fixed,
        # the F-P-P-P rollout plus the Predictor steps' recompute and backward
        "memory rollout": margin * 1.5 * totals["F-P-P-P exact"] / rate + fixed,
        "rollouts": margin * (sum(totals.values()) + sum(warm_up.values())) / rate + fixed,
        "numerics": margin * (1 + 12) * two_chunks / rate + 2 * fixed,
    }


def real_size_shapes(size: Size = REAL) -> dict:
    """The per-call timings' code at `size` on fake tensors (nothing allocated, CPU only; the CUDA autocast rules
    emulated by `runtime/memory_rehearsal.py`): {call: output shape}, the four calls' FLOPs and the rollout FLOP
    bounds of `size.chunks` chunks with the memory's context sizes, and the plan at an assumed 400 TFLOP/s Full step
    (what a GPU run then measures)."""
    from predictor_training.runtime.memory_rehearsal import Rehearsal

    device = torch.device("cpu")
    with Rehearsal(f"gpu_acceptance shapes, {size.preset}"):
        teacher = build_teacher(size, device, torch.bfloat16, randomize=False)
        predictor = build_predictor(teacher, "v4", size.source_blocks, gradient_checkpointing=True)
        text_kv = random_text_kv(teacher, size, device)
        shapes = {}
        with torch.no_grad(), autocast(device, torch.bfloat16):
            for name, call in timed_calls(teacher, predictor, text_kv, size, device).items():
                output = call()
                output = {"full_step": lambda: output,  # velocity [1, C, 4, H, W]
                          "context_prefill": lambda: output.layer(0).stacked()[0],  # layer 0's stacked K
                          "cache_pass": lambda: output[0][0],  # layer 0's raw K of the chunk
                          "predictor_step": lambda: output[1]}[name]()  # the velocity
                shapes[name] = list(output.shape)
    shape = TeacherShape.from_config(teacher.config)
    per_frame = size.height * size.width
    flops = {"full_step": teacher_chunk_step_flops(shape, per_frame, size.text_tokens, size.context_frames),
             "context_prefill": context_prefill_flops(shape, per_frame, size.text_tokens, size.context_frames)}
    context_frames = [min(CHUNK_FRAMES * chunk, 20) for chunk in range(size.chunks)]
    totals = rollout_totals(shape, size, size.chunks, predictor.predictor_config())
    bounds = {name: flop_speedup_bound(totals[REFERENCE_ROLLOUT], total) for name, total in totals.items()
              if name != REFERENCE_ROLLOUT}
    assumed = 400e12
    plan = plan_seconds(assumed, shape, size, predictor.predictor_config(), tiny=False)
    return {"shapes": shapes, "flops": flops, "context_frames": context_frames, "flop_bounds": bounds,
            "assumed_tflops": assumed / 1e12, "plan_s": plan,
            "teacher_parameters": sum(param.numel() for param in teacher.parameters())}


# ---------------------------------------------------------------------------------------------------------------
# 6. Report
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
# 7. Main
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
              "environment": environment(device), "skipped": budget.skipped,
              "memory_estimates_file": None if args.memory_estimates is None else str(args.memory_estimates)}
    print(f"gpu_acceptance ({report['mode']}): {report['environment']['device']}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; budget {args.budget_s:.0f} s", flush=True)

    # 1. Models (always: every section needs them).
    start = time.perf_counter()
    teacher = build_teacher(size, device, torch.bfloat16)
    predictor = make_predictor(teacher, "v4", size)
    text_kv = random_text_kv(teacher, size, device)
    report["build_s"] = time.perf_counter() - start
    report["teacher_parameters"] = sum(param.numel() for param in teacher.parameters())
    print(f"built the {size.preset} Teacher ({report['teacher_parameters']:,} parameters, bf16) in "
          f"{report['build_s']:.1f} s", flush=True)

    # 2. Per-call speed (its times plan the rest).
    unit = None  # seconds of one Full step at this size
    if "speed_calls" not in args.skip and budget.fits("speed_calls", 30.0 if not args.tiny else 1.0):
        report["matmul_peak"] = measured_matmul_peak(size, device, args.repeats)
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
        report["numerics"] = {"conformance": conformance_numerics(device)}
        free = (torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
        needed = 2 * report["teacher_parameters"] * 4
        if free is not None and free < needed:
            line = (f"skipped numerics rollout_2chunks: an FP32 copy of the Teacher needs {needed / GIB:.1f} GiB, "
                    f"{free / GIB:.1f} GiB free")
            print(line, flush=True)
            budget.skipped.append({"section": "numerics rollout_2chunks", "planned_s": 0.0, "left_s": budget.left(),
                                   "line": line})
        else:
            report["numerics"]["rollout_2chunks"] = rollout_numerics(teacher, text_kv, size, device)
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
