"""Evaluation of Predictor checkpoints against the full Teacher (SPEC §7, user notes §7 and §8.11).

For every (case, action) row of a split, the same seed (same noise, same memory points) is rolled out several ways
with the Teacher's AR loop (`ar_rollout.ARRollout`, one step hook per method), decoded with the VAE, and compared
frame by frame with the reference:

    reference        F-F-F-F in every chunk
    reuse_velocity   a replaced step k reuses the previous step's velocity:        v_k = v_{k-1}
    reuse_hidden     a replaced step k reuses the previous hidden through the final layer:
                     h_k = h_{k-1},  v_k = final_layer(h_{k-1}, vec_k)   (what an untrained Predictor computes)
    predictor_<ckpt> a replaced step k runs the Predictor: anchor = the Teacher's h_0 at step 1, then its own pred_h;
                     v4 also gets this rollout's previous-chunk hidden of the same step and the exact context K/V of
                     its source layers from the Teacher's prefill of this chunk

The schedule (`Schedule`) replaces `replace_steps` in chunks 1.. and, by default, runs chunk 0 F-F-F-F (notes §8.11;
`chunk0_full=False` applies it to chunk 0 as well). Every method uses the same schedule, so the reuse baselines are
exactly "the Predictor replaced by a copy".

Timings (CUDA synchronised around every timed call; perf_counter on the CPU; a warm-up rollout runs first and is
not counted): text prefill, context prefill, Full step, Predictor / reuse step, VAE decode, the rollout, and the
end-to-end time of each method (text prefill + rollout + VAE decode). Next to the measured speedups stands the
FLOP-count bound of `predictor_training.flops` (DiT work only: the VAE decode is the same for every method).

Outputs of one evaluation run (directory `<output_root>/<run_name>`), written by rank 0 except the per-video files:

    eval_config.json          settings and the fingerprint of everything that changes the numbers
    videos/<case>__a<action>.json   one per finished video (the unit of resume): metrics, per-chunk and per-frame
                              series of every method vs the reference, timings, FLOPs
    side_by_side/<case>__a<action>.mp4   reference | reuse_velocity | reuse_hidden | predictor(s), chosen subset
    per_video.csv, per_chunk.csv, aggregate.csv, timings.csv, aggregate.json, drift.png, table.md
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
import textwrap
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from predictor_training.ar_rollout import ARRollout, ChunkContext, RolloutConfig, StepCall, StepFn, StepOutput
from predictor_training.checkpoint import (
    load_model_weights,
    read_inference_config,
    read_inference_metadata,
    read_training_state,
)
from predictor_training.data.shards import sha256_file, sha256_json
from predictor_training.distributed import DistEnv, all_gather_objects, barrier, log0
from predictor_training.flops import (
    TeacherShape,
    flop_speedup_bound,
    rollout_flops,
    text_prefill_flops,
)
from predictor_training.atomic_io import atomic_write, write_text_atomic
from predictor_training.logger import write_json_atomic
from predictor_training.metrics import (
    LPIPS_METRIC_NAME,
    LpipsScorer,
    aggregate_videos,
    chunk_frame_ranges,
    compute_video_metrics,
    jsonable,
    summarize_frame_range,
)
from predictor_training.predictor import Predictor, build_predictor_from_config
from predictor_training.rollout_utils import rollout_inputs_for_item, text_kv_from_case
from predictor_training.teacher import TextKV, WorldPlayTransformer
from predictor_training.training_setup import TeacherSource, load_teacher_weights, teacher_config_sha256
from predictor_training.trajectory_dataset import TrajectoryTableDataset
from predictor_training.video_io import side_by_side, write_video

RESULT_FORMAT = "predictor_training.eval_video"
RESULT_VERSION = 2
EVAL_CONFIG_NAME = "eval_config.json"
REFERENCE = "reference"
REUSE_VELOCITY = "reuse_velocity"
REUSE_HIDDEN = "reuse_hidden"
PREDICTOR_PREFIX = "predictor_"
# frame-mean PSNR is left out of the table: with chunk 0 F-F-F-F its identical frames make it inf (it is in the CSV)
TABLE_METRICS = ("psnr_full", "ssim", "<lpips>", "temporal_delta_mse")
DRIFT_METRICS = ("psnr_full", "ssim", "<lpips>")
MAX_RUN_NAME_LENGTH = 255  # NAME_MAX of Linux file systems
_STEP_NAME = re.compile(r"^predictor_step_(\d+)\.safetensors$")


# =============================================================================================================
# 1. Schedule
# =============================================================================================================
def parse_replace_steps(text: str) -> tuple[int, ...]:
    """"1,2,3" -> (1, 2, 3); "" or "none" -> () (every method then equals the reference)."""
    text = str(text).strip()
    if text in ("", "none"):
        return ()
    try:
        steps = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise ValueError(f"--replace_steps {text!r}: expected comma-separated step indices like '1,2,3'") from error
    return steps


@dataclass(frozen=True)
class Schedule:
    """Which denoising steps of which chunks are replaced.

    replace_steps: steps k in 1..num_steps-1 (step 0 has no previous step to reuse or anchor on), ascending.
    chunk0_full: chunk 0 stays F-F-F-F (notes §8.11) when True; otherwise chunk 0 follows the schedule too.
    """

    replace_steps: tuple[int, ...]
    num_steps: int = 4
    chunk0_full: bool = True

    def __post_init__(self):
        steps = tuple(self.replace_steps)
        if list(steps) != sorted(set(steps)):
            raise ValueError(f"replace_steps {list(steps)} must be ascending without repeats")
        bad = [step for step in steps if not 1 <= step < self.num_steps]
        if bad:
            raise ValueError(
                f"replace_steps {list(steps)}: {bad} outside 1..{self.num_steps - 1} (step 0 is always Full: "
                "the replaced steps need the previous step's output)"
            )

    def replaces(self, chunk_index: int, step_index: int) -> bool:
        if chunk_index == 0 and self.chunk0_full:
            return False
        return step_index in self.replace_steps

    def letters(self) -> str:
        """'FPPP' for (1, 2, 3)."""
        return "".join("P" if step in self.replace_steps else "F" for step in range(self.num_steps))

    @property
    def tag(self) -> str:
        """Run-name part: 'fppp' (chunk 0 Full) or 'fppp_allchunks'."""
        letters = self.letters().lower()
        return letters if self.chunk0_full or not self.replace_steps else f"{letters}_allchunks"

    def describe(self) -> str:
        letters = "-".join(self.letters())
        if self.chunk0_full:
            return f"chunk 0 F-F-F-F, later chunks {letters}"
        return f"every chunk {letters}"

    def to_dict(self) -> dict:
        return {"replace_steps": list(self.replace_steps), "num_steps": self.num_steps,
                "chunk0_full": self.chunk0_full, "letters": self.letters()}


# =============================================================================================================
# 2. Predictor checkpoints
# =============================================================================================================
@dataclass(frozen=True)
class PredictorCheckpoint:
    """One `--ckpt`: an inference file (`predictor_step_XXXXX.safetensors`) or a `training_latest.pt`.

    run_name: the training run directory's name; step: the checkpoint's optimizer step; meta: variant,
    source_blocks, precision (+ step); predictor_config: `Predictor.predictor_config()` saved with the run config;
    label: unique name within this eval (`ckptstep300`, or `<run>_ckptstep300` across runs); panel: the short
    side-by-side label (`ckptstep300`, or `#<position in --ckpt> ckptstep300` across runs).
    """

    path: Path
    run_name: str
    step: int
    meta: dict
    predictor_config: dict
    run_flags: dict
    label: str = ""
    panel: str = ""

    @property
    def method(self) -> str:
        return f"{PREDICTOR_PREFIX}{self.label}"

    @property
    def variant(self) -> str:
        return self.predictor_config["variant"]


def read_predictor_checkpoint(path: str | Path) -> PredictorCheckpoint:
    """Read a checkpoint's metadata and saved run config (no weights). Errors name the file and the field."""
    path = Path(path).resolve()
    if path.suffix == ".safetensors":
        meta = read_inference_metadata(path)
        config = read_inference_config(path)
        if "step" not in meta:
            raise KeyError(f"{path}: inference metadata has no 'step' (keys {sorted(meta)})")
        step = int(meta["step"])
        name_match = _STEP_NAME.match(path.name)
        if name_match and int(name_match.group(1)) != step:
            raise ValueError(f"{path}: the file name says step {int(name_match.group(1))}, its metadata step {step}")
    elif path.suffix == ".pt":
        payload = read_training_state(path)
        meta, config = payload["meta"], payload["config"]
        step = int(payload["run_state"]["global_step"])
    else:
        raise ValueError(f"--ckpt {path}: expected predictor_step_XXXXX.safetensors or training_latest.pt")
    for key in ("derived", "flags"):
        if key not in config:
            raise KeyError(f"{path}: the saved run config has no '{key}' section (expected train_config.json layout)")
    if "predictor" not in config["derived"]:
        raise KeyError(f"{path}: the saved run config has no 'derived.predictor' (the Predictor's architecture)")
    predictor_config = dict(config["derived"]["predictor"])
    for key in ("variant", "source_blocks"):
        if key not in meta or key not in predictor_config:
            raise KeyError(f"{path}: '{key}' is missing from the checkpoint meta or from derived.predictor")
        if predictor_config[key] != meta[key]:
            raise ValueError(f"{path}: meta {key}={meta[key]!r} but derived.predictor {key}={predictor_config[key]!r}")
    return PredictorCheckpoint(path, path.parent.name, step, dict(meta), predictor_config, dict(config["flags"]))


