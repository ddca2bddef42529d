"""Synthetic predictor dataset in the docs/dataset.md layout (random tensors, tiny sizes): what the reader tests and the
loader benchmarks read.

``write_synthetic_dataset(root, spec)`` writes ``dataset_config.json``, ``cases/{case_id}.safetensors``,
``trajectories/{case_id}__a{action_id}.safetensors`` and ``manifest.jsonl`` (through ``predictor_training.data.shards``,
the builder's writer, so the manifest carries the per-tensor checksums) and returns every tensor it wrote so tests can
compare what the readers yield. Also writes a sample table (``samples/*.jsonl`` + ``samples/poses/*.json``) for the
trajectory-table dataset. ``damage_tensor`` and ``strip_tensor_checksums`` make a damaged file and an older manifest.

``write_tiny_teacher_dataset(root)`` saves the tiny Teacher (2 blocks, random weights) under ``root/teacher`` and a
dataset that records it (its ``dataset_config.json`` names the folder and the config's sha256) under ``root/dataset``,
with velocities the Teacher's own final layer computes: what the offline recipe tests train on and
benchmarks/bench_offline_step.py times by default.

The synthetic inputs of one training step, at any size (the memory rehearsal, tools/estimate_memory.py, runs them at
real size on fake tensors; benchmarks/gpu_acceptance.py on the GPU; the tests at tiny size):

- ``offline_batch``: a collated offline batch (``collate_pairs``' keys) of the v4 or disca recipe;
- ``turning_camera_row`` / ``trajectory_row``: a sample-table row whose camera turns and steps back (so the memory
  selection has work to do), and its image condition;
- ``case_text_kv``: a case file's stored text K/V;
- ``teacher_call_inputs``: the inputs of one Teacher call (model input, timestep, action, cameras);
- ``clip_item``: one clip of the generic methods' datasets (latents or KD's ODE states, cameras, text);
- ``lora_file_stand_in``: a LoRA file's loader that reads no file (a fresh adapter of the file's shape).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from predictor_training.data.shards import (
    TENSOR_CHECKSUM_FIELD,
    append_jsonl,
    make_manifest_entry,
    read_jsonl,
    write_jsonl_atomic,
    write_safetensors_atomic,
)
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.adapters import add_lora
from predictor_training.teacher.source import teacher_config_sha256

FRAMES_PER_CHUNK = 4


@dataclass(frozen=True)
class SyntheticSpec:
    """Sizes of the synthetic dataset (defaults: a few KiB per file)."""

    cases: dict[str, str] = field(default_factory=lambda: {"c000": "train", "c001": "train", "c002": "holdout25"})
    actions: tuple[int, ...] = (0, 2)
    num_chunks: int = 4
    num_steps: int = 4
    channels: int = 4
    height: int = 2
    width: int = 3
    hidden: int = 8
    depth: int = 3
    heads: int = 2
    head_dim: int = 4
    prefeature_layers: tuple[int, ...] = (0, 2)
    max_context: int = 8  # context frames are capped like the memory window (20 in the real data)
    with_trajectories: bool = True
    seed: int = 0

    @property
    def num_latents(self) -> int:
        return self.num_chunks * FRAMES_PER_CHUNK

    @property
    def tokens_per_chunk(self) -> int:
        return FRAMES_PER_CHUNK * self.height * self.width


def context_indices(chunk: int, max_context: int, generator: torch.Generator) -> torch.Tensor:
    """Ascending earlier-frame indices of a chunk: all previous frames, or frame 0 plus a random subset when capped."""
    previous = chunk * FRAMES_PER_CHUNK
    if previous <= max_context:
        return torch.arange(previous, dtype=torch.int64)
    others = torch.randperm(previous - 1, generator=generator)[: max_context - 1] + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), others.sort().values])


def make_case_tensors(spec: SyntheticSpec, text_length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    shape_kv = (spec.depth, spec.heads, text_length, spec.head_dim)
    return {
        "image_cond": torch.randn(1, spec.channels, 1, spec.height, spec.width, generator=generator).bfloat16(),
        "text_k": torch.randn(*shape_kv, generator=generator).bfloat16(),
        "text_v": torch.randn(*shape_kv, generator=generator).bfloat16(),
    }


def make_trajectory_tensors(spec: SyntheticSpec, generator: torch.Generator) -> dict[str, torch.Tensor]:
    frames, latent = spec.num_latents, (spec.channels, FRAMES_PER_CHUNK, spec.height, spec.width)
    tensors = {
        "viewmats": torch.randn(frames, 4, 4, generator=generator),
        "Ks": torch.randn(frames, 3, 3, generator=generator),
        "action": torch.randint(0, 81, (frames,), generator=generator),
        "timesteps": torch.tensor([1000.0, 937.5, 833.3333, 625.0]),
        "sigmas": torch.tensor([1.0, 0.9375, 0.8333333, 0.625, 0.0]),
        "seed": torch.tensor([1234], dtype=torch.int64),
    }
    for chunk in range(spec.num_chunks):
        if chunk > 0:
            indices = context_indices(chunk, spec.max_context, generator)
            tensors[f"chunk{chunk}.ctx_indices"] = indices
            for layer in spec.prefeature_layers:
                rows = indices.numel() * spec.height * spec.width
                tensors[f"chunk{chunk}.ctx_prefeature.layer{layer}"] = torch.randn(
                    rows, spec.hidden, generator=generator
                ).bfloat16()
        for step in range(spec.num_steps):
            prefix = f"chunk{chunk}.step{step}"
            tensors[f"{prefix}.latent_in"] = torch.randn(*latent, generator=generator).bfloat16()
            hidden = torch.randn(spec.tokens_per_chunk, spec.hidden, generator=generator)
            tensors[f"{prefix}.final_hidden"] = hidden.bfloat16()
            tensors[f"{prefix}.velocity"] = torch.randn(*latent, generator=generator).bfloat16()
        tensors[f"chunk{chunk}.final_latent"] = torch.randn(*latent, generator=generator).bfloat16()
    return tensors


def dataset_config(spec: SyntheticSpec) -> dict:
    return {
        "builder_version": "synthetic-test",
        "grid": {"C": spec.channels, "H": spec.height, "W": spec.width},
        "num_latents": spec.num_latents,
        "chunk_latents": FRAMES_PER_CHUNK,
        "num_chunks": spec.num_chunks,
        "num_steps": spec.num_steps,
        "context_timestep": 14.0,
        "prefeature_layers": list(spec.prefeature_layers),
        "storage_dtype": "bfloat16",
        "splits": sorted(set(spec.cases.values())),
    }


def write_synthetic_dataset(
    root: str | Path, spec: SyntheticSpec = SyntheticSpec()
) -> dict[str, dict[str, torch.Tensor]]:
    """Write the dataset under ``root``; returns ``{relative file: {tensor name: tensor}}``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(spec.seed)
    (root / "dataset_config.json").write_text(json.dumps(dataset_config(spec), indent=2))
    written: dict[str, dict[str, torch.Tensor]] = {}
    for case_number, (case_id, split) in enumerate(sorted(spec.cases.items())):
        case_file = f"cases/{case_id}.safetensors"
        tensors = make_case_tensors(spec, text_length=3 + 2 * case_number, generator=generator)
        facts = write_safetensors_atomic(root / case_file, tensors)
        append_jsonl(root / "manifest.jsonl", make_manifest_entry("case", case_file, facts, case_id, None, split))
        written[case_file] = tensors
        if not spec.with_trajectories:
            continue
        for action_id in spec.actions:
            trajectory_file = f"trajectories/{case_id}__a{action_id}.safetensors"
            tensors = make_trajectory_tensors(spec, generator)
            facts = write_safetensors_atomic(root / trajectory_file, tensors)
            entry = make_manifest_entry("trajectory", trajectory_file, facts, case_id, action_id, split)
            append_jsonl(root / "manifest.jsonl", entry)
            written[trajectory_file] = tensors
    return written


