"""tools/eval_predictor.py and the package predictor_training/eval/ + flops.py on a tiny Teacher, a tiny random VAE
and an untrained Predictor (which is exactly hidden reuse): equal rollouts, reference reproduction, resume, outputs,
FLOPs. The command line runs as a subprocess, as a user runs it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from predictor_training.camera import pose_string_to_json
from predictor_training.checkpoint import save_inference_weights
from predictor_training.distributed import init_distributed
from predictor_training.eval import (
    REFERENCE,
    REUSE_HIDDEN,
    REUSE_VELOCITY,
    EvalRuntime,
    EvalSettings,
    HiddenReuse,
    PredictorMethod,
    ReferenceMethod,
    Schedule,
    Stopwatch,
    TimedRollout,
    VaeDecoder,
    VelocityReuse,
    default_run_name,
    label_checkpoints,
    load_predictor,
    parse_replace_steps,
    read_predictor_checkpoint,
    resolve_dtype,
    resolve_teacher,
    rollout_config_for,
    run_evaluation,
)
from predictor_training.flops import (
    TeacherShape,
    context_prefill_flops,
    predictor_step_flops,
    teacher_chunk_step_flops,
    text_prefill_flops,
)
from predictor_training.predictor import build_predictor
from predictor_training.teacher import TextKV, WorldPlayTransformer, randomize_zero_initialised_
from predictor_training.teacher.source import TeacherSource, load_teacher, teacher_config_sha256
from predictor_training.data.trajectory_dataset import TrajectoryTableDataset

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOL = REPO_ROOT / "tools" / "eval_predictor.py"
CLI_LATENTS = 8  # holdout25: 2 chunks per video (chunk 0 F-F-F-F, chunk 1 scheduled), decoded by the CLI runs
LONG_LATENTS = 12  # holdout50: 3 chunks, so chunk 2 gets the previous-chunk hidden the Predictor itself made
HEIGHT, WIDTH = 2, 3
RUN_DIR_NAME = "v4tiny_flr1e-4_blr1e-5_schedsteps20_swarmup2_bwarmup2"
STEP = 5
SOURCE_BLOCKS = (0, 1)


# ---------------------------------------------------------------------------------------------------------------
# A tiny world on disk: Teacher, VAE, encoder outputs, sample table, an untrained v4 checkpoint
# ---------------------------------------------------------------------------------------------------------------
def _write_world(root: Path) -> dict:
    torch.manual_seed(0)
    teacher = WorldPlayTransformer.from_preset("demo", mm_double_blocks_depth=2)
    randomize_zero_initialised_(teacher, torch.Generator().manual_seed(1))
    teacher.save_pretrained(str(root / "teacher"))

    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(2)
    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                      spatial_compression_ratio=16, temporal_compression_ratio=4)
    vae.save_pretrained(str(root / "vae"))

    generator = torch.Generator().manual_seed(3)
    config = teacher.config
    (root / "encoded").mkdir()
    torch.save({
        "prompt_embeds": torch.randn(1, 8, config.text_states_dim, generator=generator),
        "prompt_mask": torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]),
        "byt5_text_states": torch.randn(1, 4, config.byt5_states_dim, generator=generator),
        "byt5_text_mask": torch.tensor([[1, 1, 0, 0]]),
        "vision_states": torch.randn(1, 3, config.vision_states_dim, generator=generator),
        "image_cond": torch.randn(1, config.in_channels, 1, HEIGHT, WIDTH, generator=generator),
    }, root / "encoded" / "c000.pt")

    from PIL import Image

    from predictor_training.data.sample_table import SampleRow, write_sample_table

    samples = root / "samples"
    (samples / "poses").mkdir(parents=True)
    Image.new("RGB", (6, 4), (10, 20, 30)).save(samples / "c000.png")
    for split, num_latents, actions in (("holdout25", CLI_LATENTS, (0, 2)), ("holdout50", LONG_LATENTS, (2,))):
        rows = []
        for action_id in actions:
            motion = "w" if action_id == 0 else "w+left"
            pose = f"poses/a{action_id}_{num_latents}.json"
            (samples / pose).write_text(json.dumps(pose_string_to_json(f"{motion}-{num_latents - 1}")))
            rows.append(SampleRow("c000", "c000.png", "a tiny test case", action_id, pose, 1000 + action_id))
        write_sample_table(samples / f"{split}.jsonl", rows)

    torch.manual_seed(4)
    predictor = build_predictor(teacher, "v4", SOURCE_BLOCKS)
    meta = {"variant": "v4", "source_blocks": list(SOURCE_BLOCKS), "precision": "fp32"}
    ckpt = root / "runs" / RUN_DIR_NAME / f"predictor_step_{STEP:05d}.safetensors"
    ckpt.parent.mkdir(parents=True)
    save_inference_weights(ckpt, predictor, metadata={**meta, "step": STEP},
                           config={"flags": {"teacher": str(root / "teacher")},
                                   "derived": {"predictor": predictor.predictor_config()}})
    return {"root": root, "ckpt": ckpt}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    return _write_world(tmp_path_factory.mktemp("eval_world"))


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
    # the first line says which dtype --dtype auto chose and why
    first = fppp_run["printed"].splitlines()[0]
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
    # same directory, other numbers-changing settings: refused (a run error: message, exit 1), nothing overwritten
    refused = _cli(world, fppp_run["out"], "--replace_steps", "1,2", "--run_name", fppp_run["run_dir"].name)
    last = refused.stderr.splitlines()[-1]
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert last.startswith("eval_predictor: error: ") and "other settings" in last
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


# ---------------------------------------------------------------------------------------------------------------
# 3. Schedules, names, argument checks
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
    labelled = label_checkpoints([ckpt, foreign])
    assert [item.label for item in labelled] == [f"{RUN_DIR_NAME}_ckptstep{STEP}", "disca_run_ckptstep300"]
    assert [item.panel for item in labelled] == [f"#1 ckptstep{STEP}", "#2 ckptstep300"]
    assert label_checkpoints([ckpt])[0].panel == f"ckptstep{STEP}"
    with pytest.raises(ValueError, match="twice"):
        label_checkpoints([ckpt, ckpt])


def test_bad_flags_are_usage_errors(world, tmp_path):
    """Flag problems end like argparse's own: usage line, 'error:' message, exit code 2, no traceback, no output."""
    for extra, message in ((("--chunk0", "schedule"), "are v4 Predictors"),  # found in the checkpoint's metadata
                           (("--replace_steps", "0,1"), "outside 1..3"),
                           (("--ckpt", str(tmp_path / "missing.safetensors")), "missing.safetensors")):
        result = _cli(world, tmp_path, *extra)
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and "Traceback" not in result.stderr, (extra, result.stderr)
        assert any(line.startswith("usage: eval_predictor.py") for line in lines), (extra, result.stderr)
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
# 4. FLOP counts against torch's own counter (matmuls + attention)
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
