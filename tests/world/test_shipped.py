"""The shipped demo world (predictor_training/world/weights): it loads, its demo assets fit together, the final split
is new scenes made by the held-out rule and never enters a dataset, and the world Teacher's rollout of a final scene,
decoded by the world VAE, resembles the scene's ground-truth render."""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from diffusers import AutoencoderKLHunyuanVideo15

from predictor_training.data.sample_table import read_sample_table
from predictor_training.rollout.camera import pose_string_to_json
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.video.io import read_video
from predictor_training.world.assets import WORLD_TEACHER_DEPTH, WORLD_WEIGHTS
from predictor_training.world.clips import derive_seed, path_is_clear, path_kind
from predictor_training.world.paths import REVISIT_KINDS, video_frame_cameras
from predictor_training.world.revisits import revisits
from predictor_training.world.scene import make_scene
from predictor_training.world.shipped import demo_split_clips, final_clips, load_shipped_world, scene_case_id


REPO_ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(REPO_ROOT / "tools"))

import build_predictor_dataset  # noqa: E402
import eval_predictor  # noqa: E402
import make_demo_assets  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_shipped_weights_load_and_match_the_world():
    world = load_shipped_world()
    teacher_config = WorldPlayTransformer.load_config(str(world.teacher))
    vae_config = AutoencoderKLHunyuanVideo15.load_config(str(world.vae))
    assert teacher_config["mm_double_blocks_depth"] == WORLD_TEACHER_DEPTH
    assert teacher_config["in_channels"] == vae_config["latent_channels"] == teacher_config["out_channels"]
    assert vae_config["temporal_compression_ratio"] == 4
    assert (world.settings.num_frames - 1) // 4 + 1 == world.settings.num_latents == 32
    size = sum(path.stat().st_size for path in WORLD_WEIGHTS.rglob("*") if path.is_file())
    assert size <= 30_000_000, f"shipped weights are {size / 1e6:.1f} MB (budget 30 MB)"


def test_demo_splits_are_disjoint_scenes():
    world = load_shipped_world()
    splits = demo_split_clips(world, num_train=3, num_holdout25=2, num_holdout50=2)
    scenes = {name: {scene_case_id(clip) for clip in clips} for name, clips in splits.items()}
    assert [len(scenes[name]) for name in ("train", "holdout25", "holdout50")] == [3, 2, 2]
    assert not (scenes["train"] & scenes["holdout25"] or scenes["train"] & scenes["holdout50"]
                or scenes["holdout25"] & scenes["holdout50"])
    assert all(clip.split == "train" for clip in splits["train"])
    assert all(clip.split == "holdout" for name in ("holdout25", "holdout50") for clip in splits[name])
    assert len(splits["train"]) == 3 * world.settings.paths_per_scene
    assert len(splits["holdout50"]) == 2 * world.settings.holdout_paths
    with pytest.raises(ValueError, match="--num_holdout25 must be in"):
        demo_split_clips(world, num_train=3, num_holdout25=999, num_holdout50=1)