def label_checkpoints(checkpoints: Sequence[PredictorCheckpoint]) -> list[PredictorCheckpoint]:
    """Give each checkpoint a unique label: `ckptstep<N>` when all come from one run, else `<run>_ckptstep<N>`."""
    single_run = len({ckpt.run_name for ckpt in checkpoints}) <= 1
    labelled = [
        replace(ckpt, label=f"ckptstep{ckpt.step}" if single_run else f"{ckpt.run_name}_ckptstep{ckpt.step}",
                panel=f"ckptstep{ckpt.step}" if single_run else f"#{position} ckptstep{ckpt.step}")
        for position, ckpt in enumerate(checkpoints, start=1)
    ]
    labels = [ckpt.label for ckpt in labelled]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"--ckpt: checkpoints {duplicates} are given twice (same run and step)")
    return labelled


def load_predictor(teacher: WorldPlayTransformer, ckpt: PredictorCheckpoint) -> Predictor:
    """Rebuild the checkpoint's Predictor on `teacher` from its saved config and load its weights (strict)."""
    predictor = build_predictor_from_config(teacher, ckpt.predictor_config)
    load_model_weights(ckpt.path, predictor, expect={"variant": ckpt.meta["variant"],
                                                      "source_blocks": ckpt.meta["source_blocks"]})
    return predictor.eval().requires_grad_(False)


