"""tools/build_demo_world.py: the rebuild's stages follow the shipped Teacher, and a
rebuild can distil reused weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


REPO_ROOT = Path(__file__).resolve().parents[2]


def test_rebuild_stages_follow_the_shipped_teacher():
    """tools/build_demo_world.py: the df_sft model is shipped by default (no distillation stages); --teacher_from kd
    adds the ODE cache and kd, --teacher_from df_sft_continue the second df_sft schedule (from df_sft/model) alone,
    in one round or several (each from the previous round's model; the last ships); explicit --stages are kept as
    given, unknown ones refused."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import build_demo_world

    assert build_demo_world.parse_args(["--out", "x"]).stages == [
        "render", "vae", "encoders", "encode", "df_sft", "ship"]
    assert build_demo_world.parse_args(["--out", "x", "--teacher_from", "kd"]).stages == [
        "render", "vae", "encoders", "encode", "df_sft", "ode_cache", "kd", "ship"]
    continued = build_demo_world.parse_args(["--out", "x", "--teacher_from", "df_sft_continue"])
    assert continued.stages == ["render", "vae", "encoders", "encode", "df_sft", "df_sft_continue", "ship"]
    command = build_demo_world.stage_commands("df_sft_continue", continued, Path("x"))[0]
    assert command[command.index("--teacher") + 1] == str(Path("x") / "df_sft" / "model")
    assert command[command.index("--init_weights") + 1] == "teacher"
    assert command[command.index("--output_dir") + 1] == str(Path("x") / "df_sft_continue")
    assert build_demo_world.stage_commands("ship", continued, Path("x"))[0][-1] == str(
        Path("x") / "df_sft_continue" / "model")
    # Rounds: each trains the previous round's model on, with its own schedule, seed and folder; the last ships.
    rounds = build_demo_world.parse_args(["--out", "x", "--teacher_from", "df_sft_continue",
                                          "--df_sft_continue_steps", "4000,5000", "--df_sft_continue_lr", "5e-4,3e-4",
                                          "--df_sft_continue_sigma_min", "0,0.6"])
    first, second = build_demo_world.stage_commands("df_sft_continue", rounds, Path("x"))
    assert first == command
    assert second[second.index("--teacher") + 1] == str(Path("x") / "df_sft_continue" / "model")
    assert second[second.index("--output_dir") + 1] == str(Path("x") / "df_sft_continue_2")
    assert [second[second.index(flag) + 1] for flag in ("--lr", "--max_steps", "--seed", "--sigma_min")] == [
        "0.0003", "5000", "2", "0.6"]
    assert first[first.index("--sigma_min") + 1] == "0"
    assert build_demo_world.stage_commands("ship", rounds, Path("x"))[0][-1] == str(
        Path("x") / "df_sft_continue_2" / "model")
    one_rate = build_demo_world.parse_args(["--out", "x", "--df_sft_continue_steps", "10,20,30"])
    assert one_rate.df_sft_continue_lr == [5e-4] * 3
    with pytest.raises(SystemExit):
        build_demo_world.parse_args(["--out", "x", "--df_sft_continue_steps", "10,20", "--df_sft_continue_lr", "1,2,3"])
    assert build_demo_world.parse_args(["--out", "x", "--stages", "kd,ship"]).stages == ["kd", "ship"]
    with pytest.raises(SystemExit):
        build_demo_world.parse_args(["--out", "x", "--stages", "render,paint"])


def test_kd_rounds_train_each_round_on_from_the_last_and_ship_the_last(tmp_path):
    """--kd_steps 1500,1500 --kd_lr 3e-4,1e-4 (the shipped distilled Teacher): round 1 distils the --distil_from model
    into kd/, round 2 trains round 1's student on (same cache, its own learning rate) into kd_2/, and the ship stage
    ships kd_2/model; one --kd_lr serves every round, a count that fits neither is refused."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import build_demo_world

    out = tmp_path / "W"
    args = build_demo_world.parse_args(["--out", str(out), "--teacher_from", "kd", "--kd_steps", "1500,700",
                                        "--kd_lr", "3e-4,1e-4"])
    first, second = build_demo_world.stage_commands("kd", args, out)
    flag = lambda command, name: command[command.index(name) + 1]
    assert flag(first, "--teacher") == str(out / "df_sft" / "model")
    assert flag(second, "--teacher") == str(out / "kd" / "model")
    assert [flag(c, "--max_steps") for c in (first, second)] == ["1500", "700"]
    assert [flag(c, "--lr") for c in (first, second)] == ["0.0003", "0.0001"]
    assert [flag(c, "--output_dir") for c in (first, second)] == [str(out / "kd"), str(out / "kd_2")]
    assert flag(first, "--cache_root") == flag(second, "--cache_root") == str(out / "ode_cache")
    assert build_demo_world.shipped_teacher(args, out) == out / "kd_2" / "model"
    one_lr = build_demo_world.parse_args(["--out", "x", "--teacher_from", "kd", "--kd_steps", "5,6", "--kd_lr", "2e-4"])
    assert one_lr.kd_lr == [2e-4, 2e-4]
    assert len(build_demo_world.stage_commands("kd", build_demo_world.parse_args(
        ["--out", "x", "--teacher_from", "kd"]), Path("x"))) == 1
    with pytest.raises(SystemExit):
        build_demo_world.parse_args(["--out", "x", "--kd_steps", "5,6,7", "--kd_lr", "1e-4,2e-4"])


def test_the_shipped_report_of_a_distillation_keeps_the_reused_weights_build(tmp_path):
    """With --reuse_weights the shipped build_report.json is the reused weights' report (the build that trained the
    distilled Teacher) plus this build's ode_cache and kd entries, and its setup stages' wall time apart; without,
    this build's report as it is."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import build_demo_world

    weights = tmp_path / "weights"
    for name in build_demo_world.REUSED_FILES:
        (weights / name).parent.mkdir(parents=True, exist_ok=True)
        (weights / name).write_text("{}")
    (weights / "build_report.json").write_text(json.dumps({"df_sft": {"seconds": 9.0}, "vae": {"seconds": 5.0}}))
    report = {"render": {"seconds": 1.0}, "vae": {"seconds": 0.5}, "ode_cache": {"seconds": 2.0},
              "kd": {"seconds": 3.0, "kd": {"last_loss_mean": 0.1}}}
    args = build_demo_world.parse_args(["--out", "x", "--reuse_weights", str(weights), "--teacher_from", "kd"])
    assert build_demo_world.shipped_report(args, report) == {
        "df_sft": {"seconds": 9.0}, "vae": {"seconds": 5.0}, "ode_cache": {"seconds": 2.0},
        "kd": {"seconds": 3.0, "kd": {"last_loss_mean": 0.1}},
        "distillation_build": {"seconds": {"render": 1.0, "vae": 0.5}}}
    assert build_demo_world.shipped_report(build_demo_world.parse_args(["--out", "x"]), report) == report