def write_synthetic_sample_tables(
    folder: str | Path, splits: dict[str, list[str]], actions=(0, 1, 2, 3)
) -> dict[str, Path]:
    """Sample tables ``{split}.jsonl`` (+ standard pose files and tiny PNG images) in ``folder``.

    Args:
        splits: split name -> case ids.
    Returns:
        split name -> table path.
    """
    from PIL import Image

    from predictor_training.data.sample_table import build_sample_rows, write_sample_table, write_standard_pose_files

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    write_standard_pose_files(folder, actions)
    tables = {}
    for split, case_ids in splits.items():
        cases = []
        for case_id in case_ids:
            image = folder / "images" / f"{case_id}.png"
            Image.new("RGB", (6, 4), color=(len(case_id) * 20 % 256, 40, 90)).save(image)
            cases.append({"case_id": case_id, "source_image": str(image), "caption": f"caption of {case_id}"})
        tables[split] = folder / f"{split}.jsonl"
        write_sample_table(tables[split], build_sample_rows(cases, actions))
    return tables


# ---- the tiny Teacher's dataset ---------------------------------------------------------------------------------
TINY_NUM_CHUNKS = 3  # chunks 1 and 2 carry context (4 and 8 frames) and a previous chunk
TINY_GRID = (4, 2, 3)  # C, H, W
TINY_CASES = ("c0", "c1")
TINY_ACTIONS = (0, 3)
TINY_TEXT_LENGTHS = {"c0": 3, "c1": 5}


