"""Peak memory and step time of one self-rollout training step (chunk 0 F-F-F-F + F-P-P-P chunks) vs. chunk count.

    python benchmarks/bench_rollout_memory.py                       # tiny Teacher, 2 / 4 / 8 chunks, CPU
    python benchmarks/bench_rollout_memory.py --chunks 2 4 8 --grid 4x6 --repeats 3 --device cuda

Each trained chunk runs its backward right after its forward (`self_rollout.train_trajectory`), so the graph of a
chunk is freed before the next one starts: peak memory must stay (nearly) flat as the number of chunks grows.
The context grows with the chunk index until the memory cap (20 frames, reached from chunk 5 on), so the per-chunk
peak still rises a little up to ~6 chunks (a longer attention); the "max ctx" column shows it. For contrast the same
trajectory is also measured with ONE backward over all chunks at the end (every chunk's graph
alive at once), whose peak grows with the chunk count.

Memory measure:
* CPU: the peak of live tensor bytes created during the step, tracked by the memory rehearsal's tracker
  (`predictor_training/runtime/memory_tracker.py` MemoryTracker: every op output of the forward, backward and
  checkpoint recompute, one count per storage; parameters, the Teacher and the inputs made before the step are not
  counted: this is the step's own working memory; tools/estimate_memory.py gives the whole per-GPU figure at real
  size);
* CUDA: `torch.cuda.max_memory_allocated` minus the allocation before the step.
Step time: wall time of the step (rollout + backward + AdamW), median over --repeats after one warm-up step.
Prints a table; nothing is written.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from predictor_training.rollout.ar_rollout import RolloutInputs, make_initial_noise
from predictor_training.data.synthetic import turning_camera_row
from predictor_training.rollout.memory_retrieval import make_retrieval_points
from predictor_training.predictor.model import build_predictor
from predictor_training.predictor.self_rollout import SelfRolloutSettings, SelfRolloutTrajectory, train_trajectory
from predictor_training.runtime.memory_tracker import MemoryTracker
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_


# ---- setup -------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8, 12],
                        help="chunk counts to measure (>= 2); 12 shows the plateau once the context reaches its "
                             "20-frame memory cap")
    parser.add_argument("--grid", type=str, default="4x6", help="latent grid HxW (the demo's 64x96 px -> 4x6)")
    parser.add_argument("--depth", type=int, default=2, help="Teacher double blocks of the tiny preset")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per setting (after one warm-up)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    args = parser.parse_args(argv)
    if min(args.chunks) < 2:
        parser.error(f"--chunks {args.chunks}: every count must be >= 2 (chunk 0 plus at least one trained chunk)")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected >= 1")
    try:
        args.height, args.width = (int(part) for part in args.grid.lower().split("x"))
    except ValueError:
        parser.error(f"--grid {args.grid!r}: expected HxW like 4x6")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def make_models(depth: int, device: torch.device):
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=depth)
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    teacher = teacher.to(device).eval().requires_grad_(False)
    predictor = build_predictor(teacher, "v4", (0, depth - 1))
    with torch.no_grad():  # as after offline training: the zero-initialised output layers are non-zero
        for module in (predictor.fusion.proj, predictor.residual_head.fc2):
            for param in module.parameters():
                param.normal_(0.0, 0.05)
    generator = torch.Generator().manual_seed(2)
    config = teacher.config
    with torch.no_grad():
        text_kv = teacher.text_prefill(
            torch.randn(1, 8, config.text_states_dim, generator=generator).to(device),
            torch.ones(1, 8, dtype=torch.long, device=device),
            torch.randn(1, 4, config.byt5_states_dim, generator=generator).to(device),
            torch.ones(1, 4, dtype=torch.long, device=device),
            torch.randn(1, 4, config.vision_states_dim, generator=generator).to(device),
        )
    return teacher, predictor, text_kv


def make_inputs(num_latents: int, height: int, width: int, channels: int) -> RolloutInputs:
    row = turning_camera_row(num_latents, turn=1.0, step_back=0.05)
    return RolloutInputs(
        noise=make_initial_noise(7, (1, channels, num_latents, height, width)),
        image_cond=torch.randn(1, channels, 1, height, width, generator=torch.Generator().manual_seed(3)),
        viewmats=row["viewmats"], Ks=row["Ks"], action=row["action"],
        memory_points=make_retrieval_points(7, num_points=5000),
    )


# ---- one measured step -------------------------------------------------------------------------------------------
def one_backward_over_all_chunks(trajectory: SelfRolloutTrajectory) -> None:
    """The contrast: every chunk's graph kept until a single backward at the end."""
    trajectory.run_chunk_zero()
    losses = []
    for chunk in trajectory.trained_chunks:
        graph = trajectory.run_trained_chunk(chunk)
        losses.append(graph.loss)
        trajectory.commit(graph)
    torch.stack(losses).mean().backward()


def measure(mode: str, teacher, predictor, text_kv, inputs, optimizer, device) -> tuple[int, float, int]:
    """(peak bytes, seconds, largest context in frames) of one training step in `mode` ("per_chunk" |
    "single_backward")."""
    optimizer.zero_grad(set_to_none=True)
    trajectory = SelfRolloutTrajectory(teacher, predictor, text_kv, inputs, device=device,
                                       settings=SelfRolloutSettings(velocity_weight=1.0, hidden_weight=0.1))
    context_frames = []
    prefill = trajectory.rollout.prefill_context

    def recording_prefill(chunk_index, **kwargs):
        context = prefill(chunk_index, **kwargs)
        context_frames.append(context.num_frames)
        return context

    trajectory.rollout.prefill_context = recording_prefill
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    tracker = MemoryTracker(answer_host_reads=False) if device.type == "cpu" else None
    start = time.perf_counter()
    with tracker if tracker is not None else contextlib.nullcontext():
        if mode == "per_chunk":
            train_trajectory(trajectory)
        else:
            one_backward_over_all_chunks(trajectory)
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = tracker.peak if tracker is not None else torch.cuda.max_memory_allocated(device) - before
    return peak, seconds, max(context_frames)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    teacher, predictor, text_kv = make_models(args.depth, device)
    optimizer = torch.optim.AdamW([p for p in predictor.parameters() if p.requires_grad], lr=1e-5)
    channels = teacher.config.in_channels
    print(f"tiny Teacher depth {args.depth}, hidden {teacher.config.hidden_size}, grid {args.height}x{args.width}, "
          f"device {device}, {args.repeats} timed steps (median) after 1 warm-up")
    print(f"{'chunks':>6} {'max ctx':>7} {'mode':>16} {'peak MiB':>9} {'x first':>8} {'step s':>8}")
    baseline: dict[str, int] = {}
    for chunks in args.chunks:
        inputs = make_inputs(4 * chunks, args.height, args.width, channels)
        for mode in ("per_chunk", "single_backward"):
            measure(mode, teacher, predictor, text_kv, inputs, optimizer, device)  # warm-up
            runs = [measure(mode, teacher, predictor, text_kv, inputs, optimizer, device) for _ in range(args.repeats)]
            peak = max(run[0] for run in runs)
            seconds = statistics.median(run[1] for run in runs)
            baseline.setdefault(mode, peak)
            print(f"{chunks:>6} {runs[0][2]:>7} {mode:>16} {peak / 2**20:>9.2f} {peak / baseline[mode]:>8.2f} "
                  f"{seconds:>8.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
