"""tools/eval_predictor.py and the package predictor_training/eval/ + flops.py on a tiny Teacher, a tiny random VAE
and an untrained Predictor (which is exactly hidden reuse): equal rollouts, reference reproduction, resume, outputs,
ground truth, context modes, FLOPs. The command line runs as a subprocess, as a user runs it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.runtime.checkpoint import save_inference_weights
from predictor_training.runtime.distributed import init_distributed
from predictor_training.eval import (
    REFERENCE,
    REUSE_HIDDEN,
    REUSE_VELOCITY,
    EvalRuntime,
    EvalSettings,
    HiddenReuse,
    PredictorMethod,
    ReferenceMethod,
    VelocityReuse,
    default_run_name,
    label_checkpoints,
    load_predictor,
    parse_context_modes,
    read_predictor_checkpoint,
    resolve_dtype,
    resolve_teacher,
    rollout_config_for,
    run_evaluation,
)
from predictor_training.rollout.schedule import Schedule, parse_replace_steps
from predictor_training.eval.timing import Stopwatch, TimedRollout
from predictor_training.video.vae_decoder import VaeDecoder
from predictor_training.eval.methods import REPEAT_FIRST_FRAME
from predictor_training.eval.reports import side_by_side_scale_for
from predictor_training.teacher.flops import (
    TeacherShape,
    context_assembly_flops,
    context_prefill_flops,
    frame_kv_pass_flops,
    predictor_step_flops,
    teacher_chunk_step_flops,
    text_prefill_flops,
)
from predictor_training.predictor.model import build_predictor
from predictor_training.teacher import TextKV, WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.source import TeacherSource, load_teacher, teacher_config_sha256
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset
from predictor_training.video.io import read_video, write_video

from tests.eval_world import (  # noqa: F401 (the world's sizes)
    CLI_FRAMES,
    CLI_LATENTS,
    FRAME_SIZE,
    HEIGHT,
    LONG_LATENTS,
    REPO_ROOT,
    RUN_DIR_NAME,
    SIDE_BY_SIDE_LABEL,
    SIDE_BY_SIDE_SCALE,
    SOURCE_BLOCKS,
    STEP,
    WIDTH,
    write_eval_world,
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
# 1. Untrained Predictor == hidden reuse, bitwise (and both differ from the reference and velocity reuse)
# ---------------------------------------------------------------------------------------------------------------
def test_untrained_predictor_rollout_equals_hidden_reuse_bitwise(world):
    root = world["root"]
    teacher = WorldPlayTransformer.from_pretrained(str(root / "teacher")).eval().requires_grad_(False)
    ckpt = label_checkpoints([read_predictor_checkpoint(world["ckpt"])])[0]
    methods = [ReferenceMethod(), VelocityReuse(), HiddenReuse(teacher), PredictorMethod(load_predictor(teacher, ckpt),
                                                                                          ckpt)]
    dataset = TrajectoryTableDataset(root / "samples" / "holdout50.jsonl", encoded_dir=root / "encoded",
                                     num_latents=LONG_LATENTS)
    runtime = EvalRuntime(
        teacher=teacher, methods=methods, schedule=Schedule((1, 2, 3)),
        rollout_config=rollout_config_for(torch.float32),
        decoder=VaeDecoder.from_folder(root / "vae", torch.device("cpu"), torch.float32, tiling=False),
        scorer=None, dataset=dataset, case_source="encoded", device=torch.device("cpu"), state_dtype=torch.float32,
    )
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    text_kv, _ = runtime.text_kv(case)
    latents = {}
    stopwatches = {}
    for method in methods:
        stopwatches[method.name] = Stopwatch(torch.device("cpu"))
        latents[method.name] = runtime.rollout(method, text_kv, item, case, stopwatches[method.name]).latents
    predictor_name = methods[-1].name
    assert torch.equal(latents[predictor_name], latents[REUSE_HIDDEN])
    assert not torch.equal(latents[REUSE_HIDDEN], latents[REFERENCE])
    assert not torch.equal(latents[REUSE_HIDDEN], latents[REUSE_VELOCITY])
    chunk0 = slice(0, 4)
    assert torch.equal(latents[predictor_name][:, :, chunk0], latents[REFERENCE][:, :, chunk0])  # chunk 0 is F-F-F-F
    # the Predictor ran on chunks 1 and 2, steps 1-3; the Teacher ran the rest
    calls = stopwatches[predictor_name].summary()
    assert calls["predictor_step"]["count"] == 2 * 3 and calls["full_step"]["count"] == 4 + 2
    assert calls["context_prefill"]["count"] == 2


def test_predictor_inputs_come_from_this_rollout(world, monkeypatch):
    """Anchor: h0 of the Teacher at step 1, then the Predictor's own pred_h; previous-chunk hidden: chunk 0's Teacher
    hidden for chunk 1, the Predictor's own pred_h of chunk 1 for chunk 2; context: the Teacher prefill's exact K/V
    objects of the source layers of the same chunk."""
    root = world["root"]
    teacher = WorldPlayTransformer.from_pretrained(str(root / "teacher")).eval().requires_grad_(False)
    ckpt = label_checkpoints([read_predictor_checkpoint(world["ckpt"])])[0]
    predictor = load_predictor(teacher, ckpt)
    calls, contexts = [], []
    forward = predictor.forward

    def spy(noisy_input, anchor, *args, context=None, prev_chunk_hidden=None, **kwargs):
        out = forward(noisy_input, anchor, *args, context=context, prev_chunk_hidden=prev_chunk_hidden, **kwargs)
        calls.append({"anchor": anchor, "prev": prev_chunk_hidden, "context": context, "hidden": out[0]})
        return out

    predictor.forward = spy
    prefill = TimedRollout.prefill_context

    def recording_prefill(self, chunk_index, with_vec=False):
        contexts.append(prefill(self, chunk_index, with_vec))
        return contexts[-1]

    monkeypatch.setattr(TimedRollout, "prefill_context", recording_prefill)
    dataset = TrajectoryTableDataset(root / "samples" / "holdout50.jsonl", encoded_dir=root / "encoded",
                                     num_latents=LONG_LATENTS)
    runtime = EvalRuntime(
        teacher=teacher, methods=[PredictorMethod(predictor, ckpt)], schedule=Schedule((1, 2, 3)),
        rollout_config=rollout_config_for(torch.float32),
        decoder=VaeDecoder.from_folder(root / "vae", torch.device("cpu"), torch.float32, tiling=False),
        scorer=None, dataset=dataset, case_source="encoded", device=torch.device("cpu"), state_dtype=torch.float32,
    )
    item = dataset[0]
    case = dataset.load_case(item["case_id"])
    runtime.rollout(runtime.methods[0], runtime.text_kv(case)[0], item, case, Stopwatch(torch.device("cpu")))
    assert len(calls) == 6 and len(contexts) == 3  # chunks 1, 2 x steps 1, 2, 3
    own = [call["hidden"] for call in calls]
    for chunk in (0, 1):
        first = 3 * chunk
        assert not any(calls[first]["anchor"] is hidden for hidden in own)  # the Teacher's h0
        assert calls[first + 1]["anchor"] is own[first] and calls[first + 2]["anchor"] is own[first + 1]
        for index in range(first, first + 3):
            layers = calls[index]["context"].layers
            assert all(layers[j] is contexts[chunk + 1].kv.layers[block] for j, block in enumerate(SOURCE_BLOCKS))
    assert not any(calls[k]["prev"] is hidden for k in range(3) for hidden in own)  # chunk 0's Teacher hiddens
    assert all(calls[3 + k]["prev"] is own[k] for k in range(3))


# ---------------------------------------------------------------------------------------------------------------
# 2. The CLI: names, files, metrics, timings, FLOPs
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


def test_no_replaced_steps_reproduce_the_reference(world, tmp_path):
    """The library entry point without the command line: an empty schedule makes every method the reference."""
    root = world["root"]
    settings = EvalSettings(
        teacher_source=TeacherSource(root / "teacher", None, "--teacher", None), vae=root / "vae",
        sample_table=root / "samples" / "holdout25.jsonl", split="holdout25", case_source="encoded",
        case_root=root / "encoded", num_latents=CLI_LATENTS, checkpoints=[world["ckpt"]],
        schedule=Schedule(parse_replace_steps("")), dtype=torch.float32, vae_dtype=torch.float32,
        output_root=tmp_path, max_videos=1, num_side_by_side=0, lpips_random_backbone=True, warmup_chunks=1,
        progress=False,
    )
    report = run_evaluation(settings, init_distributed("gloo"))
    run_dir = tmp_path / f"{RUN_DIR_NAME}_ckptstep{STEP}_ffff_holdout25"
    assert report["out_dir"] == run_dir and report["computed"] == ["c000__a0"] and report["skipped"] == 0
    methods = _json(run_dir / "aggregate.json")["methods"]
    for name in (REUSE_VELOCITY, REUSE_HIDDEN, f"predictor_ckptstep{STEP}"):
        metrics = methods[name]["metrics"]
        assert metrics["mse"] == 0 and metrics["psnr_full"] == "inf" and metrics["ssim"] == 1.0
        assert metrics["identical_frames"] == metrics["num_frames"] == (CLI_LATENTS - 1) * 4 + 1
        assert methods[name]["speedup"]["flop_bound_dit"] == 1.0
    assert "| inf |" in (run_dir / "table.md").read_text() and "| inf |" in report["table"]


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
                                           "reuse_step", "total"}
            assert not {"context_cache", "context_assembly"} & set(entry["timings"]["calls"])
    for name in ("per_video.csv", "per_chunk.csv", "aggregate.csv", "timings.csv", "table.md"):
        text = (run_dir / name).read_text()
        assert "@" not in text and "context cache" not in text and "context assembly" not in text, name


# ---------------------------------------------------------------------------------------------------------------
# 3. Ground truth
# ---------------------------------------------------------------------------------------------------------------
def _write_ground_truth(folder: Path, keys, num_frames: int = CLI_FRAMES, mp4_keys=()) -> Path:
    """Random uint8 ground-truth videos [num_frames, 32, 48, 3]: PNG-frame folders <key>/, lossless <key>.mp4 for
    mp4_keys."""
    generator = np.random.default_rng(5)
    for key in keys:
        frames = generator.integers(0, 256, (num_frames, *FRAME_SIZE, 3), dtype=np.uint8)
        if key in mp4_keys:
            write_video(folder / f"{key}.mp4", frames, fps=24.0, lossless=True)
        else:
            write_video(folder / key, frames, fps=24.0)
    return folder


@pytest.fixture(scope="module")
def ground_truth_run(world, tmp_path_factory) -> dict:
    truth = _write_ground_truth(tmp_path_factory.mktemp("ground_truth"), ("c000__a0", "c000__a2"),
                                mp4_keys=("c000__a2",))
    out = tmp_path_factory.mktemp("eval_ground_truth_out")
    result = _cli(world, out, "--replace_steps", "1,2,3", "--num_side_by_side", "1", "--warmup_chunks", "0",
                  "--ground_truth", str(truth))
    assert result.returncode == 0, result.stderr
    return {"truth": truth, "printed": result.stdout, "run_dir": out / f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout25"}


def _settings(world: dict, output_root: Path, **overrides) -> EvalSettings:
    """The library entry point's settings for the tiny world (holdout25, F-P-P-P, no warm-up, no side-by-side)."""
    root = world["root"]
    settings = EvalSettings(
        teacher_source=TeacherSource(root / "teacher", None, "--teacher", None), vae=root / "vae",
        sample_table=root / "samples" / "holdout25.jsonl", split="holdout25", case_source="encoded",
        case_root=root / "encoded", num_latents=CLI_LATENTS, checkpoints=[world["ckpt"]],
        schedule=Schedule((1, 2, 3)), dtype=torch.float32, vae_dtype=torch.float32, output_root=output_root,
        num_side_by_side=0, lpips_random_backbone=True, warmup_chunks=0, progress=False,
    )
    return dataclasses.replace(settings, **overrides)


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


