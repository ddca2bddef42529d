"""tools/estimate_memory.py on the tiny Teacher: a fake run against the same step on real
CPU tensors for every recipe, the recipe list, the tool at tiny size, and each memory cut lowering its recipe's
peak. The three rows of the user's GPU table at real size are checked by `benchmarks/check_real_size_memory.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(ROOT / "tools"))

import estimate_memory  # noqa: E402


def _tiny_args(recipe: str, *extra: str):
    return estimate_memory.parse_args([
        "--recipe", recipe, "--config", "tiny", "--batch_size", "2", "--text_tokens", "8", "--latent_grid", "2x3",
        "--source_blocks", "0,1", *extra])


def test_fake_run_matches_the_real_cpu_run():
    """The v4 pair step of the tiny Teacher, once on fake tensors and once on real CPU tensors (same tracker): the
    peaks agree except the real CPU mse_loss kernel's larger result storage (a fake / GPU result is one element)."""
    args = _tiny_args("v4", "--context_frames", "4", "--world_size", "1")
    fake = estimate_memory.rehearse(args, "v4", n_ctx=4, host="cpu")
    real = estimate_memory.rehearse(args, "v4", n_ctx=4, fake=False)
    assert fake.peak > 0
    assert abs(real.peak - fake.peak) <= 2 * 128 * 1024, (real.peak, fake.peak)
    assert fake.peak_phase == real.peak_phase


# ---- the tool ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["df_sft", "kd"])
def test_method_fake_run_matches_the_real_cpu_run(recipe):
    """df_sft / kd with a LoRA on the tiny Teacher (their default mode): the recipe's own step on fake tensors
    against the same step on real CPU tensors, both tracked: same peak within the CPU mse kernel's result storages,
    same phase."""
    args = _tiny_args(recipe, "--chunks", "3", "--world_size", "1")
    fake = estimate_memory.rehearse(args, recipe)
    real = estimate_memory.rehearse(args, recipe, fake=False)
    assert fake.peak > 0 and fake.by_category["parameters"] > 0
    assert abs(real.peak - fake.peak) <= 0.05 * real.peak, (real.peak, fake.peak)
    assert fake.peak_phase == real.peak_phase


@pytest.mark.parametrize("data", ["offline", "rollout"])
def test_adversarial_fake_run_matches_the_real_cpu_run(data):
    """fvtools/train_adversarial.py on the tiny Teacher, each --data mode: the recipe's AdversarialPairStep (a batch
    with 4 context frames) or AdversarialRolloutStep (a 3-chunk F-P-P-P trajectory) with both roles due (generator
    term built, lazy R1 applied) on fake tensors against the same step on real CPU tensors: every phase's peak
    within 5 % (the CPU mse kernels' result storages), both roles' gradients and AdamW state."""
    args = _tiny_args("adversarial", "--context_frames", "4", "--world_size", "1", "--data", data, "--chunks", "3")
    fake = estimate_memory.rehearse(args, host="cpu")
    real = estimate_memory.rehearse(args, fake=False)
    assert "generator term built" in fake.notes["adversarial"] and "lazy R1 applied" in fake.notes["adversarial"]
    assert set(fake.phase_peaks) == set(real.phase_peaks) == {"setup", "forward", "backward", "optimizer"}
    for phase, value in real.phase_peaks.items():
        assert abs(fake.phase_peaks[phase] - value) <= 0.05 * value, (phase, fake.phase_peaks, real.phase_peaks)
    assert fake.peak_phase == real.peak_phase


def test_nft_fake_run_matches_the_real_cpu_run():
    """fvtools/train_nft.py (LoRA policy, old-policy adapter, reference) on the tiny Teacher: one NftStep (K = 2
    samples of 2 chunks, 1 chunk trained each, step 1's monitor rollouts) and the loop's AdamW + old-policy update,
    fake against real CPU tensors: every phase's peak within 5 %."""
    args = _tiny_args("nft", "--chunks", "2", "--world_size", "1", "--samples_per_group", "2",
                      "--chunks_per_sample", "1")
    fake = estimate_memory.rehearse(args)
    real = estimate_memory.rehearse(args, fake=False)
    assert "2 samples" in fake.name
    for phase, value in real.phase_peaks.items():
        assert abs(fake.phase_peaks[phase] - value) <= 0.05 * value, (phase, fake.phase_peaks, real.phase_peaks)
    assert fake.peak_phase == real.peak_phase
    assert fake.notes["live_after_step"]["optimizer_state"] > 0


def test_fsdp_full_run_holds_the_per_rank_share():
    """--train full over 8 ranks (FSDP2 through the fake process group): each rank holds 1/8 of the FP32 parameters,
    AdamW's two moments of its shard, and its sharded gradients. Each of the 3 trained chunks' backward
    reduce-scatters (`fsdp.gradient_sync` is a no-op for FSDP2), so at the peak one unsharded FP32 gradient of the
    model's size is alive, the backward's own: skipping the reduce-scatter on the first chunks (FSDP2's
    `set_requires_gradient_sync(False)`) would keep the accumulated one beside it until the last chunk."""
    from predictor_training.teacher import WorldPlayTransformer
    total = sum(param.numel() for param in WorldPlayTransformer.from_preset("tiny").parameters()) * 4
    args = _tiny_args("df_sft", "--chunks", "3", "--train", "full", "--world_size", "8")
    report = estimate_memory.rehearse(args, "df_sft")
    assert "FSDP2 over 8 ranks" in report.name
    assert report.peak_phase in ("forward", "backward", "setup")
    # the shards: about an eighth (padding to a multiple of 8 rows per tensor), optimizer state twice that
    shards = report.notes["live_after_step"]
    assert total / 8 <= shards["parameters"] <= total / 8 * 1.3, (shards, total)
    assert shards["optimizer_state"] >= 0.95 * 2 * total / 8  # (the last block's text stream gets no gradient)
    assert 0 < shards["gradients"] <= total / 8 * 1.3
    model_sized = [tensor for tensor in report.largest if tensor["dtype"] == "float32" and
                   tensor["bytes"] >= 0.5 * total]
    assert len(model_sized) == 1 and model_sized[0]["phase"] == "backward", (report.largest, total)


