"""Trajectory conformance: our AR rollout against a golden full F-F-F-F trajectory.

Format: section "Full F-F-F-F trajectory" of ``predictor_training/conformance/golden/README.md`` (called "README" below). A
folder holds config.json, weights.safetensors.xz (or weights.safetensors), vectors.safetensors (the text-side inputs),
trajectory.safetensors and trajectory.json. ``check_trajectory`` loads the model into our Teacher (float32, CPU),
runs the text prefill on the stored encoder stand-ins, then the whole rollout of ``predictor_training.rollout.ar_rollout`` -
the loop the dataset builder uses - on its OWN running state (every chunk's context comes from our own earlier
chunks), with the stored memory points (``retr.points``; regenerated from trajectory.json's retrieval seed when
absent). ``compare_with_golden`` compares every recorded float tensor elementwise, ``|got - ref| <= atol + rtol *
|ref|`` with the tiers of README section 11 (``TIERS``; strict: atol = rtol = 3e-6, float32 on CPU; portable: 1e-5),
every context index exactly, and that the stored noise and image latent are what ``make_initial_noise`` gives for the
recorded seeds. ``print_report`` prints one line per chunk and per tensor kind. Nothing about the set's sizes is
assumed. ``tools/check_trajectory_conformance.py`` is the command line.
"""

from __future__ import annotations

import json
import lzma
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors_bytes

from predictor_training.rollout.ar_rollout import (
    RolloutConfig,
    RolloutInputs,
    build_cond_latents,
    make_initial_noise,
    record_rollout,
)
from predictor_training.rollout.recorder import TrajectoryRecorder
from predictor_training.rollout.memory_retrieval import make_retrieval_points
from predictor_training.conformance import TIERS
from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import load_safetensors
from predictor_training.teacher import WorldPlayTransformer, load_state_dict_strict

CHUNK_NAME = re.compile(r"^chunk(\d+)\.(.+)$")
PREFEATURE_NAME = re.compile(r"^ctx\.block(\d+)_in$")
STEP_TENSORS = ("latent_in", "timestep", "velocity", "final_hidden", "latent_out")
STEP_NAME = re.compile(rf"^step(\d+)\.({'|'.join(STEP_TENSORS)})$")


class ConformanceInputError(UserInputError):
    """The folder lacks a file or tensor the check needs."""


