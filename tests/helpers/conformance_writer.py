"""Write a synthetic conformance folder (format of predictor_training/conformance/golden/README.md, sections 1-13 and
"Full F-F-F-F trajectory") from OUR teacher, with sizes chosen by the caller.

The reference tensors are produced by our own implementation (self-consistency): such a folder checks that the
conformance tools and the library make no assumption about the sizes of set A (depth, hidden, heads, RoPE split,
latent channels, grid, text lengths, context frames, chunk frames/timestep, number of latents and chunks, which
text groups exist, whether ``retr.points`` is stored, which pre-feature layers are recorded), not correctness.

    spec = SyntheticSetSpec(...)
    write_conformance_folder(tmp_path / "set", spec)
"""

from __future__ import annotations

import hashlib
import json
import lzma
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save, save_file

from predictor_training.rollout.ar_rollout import (
    RolloutConfig,
    RolloutInputs,
    build_cond_latents,
    make_initial_noise,
    record_rollout,
)
from predictor_training.rollout.camera import load_pose, pose_string_to_json, pose_to_input
from predictor_training.rollout.memory_retrieval import (
    make_retrieval_points,
    memory_candidate_distances,
    select_aligned_memory_frames,
)
from predictor_training.conformance.calls import DECOMPRESSED_WEIGHTS_ENTRY
from predictor_training.conformance.trajectory import recorded_chunk_tensors
from predictor_training.rollout.scheduler import FlowMatchEulerScheduler
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.config import preset_config

SMALL_SCALE = 2.0**-10
CONTEXT_TIMESTEP = 14.0
CHUNK_LATENTS = 4
NUM_STEPS, SHIFT = 4, 5.0
MEMORY_FRAMES, TEMPORAL_CONTEXT = 20, 12


@dataclass
class SyntheticSetSpec:
    """Sizes and choices of one synthetic set (everything that set A fixes).

    model: overrides of the teacher preset "demo" (hidden_size, heads_num, rope_dim_list, depth, channels, ...).
    height / width: latent grid. text_mask / holes_text_mask: LLM masks [L_text]; byt5_mask / holes_byt5_mask:
    ByT5 masks [L_byt5]; vision_tokens: SigLIP length. pose_string: drives pose.json (its step count + 1 = latents).
    context_frames: `ctx.frame_indices` (ascending, any pattern); chunk_start: first frame of the `chunk` groups;
    chunk_timestep_index: which scheduler timestep the chunk groups use. text_groups: which txt groups to store
    ("txt" is required). store_points: write `retr.points`. prefeature_layers: `chunk{c}.ctx.block{L}_in` layers.
    """

    name: str
    model: dict
    height: int
    width: int
    text_mask: list[int]
    holes_text_mask: list[int]
    byt5_mask: list[int]
    holes_byt5_mask: list[int]
    vision_tokens: int
    pose_string: str
    string_pose_string: str
    context_frames: list[int]
    chunk_start: int
    chunk_timestep_index: int
    text_groups: tuple[str, ...] = ("txt", "txt_holes", "txt_small", "txt_t2v")
    store_points: bool = True
    prefeature_layers: tuple[int, ...] = (0, 1)
    weights_seed: int = 0
    input_seed: int = 1
    noise_seed: int = 100
    image_cond_seed: int = 200
    retrieval_seed: int = 0
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------
# 1. Model with every parameter random (predictor_training/conformance/golden/README.md section 2), on the bf16 grid
# ---------------------------------------------------------------------------------------------------------------
def build_random_teacher(config: dict, seed: int) -> WorldPlayTransformer:
    """Our teacher with all parameters random (no zero-initialised path), values on the bfloat16 grid."""
    model = WorldPlayTransformer(**config).float().eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() >= 2:
                fan_in = parameter[0].numel()
                value = noise / fan_in**0.5
                if name == "cond_type_embedding.weight":
                    value = noise * 0.5
            elif "norm" in name and name.endswith("weight"):
                value = 1.0 + 0.1 * noise
            else:
                value = 0.1 * noise
            parameter.copy_(value.to(torch.bfloat16).float())
    return model.requires_grad_(False)


def _bf16_randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=generator).to(torch.bfloat16).float()