def test_final_split_is_new_scenes_made_by_the_held_out_rule():
    """final: scenes not in the world (no scene seed, no pose string shared with its clips), seeded by their own
    labels, with the held-out scenes' path kinds (revisit paths last, every kind), clear paths and true revisits;
    the same on every call, and a longer split starts with the shorter one."""
    world = load_shipped_world()
    settings = world.settings
    clips = final_clips(world, 4)
    assert [clip.clip_id for clip in clips] == [f"f{i:03d}_p{p:02d}" for i in range(4)
                                                for p in range(settings.paths_per_scene)]
    assert {scene_case_id(clip) for clip in clips} == {"f000", "f001", "f002", "f003"}
    assert {clip.split for clip in clips} == {"final"}
    assert not {clip.scene_seed for clip in clips} & {clip.scene_seed for clip in world.clips}
    assert not {clip.pose_string for clip in clips} & {clip.pose_string for clip in world.clips}
    assert len({clip.pose_string for clip in clips}) == len(clips)
    assert not {scene_case_id(clip) for clip in clips} & {scene_case_id(clip) for clip in world.clips}
    for clip in clips:
        assert clip.scene_seed == derive_seed(settings.seed, "final_scene", clip.scene_index)
        scene = make_scene(clip.scene_seed)
        assert clip.caption == scene.caption()
        assert path_is_clear(scene, video_frame_cameras(clip.pose_string, settings.num_frames))
        assert clip.path_kind == path_kind(settings, clip.scene_index, clip.path_index)
        revisit = clip.path_index >= settings.paths_per_scene - settings.revisit_paths
        assert (clip.path_kind != "generator") == revisit
        if revisit:
            assert revisits(pose_string_to_json(clip.pose_string)), clip  # the camera comes back
    # the kinds follow holdout25's pattern: its scenes' kinds, slot by slot
    holdout25 = demo_split_clips(world, num_train=1, num_holdout25=4, num_holdout50=1)["holdout25"]
    assert [clip.path_kind for clip in clips] == [clip.path_kind for clip in holdout25]
    assert {clip.path_kind for clip in clips} == {"generator", *REVISIT_KINDS}
    assert final_clips(world, 4) == clips and final_clips(world, 2) == clips[:2 * settings.paths_per_scene]
    assert final_clips(world, 0) == []
    with pytest.raises(ValueError, match="--num_final must be >= 0"):
        final_clips(world, -1)
    # a caption word the world's captions never use (its tokenizer would not know it) is refused
    without_three = dataclasses.replace(world, clips=[clip for clip in world.clips if "three" not in clip.caption])
    assert "three" in clips[0].caption
    with pytest.raises(ValueError, match=r"final scene f000's caption .* uses \['three'\].*--num_final <= 0"):
        final_clips(without_three, 1)


@pytest.fixture(scope="module")
def world_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("world_demo") / "D"
    make_demo_assets.main(["--out", str(root), "--num_train", "1", "--num_holdout25", "1", "--num_holdout50", "1",
                           "--num_final", "1"])
    return root


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def test_world_demo_assets_take_another_teacher_and_the_final_split_changes_no_other_file(world_demo, tmp_path,
                                                                                           capsys):
    """make_demo_assets --teacher DIR: the same world (scenes, tables, encoders) with DIR's Teacher copied in, recorded
    in demo_config.json as teacher_source; without the flag the weights' own Teacher and no such field. The second
    build also has --num_final 0: every file is then byte for byte the first build's, less the final split's own files
    and entries (cases.jsonl is the first build's without its last, final, line)."""
    teacher = tmp_path / "student"
    shutil.copytree(WORLD_WEIGHTS / "teacher", teacher)
    (teacher / "meta.json").write_text('{"role": "student"}')  # any file of the folder comes along
    root = tmp_path / "D"
    make_demo_assets.main(["--out", str(root), "--num_train", "1", "--num_holdout25", "1", "--num_holdout50", "1",
                           "--teacher", str(teacher), "--num_final", "0"])
    assert (root / "teacher" / "meta.json").read_text() == '{"role": "student"}'
    config = json.loads((root / "demo_config.json").read_text())
    assert config.pop("teacher_source") == str(teacher.resolve())
    with_final = json.loads((world_demo / "demo_config.json").read_text())
    assert "teacher_source" not in with_final and not (world_demo / "teacher" / "meta.json").exists()
    # demo_config: the final split's entries are the only difference
    assert with_final.pop("final")["clips"] == [clip.record() for clip in final_clips(load_shipped_world(), 1)]
    for entry in (with_final["samples"], with_final["sample_rows"], with_final["clips"], with_final["world"]["splits"]):
        del entry["final"]
    assert config == with_final
    # every other file: byte for byte
    ours, theirs = file_bytes(root), file_bytes(world_demo)
    final_files = {name for name in theirs if "f000" in name or name.endswith("final.jsonl")}
    assert final_files == {"samples/final.jsonl", "clips/final.jsonl", "images/f000.png", "encoded/f000.pt",
                           *(f"samples/poses/f000_p{p:02d}.json" for p in range(4)),
                           *(f"ground_truth/f000__a{p}/{frame:05d}.png" for p in range(4) for frame in range(125))}
    assert set(ours) - {"teacher/meta.json"} == set(theirs) - final_files
    differing = {name for name in set(ours) & set(theirs) if ours[name] != theirs[name]}
    assert differing == {"demo_config.json", "cases.jsonl"}
    lines = theirs["cases.jsonl"].decode().splitlines(keepends=True)
    assert "".join(lines[:-1]) == ours["cases.jsonl"].decode() and json.loads(lines[-1])["case_id"] == "f000"
    # a demo without the final split: the eval says how to get one
    with pytest.raises(SystemExit):
        eval_predictor.parse_args(eval_predictor.build_parser(), ["--demo", str(root), "--split", "final"])
    assert "make it again with tools/make_demo_assets.py --overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_demo_assets.parse_args(["--out", str(tmp_path / "E"), "--teacher", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit):
        make_demo_assets.parse_args(["--out", str(tmp_path / "E"), "--kind", "random", "--teacher", str(teacher)])


