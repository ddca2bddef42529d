"""Single-call conformance: our Teacher (and the scheduler / camera helpers) against a golden conformance folder.

A conformance folder (format: ``predictor_training/conformance/golden/README.md``, called "README" below) holds
``config.json``, ``weights.safetensors.xz``, ``vectors.safetensors``, ``vectors.json``, ``pose.json`` and ``pose_from_string.json``.
Nothing here depends on the sizes of a particular set: depth, grid, lengths and chunk parameters are read from the
files. ``tools/check_conformance.py`` is the command line around ``run_conformance``; ``bf16_vs_fp32`` runs the same
calls on a device in BF16 and FP32, ``bf16_vs_fp32_rollout`` a Teacher's AR rollout (benchmarks/gpu_acceptance.py's
numerics).

Model cases are teacher-forced: the context prefill and the chunk steps receive the stored reference text cache
(and the chunk with a context the stored context cache), so a failure points at the call that is wrong. Model tensors
use ``|got - ref| <= atol + rtol * |ref|`` with atol = rtol = the tier's value (``TIERS``: portable 1e-5, strict
3e-6); the scheduler, pose and retrieval cases use the fixed tolerances of README section 11 ("Recommended
tolerances (float32, CPU)").
"""

from __future__ import annotations

import gc
import json
import lzma
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load as load_safetensors_bytes

from predictor_training.conformance import TIERS
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.io import sha256_bytes
from predictor_training.rollout.ar_rollout import ARRollout, RolloutConfig, RolloutInputs
from predictor_training.runtime.precision import autocast
from predictor_training.teacher import (
    ContextKV,
    LayerContextKV,
    TextKV,
    WorldPlayTransformer,
    load_state_dict_strict,
)
from predictor_training.teacher.source import random_teacher

WEIGHTS_FILE = "weights.safetensors.xz"
DECOMPRESSED_WEIGHTS_ENTRY = "weights.safetensors (after xz -d)"
SMALL_INPUT_SCALE = 2.0**-10

# README section 11 ("Recommended tolerances"): fixed tolerances of the non-network pieces (absolute).
SIGMA_ATOL = 1e-7
TIMESTEP_ATOL = 1e-4
PREV_SAMPLE_ATOL = 1e-6
VIEWMAT_ATOL = 1e-12
CANDIDATE_DISTANCE_ATOL = 1e-6
POINTS_ATOL = 1e-6

# README section 10 ("Memory-frame retrieval"): retrieval parameters of the stored selections.
MEMORY_FRAMES, TEMPORAL_CONTEXT, PREDICTION_LATENTS = 20, 12, 4

# README section 4 ("Text prefill"): how each text-prefill group was made.
@dataclass(frozen=True)
class TextRecipe:
    text_mask: str  # tensor name of the LLM mask
    byt5_mask: str  # tensor name of the ByT5 mask
    scale: float  # factor applied to the text, ByT5 and SigLIP states
    zero_vision: bool  # replace the SigLIP states by zeros
    mask_type: str


TEXT_GROUPS = {
    "txt": TextRecipe("inputs.text_mask", "inputs.byt5_mask", 1.0, False, "i2v"),
    "txt_holes": TextRecipe("inputs.holes_text_mask", "inputs.holes_byt5_mask", 1.0, False, "i2v"),
    "txt_small": TextRecipe("inputs.text_mask", "inputs.byt5_mask", SMALL_INPUT_SCALE, False, "i2v"),
    "txt_t2v": TextRecipe("inputs.text_mask", "inputs.byt5_mask", 1.0, True, "t2v"),
}
CATEGORIES = ("text", "context", "chunk", "scheduler", "pose", "retrieval")


def disable_reduced_precision_matmul() -> None:
    """No TF32 anywhere (matmul and cuDNN), float32 matmuls at full precision."""
    torch.backends.fp32_precision = "ieee"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"


# ---------------------------------------------------------------------------------------------------------------
# 1. Loading a conformance folder
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ConformanceSet:
    root: Path
    config: dict
    info: dict  # vectors.json
    vectors: dict[str, torch.Tensor]
    weights_bytes: bytes

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.vectors:
            raise KeyError(f"{self.root / 'vectors.safetensors'}: tensor {name!r} is missing")
        return self.vectors[name]




