"""tools/eval_predictor.py on a tiny Teacher, a tiny random VAE and an untrained
Predictor (which is exactly hidden reuse): named outputs, metrics, timings and FLOP bounds, resume, ground truth,
context modes, flag refusals. The command line runs as a subprocess, as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from predictor_training.eval import REFERENCE, REUSE_HIDDEN, REUSE_VELOCITY, run_evaluation
from predictor_training.eval.methods import REPEAT_FIRST_FRAME
from predictor_training.eval.reports import side_by_side_scale_for
from predictor_training.runtime.distributed import init_distributed
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.teacher.flops import TeacherShape, context_assembly_flops, frame_kv_pass_flops
from predictor_training.video.io import read_video
from tests.helpers.eval_world import (
    CLI_FRAMES,
    CLI_LATENTS,
    FRAME_SIZE,
    HEIGHT,
    LONG_LATENTS,
    REPO_ROOT,
    RUN_DIR_NAME,
    SIDE_BY_SIDE_LABEL,
    SIDE_BY_SIDE_SCALE,
    STEP,
    WIDTH,
    eval_settings,
    write_eval_world,
    write_ground_truth,
)


TOOL = REPO_ROOT / "tools" / "eval_predictor.py"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return write_eval_world(tmp_path_factory.mktemp("eval_world"))


def _cli(world: dict, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """tools/eval_predictor.py on the tiny world, as a subprocess (returncode, stdout, stderr)."""
    root = world["root"]
    argv = [
        "--teacher", str(root / "teacher"), "--vae", str(root / "vae"), "--samples_dir", str(root / "samples"),
        "--encoded", str(root / "encoded"), "--split", "holdout25", "--num_latents", str(CLI_LATENTS),
        "--ckpt", str(world["ckpt"]), "--lpips_random_backbone", "--output_root", str(out), "--no_progress",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}  # this checkout's package, installed or not
    return subprocess.run([sys.executable, str(TOOL), *argv], capture_output=True, text=True, env=env,
                          cwd=REPO_ROOT, timeout=600)


@pytest.fixture(scope="module")
def fppp_run(world, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("eval_out")
    result = _cli(world, out, "--replace_steps", "1,2,3", "--num_side_by_side", "1", "--warmup_chunks", "0")
    run_dir = out / f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout25"
    return {"out": out, "status": result.returncode, "printed": result.stdout, "stderr": result.stderr,
            "run_dir": run_dir}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------------------------
# 1. The command line: names, files, metrics, timings, FLOPs
# ---------------------------------------------------------------------------------------------------------------
def test_cli_writes_named_outputs(fppp_run):
    assert fppp_run["status"] == 0, fppp_run["stderr"]
    # the first line says which dtype --dtype auto chose and why (the CPU-thread choice goes to stderr)
    first = fppp_run["printed"].splitlines()[0]
    assert "[eval] cpu threads: 1 (OMP_NUM_THREADS=1" in fppp_run["stderr"], fppp_run["stderr"]
    assert "eval dtype float32 (--dtype auto: the checkpoints' training precision fp32)" in first, first
    run_dir = fppp_run["run_dir"]
    assert run_dir.is_dir(), sorted(path.name for path in fppp_run["out"].iterdir())
    for name in ("eval_config.json", "per_video.csv", "per_chunk.csv", "aggregate.csv", "timings.csv",
                 "aggregate.json", "drift.png", "table.md"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "drift.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(path.name for path in (run_dir / "videos").iterdir()) == ["c000__a0.json", "c000__a2.json"]
    assert [path.name for path in (run_dir / "side_by_side").iterdir()] == ["c000__a0.mp4"]  # --num_side_by_side 1
    assert not list(run_dir.rglob("*.tmp"))


def test_cli_predictor_metrics_equal_hidden_reuse_and_lpips_is_labelled(fppp_run):
    run_dir = fppp_run["run_dir"]
    methods = _json(run_dir / "aggregate.json")["methods"]
    predictor = f"predictor_ckptstep{STEP}"
    assert list(methods) == [REFERENCE, REUSE_VELOCITY, REUSE_HIDDEN, predictor]
    assert methods[predictor]["metrics"] == methods[REUSE_HIDDEN]["metrics"]
    assert methods[predictor]["per_chunk"] == methods[REUSE_HIDDEN]["per_chunk"]
    assert methods[REUSE_VELOCITY]["metrics"] != methods[REUSE_HIDDEN]["metrics"]
    # chunk 0 is F-F-F-F everywhere, so its 13 decoded frames equal the reference
    assert methods[predictor]["per_chunk"][0]["psnr_full"] == "inf"
    assert math.isfinite(methods[predictor]["per_chunk"][1]["psnr_full"])
    # random AlexNet: never called LPIPS
    everything = "".join(path.read_text() for path in run_dir.glob("*.*") if path.suffix in (".json", ".csv", ".md"))
    assert "lpips_random_backbone_NOT_LPIPS" in everything and "lpips_alex" not in everything
    table = (run_dir / "table.md").read_text()
    assert "NOT LPIPS" in table and f"| predictor ckptstep{STEP} |" in table
    assert fppp_run["printed"].count("| reuse_hidden |") == 2


def test_cli_records_timings_and_flop_bound(fppp_run):
    result = _json(fppp_run["run_dir"] / "videos" / "c000__a0.json")
    assert result["context_frames_per_chunk"][0] == 0 and min(result["context_frames_per_chunk"][1:]) > 0
    predictor = result["methods"][f"predictor_ckptstep{STEP}"]
    reference = result["methods"][REFERENCE]
    for entry in (predictor, reference):
        timings = entry["timings"]
        assert timings["text_prefill_s"] > 0 and timings["vae_decode_s"] > 0 and timings["rollout_s"] > 0
        assert timings["end_to_end_s"] == pytest.approx(timings["text_prefill_s"] + timings["rollout_s"]
                                                         + timings["vae_decode_s"])
        assert entry["timings"]["calls"]["context_prefill"]["count"] == 1  # chunk 1 only
    assert predictor["timings"]["calls"]["predictor_step"]["count"] == 3 and predictor["timings"]["calls"][
        "full_step"]["count"] == 4 + 1
    assert reference["timings"]["calls"]["full_step"]["count"] == 8 and "predictor_step" not in reference["timings"][
        "calls"]
    assert predictor["flops"]["predictor_step"] > 0 and reference["flops"]["predictor_step"] == 0
    assert predictor["flops"]["text_prefill"] == reference["flops"]["text_prefill"] > 0
    methods = _json(fppp_run["run_dir"] / "aggregate.json")["methods"]
    speed = methods[f"predictor_ckptstep{STEP}"]["speedup"]
    assert set(speed) == {"measured_dit", "measured_end_to_end", "flop_bound_dit"}
    # both videos have the same context sizes here, so the bound is this video's FLOP ratio (the 2-block Teacher
    # makes a Predictor step dearer than a Full step: the bound is below 1)
    assert speed["flop_bound_dit"] == pytest.approx(reference["flops"]["total"] / predictor["flops"]["total"])
    assert methods[REUSE_VELOCITY]["speedup"]["flop_bound_dit"] > 1
    timings_csv = (fppp_run["run_dir"] / "timings.csv").read_text()
    for component in ("text prefill", "context prefill", "full step", "predictor step", "VAE decode"):
        assert component in timings_csv


def test_rerun_skips_finished_videos_and_refuses_other_settings(world, fppp_run):
    videos = sorted((fppp_run["run_dir"] / "videos").iterdir())
    stamps = [path.stat().st_mtime_ns for path in videos]
    rerun = _cli(world, fppp_run["out"], "--replace_steps", "1,2,3", "--num_side_by_side", "1")
    assert rerun.returncode == 0 and "0 videos computed, 2 already finished" in rerun.stdout, rerun.stderr
    assert [path.stat().st_mtime_ns for path in videos] == stamps
    # same directory, other numbers-changing settings: refused (one line, exit 2), nothing overwritten
    refused = _cli(world, fppp_run["out"], "--replace_steps", "1,2", "--run_name", fppp_run["run_dir"].name)
    last = refused.stderr.splitlines()[-1]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert last.startswith("eval_predictor.py: error: ") and "other settings" in last
    assert [path.stat().st_mtime_ns for path in videos] == stamps


def test_reuse_steps_score_an_frrp_checkpoint_at_its_own_plan(world, tmp_path):
    """--reuse_steps 1,2 --replace_steps 3: the Predictor runs F-R-R-P (one Predictor call per scheduled chunk, two
    velocity reuses), the reuse baselines fill steps 1-3 (F-R-R-R), and the run name carries the plan."""
    result = _cli(world, tmp_path, "--replace_steps", "3", "--reuse_steps", "1,2", "--warmup_chunks", "0",
                  "--num_side_by_side", "0", "--max_videos", "1")
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / f"{RUN_DIR_NAME}_ckptstep{STEP}_frrp_holdout25"
    video = _json(run_dir / "videos" / "c000__a0.json")
    predictor = video["methods"][f"predictor_ckptstep{STEP}"]["timings"]["calls"]
    assert predictor["predictor_step"]["count"] == 1 and predictor["reuse_step"]["count"] == 2
    assert predictor["full_step"]["count"] == 4 + 1
    assert video["methods"][REUSE_VELOCITY]["timings"]["calls"]["reuse_step"]["count"] == 3
    assert _json(run_dir / "eval_config.json")["settings"]["reuse_steps"] == [1, 2]
    assert "Predictors F-R-R-P" in result.stdout
    for extra, message in ((("--replace_steps", "2,3", "--reuse_steps", "1,2"), "steps [2] are also in"),
                           (("--replace_steps", "", "--reuse_steps", "1,2"), "needs --replace_steps")):
        refused = _cli(world, tmp_path / "refused", *extra)
        assert refused.returncode == 2 and message in refused.stderr.splitlines()[-1], refused.stderr
    assert not (tmp_path / "refused").exists()


def test_without_ground_truth_nothing_is_added(fppp_run):
    """A run without ground truth writes exactly the files and keys it always did (the demo baseline compares
    aggregate.json); only the side-by-side panels are scaled up."""
    run_dir = fppp_run["run_dir"]
    aggregate = _json(run_dir / "aggregate.json")
    assert list(aggregate) == ["header", "methods"] and "ground_truth" not in aggregate["header"]
    assert REPEAT_FIRST_FRAME not in aggregate["header"]["display_names"]
    assert "ground_truth" not in _json(run_dir / "eval_config.json")["settings"]
    assert "against_ground_truth" not in _json(run_dir / "videos" / "c000__a0.json")
    assert not (run_dir / "drift_ground_truth.png").exists()
    for name in ("per_video.csv", "per_chunk.csv", "aggregate.csv"):
        text = (run_dir / name).read_text()
        assert "gt_" not in text.splitlines()[0] and REPEAT_FIRST_FRAME not in text, name
    assert "ground truth" not in (run_dir / "table.md").read_text()
    video = read_video(run_dir / "side_by_side" / "c000__a0.mp4")  # reference | reuse v | reuse h | P
    panel_width = FRAME_SIZE[1] * SIDE_BY_SIDE_SCALE
    assert video.shape == (CLI_FRAMES, SIDE_BY_SIDE_LABEL + FRAME_SIZE[0] * SIDE_BY_SIDE_SCALE,
                           4 * panel_width + 3 * 4, 3)


def test_without_context_modes_nothing_is_added(fppp_run):
    """The default --context_modes exact adds no method, key, row or note: the outputs are those of a run before
    the flag (the demo baseline compares aggregate.json), and the fingerprint of existing eval dirs is unchanged."""
    run_dir = fppp_run["run_dir"]
    assert "_ctx-" not in run_dir.name
    aggregate = _json(run_dir / "aggregate.json")
    assert "context_modes" not in aggregate["header"] and not any("@" in name for name in aggregate["methods"])
    assert not any("@" in name for name in aggregate["header"]["display_names"])
    assert "context_modes" not in _json(run_dir / "eval_config.json")["settings"]
    for path in (run_dir / "videos").iterdir():
        for entry in _json(path)["methods"].values():
            assert set(entry["flops"]) == {"text_prefill", "context_prefill", "full_step", "predictor_step",
                                           "reuse_step", "block_residual_step", "total"}
            assert not {"context_cache", "context_assembly"} & set(entry["timings"]["calls"])
    for name in ("per_video.csv", "per_chunk.csv", "aggregate.csv", "timings.csv", "table.md"):
        text = (run_dir / name).read_text()
        assert "@" not in text and "context cache" not in text and "context assembly" not in text, name


# ---------------------------------------------------------------------------------------------------------------
# 2. Ground truth
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ground_truth_run(world, tmp_path_factory) -> dict:
    truth = write_ground_truth(tmp_path_factory.mktemp("ground_truth"), ("c000__a0", "c000__a2"),
                               mp4_keys=("c000__a2",))
    out = tmp_path_factory.mktemp("eval_ground_truth_out")
    result = _cli(world, out, "--replace_steps", "1,2,3", "--num_side_by_side", "1", "--warmup_chunks", "0",
                  "--ground_truth", str(truth))
    assert result.returncode == 0, result.stderr
    return {"truth": truth, "printed": result.stdout, "run_dir": out / f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout25"}


def test_every_method_and_the_still_first_frame_are_scored_against_the_ground_truth(ground_truth_run):
    truth, run_dir = ground_truth_run["truth"], ground_truth_run["run_dir"]
    predictor = f"predictor_ckptstep{STEP}"
    result = _json(run_dir / "videos" / "c000__a0.json")
    against = result["against_ground_truth"]
    assert against["video"] == str(truth / "c000__a0")
    assert _json(run_dir / "videos" / "c000__a2.json")["against_ground_truth"]["video"] == str(truth / "c000__a2.mp4")
    assert list(against["methods"]) == [REFERENCE, REUSE_VELOCITY, REUSE_HIDDEN, predictor, REPEAT_FIRST_FRAME]
    for name in (REFERENCE, REPEAT_FIRST_FRAME):
        scores = against["methods"][name]
        for key in ("psnr_full", "ssim", "lpips_random_backbone_NOT_LPIPS", "mse", "temporal_delta_mse"):
            assert math.isfinite(scores["metrics"][key]), (name, key)
        assert len(scores["per_chunk"]) == 2 and all(math.isfinite(chunk["psnr_full"]) for chunk in scores["per_chunk"])
        assert len(scores["per_frame"]["psnr"]) == CLI_FRAMES
    # the still image equals the ground truth at frame 0 only: PSNR there is what the metric code gives identical
    # frames (inf), and 0 < its score elsewhere
    still = against["methods"][REPEAT_FIRST_FRAME]
    assert still["per_frame"]["mse"][0] == 0 and still["per_frame"]["psnr"][0] == "inf"
    assert still["metrics"]["identical_frames"] == 1 and still["metrics"]["psnr_frame_mean"] == "inf"
    # chunks 1.. leave chunk 0 (and so the still image's identical frame 0) out; with 2 chunks they are chunk 1
    assert still["after_first_chunk"] == still["per_chunk"][1] and still["after_first_chunk"]["identical_frames"] == 0
    assert against["methods"][REFERENCE]["metrics"]["identical_frames"] == 0
    # the untrained Predictor is hidden reuse against the ground truth too; the against-reference record is as before
    assert against["methods"][predictor]["metrics"] == against["methods"][REUSE_HIDDEN]["metrics"]
    assert "metrics" not in result["methods"][REFERENCE] and "metrics" in result["methods"][predictor]


def test_ground_truth_reports(ground_truth_run):
    truth, run_dir = ground_truth_run["truth"], ground_truth_run["run_dir"]
    predictor = f"predictor_ckptstep{STEP}"
    names = [REFERENCE, REUSE_VELOCITY, REUSE_HIDDEN, predictor, REPEAT_FIRST_FRAME]
    assert _json(run_dir / "eval_config.json")["settings"]["ground_truth"] == str(truth.resolve())
    aggregate = _json(run_dir / "aggregate.json")
    assert aggregate["header"]["ground_truth"] == str(truth.resolve())
    assert list(aggregate["methods"]) == names[:-1] and list(aggregate["against_ground_truth"]) == names
    still = aggregate["against_ground_truth"][REPEAT_FIRST_FRAME]
    assert still["num_videos"] == 2 and still["metrics"]["identical_frames"] == 2 and len(still["per_chunk"]) == 2
    assert math.isfinite(aggregate["against_ground_truth"][REFERENCE]["metrics"]["psnr_full"])
    # CSV files: gt_ columns; rows for the reference and the still frame (their against-reference cells empty)
    per_video = (run_dir / "per_video.csv").read_text().splitlines()
    assert per_video[0].startswith("video,method,psnr_full,") and ",end_to_end_s,gt_psnr_full," in per_video[0]
    assert len(per_video) == 1 + 2 * len(names)
    assert any(line.startswith(f"c000__a0,{REPEAT_FIRST_FRAME},,") for line in per_video)
    per_chunk = (run_dir / "per_chunk.csv").read_text()
    assert "gt_psnr_full" in per_chunk.splitlines()[0] and f"MEAN,{REPEAT_FIRST_FRAME},1," in per_chunk
    aggregate_csv = (run_dir / "aggregate.csv").read_text().splitlines()
    assert "gt_psnr_full" in aggregate_csv[0] and aggregate_csv[-1].startswith(f"{REPEAT_FIRST_FRAME},")
    # the second table and the second drift plot
    table = (run_dir / "table.md").read_text()
    assert "**Against the ground truth**" in table and f"| {REPEAT_FIRST_FRAME} |" in table
    later = still["after_first_chunk"]
    assert "PSNR chunks 1.. (dB) | SSIM chunks 1.. |" in table
    assert f" | {later['psnr_full']:.4f} | {later['ssim']:.4f} |" in table  # the still image's row ends with them
    assert table.count(f"| predictor ckptstep{STEP} |") == 3  # vs reference, vs ground truth, speed
    assert "**Against the ground truth**" in ground_truth_run["printed"]
    assert (run_dir / "drift_ground_truth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_side_by_side_leads_with_the_ground_truth_scaled_up(ground_truth_run):
    run_dir = ground_truth_run["run_dir"]
    video = read_video(run_dir / "side_by_side" / "c000__a0.mp4").astype(np.float64)
    height, width = (size * SIDE_BY_SIDE_SCALE for size in FRAME_SIZE)
    assert video.shape == (CLI_FRAMES, SIDE_BY_SIDE_LABEL + height, 5 * width + 4 * 4, 3)
    truth = read_video(ground_truth_run["truth"] / "c000__a0")
    truth = truth.repeat(SIDE_BY_SIDE_SCALE, axis=1).repeat(SIDE_BY_SIDE_SCALE, axis=2).astype(np.float64)

    def error_of_panel(index: int) -> float:  # mean |pixel - upscaled ground truth| (the mp4 is lossy)
        left = index * (width + 4)
        return float(np.abs(video[:, SIDE_BY_SIDE_LABEL:, left : left + width] - truth).mean())

    assert error_of_panel(0) < error_of_panel(1) / 2  # ground truth | reference | ...
    assert [side_by_side_scale_for(height_, requested) for height_, requested in
            ((32, 0), (191, 0), (192, 0), (480, 0), (32, 2))] == [6, 2, 1, 1, 2]


def load_eval_tool():
    """tools/eval_predictor.py as a module (its parser and parse_args, in-process)."""
    spec = importlib.util.spec_from_file_location("eval_predictor_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


# ---------------------------------------------------------------------------------------------------------------
# 3. Context modes: the reference and the Predictor once more with the incremental context K/V cache
# ---------------------------------------------------------------------------------------------------------------
LONG_FRAMES = (LONG_LATENTS - 1) * 4 + 1  # holdout50: 3 chunks, so chunk 2's context is no longer one chunk


@pytest.fixture(scope="module")
def context_modes_run(world, tmp_path_factory) -> dict:
    """holdout50 (1 video, 3 chunks: from chunk 2 on the incremental context differs from the exact one) with
    --context_modes exact,incremental and ground truth."""
    truth = write_ground_truth(tmp_path_factory.mktemp("ground_truth_long"), ("c000__a2",), num_frames=LONG_FRAMES)
    out = tmp_path_factory.mktemp("eval_context_modes_out")
    result = _cli(world, out, "--split", "holdout50", "--num_latents", str(LONG_LATENTS), "--replace_steps", "1,2,3",
                  "--context_modes", "incremental,exact", "--num_side_by_side", "0", "--warmup_chunks", "1",
                  "--ground_truth", str(truth))
    assert result.returncode == 0, result.stderr
    run_dir = out / f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout50_ctx-incremental"
    return {"out": out, "truth": truth, "printed": result.stdout, "run_dir": run_dir}


def test_context_modes_add_the_reference_and_the_predictor_in_each_mode(context_modes_run):
    run_dir = context_modes_run["run_dir"]
    predictor = f"predictor_ckptstep{STEP}"
    names = [REFERENCE, REUSE_VELOCITY, REUSE_HIDDEN, predictor, f"{REFERENCE}@incremental",
             f"{predictor}@incremental"]  # the reuse baselines are not repeated per mode
    aggregate = _json(run_dir / "aggregate.json")
    assert list(aggregate["methods"]) == names and aggregate["header"]["context_modes"] == ["exact", "incremental"]
    assert list(aggregate["against_ground_truth"]) == names + [REPEAT_FIRST_FRAME]
    assert _json(run_dir / "eval_config.json")["settings"]["context_modes"] == ["exact", "incremental"]
    display = aggregate["header"]["display_names"]
    assert display[f"{REFERENCE}@incremental"] == "reference @incremental"
    assert display[f"{predictor}@incremental"] == f"predictor ckptstep{STEP} @incremental"
    # reference@incremental: scored against the exact reference; chunk 0 has no context (identical), chunks 0-1
    # agree to round-off, chunk 2's context K/V are the cached ones: different, but close
    cached = aggregate["methods"][f"{REFERENCE}@incremental"]
    assert math.isfinite(cached["metrics"]["psnr_full"]) and cached["metrics"]["psnr_full"] > 40
    assert cached["metrics"]["ssim"] > 0.99 and cached["metrics"]["mse"] > 0
    assert cached["per_chunk"][0]["psnr_full"] == "inf" and math.isfinite(cached["per_chunk"][2]["psnr_full"])
    assert math.isfinite(aggregate["methods"][f"{predictor}@incremental"]["metrics"]["psnr_full"])
    assert math.isfinite(aggregate["against_ground_truth"][f"{REFERENCE}@incremental"]["metrics"]["psnr_full"])
    # reports: every table lists the new methods by their display names; the per-chunk CSV has their rows
    table = (run_dir / "table.md").read_text()
    for label in ("reference @incremental", f"predictor ckptstep{STEP} @incremental"):
        assert table.count(f"| {label} |") == 3, label  # vs reference, vs ground truth, speed
    assert "`@incremental`: the same method" in table and "| reference |" in table
    assert f"MEAN,{REFERENCE}@incremental,2," in (run_dir / "per_chunk.csv").read_text()
    assert (run_dir / "drift.png").is_file() and (run_dir / "drift_ground_truth.png").is_file()


def test_context_modes_flops_and_timings(context_modes_run, world):
    run_dir = context_modes_run["run_dir"]
    predictor = f"predictor_ckptstep{STEP}"
    result = _json(run_dir / "videos" / "c000__a2.json")
    reference, cached = result["methods"][REFERENCE], result["methods"][f"{REFERENCE}@incremental"]
    # FLOPs: the exact context prefills are replaced by the cache (its K/V passes and the placing of cached K/V)
    assert "context_cache" not in reference["flops"]
    assert cached["flops"]["context_prefill"] == 0 and cached["flops"]["context_cache"] > 0
    assert cached["flops"]["full_step"] == reference["flops"]["full_step"]  # still F-F-F-F
    assert cached["flops"]["predictor_step"] == 0
    # 3 chunks of a 3-block model: a K/V pass over a chunk (one chunk step) costs about what the prefill of its 4-8
    # frames costs, so the totals are close here; the count itself is checked against the FLOP model
    contexts, text_tokens = result["context_frames_per_chunk"], result["text_tokens"]
    assert contexts == [0, 4, 8]
    shape = TeacherShape.from_config(WorldPlayTransformer.load_config(str(world["root"] / "teacher")))
    tokens = HEIGHT * WIDTH
    passes = sum(frame_kv_pass_flops(shape, tokens, text_tokens, n) for n in contexts[:-1])
    assert cached["flops"]["context_cache"] == passes + sum(context_assembly_flops(shape, tokens, n) for n in contexts)
    cached_predictor = result["methods"][f"{predictor}@incremental"]["flops"]
    assert cached_predictor["predictor_step"] == result["methods"][predictor]["flops"]["predictor_step"] > 0
    assert cached_predictor["context_cache"] == cached["flops"]["context_cache"]
    bound = _json(run_dir / "aggregate.json")["methods"][f"{REFERENCE}@incremental"]["speedup"]["flop_bound_dit"]
    assert bound == pytest.approx(reference["flops"]["total"] / cached["flops"]["total"])
    # timings: no exact prefill; the context is assembled (chunks 1, 2) and chunks 0, 1 are cached (not the last)
    calls = cached["timings"]["calls"]
    assert "context_prefill" not in calls and calls["full_step"]["count"] == 3 * 4
    assert calls["context_assembly"]["count"] == 2 and calls["context_cache"]["count"] == 2
    assert result["methods"][f"{predictor}@incremental"]["timings"]["calls"]["context_cache"]["count"] == 2
    assert not {"context_cache", "context_assembly"} & set(reference["timings"]["calls"])
    timings_csv = (run_dir / "timings.csv").read_text()
    assert f"context cache of a finished chunk ({REFERENCE}@incremental)," in timings_csv
    assert f"context assembly from cached K/V ({predictor}@incremental)," in timings_csv
    assert "| context cache of a finished chunk (reference @incremental) |" in context_modes_run["printed"]


def test_context_modes_are_part_of_the_fingerprint(world, context_modes_run):
    """The same directory with other context modes is refused before anything runs."""
    settings = eval_settings(world, context_modes_run["out"], run_name=context_modes_run["run_dir"].name,
                             sample_table=world["root"] / "samples" / "holdout50.jsonl", split="holdout50",
                             num_latents=LONG_LATENTS, ground_truth=context_modes_run["truth"])
    with pytest.raises(ValueError, match=r"other settings \(differences in \['context_modes'\]\)"):
        run_evaluation(settings, init_distributed("gloo"))


def test_bad_flags_are_usage_errors(world, tmp_path, capsys):
    """Flag problems end with one line ('error:' message), exit code 2, no traceback, no output.
    The problems found in a checkpoint go through the command line (a subprocess); those argparse finds alone are
    checked in-process on the same parser (a subprocess each would only repeat torch's import)."""
    tool = load_eval_tool()
    root = world["root"]
    argv = ["--teacher", str(root / "teacher"), "--vae", str(root / "vae"), "--samples_dir", str(root / "samples"),
            "--encoded", str(root / "encoded"), "--split", "holdout25", "--ckpt", str(world["ckpt"]),
            "--lpips_random_backbone", "--output_root", str(tmp_path)]
    for extra, message in ((("--replace_steps", "0,1"), "outside 1..3"),
                           (("--context_modes", "exact,approximate"),
                            "--context_modes 'exact,approximate': unknown context mode(s) 'approximate'; allowed: "
                            "exact, incremental, last_step")):
        with pytest.raises(SystemExit) as exit_info:
            tool.parse_args(tool.build_parser(), [*argv, *extra])
        lines = capsys.readouterr().err.splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1, (extra, lines)
        assert lines[-1].split(": error: ")[1].count(message) == 1, (extra, lines)
    for extra, message in ((("--chunk0", "schedule"), "are v4 Predictors"),  # found in the checkpoint's metadata
                           (("--ckpt", str(tmp_path / "missing.safetensors")), "missing.safetensors")):
        result = _cli(world, tmp_path, *extra)
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and "Traceback" not in result.stderr, (extra, result.stderr)
        assert lines[-1].startswith("eval_predictor.py: error: ") and message in lines[-1], (extra, result.stderr)
    assert not list(tmp_path.iterdir())