def test_world_demo_assets_fit_together(world_demo):
    config = json.loads((world_demo / "demo_config.json").read_text())
    assert config["kind"] == "world" and config["latent_grid"] == {"channels": 16, "height": 4, "width": 6}
    assert config["sample_rows"] == {"train": 4, "holdout25": 4, "holdout50": 1, "final": 4}
    for split in ("train", "holdout25", "holdout50", "final"):
        rows = read_sample_table(world_demo / config["samples"][split])
        assert len(rows) == config["sample_rows"][split]
        assert all(row.case_id.startswith("f") == (split == "final") for row in rows)
        for row in rows:
            truth = read_video(world_demo / "ground_truth" / f"{row.case_id}__a{row.action_id}")
            assert truth.shape == (125, 32, 48, 3)
            image = np.asarray(Image.open(world_demo / "images" / f"{row.case_id}.png"))
            assert np.array_equal(image, truth[0])  # the image condition is the clip's first frame
    clip_rows = {name: [json.loads(line) for line in (world_demo / "clips" / f"{name}.jsonl").read_text().splitlines()]
                 for name in ("train", "holdout", "final")}
    assert config["clips"] == {name: f"clips/{name}.jsonl" for name in clip_rows}
    assert sum(map(len, clip_rows.values())) == sum(config["sample_rows"].values())
    assert [clip["clip_id"] for clip in clip_rows["final"]] == [f"f000__a{p}" for p in range(4)]
    assert all((world_demo / "clips" / clip["video"]).is_dir() for rows in clip_rows.values() for clip in rows)


def test_the_final_split_never_enters_a_dataset(world_demo, tmp_path, capsys):
    """build_predictor_dataset --demo takes every table but final.jsonl; a final table given by name is refused."""
    args = build_predictor_dataset.parse_args(["--demo", str(world_demo), "--out", str(tmp_path / "DS")])
    assert [Path(table).name for table in args.samples] == ["holdout25.jsonl", "holdout50.jsonl", "train.jsonl"]
    samples = world_demo / "samples"
    argv = ["--teacher", str(world_demo / "teacher"), "--encoded", str(world_demo / "encoded"), "--out",
            str(tmp_path / "DS"), "--samples", f"{samples / 'train.jsonl'},{samples / 'final.jsonl'}"]
    with pytest.raises(SystemExit) as exited:
        build_predictor_dataset.main(argv)
    assert exited.value.code == 2 and not (tmp_path / "DS").exists()
    assert "split 'final' is the split nothing is chosen on" in capsys.readouterr().err


def test_world_teacher_rollout_resembles_the_ground_truth(world_demo, tmp_path):
    """One video of a final scene (new to every model) through the eval (`--split final`): the Teacher's F-F-F-F
    rollout is scored against the rendered truth."""
    argv = ["--demo", str(world_demo), "--split", "final", "--max_videos", "1", "--lpips_random_backbone",
            "--num_side_by_side", "1", "--warmup_chunks", "1", "--output_root", str(tmp_path), "--no_progress"]
    assert eval_predictor.main(argv) == 0
    (run_dir,) = tmp_path.iterdir()
    aggregate = json.loads((run_dir / "aggregate.json").read_text())
    against = aggregate["against_ground_truth"]
    reference, still = against["reference"], against["repeat_first_frame"]
    # The world VAE alone reaches ~25 dB on whole held-out clips; a rollout that had learned nothing (noise or a flat colour)
    # stays far below 12 dB on these renders.
    assert 12.0 < reference["metrics"]["psnr_full"] < 40.0, reference["metrics"]
    assert len(reference["per_chunk"]) == 8
    assert still["metrics"]["identical_frames"] == 1  # its frame 0 is the truth itself
    shutil.rmtree(run_dir)