def test_missing_ground_truth_fails_before_anything_runs(world, tmp_path):
    truth = _write_ground_truth(tmp_path / "truth", ("c000__a0",))  # the split also has c000__a2
    with pytest.raises(FileNotFoundError, match=re.escape(str(truth / "c000__a2.mp4"))) as error:
        run_evaluation(_settings(world, tmp_path / "out", ground_truth=truth), init_distributed("gloo"))
    assert "1 of 2 rows" in str(error.value) and str(truth / "c000__a0") not in str(error.value)
    assert not (tmp_path / "out").exists()  # refused before the run directory, so before any rollout


def test_ground_truth_of_another_length_is_an_error_naming_the_file(world, tmp_path, monkeypatch):
    truth = _write_ground_truth(tmp_path / "truth", ("c000__a0",), num_frames=CLI_FRAMES - 1)

    def no_rollout(*args, **kwargs):
        raise AssertionError("a rollout ran before the ground truth's shape was checked")

    monkeypatch.setattr(EvalRuntime, "rollout", no_rollout)
    expected = f"{truth / 'c000__a0'}: ground-truth frame count is {CLI_FRAMES - 1}, expected {CLI_FRAMES}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        run_evaluation(_settings(world, tmp_path / "out", ground_truth=truth, max_videos=1),
                       init_distributed("gloo"))