# =============================================================================================================
# 1. Loading a conformance folder
# =============================================================================================================
def load_conformance_teacher(folder: Path) -> WorldPlayTransformer:
    """The folder's model in float32 on the CPU: config.json + weights (xz-compressed or plain), strict."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConformanceInputError(f"{folder}: no config.json")
    try:
        arguments = WorldPlayTransformer.constructor_arguments(json.loads(config_path.read_text()), str(config_path))
    except ValueError as error:
        raise ConformanceInputError(str(error)) from error
    teacher = WorldPlayTransformer(**arguments)
    compressed, plain = folder / "weights.safetensors.xz", folder / "weights.safetensors"
    if compressed.is_file():
        state_dict = load_safetensors_bytes(lzma.open(compressed).read())
        source = compressed
    elif plain.is_file():
        state_dict = load_safetensors(plain)
        source = plain
    else:
        raise ConformanceInputError(f"{folder}: neither weights.safetensors.xz nor weights.safetensors exists")
    load_state_dict_strict(teacher, state_dict, source=str(source))
    if any(parameter.dtype != torch.float32 for parameter in teacher.parameters()):
        raise ConformanceInputError(f"{source}: conformance weights must be float32")
    return teacher.eval().requires_grad_(False)


def _require(tensors: dict, name: str, source: Path) -> torch.Tensor:
    if name not in tensors:
        raise ConformanceInputError(f"{source}: tensor {name!r} is missing")
    return tensors[name]


@dataclass
class GoldenTrajectory:
    """The stored trajectory plus what is needed to rerun it."""

    folder: Path
    tensors: dict[str, torch.Tensor]
    meta: dict
    vectors: dict[str, torch.Tensor]

    @classmethod
    def load(cls, folder: Path) -> "GoldenTrajectory":
        for name in ("trajectory.safetensors", "trajectory.json", "vectors.safetensors"):
            if not (folder / name).is_file():
                raise ConformanceInputError(f"{folder}: {name} is missing")
        return cls(
            folder=folder,
            tensors=load_safetensors(folder / "trajectory.safetensors"),
            meta=json.loads((folder / "trajectory.json").read_text()),
            vectors=load_safetensors(folder / "vectors.safetensors"),
        )

    def tensor(self, name: str) -> torch.Tensor:
        return _require(self.tensors, name, self.folder / "trajectory.safetensors")

    def meta_field(self, *path: str):
        node = self.meta
        for key in path:
            if not isinstance(node, dict) or key not in node:
                raise ConformanceInputError(f"{self.folder / 'trajectory.json'}: field {'.'.join(path)!r} is missing")
            node = node[key]
        return node

    def prefeature_layers(self) -> tuple[int, ...]:
        layers = set()
        for name in self.tensors:
            match = CHUNK_NAME.match(name)
            if match and PREFEATURE_NAME.match(match.group(2)):
                layers.add(int(PREFEATURE_NAME.match(match.group(2)).group(1)))
        return tuple(sorted(layers))

    def memory_points(self) -> tuple[torch.Tensor, str]:
        if "retr.points" in self.vectors:
            return self.vectors["retr.points"], "retr.points (stored)"
        seed = int(self.meta_field("seeds", "retrieval_seed"))
        return make_retrieval_points(seed), f"make_retrieval_points({seed})"


# =============================================================================================================
# 2. Running our rollout on the golden inputs
# =============================================================================================================
def text_kv_for(teacher, golden: GoldenTrajectory):
    """Text prefill on the stand-in encoder outputs named in trajectory.json["text_inputs"]."""
    names = golden.meta_field("text_inputs")
    source = golden.folder / "vectors.safetensors"
    fetch = {key: _require(golden.vectors, names[key], source) for key in
             ("text_states", "encoder_attention_mask", "byt5_text_states", "byt5_text_mask", "vision_states")}
    with torch.no_grad():
        return teacher.text_prefill(
            fetch["text_states"], fetch["encoder_attention_mask"], fetch["byt5_text_states"],
            fetch["byt5_text_mask"], fetch["vision_states"], mask_type=names["mask_type"],
        )


def rollout_config_for(golden: GoldenTrajectory, prefeature_layers) -> RolloutConfig:
    """The loop settings recorded in trajectory.json (float32 state, no autocast)."""
    sampling = golden.meta_field("sampling")
    grid = golden.meta_field("grid")
    if sampling["guidance_scale"] != 1.0 or sampling["solver"] != "euler":
        raise ConformanceInputError(f"{golden.folder}: only guidance 1 with the Euler solver is supported")
    return RolloutConfig(
        num_steps=int(sampling["num_inference_steps"]),
        shift=float(sampling["shift"]),
        chunk_latents=int(grid["chunk_latent_frames"]),
        context_timestep=float(sampling["context_timestep"]),
        state_dtype=torch.float32,
        autocast_dtype=None,
        prefeature_layers=tuple(prefeature_layers),
    )


def run_our_rollout(teacher, golden: GoldenTrajectory, config: RolloutConfig):
    """Our rollout with the stored inputs -> (ARRollout, TrajectoryRecorder)."""
    points, _ = golden.memory_points()
    inputs = RolloutInputs(
        noise=golden.tensor("inputs.noise"),
        image_cond=golden.tensor("inputs.image_cond"),
        viewmats=golden.tensor("inputs.viewmats")[0],
        Ks=golden.tensor("inputs.Ks")[0],
        action=golden.tensor("inputs.action")[0],
        memory_points=points,
    )
    return record_rollout(teacher, text_kv_for(teacher, golden), inputs, config, device="cpu")


def recorded_chunk_tensors(recorder: TrajectoryRecorder) -> dict[str, torch.Tensor]:
    """Every per-chunk tensor of a recorded rollout under its golden name (README "F.5 Recorded tensors").

    ``chunk{c}.ctx.indices``, ``chunk{c}.ctx.hidden_states``, ``chunk{c}.ctx.vec`` and ``chunk{c}.ctx.block{L}_in``
    for the chunks with a context; ``chunk{c}.step{k}.{latent_in, timestep, velocity, final_hidden, latent_out}``
    for every chunk and step. The one home of this naming (``CHUNK_NAME``, ``PREFEATURE_NAME`` and ``STEP_NAME``
    parse it back); the test writer of synthetic conformance folders uses it too.
    """
    tensors = {}
    for chunk in recorder.chunks:
        prefix = f"chunk{chunk.chunk_index}"
        if chunk.ctx_indices:
            tensors[f"{prefix}.ctx.indices"] = torch.tensor(chunk.ctx_indices, dtype=torch.int64)
            tensors[f"{prefix}.ctx.hidden_states"] = chunk.ctx_input
            tensors[f"{prefix}.ctx.vec"] = chunk.ctx_vec
            for layer, value in chunk.prefeatures.items():
                tensors[f"{prefix}.ctx.block{layer}_in"] = value
        for step_index, step in enumerate(chunk.steps):
            for name in STEP_TENSORS:
                tensors[f"{prefix}.step{step_index}.{name}"] = getattr(step, name)
    return tensors


def our_tensors(rollout, recorder, golden: GoldenTrajectory) -> dict[str, torch.Tensor]:
    """Our values under the golden file's names."""
    ours = {
        "inputs.cond_latents": build_cond_latents(
            golden.tensor("inputs.image_cond"), golden.tensor("inputs.noise").shape[2]
        ),
        "sched.sigmas": rollout.sigmas,
        "sched.timesteps": rollout.timesteps,
        "final.latents": rollout.latents,
    }
    ours.update(recorded_chunk_tensors(recorder))
    return ours


