"""The tiny self-rollout setup: a 3-block tiny Teacher, a v4 Predictor on blocks 0, 2
with non-zero output layers, trajectory inputs, and on disk a Teacher folder, a case-only dataset, a short sample
table and an init checkpoint (`write_rollout_setup`) with the rollout trainer's flags for them (`trainer_args`).
Shared by the self-rollout, rollout-recipe, validation, adversarial and bad-input tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from predictor_training.predictor.model import build_predictor
from predictor_training.rollout.ar_rollout import RolloutInputs, make_initial_noise
from predictor_training.rollout.memory_retrieval import make_retrieval_points
from predictor_training.teacher import WorldPlayTransformer, randomize_zero_initialised_


CHANNELS, HEIGHT, WIDTH = 4, 2, 3
SOURCE_BLOCKS = (0, 2)
TEACHER_DEPTH = 3


# ---------------------------------------------------------------------------------------------------------------
# Tiny Teacher, Predictor and trajectory inputs
# ---------------------------------------------------------------------------------------------------------------
def make_teacher(seed: int = 0) -> WorldPlayTransformer:
    torch.manual_seed(seed)
    teacher = WorldPlayTransformer.from_preset("tiny", mm_double_blocks_depth=TEACHER_DEPTH)
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(seed + 1))
    return teacher.eval().requires_grad_(False)


def make_predictor(teacher, seed: int = 3):
    """A v4 Predictor whose zero-initialised output layers got small random values, as after offline training
    (a fresh one returns its anchor unchanged, so no gradient could reach the latents)."""
    predictor = build_predictor(teacher, "v4", SOURCE_BLOCKS)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in (predictor.fusion.proj, predictor.residual_head.fc2):
            for param in module.parameters():
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return predictor


def make_text_kv(teacher, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    config = teacher.config
    with torch.no_grad():
        return teacher.text_prefill(
            torch.randn(1, 6, config.text_states_dim, generator=generator), torch.tensor([[1, 1, 1, 1, 1, 0]]),
            torch.randn(1, 3, config.byt5_states_dim, generator=generator), torch.tensor([[1, 0, 1]]),
            torch.randn(1, 2, config.vision_states_dim, generator=generator),
        )


def make_inputs(num_latents: int = 16, seed: int = 5) -> RolloutInputs:
    """A camera that turns and walks (so the memory selection of 32 latents is not just the last frames)."""
    generator = torch.Generator().manual_seed(seed)
    half = num_latents // 2
    angles = torch.cat([torch.linspace(0, 1.2, half), torch.linspace(1.2, 0, num_latents - half)]).to(torch.float64)
    viewmats = torch.eye(4, dtype=torch.float64).repeat(num_latents, 1, 1)
    viewmats[:, 0, 0], viewmats[:, 0, 2] = torch.cos(angles), torch.sin(angles)
    viewmats[:, 2, 0], viewmats[:, 2, 2] = -torch.sin(angles), torch.cos(angles)
    viewmats[:, 2, 3] = -0.05 * torch.arange(num_latents, dtype=torch.float64)
    Ks = torch.tensor([[0.5, 0, 0.5], [0, 0.9, 0.5], [0, 0, 1]], dtype=torch.float64).repeat(num_latents, 1, 1)
    return RolloutInputs(
        noise=make_initial_noise(seed, (1, CHANNELS, num_latents, HEIGHT, WIDTH)),
        image_cond=torch.randn(1, CHANNELS, 1, HEIGHT, WIDTH, generator=generator),
        viewmats=viewmats,
        Ks=Ks,
        action=torch.randint(0, 81, (num_latents,), generator=generator),
        memory_points=make_retrieval_points(seed, num_points=2000),
    )


SHORT_POSE_STRINGS = {0: "w-{n}", 1: "s-{n}", 2: "w+left-{n}", 3: "w+right-{n}"}


def write_sample_table(folder: Path, case_ids, actions=(0, 1, 2, 3), num_latents: int = 16) -> Path:
    """A sample table (train.jsonl) whose pose files have `num_latents` latents (the standard ones have 32)."""
    from PIL import Image

    from predictor_training.rollout.camera import pose_string_to_json
    from predictor_training.data.sample_table import SampleRow, sample_seed
    from predictor_training.data.sample_table import write_sample_table as write_rows

    (folder / "poses").mkdir(parents=True, exist_ok=True)
    (folder / "images").mkdir(exist_ok=True)
    for action in actions:
        pose = pose_string_to_json(SHORT_POSE_STRINGS[action].format(n=num_latents - 1))
        (folder / "poses" / f"action{action}.json").write_text(json.dumps(pose))
    rows = []
    for case_id in case_ids:
        Image.new("RGB", (6, 4), color=(40, 90, 140)).save(folder / "images" / f"{case_id}.png")
        for action in actions:
            rows.append(SampleRow(case_id, f"images/{case_id}.png", f"caption of {case_id}", action,
                                  f"poses/action{action}.json", sample_seed(case_id, action)))
    write_rows(folder / "train.jsonl", rows)
    return folder / "train.jsonl"


# ---------------------------------------------------------------------------------------------------------------
# Trainer fixtures: a case-only dataset, a saved Teacher and an "offline" init checkpoint
# ---------------------------------------------------------------------------------------------------------------
def write_rollout_setup(root: Path, num_latents: int, case_ids, actions) -> dict[str, Path]:
    """Teacher folder, dataset root (case files + dataset_config.json, no trajectories), sample table and a
    predictor_step safetensors to start from. Returns their paths."""
    from predictor_training.runtime.inference_weights import save_inference_weights
    from predictor_training.teacher.source import teacher_config_sha256
    from predictor_training.data.synthetic import SyntheticSpec, write_synthetic_dataset

    teacher = make_teacher()
    teacher.save_pretrained(str(root / "teacher"))
    spec = SyntheticSpec(cases={case_id: "train" for case_id in case_ids}, num_chunks=num_latents // 4,
                         height=HEIGHT, width=WIDTH, hidden=teacher.config.hidden_size, depth=TEACHER_DEPTH,
                         heads=teacher.heads_num, head_dim=teacher.config.hidden_size // teacher.heads_num,
                         prefeature_layers=SOURCE_BLOCKS, with_trajectories=False)
    write_synthetic_dataset(root / "dataset", spec)
    table = write_sample_table(root / "samples", case_ids, actions, num_latents)
    config_path = root / "dataset" / "dataset_config.json"
    config = json.loads(config_path.read_text())
    config.update({
        "teacher": {"folder": str(root / "teacher"), "config_sha256": teacher_config_sha256(teacher),
                    "action_ckpt": None},
        "sample_tables": [str(table)],
        "shift": 5.0,
        "memory": {"memory_frames": 20, "temporal_context_size": 12},
    })
    config_path.write_text(json.dumps(config))
    init = root / "init" / "predictor_step_00100.safetensors"
    init.parent.mkdir()
    save_inference_weights(init, make_predictor(teacher),
                           metadata={"variant": "v4", "source_blocks": list(SOURCE_BLOCKS), "precision": "fp32"})
    return {"teacher": root / "teacher", "dataset": root / "dataset", "table": table, "init": init}


def trainer_args(paths: dict[str, Path], output_dir: Path, *extra: str) -> list[str]:
    return ["--dataset_root", str(paths["dataset"]), "--output_dir", str(output_dir), "--teacher",
            str(paths["teacher"]), "--source_blocks", ",".join(map(str, SOURCE_BLOCKS)), "--precision", "fp32",
            "--backend", "gloo", "--num_workers", "0", "--tracker", "none", "--no_progress", *extra]


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