def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise MissingFileError(f"conformance folder is missing {path.name}: {path}")
    with open(path) as handle:
        return json.load(handle)


def load_conformance_set(root: str | Path) -> ConformanceSet:
    """Read every file of a conformance folder; verifies the sha256 sums listed in vectors.json["files"]."""
    root = Path(root)
    if not root.is_dir():
        raise MissingFileError(f"conformance folder not found: {root}")
    config = _read_json(root / "config.json")
    info = _read_json(root / "vectors.json")
    weights_path = root / WEIGHTS_FILE
    vectors_path = root / "vectors.safetensors"
    for path in (weights_path, vectors_path):
        if not path.is_file():
            raise MissingFileError(f"conformance folder is missing {path.name}: {path}")
    raw_files = {path.name: path.read_bytes() for path in (weights_path, vectors_path)}
    weights_bytes = lzma.decompress(raw_files[WEIGHTS_FILE])
    if "files" not in info:
        raise KeyError(f"{root / 'vectors.json'}: field 'files' (sha256 of every file) is missing")
    for entry, meta in info["files"].items():
        if entry == DECOMPRESSED_WEIGHTS_ENTRY:
            data = weights_bytes
        else:
            path = root / entry
            if not path.is_file():
                raise MissingFileError(f"{root / 'vectors.json'} lists {entry!r}, which is not in {root}")
            data = raw_files[entry] if entry in raw_files else path.read_bytes()
        if sha256_bytes(data) != meta["sha256"]:
            raise ValueError(f"{root / entry}: sha256 {sha256_bytes(data)} differs from vectors.json ({meta['sha256']})")
    vectors = load_safetensors_bytes(raw_files["vectors.safetensors"])
    return ConformanceSet(root, config, info, vectors, weights_bytes)


def build_model(cset: ConformanceSet) -> WorldPlayTransformer:
    """The set's model in float32 on the CPU with its weights loaded strictly."""
    arguments = WorldPlayTransformer.constructor_arguments(cset.config, source=str(cset.root / "config.json"))
    model = WorldPlayTransformer(**arguments)
    load_state_dict_strict(model, load_safetensors_bytes(cset.weights_bytes), source=str(cset.root / WEIGHTS_FILE))
    return model.float().eval()


# ---------------------------------------------------------------------------------------------------------------
# 2. Comparisons
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class CaseResult:
    name: str
    max_abs_err: float
    tolerance: str
    worst_ratio: float
    passed: bool

    def line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{self.name:<34} max_abs_err={self.max_abs_err:<10.3e} tol={self.tolerance:<22} "
            f"worst_ratio={self.worst_ratio:<9.4g} {verdict}"
        )