# ---------------------------------------------------------------------------------------------------------------
# 2. vectors.safetensors groups
# ---------------------------------------------------------------------------------------------------------------
def _text_group(model, inputs: dict, group: str) -> dict[str, torch.Tensor]:
    text_mask = inputs["inputs.holes_text_mask" if group == "txt_holes" else "inputs.text_mask"]
    byt5_mask = inputs["inputs.holes_byt5_mask" if group == "txt_holes" else "inputs.byt5_mask"]
    scale = SMALL_SCALE if group == "txt_small" else 1.0
    vision = inputs["inputs.vision_states"] * scale
    if group == "txt_t2v":
        vision = torch.zeros_like(vision)
    trace: dict = {}
    text_kv = model.text_prefill(
        inputs["inputs.text_states"] * scale, text_mask, inputs["inputs.byt5_states"] * scale, byt5_mask, vision,
        mask_type="t2v" if group == "txt_t2v" else "i2v", trace=trace,
    )
    out = {f"{group}.{key}": value for key, value in trace.items()}
    for index in range(text_kv.num_layers):
        out[f"{group}.layer{index}.k_txt"], out[f"{group}.layer{index}.v_txt"] = text_kv.layer(index)
    return out


def _frame_inputs(group: str, frames: list[int], pose: dict, timestep: float) -> dict[str, torch.Tensor]:
    index = torch.tensor(frames)
    return {
        f"{group}.timestep": torch.full((len(frames),), timestep, dtype=torch.float32),
        f"{group}.action": pose["pose.action"][index].float()[None],
        f"{group}.viewmats": pose["pose.viewmats"][index].float()[None],
        f"{group}.Ks": pose["pose.Ks"][index].float()[None],
    }


def _chunk_group(model, group, hidden_states, frame_inputs, text_kv, context_kv, rope_start, debug=True):
    trace: dict = {}
    output = model.chunk_step(
        hidden_states, frame_inputs[f"{group}.timestep"], frame_inputs[f"{group}.action"],
        frame_inputs[f"{group}.viewmats"], frame_inputs[f"{group}.Ks"], text_kv, context_kv=context_kv,
        rope_start=rope_start, return_final_hidden=True, trace=trace,
    )
    out = {f"{group}.hidden_states": hidden_states, **frame_inputs, f"{group}.velocity": output.velocity,
           f"{group}.final_hidden": output.final_hidden, f"{group}.vec": output.vec}
    if debug:
        out.update({f"{group}.{key}": value for key, value in trace.items()})
    return out


def _pose_tensors(prefix: str, source) -> dict[str, torch.Tensor]:
    viewmats, Ks, action = pose_to_input(load_pose(source))
    return {f"{prefix}.viewmats": viewmats, f"{prefix}.Ks": Ks, f"{prefix}.action": action}


def _retrieval(w2c: torch.Tensor, num_latents: int, points: torch.Tensor) -> tuple[dict, dict]:
    tensors, selected_json = {}, {}
    for current in range(0, num_latents, CHUNK_LATENTS):
        selected = select_aligned_memory_frames(w2c, current, MEMORY_FRAMES, TEMPORAL_CONTEXT, CHUNK_LATENTS,
                                                points=points)
        tensors[f"retr.selected.cur{current:02d}"] = torch.tensor(selected, dtype=torch.int64)
        selected_json[str(current)] = list(selected)
        if current > MEMORY_FRAMES:
            candidates = memory_candidate_distances(w2c, current, TEMPORAL_CONTEXT, CHUNK_LATENTS, points=points)
            tensors[f"retr.candidates.cur{current:02d}"] = torch.tensor(candidates, dtype=torch.float64)
    return tensors, selected_json


