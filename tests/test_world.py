"""The demo world (predictor_training.world, tools/render_world.py): scenes, renders, camera paths, clip tables.

Small renders only (16 x 24 to 32 x 48, a few frames), so the module runs in seconds.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from predictor_training.rollout.camera import POSE_STRING_K, parse_pose_string, pose_string_to_json, pose_to_input
from predictor_training.data.video_latent_build import read_clip_plan
from predictor_training.video.io import read_video
from predictor_training.world import (
    Box,
    WorldConfigError,
    WorldScene,
    WorldSettings,
    make_pose_string,
    make_scene,
    make_world,
    object_ids,
    render_frames,
    video_frame_cameras,
)
from predictor_training.world.clips import render_clip
from predictor_training.world.paths import VOCABULARY, pose_string_words
from predictor_training.world.scene import BOX_PALETTE, GROUND_Y, MIN_ORIGIN_CLEARANCE, footprint_distance

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOL = REPO_ROOT / "tools" / "render_world.py"
H, W = 32, 48
SMALL = dict(num_scenes=3, paths_per_scene=2, holdout_scenes=1, holdout_paths=1, height=16, width=24, num_frames=9)


def _yaw(degrees: float) -> np.ndarray:
    angle = math.radians(degrees)
    camera = np.eye(4)
    camera[:3, :3] = [[math.cos(angle), 0, math.sin(angle)], [0, 1, 0], [-math.sin(angle), 0, math.cos(angle)]]
    return camera


def _box(colour: str, x: float, z: float, side: float, height: float | None = None, kind: str = "cube") -> Box:
    height = side if height is None else height
    return Box(kind, colour, BOX_PALETTE[colour], (x - side / 2, GROUND_Y - height, z - side / 2),
               (x + side / 2, GROUND_Y, z + side / 2))


def _hand_scene(*boxes: Box) -> WorldScene:
    return WorldScene(seed=-1, boxes=boxes, ground_names=("grey", "white"),
                      ground_colours=((0.5, 0.5, 0.52), (0.85, 0.85, 0.86)), cell_size=0.7,
                      sky_name="a pale blue sky", horizon=(0.8, 0.87, 0.95), zenith=(0.4, 0.62, 0.9))


# =============================================================================================================
# scenes
# =============================================================================================================
def test_scenes_are_deterministic_and_put_boxes_all_around_the_start_point():
    assert make_scene(5) == make_scene(5) and make_scene(5).caption() == make_scene(5).caption()
    assert make_scene(5) != make_scene(6)
    for seed in range(30):
        scene = make_scene(seed)
        assert 5 <= len(scene.boxes) <= 9
        angles = []
        for index, box in enumerate(scene.boxes):
            assert box.hi[1] == GROUND_Y and box.lo[1] < GROUND_Y  # standing on the ground
            assert footprint_distance(box, 0.0, 0.0) >= MIN_ORIGIN_CLEARANCE
            centre_x, _, centre_z = box.centre
            assert 2.0 - 1e-6 <= math.hypot(centre_x, centre_z) <= 6.0 + 1e-6
            angles.append(math.degrees(math.atan2(centre_x, centre_z)) % 360)
            for other in scene.boxes[index + 1:]:  # footprints do not overlap
                assert (box.hi[0] <= other.lo[0] or other.hi[0] <= box.lo[0]
                        or box.hi[2] <= other.lo[2] or other.hi[2] <= box.lo[2])
        angles.sort()
        gaps = np.diff(angles + [angles[0] + 360])
        assert gaps.max() < 90, (seed, angles)
        caption = scene.caption()
        assert f"on a {scene.ground_names[0]} and {scene.ground_names[1]} checkered ground under {scene.sky_name}" \
            in caption
        assert all(box.colour_name in caption for box in scene.boxes)


def test_caption_groups_and_counts_boxes():
    scene = _hand_scene(_box("red", 0, 3, 0.5, 2.5, "pillar"), _box("blue", 2, 3, 0.8), _box("yellow", -2, 3, 0.8),
                        _box("blue", 3, -1, 0.8))
    assert scene.caption() == ("two blue cubes, a red pillar and a yellow cube on a grey and white checkered ground "
                               "under a pale blue sky")


# =============================================================================================================
# renders
# =============================================================================================================
def test_render_is_deterministic_and_the_camera_motion_changes_the_frames():
    scene, pose_string = make_scene(3), make_pose_string(3, 8)
    cameras = video_frame_cameras(pose_string, 29)
    first = render_frames(scene, cameras, POSE_STRING_K, H, W)
    again = render_frames(make_scene(3), video_frame_cameras(pose_string, 29), POSE_STRING_K, H, W)
    assert first.dtype == np.uint8 and first.shape == (29, H, W, 3)
    np.testing.assert_array_equal(first, again)
    # chunking (max_rays) does not change the pixels
    np.testing.assert_array_equal(first, render_frames(scene, cameras, POSE_STRING_K, H, W, max_rays=1 << 22))
    difference = np.abs(first[1:].astype(int) - first[0].astype(int)).mean(axis=(1, 2, 3))
    assert (difference > 0).all() and difference[-1] > 5
    # y is down: the top row is sky (between the horizon and zenith colours), the bottom row is ground
    sky_lo = np.minimum(scene.horizon, scene.zenith) * 255 - 1
    sky_hi = np.maximum(scene.horizon, scene.zenith) * 255 + 1
    assert ((first[0, 0] >= sky_lo) & (first[0, 0] <= sky_hi)).all()
    assert not ((first[0, -1] >= sky_lo) & (first[0, -1] <= sky_hi)).all(axis=-1).any()


def test_forward_path_makes_the_object_in_front_grow():
    scene = _hand_scene(_box("red", 0.0, 4.5, 1.0), _box("blue", -3.0, 1.0, 0.8), _box("yellow", 3.0, -2.0, 0.8))
    cameras = video_frame_cameras("w-31", 125)[[0, 40, 80, 124]]
    frames = render_frames(scene, cameras, POSE_STRING_K, H, W).astype(int)
    red = ((frames[..., 0] > 120) & (frames[..., 1] < 90) & (frames[..., 2] < 90)).sum(axis=(1, 2))
    assert (np.diff(red) > 0).all() and red[-1] > 4 * red[0] > 0, red
    ids = (object_ids(scene, cameras, POSE_STRING_K, H, W) == 0).sum(axis=(1, 2))
    assert (np.diff(ids) > 0).all(), ids


def _horizontal_shift(before: np.ndarray, after: np.ndarray, max_shift: int = 10) -> int:
    """s minimising |after[:, x] - before[:, x + s]| (grey levels): content moving left gives s > 0."""
    grey_before, grey_after = before.astype(float).mean(-1), after.astype(float).mean(-1)
    width = before.shape[1]
    errors = {}
    for shift in range(-max_shift, max_shift + 1):
        lo, hi = max(0, -shift), min(width, width - shift)
        errors[shift] = np.abs(grey_after[:, lo:hi] - grey_before[:, lo + shift:hi + shift]).mean()
    return min(errors, key=errors.get)


@pytest.mark.parametrize("word,sign", [("right", 1), ("left", -1)])
def test_pure_yaw_shifts_the_image_content_horizontally(word, sign):
    scene = make_scene(11)
    cameras = video_frame_cameras(f"{word}-31", 125)[[0, 8]]  # 2 latents = 6 degrees, ~3 px at 48 px for 89 deg
    before, after = render_frames(scene, cameras, POSE_STRING_K, H, W)
    shift = _horizontal_shift(before, after)
    assert sign * shift >= 2, shift  # turning right moves the world left in the image


def test_a_box_is_visible_in_every_heading_from_the_start_point():
    headings = np.stack([_yaw(45 * k) for k in range(8)])
    for seed in range(20):
        ids = object_ids(make_scene(seed), headings, POSE_STRING_K, H, W)
        visible = (ids >= 0).sum(axis=(1, 2))
        assert (visible > 0).all(), (seed, visible)


# =============================================================================================================
# camera paths
# =============================================================================================================
def test_pose_strings_have_the_asked_steps_and_only_vocabulary_words():
    for num_latents in (2, 8, 32):
        for seed in range(100):
            pose_string = make_pose_string(seed, num_latents)
            assert pose_string == make_pose_string(seed, num_latents)
            assert len(parse_pose_string(pose_string)) == num_latents - 1
            assert set(pose_string_words(pose_string)) <= set(VOCABULARY)
            assert all(int(command.split("-")[1]) > 0 for command in pose_string.split(", "))
    assert len({make_pose_string(seed) for seed in range(50)}) == 50


def test_video_frame_cameras_hit_the_latent_poses_exactly_and_interpolate_between():
    pose_string = make_pose_string(7)
    cameras = video_frame_cameras(pose_string, 125)
    pose = json.loads(json.dumps(pose_string_to_json(pose_string)))  # as written to and read from a file
    assert cameras.shape == (125, 4, 4) and len(pose) == 32
    for latent in range(32):
        np.testing.assert_array_equal(cameras[4 * latent], np.array(pose[str(latent)]["extrinsic"]))
    viewmats, ks, _ = pose_to_input(pose, 32)
    np.testing.assert_allclose(viewmats.numpy(), np.linalg.inv(cameras[::4]), rtol=0, atol=1e-12)
    # the Teacher's normalised K is what the renderer uses: fx / (2 cx) of the pose K
    assert float(ks[0, 0, 0]) == pytest.approx(POSE_STRING_K[0][0] / (2 * POSE_STRING_K[0][2]))
    # a quarter step per video frame: position along w, angle along right
    forward = video_frame_cameras("w-2", 9)
    np.testing.assert_allclose(forward[:, 2, 3], 0.02 * np.arange(9), atol=1e-12)
    turn = video_frame_cameras("w+right-1", 5)
    yaw = np.degrees(np.arctan2(turn[:, 0, 2], turn[:, 2, 2]))
    np.testing.assert_allclose(yaw, [0, 0.75, 1.5, 2.25, 3.0], atol=1e-9)
    for k in range(5):  # the move follows the partially rotated forward axis
        np.testing.assert_allclose(turn[k, :3, 3], 0.02 * k * turn[k, :3, 2], atol=1e-12)
    with pytest.raises(ValueError, match="make 9 video frames"):
        video_frame_cameras("w-2", 125)


# =============================================================================================================
# clip tables
# =============================================================================================================
def _files(root: Path) -> dict[str, bytes]:
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_world_tables_are_accepted_by_the_video_latent_builder_and_hold_the_promised_splits(tmp_path):
    settings = WorldSettings(**SMALL)
    out = make_world(tmp_path / "W", settings, progress=False)
    assert not out.reused and not (tmp_path / ".W.building").exists()
    plan = read_clip_plan(out.tables, settings.num_frames)
    assert plan.splits() == {"holdout": 4, "train": 4}
    by_split = {split: {job.clip_id for job in plan.clips if job.split == split} for split in ("train", "holdout")}
    assert by_split["train"] == {"s000_p00", "s000_p01", "s001_p00", "s001_p01"}
    # held-out scene 2 (all its paths) + a new path of each train scene
    assert by_split["holdout"] == {"s002_p00", "s002_p01", "s000_p02", "s001_p02"}
    config = json.loads((tmp_path / "W" / "world_config.json").read_text())
    assert config["splits"]["holdout"] == {"held_out_scenes": [2], "held_out_scene_paths": [0, 1],
                                           "new_paths_of_train_scenes": [2]}
    clips = {clip["clip_id"]: clip for clip in config["clips"]}
    train_scene_seeds = {clips[clip_id]["scene_seed"] for clip_id in by_split["train"]}
    assert clips["s002_p00"]["scene_seed"] not in train_scene_seeds
    for scene_index in (0, 1):  # the held-out path of a train scene is a new path of that scene
        new = clips[f"s{scene_index:03d}_p02"]
        for path_index in (0, 1):
            old = clips[f"s{scene_index:03d}_p{path_index:02d}"]
            assert new["path_seed"] != old["path_seed"] and new["pose_string"] != old["pose_string"]
    # every clip: the pose file is the pose string's pose JSON, the frames are the render of the recorded clip
    for job in plan.clips[:2] + plan.clips[-1:]:
        clip = clips[job.clip_id]
        assert json.loads(job.pose.read_text()) == json.loads(json.dumps(pose_string_to_json(clip["pose_string"])))
        assert job.caption == make_scene(clip["scene_seed"]).caption()
        np.testing.assert_array_equal(read_video(job.video), render_clip(out.clips[job.index], settings))
    # same settings: reused, nothing rewritten; other settings: refused with the fields named
    before = {path: path.stat().st_mtime_ns for path in (tmp_path / "W").rglob("*")}
    assert make_world(tmp_path / "W", settings, progress=False).reused
    assert before == {path: path.stat().st_mtime_ns for path in (tmp_path / "W").rglob("*")}
    with pytest.raises(WorldConfigError, match=r"height: 16 there, 32 asked; seed: 0 there, 1 asked"):
        make_world(tmp_path / "W", WorldSettings(**{**SMALL, "height": 32, "seed": 1}), progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(WorldConfigError, match="has no world_config.json"):
        make_world(tmp_path / "other", settings, progress=False)

    # the command line, in another process, writes byte-identical files
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [f"--{name}={value}" for name, value in SMALL.items()]
    result = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "W2"), *args], capture_output=True,
                            text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert _files(tmp_path / "W") == _files(tmp_path / "W2")
    result = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path / "W2"), *args, "--width", "32"],
                            capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 2 and "width: 24 there, 32 asked" in result.stderr


def test_mp4_worlds_are_lossless(tmp_path):
    settings = WorldSettings(**{**SMALL, "num_scenes": 2, "paths_per_scene": 1, "holdout_paths": 0,
                                "video_format": "mp4"})
    out = make_world(tmp_path / "W", settings, progress=False)
    plan = read_clip_plan(out.tables, settings.num_frames)
    assert [job.video.name for job in plan.clips] == ["s000_p00.mp4", "s001_p00.mp4"]
    np.testing.assert_array_equal(read_video(plan.clips[0].video), render_clip(out.clips[0], settings))


def test_bad_settings_are_refused(tmp_path):
    for bad, message in [({"num_frames": 10}, "4k\\+1"), ({"holdout_scenes": 3}, "holdout_scenes"),
                         ({"holdout_scenes": 0, "holdout_paths": 0}, "holdout would be empty"),
                         ({"video_format": "gif"}, "video_format")]:
        with pytest.raises(WorldConfigError, match=message):
            make_world(tmp_path / "W", WorldSettings(**{**SMALL, **bad}), progress=False)
    assert not (tmp_path / "W").exists()


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
