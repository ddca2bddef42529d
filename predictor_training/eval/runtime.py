"""Running one video: timing, the timed AR rollout, VAE decoding, the ground truth and the per-video result record.

Timings (CUDA synchronised around every timed call; perf_counter on the CPU; a warm-up rollout runs first and is
not counted): text prefill, context prefill, Full step, Predictor / reuse step, VAE decode, the rollout, and the
end-to-end time of each method (text prefill + rollout + VAE decode); with `timing_repeats` K > 1 each method's
rollout is timed K - 1 more times in interleaved rounds of every method (order rotated on from the video's) and its
rollout time is the median (or min) of the K (`eval/timing.repeated_timings`). Next to the measured speedups stands
the FLOP-count bound of `predictor_training.teacher.flops` (DiT work only: the VAE decode is the same for every method).

A method of another context mode (`Method.context_mode`, predictor_training/teacher/frame_kv_cache.py) rolls out with that
mode; its context is then assembled from cached K/V (timed as "context_assembly" instead of "context_prefill") and
each finished chunk but the last is cached for later chunks (timed as "context_cache"), and its FLOPs are counted
for that mode.

Ground truth (optional): one video per row in a folder, `<folder>/<key>/` (PNG frames) or `<folder>/<key>.mp4`, key =
`video_key(case_id, action_id)`, with the decoded videos' frame count and size. Every method is then also scored
against it, and so is the `repeat_first_frame` baseline (its first frame held for the whole video).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from predictor_training.rollout.ar_rollout import RolloutConfig, RolloutInputs
from predictor_training.eval.methods import (
    REFERENCE,
    REPEAT_FIRST_FRAME,
    Method,
    PredictorMethod,
    make_step_fn,
)
from predictor_training.rollout.schedule import StepPlan
from predictor_training.teacher.flops import TeacherShape, rollout_flops, text_prefill_flops
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.precision import autocast, synchronize
from predictor_training.teacher import TextKV, WorldPlayTransformer
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.eval.revisits import revisit_scores
from predictor_training.eval.timing import Stopwatch, TimedRollout, method_timings, repeated_timings
from predictor_training.runtime.timing import interleaved
from predictor_training.video.ground_truth import load_ground_truth, repeat_first_frame, video_key
from predictor_training.video.vae_decoder import VaeDecoder
from predictor_training.world.revisits import revisit_frames
from predictor_training.video.metrics import (
    LpipsScorer,
    chunk_frame_ranges,
    compute_video_metrics,
    summarize_frame_range,
)

RESULT_FORMAT = "predictor_training.eval_video"
RESULT_VERSION = 3
GROUND_TRUTH = "ground_truth"  # key of the ground-truth frames next to the methods' frames (side-by-side panel)


# one letter per FLOP-count step kind (teacher/flops.py STEP_KINDS) in a result's "step_kinds": one string per chunk
KIND_LETTERS = {"full": "F", "predictor": "P", "reuse_velocity": "R", "reuse_hidden": "H", "forecast": "T",
                "cache_residual": "A", "block_residual": "B"}
LETTER_KINDS = {letter: kind for kind, letter in KIND_LETTERS.items()}


def step_kind_letters(kinds: dict[tuple[int, int], str], num_chunks: int, num_steps: int) -> list[str]:
    """{(chunk, step): kind} of a finished rollout -> one string of kind letters per chunk (e.g. "FRRP")."""
    return ["".join(KIND_LETTERS[kinds[(chunk, step)]] for step in range(num_steps)) for chunk in range(num_chunks)]


def score_video(target: Tensor, test: Tensor, scorer: LpipsScorer, ranges: Sequence[tuple[int, int]],
                device: torch.device) -> dict:
    """`test` scored against `target` (both uint8 [F, H, W, 3]): {"metrics": whole video, "per_chunk": one record
    per frame range of `ranges`, "after_first_chunk": the frames of chunks 1.. (what the model made from its own
    history, not the image-conditioned chunk 0), "per_frame": the per-frame series}."""
    metrics = compute_video_metrics(target, test, scorer, per_frame=True, device=device)
    per_frame = metrics.pop("per_frame")
    return {"metrics": metrics, "per_chunk": [summarize_frame_range(per_frame, a, b) for a, b in ranges],
            "after_first_chunk": summarize_frame_range(per_frame, ranges[1][0], ranges[-1][1]),
            "per_frame": per_frame}


# =============================================================================================================
# 4. One video
# =============================================================================================================
@dataclass
class EvalRuntime:
    """Everything loaded once per rank."""

    teacher: WorldPlayTransformer
    methods: list[Method]
    plan: StepPlan  # the steps every method replaces (a `PlannedMethod` runs its own plan)
    rollout_config: RolloutConfig
    decoder: VaeDecoder
    scorer: LpipsScorer
    dataset: TrajectoryTableDataset
    case_source: str  # "encoded" | "dataset"
    device: torch.device
    state_dtype: torch.dtype
    chunk_latents: int = 4
    timing_repeats: int = 1  # rollouts timed per method and video: the scored one, then interleaved rounds
    timing_statistic: str = "median"  # of those (eval/timing.py TIMING_STATISTICS)

    def autocast(self):
        """The Teacher's (and Predictor's) autocast of this eval (a null context without one)."""
        return autocast(self.device, self.rollout_config.autocast_dtype)

    # ---- inputs ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def text_kv(self, case: dict, model: WorldPlayTransformer | None = None) -> tuple[TextKV, dict]:
        """The case's text K/V of `model` (default the Teacher) and its text-prefill facts: {"seconds",
        "llm_tokens", "byt5_tokens", "vision_tokens"} (seconds None when the K/V are read from the dataset: the
        Teacher's, so a student row needs encoded cases)."""
        model = model or self.teacher
        dtype = model.dtype
        if self.case_source == "dataset":
            if model is not self.teacher:
                raise UserInputError("a student row prefills its own text K/V: evaluate it on encoded cases "
                                     "(--encoded or --demo), not on a dataset's stored Teacher K/V")
            return TextKV.from_layer_stack(case["text_k"], case["text_v"], self.device, dtype), {"seconds": None}
        floats = {name: case[name].to(self.device, dtype) for name in ("prompt_embeds", "byt5_text_states",
                                                                       "vision_states")}
        synchronize(self.device)
        start = time.perf_counter()
        with self.autocast():
            text_kv = model.text_prefill(
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
        rollout = TimedRollout(method.model or self.teacher, text_kv, inputs, config, device=self.device,
                               stopwatch=stopwatch)
        rollout.step_kinds = {}
        step_fn = make_step_fn(method, self.plan, stopwatch, self.autocast, rollout.step_kinds)
        with stopwatch.measure("rollout"):
            rollout.run(step_fn, chunks)
        return rollout

    # ---- warm-up -----------------------------------------------------------------------------------------------
    def warm_up(self, item: dict, chunks: int) -> None:
        """Run `chunks` chunks of every method and one VAE decode, untimed (kernels, allocator, autotuning)."""
        if chunks <= 0:
            return
        case = self.dataset.load_case(item["case_id"])
        num_chunks = item["viewmats"].shape[0] // self.chunk_latents
        latents = None
        for method in self.methods:
            text_kv, _ = self.text_kv(case, method.model)
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
        student_text = {}  # a student row's own text K/V and prefill facts, once per model
        shape = TeacherShape.from_config(self.teacher.config)
        text_flops = 0
        if text_facts["seconds"] is not None:
            text_flops = text_prefill_flops(shape, text_facts["llm_tokens"], text_facts["byt5_tokens"],
                                            text_facts["vision_tokens"], text_kv.num_tokens)
        # 2. Rollouts and decodes.
        frames: dict[str, Tensor] = {}
        timings: dict[str, dict] = {}
        flops: dict[str, dict] = {}
        step_kinds: dict[str, list[str]] = {}
        context_frames = None
        shift = rotation % len(self.methods)
        run_order = self.methods[shift:] + self.methods[:shift]
        for method in run_order:
            stopwatch = Stopwatch(self.device)
            method_text_kv, method_text = text_kv, text_facts
            if method.model is not None:
                if id(method.model) not in student_text:
                    student_text[id(method.model)] = self.text_kv(case, method.model)
                method_text_kv, method_text = student_text[id(method.model)]
            rollout = self.rollout(method, method_text_kv, item, case, stopwatch)
            if context_frames is None:
                context_frames = rollout.context_frames
            elif rollout.context_frames != context_frames:
                raise RuntimeError(f"{method.name} selected context sizes {rollout.context_frames}, "
                                   f"{run_order[0].name} {context_frames}; the memory selection must not depend on "
                                   "the method")
            with stopwatch.measure("vae_decode"):
                frames[method.name] = self.decoder.decode(rollout.latents)
            timings[method.name] = method_timings(stopwatch, method_text["seconds"])
            ckpt = getattr(method, "ckpt", None)  # a Predictor's, or a planned method's with P steps
            predictor_config = None if ckpt is None else ckpt.predictor_config
            step_kinds[method.name] = step_kind_letters(rollout.step_kinds, rollout.num_chunks,
                                                        self.rollout_config.num_steps)
            flops[method.name] = rollout_flops(
                shape, height * width, text_kv.num_tokens, context_frames,
                lambda chunk, step, kinds=rollout.step_kinds: kinds[(chunk, step)],
                num_steps=self.rollout_config.num_steps, chunk_frames=self.chunk_latents,
                predictor_config=predictor_config, text_prefill=text_flops, context_mode=method.context_mode,
                residual_blocks=method.residual_blocks,
            )
        # 3. With --timing_repeats K > 1: every method's rollout timed K - 1 times more, in interleaved rounds whose
        #    order rotates on from this video's (so load changes on a shared machine hit every method alike); each
        #    method's rollout time is then the median (or min) of its K samples.
        if self.timing_repeats > 1:
            order = run_order[1:] + run_order[:1]
            calls = {method.name: (lambda method=method: self.rollout(method, text_kv, item, case,
                                                                      Stopwatch(self.device)))
                     for method in order}
            rounds = interleaved(calls, self.timing_repeats - 1, warmup=0, device=self.device, rotate=True)
            for name, record in rounds.items():
                timings[name] = repeated_timings(timings[name], record["times_s"], self.timing_statistic)
        # 4. Metrics vs the reference, whole video and per chunk.
        reference = frames[REFERENCE]
        if tuple(reference.shape[:3]) != decoded_shape:
            raise RuntimeError(f"the VAE decoded {tuple(reference.shape[:3])} (frames, height, width) from "
                               f"{num_latents} x {height} x {width} latents; expected {decoded_shape} (temporal "
                               f"compression {self.decoder.temporal_compression}, spatial "
                               f"{self.decoder.spatial_compression})")
        methods_out = {}
        for method in self.methods:
            entry = {"timings": timings[method.name], "flops": flops[method.name], "step_kinds": step_kinds[method.name]}
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
        # 5. With ground truth: every method (the reference included) and the still first frame against it.
        if truth is not None:
            against = {method.name: score_video(truth, frames[method.name], self.scorer, ranges, self.device)
                       for method in self.methods}
            against[REPEAT_FIRST_FRAME] = score_video(truth, repeat_first_frame(truth), self.scorer, ranges,
                                                      self.device)
            result["against_ground_truth"] = {"video": str(ground_truth), "methods": against}
            pairs = revisit_frames(item["pose"])  # frames whose camera was seen earlier in the video
            if pairs:
                result["revisits"] = revisit_scores({method.name: frames[method.name] for method in self.methods},
                                                    truth, pairs)
            frames[GROUND_TRUTH] = truth
        return result, frames