def test_recipe_list():
    """RECIPES covers every entry script's recipe: the three Predictor entry scripts and every fvtools/train_*.py,
    plus the eval."""
    scripts = {path.stem.removeprefix("train_") for path in (ROOT / "fvtools").glob("train_*.py")}
    assert scripts <= set(estimate_memory.RECIPES)
    assert {"v4", "disca", "rollout"} <= set(estimate_memory.RECIPES)
    # every recipe is rehearsed, and the eval: none is refused (dmd2 runs in tests/tools/test_estimate_memory_dmd2.py)
    for recipe in [*estimate_memory.RECIPES, "eval"]:
        assert estimate_memory.parse_args(["--recipe", recipe, "--config", "tiny"]).recipe == recipe
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "unknown"])
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "v4", "--context_frames", "6"])
    with pytest.raises(SystemExit):
        estimate_memory.parse_args(["--recipe", "v4", "--data", "rollout"])
    for refused in (["--recipe", "v4", "--reuse_steps", "1,2"], ["--recipe", "rollout", "--reuse_steps", "1,2"]):
        with pytest.raises(SystemExit):  # a rollout setting; disjoint from --replace_steps (default 1,2,3)
            estimate_memory.parse_args(refused)


@pytest.mark.parametrize("recipe,extra", [
    ("v4", ["--context_frames", "4", "8"]),
    ("disca", []),
    ("rollout", ["--chunks", "3"]),
    ("rollout", ["--chunks", "3", "--replace_steps", "1,2", "--context_mode", "incremental"]),
    ("rollout", ["--chunks", "3", "--reuse_steps", "1,2", "--replace_steps", "3"]),
])
def test_tool_runs_every_recipe_at_tiny_size(recipe, extra, capsys):
    argv = ["--recipe", recipe, "--config", "tiny", "--batch_size", "2", "--text_tokens", "8", "--latent_grid",
            "2x3", "--source_blocks", "0,1", "--json", *extra]
    assert estimate_memory.main(argv) == 0
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(reports) == (2 if recipe == "v4" else 1)
    for report in reports:
        assert report["peak_gib"] > 0
        assert report["peak_phase"] in ("setup", "forward", "backward", "optimizer")
        assert {"forward", "backward", "optimizer"} <= set(report["phase_peaks_gib"])
        assert 0 < len(report["largest"]) <= 10
        assert report["by_category_gib"]["parameters"] > 0
        if report["peak_phase"] != "setup":  # at tiny sizes building the Teacher may set the peak, before DDP
            assert report["by_category_gib"]["ddp_buckets"] > 0  # --world_size 8 by default
        assert report["with_margin_gib"] > report["peak_gib"]
    if recipe == "v4":
        backward = [report["phase_peaks_gib"]["backward"] for report in reports]
        assert backward[1] > backward[0]  # more context, more memory
    if "--reuse_steps" in extra:  # the plan the rollout recipe trains with --reuse_steps 1,2 --replace_steps 3
        assert reports[0]["name"].startswith("rollout F-R-R-P"), reports[0]["name"]


# ---- the memory cuts lower the peak ---------------------------------------------------------------------------------
# At real size against the user's GPUs: `python benchmarks/check_real_size_memory.py` (two 8-chunk rollouts on fake
# tensors, minutes). Here, at tiny size, each of this code's cuts must lower its recipe's forward peak.
TINY_REHEARSAL = ["--config", "tiny", "--batch_size", "2", "--text_tokens", "8", "--latent_grid", "2x3",
                  "--source_blocks", "0,1"]


def rehearse(recipe: str, flags: list[str], *, undo=()):
    """The tool's one report for `recipe` at `flags`, the memory cuts named in `undo` undone."""
    return estimate_memory.estimate(estimate_memory.parse_args(
        ["--recipe", recipe, *flags, *(["--undo_cuts", *undo] if undo else [])]))[0]


def test_each_offline_memory_cut_lowers_the_peak():
    """v4 at 20 context frames: undoing any one of RMSNorm's dtype cast, image_forward's early release of its
    attention inputs, or pair_step's release of the batch's pre-features raises the forward peak."""
    baseline = rehearse("v4", TINY_REHEARSAL).phase_peaks["forward"]
    for cut in ("rms_norm_dtype", "attention_inputs", "offline_prefeatures"):
        undone = rehearse("v4", TINY_REHEARSAL, undo=(cut,)).phase_peaks["forward"]
        assert undone > baseline, (cut, undone, baseline)


@pytest.mark.slow
def test_rollout_context_release_lowers_the_peak():
    """Rollout, 3 chunks: keeping each chunk's context K/V of every layer through its backward (the release undone)
    raises the backward peak (at tiny size the Teacher's weights set the forward phase's)."""
    flags = [*TINY_REHEARSAL, "--chunks", "3"]
    baseline = rehearse("rollout", flags).phase_peaks["backward"]
    undone = rehearse("rollout", flags, undo=("rollout_context",)).phase_peaks["backward"]
    assert undone > baseline