def default_run_name(checkpoints: Sequence[PredictorCheckpoint], schedule: Schedule, split: str) -> str:
    """`<train_run>_ckptstep<N>[+<M>...]_<schedule>_<split>` (runs joined by '__'); `reuse_<schedule>_<split>`
    without checkpoints."""
    if not checkpoints:
        return f"reuse_{schedule.tag}_{split}"
    steps_by_run: dict[str, list[int]] = defaultdict(list)
    for ckpt in checkpoints:
        steps_by_run[ckpt.run_name].append(ckpt.step)
    runs = [f"{run}_ckptstep{'+'.join(str(step) for step in sorted(steps))}" for run, steps in steps_by_run.items()]
    name = f"{'__'.join(runs)}_{schedule.tag}_{split}"
    if len(name) > MAX_RUN_NAME_LENGTH:
        raise ValueError(f"the automatic eval run name is {len(name)} characters long; pass --run_name")
    return name


# =============================================================================================================
# 3. Timing
# =============================================================================================================
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    """`ARRollout` that times every context prefill (chunks with context only) and records each chunk's n_ctx."""

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
            self.stopwatch.add("context_prefill", time.perf_counter() - start)
        self.context_frames.append(context.num_frames)
        return context


# =============================================================================================================
# 4. Methods: what runs at a replaced step
# =============================================================================================================
class Method:
    """A way to fill the replaced steps. name: output key; kind: the FLOP-count step kind; timer: stopwatch name;
    panel: side-by-side label."""

    name: str
    kind: str
    timer: str
    panel: str

    def replaced_step(self, call: StepCall) -> StepOutput:
        raise NotImplementedError


class ReferenceMethod(Method):
    name, kind, timer, panel = REFERENCE, "full", "full_step", "reference"

    def replaced_step(self, call: StepCall) -> StepOutput:
        raise RuntimeError("the reference never replaces a step")


class VelocityReuse(Method):
    name, kind, timer, panel = REUSE_VELOCITY, REUSE_VELOCITY, "reuse_step", "reuse v"

    def replaced_step(self, call: StepCall) -> StepOutput:
        return StepOutput(velocity=call.previous.velocity, final_hidden=call.previous.final_hidden)


class HiddenReuse(Method):
    name, kind, timer, panel = REUSE_HIDDEN, REUSE_HIDDEN, "reuse_step", "reuse h"

    def __init__(self, teacher: WorldPlayTransformer):
        self.teacher = teacher

    def replaced_step(self, call: StepCall) -> StepOutput:
        """v_k = final_layer(h_{k-1}, vec_k), vec_k = time_in(t_k) + action_in(a); the hidden is carried on."""
        hidden = call.previous.final_hidden
        _, _, frames, height, width = call.latent.shape
        vec = self.teacher.frame_vec(call.timestep, call.action)  # [1, T, D]
        tokens = self.teacher.final_projection(hidden, vec, height * width)
        return StepOutput(velocity=self.teacher.unpatchify(tokens, frames, height, width), final_hidden=hidden)


class PredictorMethod(Method):
    kind, timer = "predictor", "predictor_step"

    def __init__(self, predictor: Predictor, ckpt: PredictorCheckpoint):
        self.predictor = predictor
        self.ckpt = ckpt
        self.name = ckpt.method
        self.panel = f"P {ckpt.panel}"

    def replaced_step(self, call: StepCall) -> StepOutput:
        """Anchor = previous step's hidden (Teacher h_0, then this Predictor's own pred_h). v4: exact context K/V of
        the source layers and the previous chunk's hidden of the same step, both from this very rollout."""
        blocks = self.predictor.source_blocks
        context, prev_chunk_hidden = None, None
        if self.predictor.variant == "v4":
            if call.context.kv is None or call.previous_chunk is None:
                raise RuntimeError(
                    f"chunk {call.chunk_index}: the v4 Predictor needs context K/V and a previous chunk (run chunk 0 "
                    "F-F-F-F)"
                )
            context = call.context.kv.select(blocks)
            prev_chunk_hidden = call.previous_chunk[call.step_index].final_hidden
        # rope_start: the Predictor's default (n_ctx for v4, 0 for disca), as in both trainers
        pred_hidden, pred_velocity = self.predictor(
            call.model_input, call.previous.final_hidden, call.timestep[None], call.action, call.viewmats, call.Ks,
            call.text_kv.select(blocks), context=context, prev_chunk_hidden=prev_chunk_hidden,
        )
        return StepOutput(velocity=pred_velocity, final_hidden=pred_hidden)


def make_step_fn(method: Method, schedule: Schedule, stopwatch: Stopwatch, autocast: Callable) -> StepFn:
    """The ARRollout hook of `method`: Full steps where the schedule keeps them, `method.replaced_step` elsewhere."""
    replaces = (lambda chunk, step: False) if isinstance(method, ReferenceMethod) else schedule.replaces

    def step_fn(call: StepCall) -> StepOutput:
        if not replaces(call.chunk_index, call.step_index):
            with stopwatch.measure("full_step"):
                return call.run_teacher()
        with stopwatch.measure(method.timer), autocast():
            return method.replaced_step(call)

    return step_fn