# =============================================================================================================
# 3. Comparison
# =============================================================================================================
@dataclass
class Comparison:
    name: str
    passed: bool
    max_abs: float = 0.0
    worst_ratio: float = 0.0
    note: str = ""


@dataclass
class Report:
    tier: str
    tolerance: float
    comparisons: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(item.passed for item in self.comparisons)

    def failures(self) -> list[Comparison]:
        return [item for item in self.comparisons if not item.passed]


def compare_float(name: str, got: torch.Tensor, ref: torch.Tensor, tolerance: float) -> Comparison:
    if tuple(got.shape) != tuple(ref.shape):
        return Comparison(name, False, note=f"shape {list(got.shape)} != reference {list(ref.shape)}")
    got64, ref64 = got.detach().to(torch.float64), ref.to(torch.float64)
    if not torch.isfinite(got64).all():
        return Comparison(name, False, note="non-finite values")
    diff = (got64 - ref64).abs()
    budget = tolerance + tolerance * ref64.abs()
    ratio = float((diff / budget).max()) if diff.numel() else 0.0
    max_abs = float(diff.max()) if diff.numel() else 0.0
    return Comparison(name, ratio <= 1.0, max_abs, ratio)


def compare_exact(name: str, got: torch.Tensor, ref: torch.Tensor) -> Comparison:
    same = tuple(got.shape) == tuple(ref.shape) and torch.equal(got.to(ref.dtype), ref)
    note = "" if same else f"got {got.tolist()}, reference {ref.tolist()}"
    return Comparison(name, same, note=note)


def our_trajectory(golden: GoldenTrajectory, config: RolloutConfig | None = None) -> dict[str, torch.Tensor]:
    """Load the folder's model and run our rollout on the golden inputs -> our tensors under the golden names.

    ``config``: loop settings (default: the ones recorded in trajectory.json, ``rollout_config_for``).
    """
    teacher = load_conformance_teacher(golden.folder)
    config = rollout_config_for(golden, golden.prefeature_layers()) if config is None else config
    rollout, recorder = run_our_rollout(teacher, golden, config)
    return our_tensors(rollout, recorder, golden)


