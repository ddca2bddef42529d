"""The tiny offline dataset (the data.md layout, random tensors and sane cameras for a
saved tiny Teacher) and the command lines of train_predictor_v4.py / train_predictor_disca.py /
fvtools/train_adversarial.py on it, shared by the offline recipe, adversarial and bad-input tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from predictor_training.data.shards import append_jsonl, make_manifest_entry, write_safetensors_atomic
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.source import teacher_config_sha256


CHUNK_LATENTS = 4
NUM_CHUNKS = 3  # chunks 1 and 2 carry context (4 and 8 frames) and a previous chunk
GRID = (4, 2, 3)  # C, H, W
CASES = ("c0", "c1")
ACTIONS = (0, 3)
TEXT_LENGTHS = {"c0": 3, "c1": 5}


# ---------------------------------------------------------------------------------------------------------------
# Tiny dataset
# ---------------------------------------------------------------------------------------------------------------
def write_tiny_dataset(root: Path) -> Path:
    """Tiny Teacher (2 blocks) saved under root/teacher and a dataset under root/dataset; returns the dataset root."""
    generator = torch.Generator().manual_seed(7)
    teacher = WorldPlayTransformer.from_preset("tiny")
    randomize_zero_initialised_(teacher, generator)
    teacher.save_pretrained(root / "teacher")
    depth, heads = teacher.num_layers, teacher.heads_num
    hidden = teacher.config.hidden_size
    head_dim = hidden // heads
    channels, height, width = GRID
    dataset = root / "dataset"
    dataset.mkdir(parents=True)
    config = {
        "teacher": {"folder": str(root / "teacher"), "config_sha256": teacher_config_sha256(teacher),
                    "action_ckpt": None},
        "grid": {"C": channels, "H": height, "W": width},
        "num_latents": NUM_CHUNKS * CHUNK_LATENTS, "chunk_latents": CHUNK_LATENTS, "num_chunks": NUM_CHUNKS,
        "num_steps": 4, "context_timestep": 14.0, "prefeature_layers": list(range(depth)),
        "storage_dtype": "bfloat16", "splits": ["train"],
    }
    (dataset / "dataset_config.json").write_text(json.dumps(config))
    frames, tokens = NUM_CHUNKS * CHUNK_LATENTS, CHUNK_LATENTS * height * width
    hidden_offset = 0.5 * torch.randn(hidden, generator=generator)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).bfloat16()

    for case_id in CASES:
        case = {"image_cond": randn(1, channels, 1, height, width),
                "text_k": randn(depth, heads, TEXT_LENGTHS[case_id], head_dim),
                "text_v": randn(depth, heads, TEXT_LENGTHS[case_id], head_dim)}
        facts = write_safetensors_atomic(dataset / f"cases/{case_id}.safetensors", case)
        append_jsonl(dataset / "manifest.jsonl",
                     make_manifest_entry("case", f"cases/{case_id}.safetensors", facts, case_id, None, "train"))
        for action_id in ACTIONS:
            viewmats = torch.eye(4).repeat(frames, 1, 1)
            viewmats[:, 2, 3] = -0.1 * torch.arange(frames)  # the camera walks forward
            intrinsics = torch.tensor([[0.8, 0.0, 0.5], [0.0, 0.8, 0.5], [0.0, 0.0, 1.0]]).repeat(frames, 1, 1)
            tensors = {"viewmats": viewmats, "Ks": intrinsics,
                       "action": torch.randint(0, 81, (frames,), generator=generator),
                       "timesteps": torch.tensor([1000.0, 937.5, 833.3333, 625.0]),
                       "sigmas": torch.tensor([1.0, 0.9375, 0.8333333, 0.625, 0.0]),
                       "seed": torch.tensor([action_id], dtype=torch.int64)}
            for chunk in range(NUM_CHUNKS):
                if chunk > 0:
                    indices = torch.arange(chunk * CHUNK_LATENTS)
                    tensors[f"chunk{chunk}.ctx_indices"] = indices
                    for layer in range(depth):
                        tensors[f"chunk{chunk}.ctx_prefeature.layer{layer}"] = randn(
                            indices.numel() * height * width, hidden)
                chunk_action = tensors["action"][chunk * CHUNK_LATENTS:(chunk + 1) * CHUNK_LATENTS]
                final_hidden = torch.randn(tokens, hidden, generator=generator)
                for step in range(4):
                    # A learnable rule: each step adds the same offset to the hidden, and the velocity is the
                    # Teacher's own final layer applied to it (as in real data).
                    final_hidden = final_hidden + hidden_offset
                    tensors[f"chunk{chunk}.step{step}.latent_in"] = randn(channels, CHUNK_LATENTS, height, width)
                    tensors[f"chunk{chunk}.step{step}.final_hidden"] = final_hidden.bfloat16()
                    tensors[f"chunk{chunk}.step{step}.velocity"] = teacher_velocity(
                        teacher, final_hidden, tensors["timesteps"][step], chunk_action).bfloat16()
                tensors[f"chunk{chunk}.final_latent"] = randn(channels, CHUNK_LATENTS, height, width)
            file = f"trajectories/{case_id}__a{action_id}.safetensors"
            facts = write_safetensors_atomic(dataset / file, tensors)
            append_jsonl(dataset / "manifest.jsonl",
                         make_manifest_entry("trajectory", file, facts, case_id, action_id, "train"))
    return dataset


@torch.no_grad()
def teacher_velocity(teacher, final_hidden, timestep, action):
    """Teacher final layer on one chunk's hidden: [N, D] -> velocity [C, T, H, W]."""
    _, height, width = GRID
    frame_vec = teacher.frame_vec(timestep.repeat(1, CHUNK_LATENTS), action[None])
    tokens = teacher.final_projection(final_hidden[None], frame_vec, height * width)
    return teacher.unpatchify(tokens, CHUNK_LATENTS, height, width)[0]


def train_args(dataset: Path, run_dir: Path, *extra: str, steps: int = 3) -> list[str]:
    return ["--dataset_root", str(dataset), "--output_dir", str(run_dir), "--source_blocks", "0,1",
            "--precision", "fp32", "--batch_size", "2", "--max_steps", str(steps), "--scheduler_warmup_steps", "1",
            "--block_warmup_steps", "1", "--fusion_lr", "1e-3", "--blocks_lr", "1e-4", "--ckpt_every", "2",
            "--num_workers", "0", "--tracker", "none", "--no_progress", *extra]


def adversarial_args(dataset: Path, run_dir: Path, *extra: str, steps: int = 3) -> list[str]:
    """The offline tests' flags (train_args) plus a small discriminator."""
    return train_args(dataset, run_dir, "--discriminator_width", "16", "--discriminator_lr", "1e-3", *extra,
                      steps=steps)


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