def write_tiny_teacher_dataset(root: str | Path) -> Path:
    """Tiny Teacher (2 blocks, random weights) saved under root/teacher and a dataset in the docs/dataset.md layout
    under root/dataset whose config records it (folder and config sha256): cases TINY_CASES (split "train"),
    actions TINY_ACTIONS, TINY_NUM_CHUNKS chunks of TINY_GRID latents, pre-features of every layer, cameras that
    walk forward, and a learnable rule (each step adds the same offset to the hidden, the velocity is the Teacher's
    own final layer on it, as in real data). What the offline recipe tests and benchmarks/bench_offline_step.py
    train on. Returns the dataset root."""
    root = Path(root)
    generator = torch.Generator().manual_seed(7)
    teacher = WorldPlayTransformer.from_preset("tiny")
    randomize_zero_initialised_(teacher, generator)
    teacher.save_pretrained(root / "teacher")
    depth, heads = teacher.num_layers, teacher.heads_num
    hidden = teacher.config.hidden_size
    head_dim = hidden // heads
    channels, height, width = TINY_GRID
    chunk_latents = FRAMES_PER_CHUNK
    dataset = root / "dataset"
    dataset.mkdir(parents=True)
    config = {
        "teacher": {"folder": str(root / "teacher"), "config_sha256": teacher_config_sha256(teacher),
                    "action_ckpt": None},
        "grid": {"C": channels, "H": height, "W": width},
        "num_latents": TINY_NUM_CHUNKS * chunk_latents, "chunk_latents": chunk_latents, "num_chunks": TINY_NUM_CHUNKS,
        "num_steps": 4, "context_timestep": 14.0, "prefeature_layers": list(range(depth)),
        "storage_dtype": "bfloat16", "splits": ["train"],
    }
    (dataset / "dataset_config.json").write_text(json.dumps(config))
    frames, tokens = TINY_NUM_CHUNKS * chunk_latents, chunk_latents * height * width
    hidden_offset = 0.5 * torch.randn(hidden, generator=generator)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).bfloat16()

    for case_id in TINY_CASES:
        case = {"image_cond": randn(1, channels, 1, height, width),
                "text_k": randn(depth, heads, TINY_TEXT_LENGTHS[case_id], head_dim),
                "text_v": randn(depth, heads, TINY_TEXT_LENGTHS[case_id], head_dim)}
        facts = write_safetensors_atomic(dataset / f"cases/{case_id}.safetensors", case)
        append_jsonl(dataset / "manifest.jsonl",
                     make_manifest_entry("case", f"cases/{case_id}.safetensors", facts, case_id, None, "train"))
        for action_id in TINY_ACTIONS:
            viewmats = torch.eye(4).repeat(frames, 1, 1)
            viewmats[:, 2, 3] = -0.1 * torch.arange(frames)  # the camera walks forward
            intrinsics = torch.tensor([[0.8, 0.0, 0.5], [0.0, 0.8, 0.5], [0.0, 0.0, 1.0]]).repeat(frames, 1, 1)
            tensors = {"viewmats": viewmats, "Ks": intrinsics,
                       "action": torch.randint(0, 81, (frames,), generator=generator),
                       "timesteps": torch.tensor([1000.0, 937.5, 833.3333, 625.0]),
                       "sigmas": torch.tensor([1.0, 0.9375, 0.8333333, 0.625, 0.0]),
                       "seed": torch.tensor([action_id], dtype=torch.int64)}
            for chunk in range(TINY_NUM_CHUNKS):
                if chunk > 0:
                    indices = torch.arange(chunk * chunk_latents)
                    tensors[f"chunk{chunk}.ctx_indices"] = indices
                    for layer in range(depth):
                        tensors[f"chunk{chunk}.ctx_prefeature.layer{layer}"] = randn(
                            indices.numel() * height * width, hidden)
                chunk_action = tensors["action"][chunk * chunk_latents:(chunk + 1) * chunk_latents]
                final_hidden = torch.randn(tokens, hidden, generator=generator)
                for step in range(4):
                    # A learnable rule: each step adds the same offset to the hidden, and the velocity is the
                    # Teacher's own final layer applied to it (as in real data).
                    final_hidden = final_hidden + hidden_offset
                    tensors[f"chunk{chunk}.step{step}.latent_in"] = randn(channels, chunk_latents, height, width)
                    tensors[f"chunk{chunk}.step{step}.final_hidden"] = final_hidden.bfloat16()
                    tensors[f"chunk{chunk}.step{step}.velocity"] = tiny_teacher_velocity(
                        teacher, final_hidden, tensors["timesteps"][step], chunk_action).bfloat16()
                tensors[f"chunk{chunk}.final_latent"] = randn(channels, chunk_latents, height, width)
            file = f"trajectories/{case_id}__a{action_id}.safetensors"
            facts = write_safetensors_atomic(dataset / file, tensors)
            append_jsonl(dataset / "manifest.jsonl",
                         make_manifest_entry("trajectory", file, facts, case_id, action_id, "train"))
    return dataset


