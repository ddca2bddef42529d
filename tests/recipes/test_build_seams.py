"""The fvtools recipes' `build(args, env, policy, *, ...)` seams (predictor_training/recipes/<method>.py; what they
return: predictor_training/runtime/recipe.py): each builds
its models, roles and step from stand-ins alone (no Teacher folder, no LoRA file, no VAE, no dataset), as a memory
rehearsal does, and the step runs on a synthetic clip. The flags come from each recipe's own parser (the --dry_run
path: no file checks), as `tools/estimate_memory.py method_flags` reads them."""

from __future__ import annotations

import argparse
import importlib
import math
from pathlib import Path

import pytest
import torch

from predictor_training.data.synthetic import clip_item
from predictor_training.methods.rewards import TOTAL
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.distributed import DistEnv
from predictor_training.runtime.precision import precision_policy
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.adapters import add_lora
from predictor_training.teacher.config import preset_config

pytestmark = pytest.mark.usefixtures("one_thread")

ENV = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend=None, is_main=True)
POLICY = precision_policy("fp32", ENV.device)
CONFIG = argparse.Namespace(**preset_config("demo"))
SMALL = ["--lora_rank", "2", "--lora_alpha", "2", "--no-gradient_checkpointing"]


class StandIns:
    """The seams' stand-ins, recording their calls."""

    def __init__(self):
        self.calls: list[str] = []

    def load_teacher(self, source, device, dtype):
        self.calls.append("load_teacher")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return WorldPlayTransformer.from_preset("demo").eval().requires_grad_(False)

    def draw_chunks(self, num_chunks, count, rank_generator, shared_generator):
        self.calls.append("draw_chunks")
        return list(range(max(0, num_chunks - count), num_chunks))

    def load_lora(self, model, path, name=None, *, trainable=False):
        self.calls.append("load_lora")
        return add_lora(model, name, 2, 2.0, trainable=trainable)

    def make_rewards(self, args, vae_folder, device):
        self.calls.append("make_rewards")
        return lambda samples, item: {TOTAL: torch.linspace(0.0, 1.0, samples.shape[0])}


def recipe_flags(name: str, *argv: str) -> tuple:
    script = importlib.import_module(f"fvtools.train_{name}")
    args = script.parse_args([*argv, "--dry_run", "unused"])
    args.dry_run = None
    return importlib.import_module(f"predictor_training.recipes.{name}"), args


def step_once(parts, item) -> dict:
    metrics = parts.step_fn(item, sync=True, due=frozenset(role.name for role in parts.roles))
    assert math.isfinite(metrics["loss"])
    assert any(param.grad is not None for role in parts.roles for param in role.parameters)
    return metrics


def test_df_sft_kd_and_nft_build_from_stand_ins():
    clip = clip_item(CONFIG, chunks=2, grid=(2, 3), text_tokens=8, host="cpu")
    rollout_config = RolloutConfig(state_dtype=torch.float32)
    seams = StandIns()
    module, args = recipe_flags("df_sft", "--train", "lora", "--chunks_per_clip", "1", *SMALL)
    step_once(module.build(args, ENV, POLICY, rollout_config=rollout_config, load_teacher=seams.load_teacher,
                           draw_chunks=seams.draw_chunks), clip)
    assert seams.calls == ["load_teacher", "draw_chunks"]

    seams = StandIns()
    module, args = recipe_flags("kd", "--train", "lora", "--chunks_per_clip", "1", *SMALL)
    sample = clip_item(CONFIG, chunks=2, grid=(2, 3), text_tokens=8, data="final", states=4, host="cpu")
    sample["sigmas"] = torch.linspace(1.0, 0.5, 4).tolist()
    step_once(module.build(args, ENV, POLICY, state_indices=[0, 1, 2, 3], load_teacher=seams.load_teacher,
                           draw_chunks=seams.draw_chunks), sample)
    assert seams.calls == ["load_teacher", "draw_chunks"]

    seams = StandIns()
    module, args = recipe_flags("nft", "--train", "lora", "--samples_per_group", "2", "--chunks_per_sample", "1",
                                *SMALL)
    parts = module.build(args, ENV, POLICY, vae_folder=None, load_teacher=seams.load_teacher,
                         draw_chunks=seams.draw_chunks, make_rewards=seams.make_rewards)
    assert parts.validation is None and parts.roles[0].ema is not None  # the old policy in the EMA slot
    step_once(parts, clip)
    assert seams.calls == ["load_teacher", "make_rewards", "draw_chunks", "draw_chunks"]


@pytest.mark.parametrize("generator", ["student", "predictor"])
def test_dmd2_builds_from_stand_ins(generator):
    """A LoRA student on the Teacher with a LoRA-file real score (`load_lora`), or the Predictor built as on resume
    (`resuming`: no --init_from read) with the raw Teacher as real score."""
    seams = StandIns()
    if generator == "student":
        module, args = recipe_flags("dmd2", "--generator", "student", "--rollout", "data", "--train", "lora",
                                    "--real_score", "lora", "--chunks_per_clip", "1", *SMALL)
        args.real_score_kind, args.real_score_path = "lora", Path("unused")
    else:
        module, args = recipe_flags("dmd2", "--source_blocks", "1,2", "--real_score", "teacher",
                                    "--allow_raw_teacher_score", "--score_sigma_min", "0.625", *SMALL)
        args.real_score_kind, args.real_score_path = "teacher", None
    parts = module.build(args, ENV, POLICY, rollout_config=RolloutConfig(state_dtype=torch.float32), resuming=True,
                         load_teacher=seams.load_teacher, load_lora=seams.load_lora, draw_chunks=seams.draw_chunks)
    assert [role.name for role in parts.roles] == [generator, "fake_score"]
    assert parts.derived["init_meta"] is None
    step_once(parts, clip_item(CONFIG, chunks=2, grid=(2, 3), text_tokens=8, host="cpu"))
    expected = ["load_teacher", "load_lora", "draw_chunks"] if generator == "student" else ["load_teacher"]
    assert seams.calls == expected