def test_rebuild_can_distil_reused_weights(tmp_path):
    """--reuse_weights DIR: the vae stage copies DIR's VAE (after checking the rendered world is DIR's), the df_sft
    stages are left out, the ode_cache and kd stages distil DIR/teacher (--distil_from), --distil_clips reaches the
    cache as --max_clips; --distil_from df_sft_continue names the last round's model; a world other than the weights'
    is refused, and a second run of the copy keeps the VAE."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import build_demo_world

    weights = tmp_path / "weights"
    (weights / "vae").mkdir(parents=True)
    (weights / "teacher").mkdir()
    (weights / "vae" / "config.json").write_text('{"latent_channels": 16}')
    (weights / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"vae weights")
    (weights / "teacher" / "config.json").write_text("{}")
    (weights / "vae_eval.json").write_text('{"held_out_scenes_psnr_mean": 25.0}')
    world = {"settings": {"num_scenes": 3}, "clips": [{"clip_id": "s000_p00"}]}
    (weights / "world_config.json").write_text(json.dumps(world))
    out = tmp_path / "W"
    args = build_demo_world.parse_args(["--out", str(out), "--reuse_weights", str(weights), "--teacher_from", "kd",
                                        "--distil_clips", "40,4"])
    assert args.stages == ["render", "vae", "encoders", "encode", "ode_cache", "kd", "ship"]
    assert args.distil_from == "weights"
    ode_cache = build_demo_world.stage_commands("ode_cache", args, out)[0]
    kd = build_demo_world.stage_commands("kd", args, out)[0]
    for command in (ode_cache, kd):
        assert command[command.index("--teacher") + 1] == str(weights.resolve() / "teacher")
    assert ode_cache[ode_cache.index("--max_clips") + 1] == "40,4"
    assert "--max_clips" not in build_demo_world.stage_commands(
        "ode_cache", build_demo_world.parse_args(["--out", "x", "--teacher_from", "kd"]), Path("x"))[0]
    continued = build_demo_world.parse_args(["--out", "x", "--teacher_from", "kd", "--distil_from", "df_sft_continue",
                                             "--df_sft_continue_steps", "10,20"])
    command = build_demo_world.stage_commands("kd", continued, Path("x"))[0]
    assert command[command.index("--teacher") + 1] == str(Path("x") / "df_sft_continue_2" / "model")
    for bad in (["--distil_from", "weights"], ["--reuse_weights", str(weights)],
                ["--reuse_weights", str(tmp_path / "nowhere"), "--teacher_from", "kd"]):
        with pytest.raises(SystemExit):
            build_demo_world.parse_args(["--out", "x", *bad])

    # With --reuse_weights the encode stage encodes only the distilled clips (the same evenly spaced subset).
    subset, encode = build_demo_world.stage_commands("encode", args, out)
    assert encode[encode.index("--clips") + 1] == f"{out / 'distil_clips' / 'train.jsonl'},{out / 'distil_clips' / 'holdout.jsonl'}"
    render = out / "render"
    render.mkdir(parents=True)
    for name, count in (("train", 100), ("holdout", 10)):
        (render / f"{name}.jsonl").write_text("".join(json.dumps(
            {"clip_id": f"{name}{index}", "video": f"frames/{name}{index}", "pose": f"poses/{name}{index}.json",
             "caption": "c"}) + "\n" for index in range(count)))
    subprocess.run(subset, check=True, capture_output=True, cwd=REPO_ROOT)
    rows = {name: [json.loads(line) for line in (out / "distil_clips" / f"{name}.jsonl").read_text().splitlines()]
            for name in ("train", "holdout")}
    assert [row["clip_id"] for row in rows["train"]] == [f"train{index * 100 // 40}" for index in range(40)]
    assert [row["clip_id"] for row in rows["holdout"]] == [f"holdout{index * 10 // 4}" for index in range(4)]
    assert (out / "distil_clips" / rows["train"][1]["video"]).resolve() == (render / "frames" / "train2").resolve()
    assert len(build_demo_world.stage_commands("encode", build_demo_world.parse_args(
        ["--out", str(out), "--reuse_weights", str(weights), "--teacher_from", "kd"]), out)) == 1
    assert len(build_demo_world.stage_commands("encode", build_demo_world.parse_args(
        ["--out", "x", "--teacher_from", "kd", "--distil_clips", "4"]), Path("x"))) == 1  # df_sft needs every clip
    with pytest.raises(SystemExit):
        build_demo_world.parse_args(["--out", "x", "--distil_clips", "4,x"])

    # The copy, run as the stage runs it.
    (out / "render" / "world_config.json").write_text(json.dumps({**world, "clips": []}))
    vae_stage = build_demo_world.stage_commands("vae", args, out)[0]
    refused = subprocess.run(vae_stage, capture_output=True, text=True, cwd=REPO_ROOT)
    assert refused.returncode != 0 and "is not the world of" in refused.stderr
    (out / "render" / "world_config.json").write_text(json.dumps({**world, "counts": {"train": 1}}))
    for _ in range(2):
        subprocess.run(vae_stage, check=True, capture_output=True, cwd=REPO_ROOT)
        assert (out / "vae_run" / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() == b"vae weights"
        assert json.loads((out / "vae_run" / "vae_eval.json").read_text()) == {"held_out_scenes_psnr_mean": 25.0}
    (out / "vae_run" / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"other weights")
    refused = subprocess.run(vae_stage, capture_output=True, text=True, cwd=REPO_ROOT)
    assert refused.returncode != 0 and "differs from" in refused.stderr


def test_dmd_stage_distils_a_student_against_the_many_step_model_and_ships_its_ema(tmp_path):
    """--teacher_from dmd: after the kd stages, distribution matching starts from kd's last round (or --dmd_from,
    which leaves the kd stages out), the real score is the many-step model kd distilled (--distil_from), the fake
    score a full copy of it, the student rolls out on its own history; the generator's EMA ships; a --dmd_from that
    is no model folder is refused."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import build_demo_world

    flag = lambda command, name: command[command.index(name) + 1]
    out = tmp_path / "W"
    chained = build_demo_world.parse_args(["--out", str(out), "--teacher_from", "dmd", "--kd_steps", "5,6",
                                           "--dmd_steps", "300", "--dmd_lr", "3e-5"])
    assert chained.stages == ["render", "vae", "encoders", "encode", "df_sft", "ode_cache", "kd", "dmd", "ship"]
    command = build_demo_world.stage_commands("dmd", chained, out)[0]
    assert command[1] == "fvtools/train_dmd2.py"
    assert flag(command, "--teacher") == str(out / "kd_2" / "model")
    assert flag(command, "--real_score") == str(out / "df_sft" / "model")
    assert [flag(command, name) for name in ("--generator", "--train", "--fake_score_train", "--rollout")] == [
        "student", "full", "full", "self"]
    assert [flag(command, name) for name in ("--max_steps", "--lr", "--output_dir", "--student_sampler")] == [
        "300", "3e-05", str(out / "dmd"), "renoise"]
    assert build_demo_world.shipped_teacher(chained, out) == out / "dmd" / "ema" / "model"
    floor = build_demo_world.parse_args(["--out", str(out), "--teacher_from", "dmd", "--dmd_score_sigma_min", "0.6"])
    assert flag(build_demo_world.stage_commands("dmd", floor, out)[0], "--score_sigma_min") == "0.6"

    student = tmp_path / "kd_teacher"
    student.mkdir()
    (student / "config.json").write_text("{}")
    weights = tmp_path / "weights"
    for name in build_demo_world.REUSED_FILES:
        (weights / name).parent.mkdir(parents=True, exist_ok=True)
        (weights / name).write_text("{}")
    given = build_demo_world.parse_args(["--out", str(out), "--reuse_weights", str(weights), "--teacher_from", "dmd",
                                         "--dmd_from", str(student)])
    assert given.stages == ["render", "vae", "encoders", "encode", "dmd", "ship"]
    command = build_demo_world.stage_commands("dmd", given, out)[0]
    assert flag(command, "--teacher") == str(student.resolve())
    assert flag(command, "--real_score") == str(weights.resolve() / "teacher")
    assert flag(command, "--truth_weight") == "0"
    weighted = build_demo_world.parse_args(["--out", str(out), "--reuse_weights", str(weights), "--teacher_from",
                                            "dmd", "--dmd_from", str(student), "--dmd_truth_weight", "0.25"])
    assert flag(build_demo_world.stage_commands("dmd", weighted, out)[0], "--truth_weight") == "0.25"
    for bad in (["--dmd_from", str(tmp_path)], ["--dmd_steps", "0"], ["--dmd_warmup_steps", "2000"],
                ["--dmd_score_sigma_min", "0.99"]):
        with pytest.raises(SystemExit):
            build_demo_world.parse_args(["--out", str(out), "--teacher_from", "dmd", *bad])