@torch.no_grad()
def tiny_teacher_velocity(teacher, final_hidden, timestep, action):
    """Teacher final layer on one chunk's hidden of the TINY_GRID: [N, D] -> velocity [C, T, H, W]."""
    _, height, width = TINY_GRID
    frame_vec = teacher.frame_vec(timestep.repeat(1, FRAMES_PER_CHUNK), action[None])
    tokens = teacher.final_projection(final_hidden[None], frame_vec, height * width)
    return teacher.unpatchify(tokens, FRAMES_PER_CHUNK, height, width)[0]


def tensor_byte_range(path: str | Path, name: str) -> tuple[int, int]:
    """[start, end) file offsets of tensor ``name``'s bytes in a safetensors file (from its header)."""
    data = Path(path).read_bytes()
    header_size = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + header_size])[name]["data_offsets"]
    return 8 + header_size + begin, 8 + header_size + end


def damage_tensor(path: str | Path, name: str, num_bytes: int = 256) -> tuple[int, int]:
    """Overwrite ``num_bytes`` bytes (each one changed) from the start of tensor ``name``'s data, in place, as a
    disk fault would: same size, header intact. Returns the damaged [start, end) file range."""
    start, _ = tensor_byte_range(path, name)
    data = bytearray(Path(path).read_bytes())
    end = min(start + num_bytes, len(data))
    for offset in range(start, end):
        data[offset] ^= 0xA5
    Path(path).write_bytes(bytes(data))
    return start, end


def strip_tensor_checksums(root: str | Path) -> None:
    """Rewrite ``root/manifest.jsonl`` as a builder without per-tensor checksums wrote it."""
    manifest = Path(root) / "manifest.jsonl"
    entries = read_jsonl(manifest)
    write_jsonl_atomic(manifest, [{k: v for k, v in e.items() if k != TENSOR_CHECKSUM_FIELD} for e in entries])