def compare_close(name: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> CaseResult:
    """Elementwise |got - ref| <= atol + rtol * |ref| (computed in float64)."""
    label = f"atol={atol:g},rtol={rtol:g}"
    if tuple(got.shape) != tuple(ref.shape):
        shapes = f"shape {tuple(got.shape)} != {tuple(ref.shape)}"
        return CaseResult(f"{name} ({shapes})", math.inf, label, math.inf, False)
    got64, ref64 = got.detach().to(torch.float64).cpu(), ref.to(torch.float64)
    diff = (got64 - ref64).abs()
    if diff.numel() == 0:
        return CaseResult(name, 0.0, label, 0.0, True)
    ratio = diff / (atol + rtol * ref64.abs())
    finite = bool(torch.isfinite(got64).all())
    max_err = float(diff.max()) if finite else math.inf
    worst = float(ratio.max()) if finite else math.inf
    return CaseResult(name, max_err, label, worst, finite and worst <= 1.0)


def compare_exact(name: str, got, ref) -> CaseResult:
    """Exact equality of tensors or lists (shape and values)."""
    got_t, ref_t = torch.as_tensor(got), torch.as_tensor(ref)
    if tuple(got_t.shape) != tuple(ref_t.shape):
        shapes = f"shape {tuple(got_t.shape)} != {tuple(ref_t.shape)}"
        return CaseResult(f"{name} ({shapes})", math.inf, "exact", math.inf, False)
    if got_t.numel() == 0:
        return CaseResult(name, 0.0, "exact", 0.0, True)
    diff = (got_t.to(torch.float64) - ref_t.to(torch.float64)).abs()
    max_err = float(diff.max())
    return CaseResult(name, max_err, "exact", 0.0 if max_err == 0 else math.inf, max_err == 0)


def _depth(cset: ConformanceSet) -> int:
    return int(cset.config["mm_double_blocks_depth"])


def reference_text_kv(cset: ConformanceSet) -> TextKV:
    """The stored `txt` cache (the one the context prefill and chunk steps were made with)."""
    depth = _depth(cset)
    return TextKV(
        [cset.tensor(f"txt.layer{i}.k_txt") for i in range(depth)],
        [cset.tensor(f"txt.layer{i}.v_txt") for i in range(depth)],
    )


def reference_context_kv(cset: ConformanceSet) -> ContextKV:
    """The stored `ctx` cache in our layout."""
    layers = [
        LayerContextKV.from_stacked(cset.tensor(f"ctx.layer{i}.k_vision"), cset.tensor(f"ctx.layer{i}.v_vision"))
        for i in range(_depth(cset))
    ]
    return ContextKV(layers, num_frames=int(cset.info["context_prefill"]["n_ctx"]))


# ---------------------------------------------------------------------------------------------------------------
# 3. Model cases
# ---------------------------------------------------------------------------------------------------------------
def _model_case(cset: ConformanceSet, name: str, got: torch.Tensor, tol: float) -> CaseResult:
    return compare_close(name, got, cset.tensor(name), tol, tol)


def text_prefill_cases(model, cset: ConformanceSet, tol: float, groups: list[str]) -> list[CaseResult]:
    timestep_txt = cset.info["text_prefill"]["timestep_txt"]
    if list(timestep_txt) != [0.0]:
        raise ValueError(f"{cset.root / 'vectors.json'}: text_prefill.timestep_txt {timestep_txt} != [0.0]")
    results = []
    for group in groups:
        recipe = TEXT_GROUPS[group]
        vision = cset.tensor("inputs.vision_states") * recipe.scale
        if recipe.zero_vision:
            vision = torch.zeros_like(vision)
        trace: dict = {}
        with torch.no_grad():
            text_kv = model.text_prefill(
                cset.tensor("inputs.text_states") * recipe.scale,
                cset.tensor(recipe.text_mask),
                cset.tensor("inputs.byt5_states") * recipe.scale,
                cset.tensor(recipe.byt5_mask),
                vision,
                mask_type=recipe.mask_type,
                trace=trace,
            )
        got = dict(trace)
        for index in range(text_kv.num_layers):
            got[f"layer{index}.k_txt"], got[f"layer{index}.v_txt"] = text_kv.layer(index)
        results += _model_cases(cset, group, got, tol)
    return results


def _model_cases(cset: ConformanceSet, group: str, got: dict, tol: float) -> list[CaseResult]:
    """Compare every stored output `group.<key>` with `got[key]`."""
    return [_model_case(cset, name, got[name.removeprefix(f"{group}.")], tol) for name in _stored(cset, group, got)]


def _stored(cset: ConformanceSet, group: str, got: dict) -> list[str]:
    """Names `group.<key>` of `got` that the set stores (in `got`'s order); raises if a stored output is uncovered."""
    prefix = f"{group}."
    stored = {name for name in cset.vectors if name.startswith(prefix)}
    outputs = {name for name in stored if _is_output(cset, name)}
    missing = sorted(outputs - {prefix + key for key in got})
    if missing:
        raise KeyError(f"{cset.root / 'vectors.safetensors'}: no computed value for the stored output(s) {missing}")
    return [prefix + key for key in got if prefix + key in stored]


def _is_output(cset: ConformanceSet, name: str) -> bool:
    """Stored tensors other than the call inputs (inputs: hidden_states, timestep, action, viewmats, Ks, indices)."""
    return name.rsplit(".", 1)[-1] not in {"hidden_states", "timestep", "action", "viewmats", "Ks", "frame_indices"}


def context_prefill_cases(model, cset: ConformanceSet, tol: float) -> list[CaseResult]:
    params = cset.info["context_prefill"]
    source = cset.root / "vectors.json"
    if int(params["start_rope_start_idx"]) != 0:
        start = params["start_rope_start_idx"]
        raise ValueError(f"{source}: context_prefill.start_rope_start_idx must be 0, got {start}")
    hidden_states = cset.tensor("ctx.hidden_states")
    frames = hidden_states.shape[2]
    if int(params["n_ctx"]) != frames or int(params["rope_temporal_size"]) != frames:
        raise ValueError(f"{source}: context_prefill n_ctx / rope_temporal_size differ from the {frames} stored frames")
    trace: dict = {}
    with torch.no_grad():
        context_kv, _ = model.context_prefill(
            hidden_states, cset.tensor("ctx.timestep"), cset.tensor("ctx.action"), cset.tensor("ctx.viewmats"),
            cset.tensor("ctx.Ks"), reference_text_kv(cset), trace=trace,
        )
    got = dict(trace)
    for index in range(context_kv.num_layers):
        got[f"layer{index}.k_vision"], got[f"layer{index}.v_vision"] = context_kv.layer(index).stacked()
    return _model_cases(cset, "ctx", got, tol)


def chunk_cases(model, cset: ConformanceSet, tol: float, groups: list[str]) -> list[CaseResult]:
    results = []
    for group in groups:
        params = cset.info["chunk_steps"][group]
        hidden_states = cset.tensor(f"{group}.hidden_states")
        rope_start = int(params["start_rope_start_idx"])
        context_frames = int(params["rope_temporal_size"]) - hidden_states.shape[2]
        context_kv = None
        if context_frames > 0:
            context_kv = reference_context_kv(cset)
            if context_frames != context_kv.num_frames or rope_start != context_frames:
                raise ValueError(
                    f"{cset.root / 'vectors.json'}: chunk_steps.{group} (rope_temporal_size "
                    f"{params['rope_temporal_size']}, start {rope_start}) does not match the stored context of "
                    f"{context_kv.num_frames} frames"
                )
        trace: dict = {}
        with torch.no_grad():
            output = model.chunk_step(
                hidden_states, cset.tensor(f"{group}.timestep"), cset.tensor(f"{group}.action"),
                cset.tensor(f"{group}.viewmats"), cset.tensor(f"{group}.Ks"), reference_text_kv(cset),
                context_kv=context_kv, rope_start=rope_start, return_final_hidden=True, trace=trace,
            )
        got = {"velocity": output.velocity, "final_hidden": output.final_hidden, "vec": output.vec, **trace}
        results += _model_cases(cset, group, got, tol)
    return results


# ---------------------------------------------------------------------------------------------------------------
# 4. Scheduler, pose and retrieval cases
# ---------------------------------------------------------------------------------------------------------------
def scheduler_cases(cset: ConformanceSet) -> list[CaseResult]:
    from predictor_training.rollout.scheduler import FlowMatchEulerScheduler, differentiable_euler_step, flow_match_sigmas

    params = cset.info["scheduler"]
    num_steps, shift = int(params["num_inference_steps"]), float(params["shift"])
    scheduler = FlowMatchEulerScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    sigmas, timesteps = cset.tensor("sched.sigmas"), cset.tensor("sched.timesteps")
    results = [
        compare_close("sched.sigmas", flow_match_sigmas(num_steps, shift), sigmas, SIGMA_ATOL, 0.0),
        compare_close("sched.scheduler_sigmas", scheduler.sigmas, sigmas, SIGMA_ATOL, 0.0),
        compare_close("sched.timesteps", scheduler.timesteps, timesteps, TIMESTEP_ATOL, 0.0),
    ]
    sample = cset.tensor("sched.x0")
    step_pattern = re.compile(r"^sched\.step(\d+)\.prev_sample$")
    steps = sorted(int(match.group(1)) for name in cset.vectors if (match := step_pattern.match(name)))
    if steps != list(range(len(steps))):
        raise ValueError(f"{cset.root / 'vectors.safetensors'}: scheduler steps {steps} are not 0..n-1")
    for step in steps:
        model_output = cset.tensor(f"sched.step{step}.model_output")
        stateless = differentiable_euler_step(sample, model_output, scheduler.sigmas, step)
        sample = scheduler.step(model_output, scheduler.timesteps[step], sample)
        name = f"sched.step{step}.prev_sample"
        results.append(compare_close(name, sample, cset.tensor(name), PREV_SAMPLE_ATOL, 0.0))
        results.append(compare_exact(f"sched.step{step}.stateless_equal", stateless, sample))
    return results


def pose_cases(cset: ConformanceSet) -> list[CaseResult]:
    from predictor_training.rollout.camera import load_pose, pose_string_to_json, pose_to_input

    def compare_pose(prefix: str, label: str, converted) -> list[CaseResult]:
        viewmats, Ks, action = converted
        return [
            compare_close(f"{label}.viewmats", viewmats, cset.tensor(f"{prefix}.viewmats"), VIEWMAT_ATOL, 0.0),
            compare_exact(f"{label}.Ks", Ks, cset.tensor(f"{prefix}.Ks")),
            compare_exact(f"{label}.action", action, cset.tensor(f"{prefix}.action")),
        ]

    results = compare_pose("pose", "pose", pose_to_input(load_pose(cset.root / "pose.json")))
    results += compare_pose("pose_str", "pose_str", pose_to_input(pose_string_to_json(cset.info["pose_string"])))
    from_file = pose_to_input(load_pose(cset.root / "pose_from_string.json"))
    results += compare_pose("pose_str", "pose_str.from_file", from_file)
    return results


def retrieval_cases(cset: ConformanceSet) -> list[CaseResult]:
    from predictor_training.rollout.memory_retrieval import (
        make_retrieval_points,
        memory_candidate_distances,
        select_aligned_memory_frames,
    )

    seed = int(cset.info["retrieval"]["seed"])
    seeded_points = make_retrieval_points(seed)
    results = []
    if "retr.points" in cset.vectors:
        points = cset.tensor("retr.points")
        results.append(compare_close("retr.points", seeded_points, points, POINTS_ATOL, 0.0))
    else:
        points = seeded_points
    w2c = cset.tensor("pose.viewmats")
    for name in sorted(n for n in cset.vectors if n.startswith("retr.selected.cur")):
        current = int(name.removeprefix("retr.selected.cur"))
        selected = select_aligned_memory_frames(
            w2c, current, MEMORY_FRAMES, TEMPORAL_CONTEXT, PREDICTION_LATENTS, points=points
        )
        results.append(compare_exact(name, torch.tensor(selected, dtype=torch.int64), cset.tensor(name)))
    for name in sorted(n for n in cset.vectors if n.startswith("retr.candidates.cur")):
        current = int(name.removeprefix("retr.candidates.cur"))
        reference = cset.tensor(name)
        candidates = memory_candidate_distances(w2c, current, TEMPORAL_CONTEXT, PREDICTION_LATENTS, points=points)
        starts = torch.tensor([start for start, _ in candidates], dtype=torch.float64)
        distances = torch.tensor([distance for _, distance in candidates], dtype=torch.float64)
        results.append(compare_exact(f"{name}.starts", starts, reference[:, 0]))
        results.append(compare_close(f"{name}.distances", distances, reference[:, 1], CANDIDATE_DISTANCE_ATOL, 0.0))
    return results


# ---------------------------------------------------------------------------------------------------------------
# 5. Running
# ---------------------------------------------------------------------------------------------------------------
def available_groups(cset: ConformanceSet) -> dict[str, list[str]]:
    """Category -> groups present in this set."""
    text = [group for group in TEXT_GROUPS if f"{group}.vec_txt" in cset.vectors]
    chunks = [group for group in cset.info["chunk_steps"] if f"{group}.velocity" in cset.vectors]
    return {
        "text": text,
        "context": ["ctx"] if "ctx.layer0.k_vision" in cset.vectors else [],
        "chunk": chunks,
        "scheduler": ["sched"] if "sched.sigmas" in cset.vectors else [],
        "pose": ["pose"] if "pose.viewmats" in cset.vectors else [],
        "retrieval": ["retr"] if any(name.startswith("retr.selected.") for name in cset.vectors) else [],
    }


def resolve_selection(groups: dict[str, list[str]], requested: list[str] | None) -> dict[str, list[str]]:
    """Restrict `groups` to the requested categories / group names (None = everything)."""
    if not requested:
        return groups
    valid = set(groups) | {group for members in groups.values() for group in members}
    unknown = sorted(set(requested) - valid)
    if unknown:
        group_names = sorted(valid - set(groups))
        raise ValueError(f"unknown case(s) {unknown}; valid: categories {list(groups)} or groups {group_names}")
    return {
        category: [group for group in members if category in requested or group in requested]
        for category, members in groups.items()
    }


def run_conformance(
    root: str | Path, tier: str = "portable", cases: list[str] | None = None, model=None
) -> list[CaseResult]:
    """Run the selected cases of folder `root`; returns one CaseResult per compared tensor.

    `model` (optional) replaces the set's own model (e.g. a deliberately perturbed copy in a test).
    """
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {sorted(TIERS)}")
    disable_reduced_precision_matmul()
    tol = TIERS[tier]
    cset = load_conformance_set(root)
    selection = resolve_selection(available_groups(cset), cases)
    needs_model = any(selection[category] for category in ("text", "context", "chunk"))
    if needs_model and model is None:
        model = build_model(cset)
    runners: list[tuple[str, Callable[[], list[CaseResult]]]] = [
        ("text", lambda: text_prefill_cases(model, cset, tol, selection["text"])),
        ("context", lambda: context_prefill_cases(model, cset, tol)),
        ("chunk", lambda: chunk_cases(model, cset, tol, selection["chunk"])),
        ("scheduler", lambda: scheduler_cases(cset)),
        ("pose", lambda: pose_cases(cset)),
        ("retrieval", lambda: retrieval_cases(cset)),
    ]
    results: list[CaseResult] = []
    for category, runner in runners:
        if selection[category]:
            results.extend(runner())
    return results


# ---------------------------------------------------------------------------------------------------------------
# Reduced precision on a device: the same calls in BF16 against FP32 (benchmarks/gpu_acceptance.py)
# ---------------------------------------------------------------------------------------------------------------
def max_difference(got: torch.Tensor, reference: torch.Tensor) -> dict:
    """{"max_abs", "max_rel" (max |got - reference| / max |reference|), "finite" (of got)}, in float64 on the CPU."""
    got, reference = got.detach().double().cpu(), reference.detach().double().cpu()
    error = (got - reference).abs().max().item() if got.numel() else 0.0
    scale = reference.abs().max().item() if reference.numel() else 0.0
    return {"max_abs": error, "max_rel": error / scale if scale > 0 else (0.0 if error == 0 else math.inf),
            "finite": bool(torch.isfinite(got).all())}


def precision_outputs(model, cset: ConformanceSet, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The set's context prefill and every stored chunk step (teacher-forced on the stored caches, as the model cases
    run them) on `device`: the latents and the K/V caches in `dtype`, timesteps and cameras in their stored dtype,
    under `dtype` autocast (as the AR loop runs a BF16 Teacher): {output name: tensor}."""
    def move(tensor):
        tensor = tensor.to(device)
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != torch.float64 else tensor

    def keep(name):
        return cset.tensor(name).to(device)

    text_kv = reference_text_kv(cset)
    text_kv = TextKV([move(k) for k in text_kv.k], [move(v) for v in text_kv.v], text_kv.mask)
    outputs = {}
    with torch.no_grad(), autocast(device, dtype):
        context_kv, _ = model.context_prefill(move(cset.tensor("ctx.hidden_states")), keep("ctx.timestep"),
                                              keep("ctx.action"), keep("ctx.viewmats"), keep("ctx.Ks"), text_kv)
        for index in range(context_kv.num_layers):
            k, v = context_kv.layer(index).stacked()
            outputs[f"ctx.layer{index}.k_vision"], outputs[f"ctx.layer{index}.v_vision"] = k, v
        stored_context = reference_context_kv(cset)
        for group, params in cset.info["chunk_steps"].items():
            hidden_states = cset.tensor(f"{group}.hidden_states")
            context = None
            if int(params["rope_temporal_size"]) - hidden_states.shape[2] > 0:  # context frames
                context = ContextKV([LayerContextKV.from_stacked(*[move(t) for t in layer.stacked()])
                                     for layer in stored_context.layers], num_frames=stored_context.num_frames)
            output = model.chunk_step(
                move(hidden_states), keep(f"{group}.timestep"), keep(f"{group}.action"), keep(f"{group}.viewmats"),
                keep(f"{group}.Ks"), text_kv, context_kv=context, rope_start=int(params["start_rope_start_idx"]),
                return_final_hidden=True)
            outputs[f"{group}.velocity"], outputs[f"{group}.final_hidden"] = output.velocity, output.final_hidden
    return outputs


def bf16_vs_fp32(root: str | Path, device: torch.device) -> dict:
    """The set's model in BF16 against FP32 on `device` (`precision_outputs`: every output's `max_difference` and
    the worst relative one), and FP32 on `device` against the golden vectors (worst absolute difference)."""
    cset = load_conformance_set(root)
    reference = precision_outputs(build_model(cset).to(device), cset, device, torch.float32)
    lower = precision_outputs(build_model(cset).to(device=device, dtype=torch.bfloat16), cset, device, torch.bfloat16)
    per_output = {name: max_difference(lower[name], reference[name]) for name in reference}
    golden = {name: max_difference(reference[name], cset.tensor(name)) for name in reference if name in cset.vectors}
    return {"bf16_vs_fp32": per_output,
            "bf16_vs_fp32_worst_rel": max(record["max_rel"] for record in per_output.values()),
            "fp32_device_vs_golden_worst_abs": max((record["max_abs"] for record in golden.values()), default=None),
            "fp32_device_vs_golden": golden}


def bf16_vs_fp32_rollout(teacher, preset: str, text_kv: TextKV, row: dict, image_cond: torch.Tensor,
                         device: torch.device, chunk_frames: int = 4) -> dict:
    """An F-F-F-F rollout (`rollout/ar_rollout.py ARRollout`) of the sample-table `row` (seed, cameras, actions)
    by the BF16 `teacher` of config `preset` (BF16 state and autocast, as the eval runs it) against the same weights
    in FP32 (FP32 state, no autocast): `max_difference` of each chunk's final latents and of the whole."""
    results = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        model, kv = teacher, text_kv
        if dtype != teacher.dtype:  # the same weights in FP32
            model = random_teacher(preset, device, dtype, randomize=False)
            model.load_state_dict(teacher.state_dict())
            kv = TextKV([k.to(dtype) for k in text_kv.k], [v.to(dtype) for v in text_kv.v], text_kv.mask)
        config = RolloutConfig(state_dtype=dtype, autocast_dtype=None if dtype == torch.float32 else dtype)
        inputs = RolloutInputs.from_seed(row["seed"], image_cond, row["viewmats"], row["Ks"], row["action"],
                                         state_dtype=dtype)
        with torch.no_grad():
            results[name] = ARRollout(model, kv, inputs, config, device=device).run().float().cpu()
        del model, kv
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    chunks = {f"chunk{chunk}": max_difference(results["bf16"][:, :, chunk * chunk_frames:(chunk + 1) * chunk_frames],
                                              results["fp32"][:, :, chunk * chunk_frames:(chunk + 1) * chunk_frames])
              for chunk in range(results["bf16"].shape[2] // chunk_frames)}
    return {"chunks": chunks, "whole": max_difference(results["bf16"], results["fp32"])}