def method_step_kind(method: Method, schedule: Schedule) -> Callable[[int, int], str]:
    """(chunk, step) -> flops step kind of `method` under `schedule`."""
    if isinstance(method, ReferenceMethod):
        return lambda chunk, step: "full"
    return lambda chunk, step: method.kind if schedule.replaces(chunk, step) else "full"


# =============================================================================================================
# 5. VAE decoding
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
# 6. One video
# =============================================================================================================
def video_key(case_id: str, action_id: int) -> str:
    return f"{case_id}__a{action_id}"


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
        dtype = self.rollout_config.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    # ---- inputs ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def text_kv(self, case: dict) -> tuple[TextKV, dict]:
        """The case's text K/V and its text-prefill facts: {"seconds", "llm_tokens", "byt5_tokens", "vision_tokens"}
        (seconds None when the K/V are read from the dataset)."""
        dtype = self.teacher.dtype
        if self.case_source == "dataset":
            return text_kv_from_case(case, self.device, dtype), {"seconds": None}
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
        inputs = rollout_inputs_for_item(item, case["image_cond"], self.state_dtype)
        rollout = TimedRollout(self.teacher, text_kv, inputs, self.rollout_config, device=self.device,
                               stopwatch=stopwatch)
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
    def evaluate(self, item: dict, rotation: int = 0) -> tuple[dict, dict[str, Tensor]]:
        """Roll out, decode and score every method on one item. Returns (result dict, {method: frames}).

        rotation: the methods run in the order methods[r:] + methods[:r], r = rotation mod #methods, so that on a
        shared machine slow changes of load do not always hit the same method (the numbers do not depend on it).
        """
        # 1. Case, text K/V (timed), FLOP facts.
        case = self.dataset.load_case(item["case_id"])
        text_kv, text_facts = self.text_kv(case)
        _, _, _, height, width = case["image_cond"].shape
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
                predictor_config=predictor_config, text_prefill=text_flops,
            )
        # 3. Metrics vs the reference, whole video and per chunk.
        reference = frames[REFERENCE]
        num_latents = item["viewmats"].shape[0]
        ranges = chunk_frame_ranges(num_latents, self.chunk_latents, self.decoder.temporal_compression)
        if ranges[-1][1] != reference.shape[0]:
            raise RuntimeError(f"the VAE decoded {reference.shape[0]} frames from {num_latents} latents; expected "
                               f"{ranges[-1][1]} (temporal compression {self.decoder.temporal_compression})")
        methods_out = {}
        for method in self.methods:
            entry = {"timings": timings[method.name], "flops": flops[method.name]}
            if method.name != REFERENCE:
                metrics = compute_video_metrics(reference, frames[method.name], self.scorer, per_frame=True,
                                                device=self.device)
                per_frame = metrics.pop("per_frame")
                entry.update(metrics=metrics, per_chunk=[summarize_frame_range(per_frame, a, b) for a, b in ranges],
                             per_frame=per_frame)
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
        return result, frames


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
# 7. Reading per-video results back
# =============================================================================================================
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _restore_floats(value):
    """Inverse of `metrics.jsonable` inside metric records: "inf" / "-inf" / "nan" strings back to floats."""
    if isinstance(value, dict):
        return {key: _restore_floats(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_restore_floats(item) for item in value]
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    return value


def read_video_result(path: Path, fingerprint: str) -> dict:
    """A finished per-video JSON, checked against this run's fingerprint; metric strings back to floats."""
    result = json.loads(path.read_text(encoding="utf-8"))
    if result.get("format") != RESULT_FORMAT or result.get("version") != RESULT_VERSION:
        raise ValueError(f"{path}: not a version-{RESULT_VERSION} eval video result (format/version fields)")
    if result.get("fingerprint") != fingerprint:
        raise ValueError(f"{path}: made with other eval settings (fingerprint {result.get('fingerprint')!r}, this run "
                         f"{fingerprint!r}); use another --output_root / --run_name, or remove that directory")
    for entry in result["methods"].values():
        for key in ("metrics", "per_chunk", "per_frame"):
            if key in entry:
                entry[key] = _restore_floats(entry[key])
    return result


# =============================================================================================================
# 8. Aggregation and reports
# =============================================================================================================
def _mean_of(values: Sequence[float]) -> float:
    return float(np.mean(values))


def aggregate_results(results: Sequence[dict], method_names: Sequence[str]) -> dict:
    """Across videos, per method: mean metrics, mean per-chunk metrics, timings and FLOPs, speedups vs reference."""
    if not results:
        raise ValueError("no finished videos to aggregate")
    out: dict[str, dict] = {}
    reference_flops = sum(result["methods"][REFERENCE]["flops"]["total"] for result in results)
    reference_dit = _mean_of([result["methods"][REFERENCE]["timings"]["dit_s"] for result in results])
    reference_e2e = _mean_of([result["methods"][REFERENCE]["timings"]["end_to_end_s"] for result in results])
    num_chunks = len(results[0]["chunk_frame_ranges"])
    for name in method_names:
        entries = [result["methods"][name] for result in results]
        # 1. Timings: per-call means over every call of every video, per-video means of the totals.
        calls: dict[str, list] = defaultdict(lambda: [0, 0.0, math.inf])
        for entry in entries:
            for call, summary in entry["timings"]["calls"].items():
                calls[call][0] += summary["count"]
                calls[call][1] += summary["total_s"]
                calls[call][2] = min(calls[call][2], summary["min_s"])
        text_values = [entry["timings"]["text_prefill_s"] for entry in entries]
        timings = {
            "text_prefill_s": None if text_values[0] is None else _mean_of(text_values),
            **{key: _mean_of([entry["timings"][key] for entry in entries])
               for key in ("rollout_s", "vae_decode_s", "dit_s", "end_to_end_s")},
            "calls": {call: {"count": count, "mean_s": total / count, "min_s": fastest}
                      for call, (count, total, fastest) in calls.items()},
        }
        method_flops = sum(entry["flops"]["total"] for entry in entries)
        record = {
            "num_videos": len(entries),
            "timings": timings,
            "flops_per_video": method_flops / len(entries),
            "speedup": {
                "measured_dit": reference_dit / timings["dit_s"],
                "measured_end_to_end": reference_e2e / timings["end_to_end_s"],
                "flop_bound_dit": flop_speedup_bound(reference_flops, method_flops),
            },
        }
        # 2. Quality (not for the reference itself).
        if name != REFERENCE:
            record["metrics"] = aggregate_videos([entry["metrics"] for entry in entries])
            record["per_chunk"] = [aggregate_videos([entry["per_chunk"][chunk] for entry in entries])
                                   for chunk in range(num_chunks)]
        out[name] = record
    return out


def _lpips_key(aggregate: dict) -> str:
    for record in aggregate.values():
        if "metrics" in record:
            keys = [key for key in record["metrics"] if key.startswith("lpips")]
            if len(keys) != 1:
                raise ValueError(f"expected one LPIPS key in the metrics, got {keys}")
            return keys[0]
    raise ValueError("no compared method in the aggregate")


def _metric_columns(lpips_key: str, names: Sequence[str]) -> list[str]:
    return [lpips_key if name == "<lpips>" else name for name in names]


def _fmt(value, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value > 0 else ("-inf" if value < 0 else "nan")
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return str(value)


def format_markdown_table(aggregate: dict, method_names: Sequence[str], header: dict) -> str:
    """Quality table (method x PSNR / SSIM / LPIPS-label / temporal-delta MSE), speed table, component timings."""
    lpips_key = _lpips_key(aggregate)
    real_lpips = lpips_key == LPIPS_METRIC_NAME
    lpips_title = "LPIPS (AlexNet)" if real_lpips else f"{lpips_key} (random AlexNet, NOT LPIPS)"
    titles = {"psnr_full": "PSNR (dB)", "psnr_frame_mean": "frame-mean PSNR (dB)", "ssim": "SSIM",
              lpips_key: lpips_title, "temporal_delta_mse": "temporal-delta MSE"}
    columns = _metric_columns(lpips_key, TABLE_METRICS)
    lines = [
        f"**{header['run_name']}** - split `{header['split']}`, {header['num_videos']} videos, schedule "
        f"{header['schedule']}; every metric against the reference F-F-F-F rollout of the same seed.",
        "",
        "| method | " + " | ".join(titles[column] for column in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |",
    ]
    display = header["display_names"]
    for name in method_names:
        if name == REFERENCE:
            continue
        metrics = aggregate[name]["metrics"]
        lines.append(f"| {display[name]} | " + " | ".join(_fmt(metrics[column]) for column in columns) + " |")
    if not real_lpips:
        lines += ["", f"`{lpips_key}`: LPIPS formula on a randomly initialised AlexNet (no real weights available); "
                      "it is NOT LPIPS and must not be compared with LPIPS numbers."]
    lines += ["", "| method | end-to-end s/video | DiT s/video | speedup end-to-end | speedup DiT | "
                  "FLOP bound (DiT) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in method_names:
        timings, speed = aggregate[name]["timings"], aggregate[name]["speedup"]
        lines.append(f"| {display[name]} | {timings['end_to_end_s']:.3f} | {timings['dit_s']:.3f} | "
                     f"{speed['measured_end_to_end']:.2f}x | {speed['measured_dit']:.2f}x | "
                     f"{speed['flop_bound_dit']:.2f}x |")
    lines += ["", "| component | mean s/call | fastest s/call | calls |", "| --- | ---: | ---: | ---: |"]
    for row in component_rows(aggregate, method_names, display):
        lines.append(f"| {row[0]} | {_fmt(row[1], 5)} | {_fmt(row[2], 5)} | {row[3]} |")
    if header["legend"]:
        lines += [""] + [f"- {line}" for line in header["legend"]]
    return "\n".join(lines) + "\n"


def component_rows(aggregate: dict, method_names: Sequence[str], display: dict[str, str]
                   ) -> list[tuple[str, float | None, float | None, int]]:
    """(component, mean seconds per call, fastest call, number of calls): text prefill, context prefill, Full step,
    each Predictor / reuse step (per call), VAE decode (per video); the shared components from the reference
    rollouts. The fastest call is the least disturbed figure on a shared machine. display: method -> label."""
    reference = aggregate[REFERENCE]
    num_videos = reference["num_videos"]
    calls = reference["timings"]["calls"]
    rows = [("text prefill", reference["timings"]["text_prefill_s"], None, num_videos)]
    for call, label in (("context_prefill", "context prefill"), ("full_step", "full step (Teacher)")):
        if call in calls:
            rows.append((label, calls[call]["mean_s"], calls[call]["min_s"], calls[call]["count"]))
    for name in method_names:
        for call in ("predictor_step", "reuse_step"):
            if call in aggregate[name]["timings"]["calls"]:
                summary = aggregate[name]["timings"]["calls"][call]
                rows.append((f"{call.replace('_', ' ')} ({display[name]})", summary["mean_s"], summary["min_s"],
                             summary["count"]))
    rows.append(("VAE decode (per video)", reference["timings"]["vae_decode_s"], None, num_videos))
    return rows


def _csv_text(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([[_fmt(value, 8) if isinstance(value, float) else value for value in row] for row in rows])
    return buffer.getvalue()


def _write_text(path: Path, text: str) -> None:
    write_text_atomic(path, text)


def write_reports(out_dir: Path, results: Sequence[dict], aggregate: dict, method_names: Sequence[str],
                  header: dict) -> dict[str, Path]:
    """CSV files, aggregate.json, drift.png and table.md (each atomically). Returns {name: path}."""
    compared = [name for name in method_names if name != REFERENCE]
    lpips_key = _lpips_key(aggregate)
    method_labels = {name: name for name in method_names}  # the CSV files keep the full method keys
    written = {}
    # 1. per video: one row per (video, method)
    video_columns = list(results[0]["methods"][compared[0]]["metrics"])
    rows = [[result["key"], name] + [result["methods"][name]["metrics"][key] for key in video_columns]
            + [result["methods"][name]["timings"]["end_to_end_s"]]
            for result in results for name in compared]
    written["per_video.csv"] = out_dir / "per_video.csv"
    _write_text(written["per_video.csv"], _csv_text(["video", "method"] + video_columns + ["end_to_end_s"], rows))
    # 2. per chunk: every video and the mean
    chunk_columns = list(results[0]["methods"][compared[0]]["per_chunk"][0])
    rows = []
    for name in compared:
        for chunk in range(len(results[0]["chunk_frame_ranges"])):
            for result in results:
                rows.append([result["key"], name, chunk] + [result["methods"][name]["per_chunk"][chunk][key]
                                                            for key in chunk_columns])
            rows.append(["MEAN", name, chunk] + [aggregate[name]["per_chunk"][chunk][key] for key in chunk_columns])
    written["per_chunk.csv"] = out_dir / "per_chunk.csv"
    _write_text(written["per_chunk.csv"], _csv_text(["video", "method", "chunk"] + chunk_columns, rows))
    # 3. aggregate: one row per method
    columns = list(aggregate[compared[0]]["metrics"])
    rows = []
    for name in method_names:
        record = aggregate[name]
        metrics = [record["metrics"][key] if "metrics" in record else None for key in columns]
        speed = record["speedup"]
        rows.append([name] + metrics + [record["timings"]["end_to_end_s"], record["timings"]["dit_s"],
                                        speed["measured_end_to_end"], speed["measured_dit"], speed["flop_bound_dit"],
                                        record["flops_per_video"]])
    written["aggregate.csv"] = out_dir / "aggregate.csv"
    _write_text(written["aggregate.csv"], _csv_text(
        ["method"] + columns + ["end_to_end_s", "dit_s", "speedup_end_to_end", "speedup_dit", "flop_bound_dit",
                                "flops_per_video"], rows))
    # 4. timings per component
    written["timings.csv"] = out_dir / "timings.csv"
    _write_text(written["timings.csv"], _csv_text(["component", "mean_s_per_call", "fastest_s_per_call", "calls"],
                                                 component_rows(aggregate, method_names, method_labels)))
    # 5. JSON, drift plot, markdown table
    written["aggregate.json"] = out_dir / "aggregate.json"
    write_json_atomic(written["aggregate.json"], jsonable({"header": header, "methods": aggregate}))
    written["drift.png"] = out_dir / "drift.png"
    plot_drift(written["drift.png"], aggregate, compared, lpips_key, header)
    written["table.md"] = out_dir / "table.md"
    _write_text(written["table.md"], format_markdown_table(aggregate, method_names, header))
    return written


def plot_drift(path: Path, aggregate: dict, method_names: Sequence[str], lpips_key: str, header: dict) -> None:
    """Mean metric per chunk index (drift), one line per method; infinite PSNR (identical chunk) is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = _metric_columns(lpips_key, DRIFT_METRICS)
    figure, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
    identical_note = False
    for axis, metric in zip(axes[0], metrics):
        for name in method_names:
            values = np.array([chunk[metric] for chunk in aggregate[name]["per_chunk"]], dtype=float)
            identical_note |= bool(np.isinf(values).any())
            values[~np.isfinite(values)] = np.nan
            axis.plot(range(len(values)), values, marker="o", label=header["display_names"][name])
        not_lpips = metric == lpips_key and lpips_key != LPIPS_METRIC_NAME
        axis.set_xlabel("chunk index")
        axis.set_ylabel("random-AlexNet LPIPS (NOT LPIPS)" if not_lpips else metric)
        axis.set_title(metric)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    note = " (chunks identical to the reference, PSNR = inf, are not drawn)" if identical_note else ""
    title = f"{header['run_name']}: drift vs chunk, {header['split']}, {header['num_videos']} videos{note}"
    lines = textwrap.wrap(title, width=40 * len(metrics), break_on_hyphens=False)
    figure.suptitle("\n".join(lines), fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.04 * len(lines)))

    def save(tmp: Path) -> None:
        figure.savefig(tmp, format="png", dpi=100)

    try:
        atomic_write(path, save)
    finally:
        plt.close(figure)


# =============================================================================================================
# 9. The run: settings, fingerprint, sharding, resume, gathering
# =============================================================================================================
@dataclass
class EvalSettings:
    """Resolved inputs of one evaluation (tools/eval_predictor.py builds it from its flags)."""

    teacher_source: TeacherSource
    vae: Path
    sample_table: Path
    split: str
    case_source: str  # "encoded" | "dataset"
    case_root: Path  # encoded dir or dataset root
    num_latents: int
    checkpoints: list[Path]
    schedule: Schedule
    dtype: torch.dtype
    vae_dtype: torch.dtype
    output_root: Path
    run_name: str | None = None
    max_videos: int | None = None
    num_side_by_side: int = 2
    fps: float = 24.0
    lpips_alexnet: Path | None = None
    lpips_random_backbone: bool = False
    warmup_chunks: int = 2
    vae_tiling: bool = False
    progress: bool = True
    extra: dict = field(default_factory=dict)


def rollout_config_for(dtype: torch.dtype) -> RolloutConfig:
    """bf16: the real pipeline (bf16 weights, bf16 autocast, bf16 running latents); fp32: exact."""
    return RolloutConfig(state_dtype=dtype, autocast_dtype=None if dtype == torch.float32 else dtype)


def settings_fingerprint(settings: EvalSettings, checkpoints: Sequence[PredictorCheckpoint], teacher_sha: str,
                         scorer: LpipsScorer, device: torch.device) -> tuple[str, dict]:
    """sha256 of everything that changes a per-video result, and that record itself."""
    record = {
        "result_version": RESULT_VERSION,
        "teacher": {"folder": str(Path(settings.teacher_source.folder).resolve()),
                    "action_ckpt": None if settings.teacher_source.action_ckpt is None
                    else str(Path(settings.teacher_source.action_ckpt).resolve()),
                    "config_sha256": teacher_sha},
        "vae": str(Path(settings.vae).resolve()),
        "sample_table": str(Path(settings.sample_table).resolve()),
        "split": settings.split,
        "case_source": settings.case_source,
        "case_root": str(Path(settings.case_root).resolve()),
        "num_latents": settings.num_latents,
        "checkpoints": [{"path": str(ckpt.path), "label": ckpt.label, "sha256": sha256_file(ckpt.path)}
                        for ckpt in checkpoints],
        "schedule": settings.schedule.to_dict(),
        "dtype": str(settings.dtype).removeprefix("torch."),
        "vae_dtype": str(settings.vae_dtype).removeprefix("torch."),
        "vae_tiling": settings.vae_tiling,
        "device_type": device.type,
        "lpips": {"metric_name": scorer.metric_name, "backbone_sha256": scorer.backbone_sha256,
                  "backbone_source": scorer.backbone_source},
    }
    return sha256_json(record), record


def check_or_write_eval_config(out_dir: Path, fingerprint: str, record: dict, settings: EvalSettings,
                               env: DistEnv) -> None:
    """A new run writes eval_config.json (rank 0); an existing one must have the same fingerprint, else every rank
    raises (nothing in the directory is touched)."""
    path = out_dir / EVAL_CONFIG_NAME
    if env.is_main and not path.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"fingerprint": fingerprint, "settings": record, "run": {
            "max_videos": settings.max_videos, "num_side_by_side": settings.num_side_by_side,
            "fps": settings.fps, **settings.extra}})
    barrier()
    saved = json.loads(path.read_text(encoding="utf-8"))
    if saved["fingerprint"] != fingerprint:
        changed = sorted(key for key in record if saved["settings"].get(key) != record[key])
        raise ValueError(f"{path}: this eval directory was made with other settings (differences in {changed}); "
                         "use another --output_root / --run_name, or remove the directory")


def select_items(dataset: TrajectoryTableDataset, max_videos: int | None) -> list[int]:
    indices = list(range(len(dataset)))
    return indices if max_videos is None else indices[:max_videos]


def run_evaluation(settings: EvalSettings, env: DistEnv) -> dict:
    """Evaluate every selected video (sharded over ranks, finished ones skipped), then aggregate and report on
    rank 0. Returns {"out_dir", "computed", "skipped", "aggregate" (rank 0), "written" (rank 0)}."""
    device = env.device
    # 1. Checkpoints (metadata), precision, output directory, LPIPS.
    checkpoints = label_checkpoints([read_predictor_checkpoint(path) for path in settings.checkpoints])
    if not settings.schedule.chunk0_full and settings.schedule.replace_steps:
        v4 = [ckpt.label for ckpt in checkpoints if ckpt.variant == "v4"]
        if v4:
            raise ValueError(f"checkpoints {v4} are v4 Predictors: they need the previous chunk's hidden and context "
                             "K/V, which chunk 0 does not have; keep chunk 0 F-F-F-F (--chunk0 full)")
    run_name = settings.run_name or default_run_name(checkpoints, settings.schedule, settings.split)
    out_dir = Path(settings.output_root) / run_name
    scorer = LpipsScorer.from_policy(settings.lpips_alexnet, random_backbone=settings.lpips_random_backbone,
                                     device=device)
    teacher = load_teacher_weights(settings.teacher_source, device, settings.dtype)
    fingerprint, record = settings_fingerprint(settings, checkpoints, teacher_config_sha256(teacher), scorer, device)
    check_or_write_eval_config(out_dir, fingerprint, record, settings, env)

    # 2. Videos: the selection, which are finished, this rank's share.
    if settings.case_source == "encoded":
        dataset = TrajectoryTableDataset(settings.sample_table, encoded_dir=settings.case_root,
                                         num_latents=settings.num_latents)
    else:
        dataset = TrajectoryTableDataset(settings.sample_table, dataset_root=settings.case_root,
                                         num_latents=settings.num_latents)
    selected = select_items(dataset, settings.max_videos)
    keys = {index: video_key(*dataset.keys()[index]) for index in selected}
    side_by_side_keys = {keys[index] for index in selected[: settings.num_side_by_side]}
    result_path = lambda key: out_dir / "videos" / f"{key}.json"  # noqa: E731
    pending = [index for index in selected if not result_path(keys[index]).is_file()]
    mine = pending[env.rank :: env.world_size]
    log0(f"eval {run_name}: {len(selected)} videos of {settings.sample_table.name}, {len(selected) - len(pending)} "
         f"already finished, {len(pending)} to run on {env.world_size} rank(s); schedule "
         f"{settings.schedule.describe()}; LPIPS column '{scorer.metric_name}'")

    # 3. This rank's videos.
    computed = []
    if mine:
        methods: list[Method] = [ReferenceMethod(), VelocityReuse(), HiddenReuse(teacher)]
        methods += [PredictorMethod(load_predictor(teacher, ckpt), ckpt) for ckpt in checkpoints]
        runtime = EvalRuntime(
            teacher=teacher, methods=methods, schedule=settings.schedule,
            rollout_config=rollout_config_for(settings.dtype),
            decoder=VaeDecoder.from_folder(settings.vae, device, settings.vae_dtype, settings.vae_tiling),
            scorer=scorer, dataset=dataset, case_source=settings.case_source, device=device,
            state_dtype=settings.dtype,
        )
        runtime.warm_up(dataset[mine[0]], settings.warmup_chunks)
        for index in tqdm(mine, desc=f"eval rank {env.rank}", unit="video", disable=not settings.progress):
            item = dataset[index]
            result, frames = runtime.evaluate(item, rotation=selected.index(index))
            result["fingerprint"] = fingerprint
            if result["key"] in side_by_side_keys:
                result["side_by_side"] = write_side_by_side(out_dir, result["key"], frames, runtime.methods,
                                                            settings.fps)
            result_path(result["key"]).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(result_path(result["key"]), jsonable(result))
            computed.append(result["key"])

    # 4. Gather on rank 0 (results written by other ranks are read from the shared directory).
    gathered = all_gather_objects(computed)
    report = {"out_dir": out_dir, "computed": sorted(key for keys_ in gathered for key in keys_),
              "skipped": len(selected) - len(pending)}
    barrier()
    if env.is_main:
        results = [read_video_result(result_path(keys[index]), fingerprint) for index in selected]
        method_names = list(results[0]["methods"])
        aggregate = aggregate_results(results, method_names)
        display_names = {name: name for name in method_names}
        display_names.update({ckpt.method: f"predictor {ckpt.panel}" for ckpt in checkpoints})
        legend = [f"{ckpt.panel.split()[0]}: {ckpt.run_name}, step {ckpt.step} ({ckpt.path})"
                  for ckpt in checkpoints if ckpt.panel.startswith("#")]
        header = {"run_name": run_name, "split": settings.split, "num_videos": len(results),
                  "display_names": display_names, "legend": legend,
                  "schedule": settings.schedule.describe(), "replace_steps": list(settings.schedule.replace_steps),
                  "lpips": scorer.describe(), "checkpoints": {ckpt.method: str(ckpt.path) for ckpt in checkpoints},
                  "dtype": str(settings.dtype).removeprefix("torch."), "device": str(device),
                  "world_size": env.world_size,
                  "speed_note": "speedups: reference time / method time (per video, warm-up excluded); FLOP bound "
                                "= reference DiT FLOPs / method DiT FLOPs (text prefill, context prefills, steps; "
                                "the VAE decode is not counted)"}
        report["written"] = write_reports(out_dir, results, aggregate, method_names, header)
        report["aggregate"] = aggregate
        report["table"] = (out_dir / "table.md").read_text(encoding="utf-8")
    barrier()
    return report


def write_side_by_side(out_dir: Path, key: str, frames: dict[str, Tensor], methods: Sequence[Method],
                       fps: float) -> str:
    """reference | reuse v | reuse h | P <ckpt>... as one mp4; returns its path relative to out_dir."""
    panels = [frames[method.name].numpy() for method in methods]
    width = panels[0].shape[2]
    video = side_by_side(panels, [method.panel for method in methods], label_height=24 if width >= 256 else 14)
    relative = f"side_by_side/{key}.mp4"
    write_video(out_dir / relative, video, fps)
    return relative