# ---- the synthetic inputs of one training step ------------------------------------------------------------------
def offline_batch(variant: str, config, *, batch_size: int, n_ctx: int, text_tokens: int, grid: tuple[int, int],
                  source_blocks, device="meta", generator: torch.Generator | None = None) -> dict:
    """A collated offline batch (`collate_pairs`' keys) of `variant` ("v4" adds the context and the previous chunk's
    hidden) for the Teacher `config`, on `device`, float tensors in their storage dtype (BF16): zeros, or standard
    normal draws from `generator` (on `device`) in the order of the keys. n_ctx: context frames (v4)."""
    height, width = grid
    frames, channels, hidden = FRAMES_PER_CHUNK, config.out_channels, config.hidden_size
    heads, head_dim = config.heads_num, config.hidden_size // config.heads_num
    tokens = frames * height * width

    def floats(*shape):
        if generator is None:
            return torch.zeros(*shape, dtype=torch.bfloat16)
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    with torch.device(device):
        batch = {
            "noisy_input": floats(batch_size, 2 * channels + 1, frames, height, width),
            "timestep": torch.full((batch_size,), 937.5),
            "action": torch.zeros(batch_size, frames, dtype=torch.long),
            "viewmats": torch.eye(4).repeat(batch_size, frames, 1, 1),
            "Ks": torch.eye(3).repeat(batch_size, frames, 1, 1),
            "anchor_hidden": floats(batch_size, tokens, hidden),
            "target_hidden": floats(batch_size, tokens, hidden),
            "target_velocity": floats(batch_size, channels, frames, height, width),
            "text_k": floats(batch_size, 2, heads, text_tokens, head_dim),
            "text_v": floats(batch_size, 2, heads, text_tokens, head_dim),
            "text_mask": torch.ones(batch_size, text_tokens, dtype=torch.bool),
        }
        if variant == "v4":
            batch.update({
                "prev_chunk_hidden": floats(batch_size, tokens, hidden),
                "n_ctx": n_ctx,
                "ctx_prefeatures": {layer: floats(batch_size, n_ctx * height * width, hidden)
                                    for layer in source_blocks},
                "ctx_action": torch.zeros(batch_size, n_ctx, dtype=torch.long),
                "ctx_viewmats": torch.eye(4).repeat(batch_size, n_ctx, 1, 1),
                "ctx_Ks": torch.eye(3).repeat(batch_size, n_ctx, 1, 1),
            })
    return batch


def turning_camera_row(num_latents: int, seed: int = 7, *, turn: float = 2.0, step_back: float = 0.2) -> dict:
    """A synthetic sample-table row: a camera that turns through `turn` rad while it steps `step_back` back per
    latent, so the memory selection has work to do; fixed intrinsics, no action.
    Holds "seed", "viewmats" [T, 4, 4] and "Ks" [T, 3, 3] (float64), "action" [T] (long)."""
    angles = torch.linspace(0, turn, num_latents, dtype=torch.float64)
    viewmats = torch.eye(4, dtype=torch.float64).repeat(num_latents, 1, 1)
    viewmats[:, 0, 0], viewmats[:, 0, 2] = torch.cos(angles), torch.sin(angles)
    viewmats[:, 2, 0], viewmats[:, 2, 2] = -torch.sin(angles), torch.cos(angles)
    viewmats[:, 2, 3] = -step_back * torch.arange(num_latents, dtype=torch.float64)
    Ks = torch.tensor([[0.5, 0, 0.5], [0, 0.9, 0.5], [0, 0, 1]], dtype=torch.float64).repeat(num_latents, 1, 1)
    return {"seed": seed, "viewmats": viewmats, "Ks": Ks, "action": torch.zeros(num_latents, dtype=torch.long)}


def trajectory_row(chunks: int, grid: tuple[int, int], channels: int,
                   generator: torch.Generator | None = None) -> tuple[dict, torch.Tensor]:
    """(`turning_camera_row` of `chunks` chunks, its image condition [1, C, 1, H, W]: zeros, or standard normal
    draws from `generator`). Real small CPU tensors: the memory selection reads the poses and the seed."""
    height, width = grid
    row = turning_camera_row(FRAMES_PER_CHUNK * chunks)
    if generator is None:
        return row, torch.zeros(1, channels, 1, height, width)
    return row, torch.randn(1, channels, 1, height, width, generator=generator)


def case_text_kv(config, *, text_tokens: int, host="meta", generator: torch.Generator | None = None) -> dict:
    """A case file's stored text K/V ("text_k", "text_v" [depth, heads, text_tokens, head_dim], BF16) for the
    Teacher `config` in `host` memory (meta: the loader's, not counted by a rehearsal): zeros, or standard normal
    draws from `generator` (on `host`)."""
    shape = (config.mm_double_blocks_depth, config.heads_num, text_tokens, config.hidden_size // config.heads_num)
    with torch.device(host):
        if generator is None:
            return {name: torch.zeros(shape, dtype=torch.bfloat16) for name in ("text_k", "text_v")}
        return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name in ("text_k", "text_v")}


