"""Running one video: timing, the timed AR rollout, VAE decoding, the ground truth and the per-video result record.

Timings (CUDA synchronised around every timed call; perf_counter on the CPU; a warm-up rollout runs first and is
not counted): text prefill, context prefill, Full step, Predictor / reuse step, VAE decode, the rollout, and the
end-to-end time of each method (text prefill + rollout + VAE decode). Next to the measured speedups stands the
FLOP-count bound of `predictor_training.flops` (DiT work only: the VAE decode is the same for every method).

A method of another context mode (`Method.context_mode`, predictor_training/frame_kv_cache.py) rolls out with that
mode; its context is then assembled from cached K/V (timed as "context_assembly" instead of "context_prefill") and
each finished chunk but the last is cached for later chunks (timed as "context_cache"), and its FLOPs are counted
for that mode.

Ground truth (optional): one video per row in a folder, `<folder>/<key>/` (PNG frames) or `<folder>/<key>.mp4`, key =
`video_key(case_id, action_id)`, with the decoded videos' frame count and size. Every method is then also scored
against it, and so is the `repeat_first_frame` baseline (its first frame held for the whole video).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from predictor_training.ar_rollout import ARRollout, ChunkContext, RolloutConfig, RolloutInputs
from predictor_training.eval.methods import (
    REFERENCE,
    REPEAT_FIRST_FRAME,
    Method,
    PredictorMethod,
    Schedule,
    make_step_fn,
    method_step_kind,
)
from predictor_training.flops import TeacherShape, rollout_flops, text_prefill_flops
from predictor_training.precision import autocast, synchronize
from predictor_training.teacher import TextKV, WorldPlayTransformer
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.video_io import read_video
from predictor_training.video_metrics import (
    LpipsScorer,
    chunk_frame_ranges,
    compute_video_metrics,
    summarize_frame_range,
)

RESULT_FORMAT = "predictor_training.eval_video"
RESULT_VERSION = 2
GROUND_TRUTH = "ground_truth"  # key of the ground-truth frames next to the methods' frames (side-by-side panel)
GROUND_TRUTH_FILE_SUFFIX = ".mp4"  # <folder>/<key>.mp4; the other layout is the PNG-frame folder <folder>/<key>/


# =============================================================================================================
# 1. Timing
# =============================================================================================================
class Stopwatch:
    """Wall-clock durations by name (CUDA synchronised before and after each measured block)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.durations: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def measure(self, name: str):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.durations[name].append(time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.durations[name].append(seconds)

    def summary(self) -> dict[str, dict]:
        """{name: {"count", "total_s", "mean_s", "min_s"}}."""
        return {name: {"count": len(values), "total_s": float(sum(values)), "mean_s": float(np.mean(values)),
                       "min_s": float(min(values))} for name, values in self.durations.items()}


class TimedRollout(ARRollout):
    """`ARRollout` that times every context prefill (chunks with context only) and records each chunk's n_ctx.

    In a cached context mode (`RolloutConfig.context_mode` other than exact) the context of a chunk is assembled
    from cached K/V, timed as "context_assembly", and the caching of a finished chunk (`ARRollout.cache_chunk`: the
    incremental mode's Teacher K/V pass, or storing the last Full step's K/V) as "context_cache" (chunks that
    cache something only)."""

    def __init__(self, *args, stopwatch: Stopwatch, **kwargs):
        super().__init__(*args, **kwargs)
        self.stopwatch = stopwatch
        self.context_frames: list[int] = []

    def prefill_context(self, chunk_index: int, with_vec: bool = False) -> ChunkContext:
        synchronize(self.device)
        start = time.perf_counter()
        context = super().prefill_context(chunk_index, with_vec)
        synchronize(self.device)
        if context.num_frames:
            name = "context_prefill" if self.frame_cache is None else "context_assembly"
            self.stopwatch.add(name, time.perf_counter() - start)
        self.context_frames.append(context.num_frames)
        return context

    def cache_chunk(self, chunk_index: int, context: ChunkContext, outputs) -> None:
        cached_before = None if self.frame_cache is None else len(self.frame_cache.frames)
        synchronize(self.device)
        start = time.perf_counter()
        super().cache_chunk(chunk_index, context, outputs)
        synchronize(self.device)
        if cached_before is not None and len(self.frame_cache.frames) > cached_before:
            self.stopwatch.add("context_cache", time.perf_counter() - start)


def method_timings(stopwatch: Stopwatch, text_prefill_s: float | None) -> dict:
    """Per-method timing record: per-call summaries plus rollout / decode / end-to-end seconds."""
    summary = stopwatch.summary()
    rollout_s = summary.pop("rollout")["total_s"]
    decode_s = summary.pop("vae_decode")["total_s"]
    text_s = 0.0 if text_prefill_s is None else text_prefill_s
    return {
        "text_prefill_s": text_prefill_s,
        "rollout_s": rollout_s,
        "vae_decode_s": decode_s,
        "dit_s": text_s + rollout_s,
        "end_to_end_s": text_s + rollout_s + decode_s,
        "calls": summary,
    }


# =============================================================================================================
# 2. VAE decoding
# =============================================================================================================
class VaeDecoder:
    """Latents [1, C, T, H, W] -> uint8 frames [F, H*s, W*s, 3] with an `AutoencoderKLHunyuanVideo15`.

    As the diffusers pipeline: decode(latents / scaling_factor), then (x / 2 + 0.5).clamp(0, 1), * 255, rounded.
    """

    def __init__(self, vae, device: torch.device):
        self.vae = vae
        self.device = device
        self.scaling_factor = float(vae.config.scaling_factor)
        self.temporal_compression = int(vae.config.temporal_compression_ratio)
        self.spatial_compression = int(vae.config.spatial_compression_ratio)

    @classmethod
    def from_folder(cls, folder: str | Path, device: torch.device, dtype: torch.dtype, tiling: bool) -> "VaeDecoder":
        """`folder`: the VAE folder itself (config.json of AutoencoderKLHunyuanVideo15) or a diffusers pipeline
        folder with a `vae/` subfolder."""
        from diffusers import AutoencoderKLHunyuanVideo15

        folder = Path(folder)
        if not (folder / "config.json").is_file() and (folder / "vae" / "config.json").is_file():
            folder = folder / "vae"
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--vae {folder}: no config.json (expected an AutoencoderKLHunyuanVideo15 folder)")
        vae = AutoencoderKLHunyuanVideo15.from_pretrained(str(folder), torch_dtype=dtype)
        if tiling:
            vae.enable_tiling()
        return cls(vae.to(device).eval().requires_grad_(False), device)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        video = self.vae.decode(latents.to(self.device, self.vae.dtype) / self.scaling_factor, return_dict=False)[0]
        frames = ((video[0].float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)  # [3, F, H, W]
        return frames.permute(1, 2, 3, 0).contiguous().cpu()


# =============================================================================================================
# 3. Video keys and ground truth
# =============================================================================================================
def video_key(case_id: str, action_id: int) -> str:
    return f"{case_id}__a{action_id}"


def ground_truth_candidates(folder: Path, key: str) -> tuple[Path, Path]:
    """The two accepted places of one row's ground truth: (PNG-frame folder <folder>/<key>, file <folder>/<key>.mp4)."""
    folder = Path(folder)
    return folder / key, folder / f"{key}{GROUND_TRUTH_FILE_SUFFIX}"


def find_ground_truth_videos(folder: Path, keys: Sequence[str]) -> dict[str, Path]:
    """{key: ground-truth video path} for every key, checked before anything runs: a row with neither a frame folder
    nor an mp4, or with both, is an error naming the paths (missing rows are all listed)."""
    found, missing, ambiguous = {}, [], []
    for key in keys:
        frame_folder, video_file = ground_truth_candidates(folder, key)
        present = [path for path, exists in ((frame_folder, frame_folder.is_dir()), (video_file, video_file.is_file()))
                   if exists]
        if not present:
            missing.append(f"{frame_folder}/ or {video_file}")
        elif len(present) == 2:
            ambiguous.append(f"{frame_folder}/ and {video_file}")
        else:
            found[key] = present[0]
    if missing:
        raise FileNotFoundError(
            f"--ground_truth {folder}: no ground-truth video for {len(missing)} of {len(keys)} rows; expected a "
            f"folder of PNG frames <key>/ or a file <key>{GROUND_TRUTH_FILE_SUFFIX} for each: {'; '.join(missing)}")
    if ambiguous:
        raise ValueError(f"--ground_truth {folder}: both a frame folder and a file for {len(ambiguous)} rows (keep "
                         f"one): {'; '.join(ambiguous)}")
    return found


def load_ground_truth(path: Path, expected_shape: tuple[int, int, int]) -> Tensor:
    """One ground-truth video (`video_io.read_video`) -> uint8 [F, H, W, 3], checked against the decoded videos'
    (F, H, W) = `expected_shape`; a difference is an error naming the path, the field and both values."""
    video = read_video(path)  # uint8 [F, H, W, 3]
    for field, index in (("frame count", 0), ("height", 1), ("width", 2)):
        if video.shape[index] != expected_shape[index]:
            frames, height, width = expected_shape
            raise ValueError(f"{path}: ground-truth {field} is {video.shape[index]}, expected {expected_shape[index]} "
                             f"(the decoded videos have {frames} frames of {height} x {width} pixels)")
    return torch.from_numpy(np.ascontiguousarray(video))


def repeat_first_frame(truth: Tensor) -> Tensor:
    """The still-image baseline: frame 0 of `truth` [F, H, W, 3] repeated F times -> [F, H, W, 3]."""
    return truth[:1].expand_as(truth).contiguous()


def score_video(target: Tensor, test: Tensor, scorer: LpipsScorer, ranges: Sequence[tuple[int, int]],
                device: torch.device) -> dict:
    """`test` scored against `target` (both uint8 [F, H, W, 3]): {"metrics": whole video, "per_chunk": one record
    per frame range of `ranges`, "per_frame": the per-frame series}."""
    metrics = compute_video_metrics(target, test, scorer, per_frame=True, device=device)
    per_frame = metrics.pop("per_frame")
    return {"metrics": metrics, "per_chunk": [summarize_frame_range(per_frame, a, b) for a, b in ranges],
            "per_frame": per_frame}


# =============================================================================================================
# 4. One video
# =============================================================================================================
@dataclass
class EvalRuntime:
    """Everything loaded once per rank."""

    teacher: WorldPlayTransformer
    methods: list[Method]
    schedule: Schedule
    rollout_config: RolloutConfig
    decoder: VaeDecoder
    scorer: LpipsScorer
    dataset: TrajectoryTableDataset
    case_source: str  # "encoded" | "dataset"
    device: torch.device
    state_dtype: torch.dtype
    chunk_latents: int = 4

    def autocast(self):
        """The Teacher's (and Predictor's) autocast of this eval (a null context without one)."""
        return autocast(self.device, self.rollout_config.autocast_dtype)

    # ---- inputs ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def text_kv(self, case: dict) -> tuple[TextKV, dict]:
        """The case's text K/V and its text-prefill facts: {"seconds", "llm_tokens", "byt5_tokens", "vision_tokens"}
        (seconds None when the K/V are read from the dataset)."""
        dtype = self.teacher.dtype
        if self.case_source == "dataset":
            return TextKV.from_layer_stack(case["text_k"], case["text_v"], self.device, dtype), {"seconds": None}
        floats = {name: case[name].to(self.device, dtype) for name in ("prompt_embeds", "byt5_text_states",
                                                                       "vision_states")}
        synchronize(self.device)
        start = time.perf_counter()
        with self.autocast():
            text_kv = self.teacher.text_prefill(
                floats["prompt_embeds"], case["prompt_mask"].to(self.device), floats["byt5_text_states"],
                case["byt5_text_mask"].to(self.device), floats["vision_states"], mask_type="i2v",
            )
        synchronize(self.device)
        facts = {"seconds": time.perf_counter() - start, "llm_tokens": int(case["prompt_embeds"].shape[1]),
                 "byt5_tokens": int(case["byt5_text_states"].shape[1]),
                 "vision_tokens": int(case["vision_states"].shape[1])}
        return text_kv, facts

    def rollout(self, method: Method, text_kv: TextKV, item: dict, case: dict, stopwatch: Stopwatch,
                chunks: Sequence[int] | None = None) -> TimedRollout:
        inputs = RolloutInputs.from_seed(item["seed"], case["image_cond"], item["viewmats"], item["Ks"], item["action"],
                                         state_dtype=self.state_dtype)
        config = dataclasses.replace(self.rollout_config, context_mode=method.context_mode)
        rollout = TimedRollout(self.teacher, text_kv, inputs, config, device=self.device, stopwatch=stopwatch)
        step_fn = make_step_fn(method, self.schedule, stopwatch, self.autocast)
        with stopwatch.measure("rollout"):
            rollout.run(step_fn, chunks)
        return rollout

    # ---- warm-up -----------------------------------------------------------------------------------------------
    def warm_up(self, item: dict, chunks: int) -> None:
        """Run `chunks` chunks of every method and one VAE decode, untimed (kernels, allocator, autotuning)."""
        if chunks <= 0:
            return
        case = self.dataset.load_case(item["case_id"])
        text_kv, _ = self.text_kv(case)
        num_chunks = item["viewmats"].shape[0] // self.chunk_latents
        latents = None
        for method in self.methods:
            rollout = self.rollout(method, text_kv, item, case, Stopwatch(self.device), range(min(chunks, num_chunks)))
            latents = rollout.latents
        self.decoder.decode(latents)

    # ---- the whole video -----------------------------------------------------------------------------------------
    def evaluate(self, item: dict, rotation: int = 0, ground_truth: Path | None = None
                 ) -> tuple[dict, dict[str, Tensor]]:
        """Roll out, decode and score every method on one item. Returns (result dict, {method: frames}); frames are
        uint8 [F, H, W, 3], plus the ground truth's under GROUND_TRUTH when given.

        rotation: the methods run in the order methods[r:] + methods[:r], r = rotation mod #methods, so that on a
        shared machine slow changes of load do not always hit the same method (the numbers do not depend on it).
        ground_truth: this row's ground-truth video (`find_ground_truth_videos`); it is read and its shape checked
        before the rollouts, and every method plus `repeat_first_frame` is scored against it
        (result["against_ground_truth"]).
        """
        # 1. Case, ground truth, text K/V (timed), FLOP facts.
        case = self.dataset.load_case(item["case_id"])
        _, _, _, height, width = case["image_cond"].shape
        num_latents = item["viewmats"].shape[0]
        ranges = chunk_frame_ranges(num_latents, self.chunk_latents, self.decoder.temporal_compression)
        decoded_shape = (ranges[-1][1], height * self.decoder.spatial_compression,
                         width * self.decoder.spatial_compression)  # (F, H, W) the VAE decodes
        truth = None if ground_truth is None else load_ground_truth(ground_truth, decoded_shape)
        text_kv, text_facts = self.text_kv(case)
        shape = TeacherShape.from_config(self.teacher.config)
        text_flops = 0
        if text_facts["seconds"] is not None:
            text_flops = text_prefill_flops(shape, text_facts["llm_tokens"], text_facts["byt5_tokens"],
                                            text_facts["vision_tokens"], text_kv.num_tokens)
        # 2. Rollouts and decodes.
        frames: dict[str, Tensor] = {}
        timings: dict[str, dict] = {}
        flops: dict[str, dict] = {}
        context_frames = None
        shift = rotation % len(self.methods)
        run_order = self.methods[shift:] + self.methods[:shift]
        for method in run_order:
            stopwatch = Stopwatch(self.device)
            rollout = self.rollout(method, text_kv, item, case, stopwatch)
            if context_frames is None:
                context_frames = rollout.context_frames
            elif rollout.context_frames != context_frames:
                raise RuntimeError(f"{method.name} selected context sizes {rollout.context_frames}, "
                                   f"{run_order[0].name} {context_frames}; the memory selection must not depend on "
                                   "the method")
            with stopwatch.measure("vae_decode"):
                frames[method.name] = self.decoder.decode(rollout.latents)
            timings[method.name] = method_timings(stopwatch, text_facts["seconds"])
            predictor_config = method.ckpt.predictor_config if isinstance(method, PredictorMethod) else None
            flops[method.name] = rollout_flops(
                shape, height * width, text_kv.num_tokens, context_frames, method_step_kind(method, self.schedule),
                num_steps=self.rollout_config.num_steps, chunk_frames=self.chunk_latents,
                predictor_config=predictor_config, text_prefill=text_flops, context_mode=method.context_mode,
            )
        # 3. Metrics vs the reference, whole video and per chunk.
        reference = frames[REFERENCE]
        if tuple(reference.shape[:3]) != decoded_shape:
            raise RuntimeError(f"the VAE decoded {tuple(reference.shape[:3])} (frames, height, width) from "
                               f"{num_latents} x {height} x {width} latents; expected {decoded_shape} (temporal "
                               f"compression {self.decoder.temporal_compression}, spatial "
                               f"{self.decoder.spatial_compression})")
        methods_out = {}
        for method in self.methods:
            entry = {"timings": timings[method.name], "flops": flops[method.name]}
            if method.name != REFERENCE:
                entry.update(score_video(reference, frames[method.name], self.scorer, ranges, self.device))
            methods_out[method.name] = entry
        result = {
            "format": RESULT_FORMAT, "version": RESULT_VERSION, "key": video_key(item["case_id"], item["action_id"]),
            "case_id": item["case_id"], "action_id": int(item["action_id"]), "seed": int(item["seed"]),
            "caption": item["caption"], "num_latents": num_latents, "num_frames": int(reference.shape[0]),
            "frame_size": [int(reference.shape[1]), int(reference.shape[2])], "chunk_frame_ranges": ranges,
            "context_frames_per_chunk": context_frames, "text_tokens": text_kv.num_tokens,
            "lpips_metric": self.scorer.metric_name, "run_order": [method.name for method in run_order],
            "methods": methods_out,
        }
        # 4. With ground truth: every method (the reference included) and the still first frame against it.
        if truth is not None:
            against = {method.name: score_video(truth, frames[method.name], self.scorer, ranges, self.device)
                       for method in self.methods}
            against[REPEAT_FIRST_FRAME] = score_video(truth, repeat_first_frame(truth), self.scorer, ranges,
                                                      self.device)
            result["against_ground_truth"] = {"video": str(ground_truth), "methods": against}
            frames[GROUND_TRUTH] = truth
        return result, frames