def _tensor_meta(tensors: dict[str, torch.Tensor]) -> dict:
    return {
        name: {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
               "meaning": "synthetic (generated by our implementation)"}
        for name, value in sorted(tensors.items())
    }


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# 3. The folder
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def write_conformance_folder(folder: Path, spec: SyntheticSetSpec) -> dict:
    """Write config.json, weights.safetensors.xz, vectors.*, pose*.json, trajectory.* into ``folder``.

    Returns a summary dict (sizes, context indices of every trajectory chunk) for the test's assertions.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = preset_config("demo", **spec.model)
    model = build_random_teacher(config, spec.weights_seed)
    channels, height, width = config["in_channels"], spec.height, spec.width
    generator = torch.Generator().manual_seed(spec.input_seed)

    # 1. config, weights (lzma), poses.
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights_bytes = save({name: value.contiguous() for name, value in model.state_dict().items()})
    (folder / "weights.safetensors.xz").write_bytes(lzma.compress(weights_bytes, preset=1))
    pose_json = pose_string_to_json(spec.pose_string)
    (folder / "pose.json").write_text(json.dumps(pose_json))
    (folder / "pose_from_string.json").write_text(json.dumps(pose_string_to_json(spec.string_pose_string)))
    pose = _pose_tensors("pose", folder / "pose.json")
    num_latents = pose["pose.viewmats"].shape[0]

    # 2. inputs.
    text_dim, vision_dim = config["text_states_dim"], config["vision_states_dim"]
    inputs = {
        "inputs.text_states": _bf16_randn(generator, 1, len(spec.text_mask), text_dim),
        "inputs.text_mask": torch.tensor([spec.text_mask], dtype=torch.int64),
        "inputs.holes_text_mask": torch.tensor([spec.holes_text_mask], dtype=torch.int64),
        "inputs.byt5_states": _bf16_randn(generator, 1, len(spec.byt5_mask), config["byt5_states_dim"]),
        "inputs.byt5_mask": torch.tensor([spec.byt5_mask], dtype=torch.int64),
        "inputs.holes_byt5_mask": torch.tensor([spec.holes_byt5_mask], dtype=torch.int64),
        "inputs.vision_states": _bf16_randn(generator, 1, spec.vision_tokens, vision_dim),
    }
    latents = _bf16_randn(generator, 1, channels, num_latents, height, width)
    image_cond = _bf16_randn(generator, 1, channels, 1, height, width)
    latent_input_all = torch.cat([latents, build_cond_latents(image_cond, num_latents)], dim=1)
    inputs["inputs.latent_input_all"] = latent_input_all
    vectors = {**inputs, **pose, **_pose_tensors("pose_str", folder / "pose_from_string.json")}

    # 3. text groups.
    if "txt" not in spec.text_groups:
        raise ValueError("spec.text_groups must contain 'txt' (the later calls use its cache)")
    for group in spec.text_groups:
        vectors.update(_text_group(model, inputs, group))
    text_kv = model.text_prefill(
        inputs["inputs.text_states"], inputs["inputs.text_mask"], inputs["inputs.byt5_states"],
        inputs["inputs.byt5_mask"], inputs["inputs.vision_states"], mask_type="i2v",
    )

    # 4. context prefill at the spec's (possibly non-contiguous) frames.
    ctx_frames = list(spec.context_frames)
    n_ctx = len(ctx_frames)
    ctx_inputs = _frame_inputs("ctx", ctx_frames, pose, CONTEXT_TIMESTEP)
    ctx_hidden = latent_input_all[:, :, torch.tensor(ctx_frames)]
    trace: dict = {}
    context_kv, _ = model.context_prefill(
        ctx_hidden, ctx_inputs["ctx.timestep"], ctx_inputs["ctx.action"], ctx_inputs["ctx.viewmats"],
        ctx_inputs["ctx.Ks"], text_kv, trace=trace,
    )
    vectors.update(ctx_inputs)
    vectors["ctx.hidden_states"] = ctx_hidden
    vectors["ctx.frame_indices"] = torch.tensor(ctx_frames, dtype=torch.int64)
    vectors.update({f"ctx.{key}": value for key, value in trace.items()})
    for index in range(context_kv.num_layers):
        vectors[f"ctx.layer{index}.k_vision"], vectors[f"ctx.layer{index}.v_vision"] = context_kv.layer(index).stacked()

    # 5. chunk groups.
    scheduler = FlowMatchEulerScheduler(shift=SHIFT)
    scheduler.set_timesteps(NUM_STEPS)
    chunk_t = float(scheduler.timesteps[spec.chunk_timestep_index])
    chunk_frames = list(range(spec.chunk_start, spec.chunk_start + CHUNK_LATENTS))
    first_frames = list(range(CHUNK_LATENTS))
    chunk_hidden = latent_input_all[:, :, spec.chunk_start : spec.chunk_start + CHUNK_LATENTS]
    first_hidden = latent_input_all[:, :, :CHUNK_LATENTS]
    chunk_inputs = lambda group, frames: _frame_inputs(group, frames, pose, chunk_t)  # noqa: E731
    vectors.update(_chunk_group(model, "chunk", chunk_hidden, chunk_inputs("chunk", chunk_frames), text_kv,
                                context_kv, n_ctx))
    vectors.update(_chunk_group(model, "chunk_noctx", chunk_hidden, chunk_inputs("chunk_noctx", chunk_frames),
                                text_kv, None, 0))
    vectors.update(_chunk_group(model, "chunk_first", first_hidden, chunk_inputs("chunk_first", first_frames),
                                text_kv, None, 0))
    vectors.update(_chunk_group(model, "chunk_small", chunk_hidden * SMALL_SCALE,
                                chunk_inputs("chunk_small", chunk_frames), text_kv, None, 0, debug=False))
    chunk_params = {
        "chunk": (chunk_frames, CHUNK_LATENTS + n_ctx, n_ctx, "text-prefill cache + context cache (ctx.*)"),
        "chunk_noctx": (chunk_frames, CHUNK_LATENTS, 0, "text-prefill cache only"),
        "chunk_first": (first_frames, CHUNK_LATENTS, 0, "text-prefill cache only"),
        "chunk_small": (chunk_frames, CHUNK_LATENTS, 0, "text-prefill cache only"),
    }

    # 6. scheduler chain.
    sample = _bf16_randn(generator, 1, channels, CHUNK_LATENTS, height, width)
    vectors.update({"sched.sigmas": scheduler.sigmas, "sched.timesteps": scheduler.timesteps, "sched.x0": sample})
    for step in range(NUM_STEPS):
        model_output = _bf16_randn(generator, 1, channels, CHUNK_LATENTS, height, width)
        sample = scheduler.step(model_output, scheduler.timesteps[step], sample)
        vectors[f"sched.step{step}.model_output"] = model_output
        vectors[f"sched.step{step}.prev_sample"] = sample

    # 7. retrieval.
    points = make_retrieval_points(spec.retrieval_seed)
    retrieval_tensors, selected_json = _retrieval(pose["pose.viewmats"], num_latents, points)
    vectors.update(retrieval_tensors)
    if spec.store_points:
        vectors["retr.points"] = points

    vectors = {name: value.detach().contiguous() for name, value in vectors.items()}
    vectors_bytes = save(vectors)
    (folder / "vectors.safetensors").write_bytes(vectors_bytes)

    # 8. trajectory (our rollout, recorded).
    trajectory, chunk_meta = _trajectory(model, text_kv, spec, pose, channels, height, width, num_latents, points)
    save_file(trajectory, folder / "trajectory.safetensors")

    # 9. sidecars.
    files = {
        "weights.safetensors.xz": {"sha256": _sha((folder / "weights.safetensors.xz").read_bytes())},
        DECOMPRESSED_WEIGHTS_ENTRY: {"sha256": _sha(weights_bytes), "bytes": len(weights_bytes), "dtype": "float32"},
        "vectors.safetensors": {"sha256": _sha(vectors_bytes)},
    }
    for name in ("config.json", "pose.json", "pose_from_string.json"):
        files[name] = {"sha256": _sha((folder / name).read_bytes())}
    info = {
        "set": spec.name,
        "weights_seed": spec.weights_seed,
        "files": files,
        "config": config,
        "latent_grid": {"C": channels, "H": height, "W": width, "T_total": num_latents},
        "text_prefill": {"timestep_txt": [0.0], "mask_type": "i2v", "cache_txt": True},
        "context_prefill": {"frame_indices": ctx_frames, "n_ctx": n_ctx, "timestep_per_frame": CONTEXT_TIMESTEP,
                            "cache_vision": True, "rope_temporal_size": n_ctx, "start_rope_start_idx": 0},
        "chunk_steps": {
            group: {"start": frames[0], "frames": frames, "rope_temporal_size": size, "start_rope_start_idx": start,
                    "timestep": chunk_t, "kv_cache_in": cache, "cache_vision": False}
            for group, (frames, size, start, cache) in chunk_params.items()
        },
        "chunk_timestep_index": spec.chunk_timestep_index,
        "scheduler": {"num_inference_steps": NUM_STEPS, "shift": SHIFT, "reverse": True, "solver": "euler",
                      "num_train_timesteps": 1000},
        "pose_string": spec.string_pose_string,
        "retrieval": {"seed": spec.retrieval_seed, "points_stored": spec.store_points, "selected": selected_json},
        "tensors": _tensor_meta(vectors),
    }
    (folder / "vectors.json").write_text(json.dumps(info, indent=1))
    trajectory_meta = {
        "set": spec.name,
        "seeds": {"noise_seed": spec.noise_seed, "image_cond_seed": spec.image_cond_seed,
                  "retrieval_seed": spec.retrieval_seed},
        "grid": {"C": channels, "H": height, "W": width, "T_latents": num_latents,
                 "chunk_latent_frames": CHUNK_LATENTS, "n_chunks": num_latents // CHUNK_LATENTS,
                 "hidden": config["hidden_size"], "depth": config["mm_double_blocks_depth"]},
        "sampling": {"num_inference_steps": NUM_STEPS, "shift": SHIFT, "guidance_scale": 1.0, "cfg": False,
                     "solver": "euler", "timesteps": scheduler.timesteps.tolist(), "sigmas": scheduler.sigmas.tolist(),
                     "context_timestep": CONTEXT_TIMESTEP, "task": "i2v", "mask_type": "i2v"},
        "text_inputs": {"source": "vectors.safetensors in this folder", "text_states": "inputs.text_states",
                        "encoder_attention_mask": "inputs.text_mask", "byt5_text_states": "inputs.byt5_states",
                        "byt5_text_mask": "inputs.byt5_mask", "vision_states": "inputs.vision_states",
                        "timestep_txt": [0.0], "mask_type": "i2v"},
        "chunks": chunk_meta,
        "tensors": _tensor_meta(trajectory),
        "files": {"trajectory.safetensors": {"sha256": _sha((folder / "trajectory.safetensors").read_bytes())},
                  "vectors.safetensors (text inputs)": {"sha256": _sha(vectors_bytes)},
                  DECOMPRESSED_WEIGHTS_ENTRY: {"sha256": _sha(weights_bytes)},
                  "pose.json": files["pose.json"]},
    }
    (folder / "trajectory.json").write_text(json.dumps(trajectory_meta, indent=1))
    return {"num_latents": num_latents, "n_ctx": n_ctx,
            "trajectory_context": [chunk["context"]["indices"] if chunk["context"] else [] for chunk in chunk_meta]}


def _trajectory(model, text_kv, spec, pose, channels, height, width, num_latents, points):
    """Our recorded F-F-F-F rollout -> (trajectory tensors, trajectory.json["chunks"])."""
    noise = make_initial_noise(spec.noise_seed, (1, channels, num_latents, height, width))
    image_cond = make_initial_noise(spec.image_cond_seed, (1, channels, 1, height, width))
    inputs = RolloutInputs(noise=noise, image_cond=image_cond, viewmats=pose["pose.viewmats"], Ks=pose["pose.Ks"],
                           action=pose["pose.action"], memory_points=points)
    config = RolloutConfig(num_steps=NUM_STEPS, shift=SHIFT, chunk_latents=CHUNK_LATENTS,
                           prefeature_layers=tuple(spec.prefeature_layers))
    rollout, recorder = record_rollout(model, text_kv, inputs, config, device="cpu")
    tensors = {
        "inputs.noise": noise, "inputs.image_cond": image_cond,
        "inputs.cond_latents": build_cond_latents(image_cond, num_latents),
        "inputs.viewmats": pose["pose.viewmats"][None], "inputs.Ks": pose["pose.Ks"][None],
        "inputs.action": pose["pose.action"][None],
        "sched.sigmas": rollout.sigmas, "sched.timesteps": rollout.timesteps, "final.latents": rollout.latents,
    }
    tensors.update(recorded_chunk_tensors(recorder))  # the production golden names
    chunks = []
    for chunk in recorder.chunks:
        n = len(chunk.ctx_indices)
        start = chunk.frame_start
        chunks.append({
            "chunk": chunk.chunk_index, "frames": list(range(start, start + CHUNK_LATENTS)),
            "context": {"indices": chunk.ctx_indices, "n": n, "rope_temporal_size": n, "start_rope_start_idx": 0}
            if n else None,
            "steps": [{"step": k, "timestep": float(rollout.timesteps[k]), "rope_temporal_size": CHUNK_LATENTS + n,
                       "start_rope_start_idx": n, "scheduler_step_index": k} for k in range(NUM_STEPS)],
        })
    return {name: value.detach().contiguous() for name, value in tensors.items()}, chunks