def teacher_call_inputs(config, frames: int, grid: tuple[int, int], *, device, dtype: torch.dtype,
                        generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """The inputs of one Teacher call over `frames` frames, as the AR loop passes them: model input
    [1, 2C+1, frames, H, W] in `dtype` (standard normal draws from `generator`, on `device`), timestep [frames] (500),
    action [1, frames] (0), viewmats [1, frames, 4, 4] (stepping back) and Ks [1, frames, 3, 3]."""
    height, width = grid
    hidden_states = torch.randn(1, 2 * config.in_channels + 1, frames, height, width, generator=generator,
                                device=device, dtype=torch.float32).to(dtype)
    viewmats = torch.eye(4, device=device).repeat(1, frames, 1, 1)
    viewmats[0, :, 2, 3] = -0.1 * torch.arange(frames, device=device)
    Ks = torch.tensor([[0.5, 0, 0.5], [0, 0.9, 0.5], [0, 0, 1.0]], device=device).repeat(1, frames, 1, 1)
    action = torch.zeros(1, frames, dtype=torch.long, device=device)
    return hidden_states, torch.full((frames,), 500.0, device=device), action, viewmats, Ks


BYT5_TOKENS, VISION_TOKENS = 256, 729  # ByT5 glyph positions; SigLIP 27 x 27 patches of the first frame


def clip_item(config, *, chunks: int, grid: tuple[int, int], text_tokens: int, data: str = "latents",
              states: int = 0, host="meta", encoder_text: bool = False) -> dict:
    """One dataset clip of `chunks` chunks for the Teacher `config`: its latents ("latents", or KD's "final" +
    `states` ODE states) in `host` memory (meta: the loader's, not counted by a rehearsal), conditioning, real CPU
    cameras (`trajectory_row`: the memory selection reads them) and its text: stored text K/V of `text_tokens` tokens,
    or (encoder_text: where the text stream trains) the encoders' outputs, `text_tokens` LLM tokens + 256 ByT5 +
    729 SigLIP, all valid."""
    latents, (height, width) = FRAMES_PER_CHUNK * chunks, grid
    channels, heads = config.out_channels, config.heads_num
    row, _ = trajectory_row(chunks, grid, channels)
    item = {"viewmats": row["viewmats"], "Ks": row["Ks"], "action": row["action"], "seed": row["seed"]}
    with torch.device(host):
        item["image_cond"] = torch.zeros(1, channels, 1, height, width)
        item[data] = torch.zeros(channels, latents, height, width, dtype=torch.bfloat16)
        if states:
            item["states"] = torch.zeros(states, channels, latents, height, width, dtype=torch.bfloat16)
        if not encoder_text:
            for name in ("text_k", "text_v"):
                item[name] = torch.zeros(config.mm_double_blocks_depth, heads, text_tokens,
                                         config.hidden_size // heads, dtype=torch.bfloat16)
    if encoder_text:
        with torch.device(host):
            item.update({
                "prompt_embeds": torch.zeros(1, text_tokens, config.text_states_dim, dtype=torch.bfloat16),
                "byt5_text_states": torch.zeros(1, BYT5_TOKENS, config.byt5_states_dim, dtype=torch.bfloat16),
                "vision_states": torch.zeros(1, VISION_TOKENS, config.vision_states_dim, dtype=torch.bfloat16)})
        item["prompt_mask"] = torch.ones(1, text_tokens, dtype=torch.long)
        item["byt5_text_mask"] = torch.ones(1, BYT5_TOKENS, dtype=torch.long)
    return item


def lora_file_stand_in(rank: int, alpha: float):
    """A `teacher.adapters.load_lora` that reads no file: it adds a fresh adapter of the file's shape (`rank`,
    `alpha`, e.g. a df_sft LoRA's) under the given name, frozen unless `trainable`."""

    def load(teacher, path, name=None, *, trainable=False):
        return add_lora(teacher, name, rank, alpha, trainable=trainable)
    return load