def load_eval_tool():
    """tools/eval_predictor.py as a module (its parser and parse_args, in-process)."""
    spec = importlib.util.spec_from_file_location("eval_predictor_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_demo_folder_names_its_ground_truth(tmp_path, capsys):
    """--demo D: the ground truth defaults to D/<demo_config.json's "ground_truth">; older demo folders have none."""
    tool = load_eval_tool()
    demo = tmp_path / "demo"
    (demo / "samples").mkdir(parents=True)
    (demo / "samples" / "holdout25.jsonl").write_text("")
    argv = ["--demo", str(demo), "--lpips_random_backbone"]
    parse = lambda *extra: tool.parse_args(tool.build_parser(), [*argv, *extra])  # noqa: E731
    assert parse().ground_truth is None  # no demo_config.json
    (demo / "demo_config.json").write_text(json.dumps({"num_latents": 32}))
    assert parse().ground_truth is None  # a demo config without ground truth
    (demo / "demo_config.json").write_text(json.dumps({"num_latents": 32, "ground_truth": "ground_truth"}))
    with pytest.raises(SystemExit):
        parse()
    assert f"ground truth {demo / 'ground_truth'} (from the 'ground_truth' entry of" in capsys.readouterr().err
    (demo / "ground_truth").mkdir()
    assert parse().ground_truth == demo / "ground_truth"
    (tmp_path / "elsewhere").mkdir()
    assert parse("--ground_truth", str(tmp_path / "elsewhere")).ground_truth == tmp_path / "elsewhere"


# ---------------------------------------------------------------------------------------------------------------
# 3b. Context modes: the reference and the Predictor once more with the incremental context K/V cache
# ---------------------------------------------------------------------------------------------------------------
LONG_FRAMES = (LONG_LATENTS - 1) * 4 + 1  # holdout50: 3 chunks, so chunk 2's context is no longer one chunk


@pytest.fixture(scope="module")
def context_modes_run(world, tmp_path_factory) -> dict:
    """holdout50 (1 video, 3 chunks: from chunk 2 on the incremental context differs from the exact one) with
    --context_modes exact,incremental and ground truth."""
    truth = _write_ground_truth(tmp_path_factory.mktemp("ground_truth_long"), ("c000__a2",), num_frames=LONG_FRAMES)
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
    settings = _settings(world, context_modes_run["out"], run_name=context_modes_run["run_dir"].name,
                         sample_table=world["root"] / "samples" / "holdout50.jsonl", split="holdout50",
                         num_latents=LONG_LATENTS, ground_truth=context_modes_run["truth"])
    with pytest.raises(ValueError, match=r"other settings \(differences in \['context_modes'\]\)"):
        run_evaluation(settings, init_distributed("gloo"))


# ---------------------------------------------------------------------------------------------------------------
# 4. Schedules, names, argument checks
# ---------------------------------------------------------------------------------------------------------------
def test_schedule_letters_and_chunk0_rule():
    fppp = Schedule(parse_replace_steps("1,2,3"))
    assert fppp.letters() == "FPPP" and fppp.tag == "fppp" and not fppp.replaces(0, 1) and fppp.replaces(1, 1)
    assert Schedule((1, 3)).letters() == "FPFP" and Schedule((1, 2)).letters() == "FPPF"
    every = Schedule((1, 2), chunk0_full=False)
    assert every.replaces(0, 2) and every.tag == "fppf_allchunks"
    assert Schedule(parse_replace_steps("")).letters() == "FFFF"
    for bad in ((0, 1), (2, 1), (4,)):
        with pytest.raises(ValueError):
            Schedule(bad)


def test_run_names_follow_the_convention(world):
    ckpt = read_predictor_checkpoint(world["ckpt"])
    other = dataclasses.replace(ckpt, step=300)
    foreign = dataclasses.replace(ckpt, run_name="disca_run", step=300)
    assert default_run_name([ckpt], Schedule((1, 2, 3)), "holdout50") == f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout50"
    assert default_run_name([ckpt, other], Schedule((1, 2)), "train") == f"{RUN_DIR_NAME}_ckptstep5+300_fppf_train"
    assert default_run_name([], Schedule((1, 2, 3)), "holdout25") == "reuse_fppp_holdout25"
    assert default_run_name([ckpt], Schedule((1, 2, 3)), "holdout50", ("exact",)) == (
        f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout50")
    assert default_run_name([ckpt], Schedule((1, 2, 3)), "holdout50", ("last_step", "incremental")) == (
        f"{RUN_DIR_NAME}_ckptstep{STEP}_fppp_holdout50_ctx-incremental+last_step")
    assert default_run_name([], Schedule((1, 2)), "train", ("exact", "last_step")) == "reuse_fppf_train_ctx-last_step"
    # exact is always run, first; the others in the order of CONTEXT_MODES, each once
    assert parse_context_modes("exact") == ("exact",) and parse_context_modes("incremental") == ("exact", "incremental")
    assert parse_context_modes(" last_step,exact,incremental,last_step") == ("exact", "incremental", "last_step")
    with pytest.raises(ValueError, match="--context_modes 'exact,': expected a comma-separated list"):
        parse_context_modes("exact,")
    labelled = label_checkpoints([ckpt, foreign])
    assert [item.label for item in labelled] == [f"{RUN_DIR_NAME}_ckptstep{STEP}", "disca_run_ckptstep300"]
    assert [item.panel for item in labelled] == [f"#1 ckptstep{STEP}", "#2 ckptstep300"]
    assert label_checkpoints([ckpt])[0].panel == f"ckptstep{STEP}"
    with pytest.raises(ValueError, match="twice"):
        label_checkpoints([ckpt, ckpt])


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


def test_dtype_choice_is_explicit():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("bfloat16", [{"precision": "fp32"}], cpu) == (torch.bfloat16, "--dtype bfloat16")
    assert resolve_dtype("auto", [{"precision": "fp32master"}], cpu)[0] == torch.bfloat16
    assert resolve_dtype("auto", [], cpu) == (torch.float32, "--dtype auto without checkpoints: float32 on cpu")
    assert resolve_dtype("auto", [], cuda) == (torch.bfloat16, "--dtype auto without checkpoints: bfloat16 on CUDA")
    with pytest.raises(ValueError, match="choose --dtype"):
        resolve_dtype("auto", [{"precision": "fp32"}, {"precision": "fp32master"}], cpu)


def test_explicit_teacher_is_checked_against_the_training_dataset_record(world, tmp_path):
    """--teacher: the Teacher config recorded by the checkpoint's training dataset is enforced, as in training; a
    run that records no dataset (or whose dataset is not here) leaves the Teacher unchecked."""
    root = world["root"]
    ckpt = label_checkpoints([read_predictor_checkpoint(world["ckpt"])])[0]
    actual = teacher_config_sha256(WorldPlayTransformer.from_pretrained(str(root / "teacher")))

    def trained_on(name: str, sha: str | None):
        dataset = tmp_path / name
        if sha is not None:
            dataset.mkdir()
            (dataset / "dataset_config.json").write_text(json.dumps(
                {"teacher": {"folder": str(root / "teacher"), "config_sha256": sha, "action_ckpt": None}}))
        return dataclasses.replace(ckpt, run_flags={**ckpt.run_flags, "dataset_root": str(dataset)})

    teacher = root / "teacher"
    assert resolve_teacher(teacher, None, "--teacher", [ckpt]).expected_config_sha256 is None  # nothing recorded
    assert resolve_teacher(teacher, None, "--teacher", [trained_on("gone", None)]).expected_config_sha256 is None
    same = resolve_teacher(teacher, None, "--teacher", [trained_on("same", actual)])
    assert same.expected_config_sha256 == actual and same.origin == "--teacher"
    load_teacher(same, torch.device("cpu"), torch.float32)
    other = resolve_teacher(teacher, None, "--demo", [trained_on("other", "0" * 64)])
    with pytest.raises(ValueError, match="config sha256"):
        load_teacher(other, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="different configs"):
        resolve_teacher(teacher, None, "--teacher", [trained_on("a", actual), trained_on("b", "0" * 64)])


# ---------------------------------------------------------------------------------------------------------------
# 5. FLOP counts against torch's own counter (matmuls + attention)
# ---------------------------------------------------------------------------------------------------------------
def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs):
    return sdpa_flop_count(query, key, value)


def _counted(function) -> int:
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        function()
    return counter.get_total_flops()


def test_flop_counts_match_torch_flop_counter():
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=3).eval()
    shape = TeacherShape.from_config(teacher.config)
    generator = torch.Generator().manual_seed(1)
    text_len, ctx_frames, heads, head_dim = 5, 4, teacher.heads_num, teacher.head_dim
    text_kv = TextKV([torch.randn(1, heads, text_len, head_dim, generator=generator) for _ in range(3)],
                     [torch.randn(1, heads, text_len, head_dim, generator=generator) for _ in range(3)])

    def inputs(frames: int, timestep: float) -> dict:
        return dict(hidden_states=torch.randn(1, 9, frames, HEIGHT, WIDTH, generator=generator),
                    timestep=torch.full((frames,), timestep), action=torch.zeros(1, frames),
                    viewmats=torch.eye(4).repeat(1, frames, 1, 1), Ks=torch.eye(3).repeat(1, frames, 1, 1))

    tokens = HEIGHT * WIDTH
    close = dict(rel=1e-4)  # the analytic count leaves out the camera matrices' 3x3 products (tens of FLOPs)
    context_kv, _ = teacher.context_prefill(**inputs(ctx_frames, 14.0), text_kv=text_kv)
    assert _counted(lambda: teacher.context_prefill(**inputs(ctx_frames, 14.0), text_kv=text_kv)) == pytest.approx(
        context_prefill_flops(shape, tokens, text_len, ctx_frames), **close)
    chunk = inputs(4, 900.0)
    assert _counted(lambda: teacher.chunk_step(**chunk, text_kv=text_kv, context_kv=context_kv)) == pytest.approx(
        teacher_chunk_step_flops(shape, tokens, text_len, ctx_frames), **close)
    anchor = torch.randn(1, 4 * tokens, teacher.config.hidden_size, generator=generator)
    for variant in ("v4", "disca"):
        predictor = build_predictor(teacher, variant, (0, 2))
        v4 = variant == "v4"
        counted = _counted(lambda: predictor(
            chunk["hidden_states"], anchor, chunk["timestep"][None], chunk["action"], chunk["viewmats"], chunk["Ks"],
            text_kv.select((0, 2)), context=context_kv.select((0, 2)) if v4 else None,
            prev_chunk_hidden=anchor if v4 else None))
        expected = predictor_step_flops(shape, predictor.predictor_config(), tokens, text_len, ctx_frames)
        assert counted == pytest.approx(expected, **close), variant
    text_inputs = (torch.randn(1, 10, 32, generator=generator), torch.tensor([[1] * 6 + [0] * 4]),
                   torch.randn(1, 4, 32, generator=generator), torch.tensor([[1, 1, 0, 0]]),
                   torch.randn(1, 3, 16, generator=generator))
    kept = teacher.text_prefill(*text_inputs).num_tokens
    assert _counted(lambda: teacher.text_prefill(*text_inputs)) == text_prefill_flops(shape, 10, 4, 3, kept)