def compare_with_golden(golden: GoldenTrajectory, ours: dict[str, torch.Tensor], tier: str = "strict") -> Report:
    """Compare every recorded tensor (floats with the tier, integers exactly) and the seed-made inputs."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {sorted(TIERS)}, got {tier!r}")
    report = Report(tier, TIERS[tier])
    report.notes.append(f"memory points: {golden.memory_points()[1]}; prefeature layers "
                        f"{list(golden.prefeature_layers())}")

    # 1. Inputs that the seeds determine (exact).
    seeds = golden.meta_field("seeds")
    noise = golden.tensor("inputs.noise")
    image_cond = golden.tensor("inputs.image_cond")
    report.comparisons.append(compare_exact(
        "inputs.noise == make_initial_noise(noise_seed)",
        make_initial_noise(int(seeds["noise_seed"]), noise.shape, "cpu", noise.dtype), noise))
    report.comparisons.append(compare_exact(
        "inputs.image_cond == make_initial_noise(image_cond_seed)",
        make_initial_noise(int(seeds["image_cond_seed"]), image_cond.shape, "cpu", image_cond.dtype), image_cond))

    # 2. Every recorded tensor.
    passthrough = {"inputs.noise", "inputs.image_cond", "inputs.viewmats", "inputs.Ks", "inputs.action"}
    for name in sorted(golden.tensors, key=_natural_key):
        if name in passthrough:  # fed to the rollout as they are
            continue
        if name not in ours:
            report.comparisons.append(Comparison(name, False, note="recorded in the golden file, not produced by us"))
            continue
        reference = golden.tensors[name]
        if reference.is_floating_point():
            report.comparisons.append(compare_float(name, ours[name], reference, report.tolerance))
        else:
            report.comparisons.append(compare_exact(name, ours[name], reference))
    extra = sorted(set(ours) - set(golden.tensors), key=_natural_key)
    if extra:
        report.comparisons.append(Comparison("our context", False, note=f"tensors the golden file lacks: {extra[:4]}"))
    return report


def check_trajectory(folder: str | Path, tier: str = "strict") -> Report:
    """Run the whole check on one folder and return the per-tensor comparisons."""
    golden = GoldenTrajectory.load(Path(folder))
    return compare_with_golden(golden, our_trajectory(golden), tier)


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


# =============================================================================================================
# 4. Printing
# =============================================================================================================
def _group_of(name: str) -> str:
    match = CHUNK_NAME.match(name)
    return f"chunk{match.group(1)}" if match else name.split(".")[0].split(" ")[0]


def _kind_of(name: str) -> str:
    match = CHUNK_NAME.match(name)
    if not match:
        return name
    rest = match.group(2)
    step = STEP_NAME.match(rest)
    return f"step*.{step.group(2)}" if step else rest


def summarise(items: list[Comparison]) -> tuple[bool, float, float, str]:
    worst = max(items, key=lambda item: item.worst_ratio)
    return all(item.passed for item in items), max(item.max_abs for item in items), worst.worst_ratio, worst.name


def print_report(report: Report, stream=None) -> None:
    """One line per chunk / group and per tensor kind, every failure, and the verdict (default: stdout)."""
    stream = sys.stdout if stream is None else stream

    def line(label: str, items: list[Comparison], extra: str = "") -> None:
        passed, max_abs, ratio, worst = summarise(items)
        print(f"{'PASS' if passed else 'FAIL'}  {label:<34} n={len(items):<3} max_abs={max_abs:.2e} "
              f"tol={report.tolerance:.0e} worst_ratio={ratio:.3f} ({worst}){extra}", file=stream)

    for note in report.notes:
        print(f"note: {note}", file=stream)
    groups: dict[str, list[Comparison]] = {}
    kinds: dict[str, list[Comparison]] = {}
    for item in report.comparisons:
        groups.setdefault(_group_of(item.name), []).append(item)
        kinds.setdefault(_kind_of(item.name), []).append(item)
    print("-- per chunk / group --", file=stream)
    for group, items in groups.items():
        indices = [item for item in items if item.name.endswith("ctx.indices")]
        extra = f" ctx_indices={'exact' if all(i.passed for i in indices) else 'DIFFER'}" if indices else ""
        line(group, items, extra)
    print("-- per tensor kind --", file=stream)
    for kind, items in sorted(kinds.items()):
        line(kind, items)
    for item in report.failures():
        print(f"FAILED {item.name}: max_abs={item.max_abs:.3e} ratio={item.worst_ratio:.3f} {item.note}", file=stream)
    verdict = "PASS" if report.passed else "FAIL"
    print(f"{verdict}: {len(report.comparisons)} checks, {len(report.failures())} failed, tier {report.tier} "
          f"(atol = rtol = {report.tolerance:.0e})", file=stream)
