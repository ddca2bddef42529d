"""The shipped demo world (predictor_training/world/weights): it loads, its demo assets fit together, and the world
Teacher's rollout of a held-out scene, decoded by the world VAE, resembles the scene's ground-truth render."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from diffusers import AutoencoderKLHunyuanVideo15

from predictor_training.data.sample_table import read_sample_table
from predictor_training.teacher import WorldPlayTransformer
from predictor_training.video.io import read_video
from predictor_training.world.assets import WORLD_TEACHER_DEPTH, WORLD_WEIGHTS
from predictor_training.world.shipped import demo_split_clips, load_shipped_world, scene_case_id


REPO_ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(REPO_ROOT / "tools"))

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


@pytest.fixture(scope="module")
def world_demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("world_demo") / "D"
    make_demo_assets.main(["--out", str(root), "--num_train", "1", "--num_holdout25", "1", "--num_holdout50", "1"])
    return root


def test_world_demo_assets_take_another_teacher(world_demo, tmp_path):
    """make_demo_assets --teacher DIR: the same world (scenes, tables, encoders) with DIR's Teacher copied in, recorded
    in demo_config.json as teacher_source; without the flag the weights' own Teacher and no such field."""
    teacher = tmp_path / "student"
    shutil.copytree(WORLD_WEIGHTS / "teacher", teacher)
    (teacher / "meta.json").write_text('{"role": "student"}')  # any file of the folder comes along
    root = tmp_path / "D"
    make_demo_assets.main(["--out", str(root), "--num_train", "1", "--num_holdout25", "1", "--num_holdout50", "1",
                           "--teacher", str(teacher)])
    assert (root / "teacher" / "meta.json").read_text() == '{"role": "student"}'
    config = json.loads((root / "demo_config.json").read_text())
    assert config.pop("teacher_source") == str(teacher.resolve())
    assert config == json.loads((world_demo / "demo_config.json").read_text())
    assert "teacher_source" not in config and not (world_demo / "teacher" / "meta.json").exists()
    for path in ("samples/holdout25.jsonl", "encoded/s388.pt"):
        assert (root / path).read_bytes() == (world_demo / path).read_bytes()
    with pytest.raises(SystemExit):
        make_demo_assets.parse_args(["--out", str(tmp_path / "E"), "--teacher", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit):
        make_demo_assets.parse_args(["--out", str(tmp_path / "E"), "--kind", "random", "--teacher", str(teacher)])


def test_world_demo_assets_fit_together(world_demo):
    config = json.loads((world_demo / "demo_config.json").read_text())
    assert config["kind"] == "world" and config["latent_grid"] == {"channels": 16, "height": 4, "width": 6}
    for split in ("train", "holdout25", "holdout50"):
        rows = read_sample_table(world_demo / config["samples"][split])
        assert len(rows) == config["sample_rows"][split]
        for row in rows:
            truth = read_video(world_demo / "ground_truth" / f"{row.case_id}__a{row.action_id}")
            assert truth.shape == (125, 32, 48, 3)
            image = np.asarray(Image.open(world_demo / "images" / f"{row.case_id}.png"))
            assert np.array_equal(image, truth[0])  # the image condition is the clip's first frame
    clip_rows = [json.loads(line) for name in ("train", "holdout")
                 for line in (world_demo / "clips" / f"{name}.jsonl").read_text().splitlines()]
    assert len(clip_rows) == sum(config["sample_rows"].values())
    assert all((world_demo / "clips" / clip["video"]).is_dir() for clip in clip_rows)


def test_world_teacher_rollout_resembles_the_ground_truth(world_demo, tmp_path):
    """One held-out video through the eval: the Teacher's F-F-F-F rollout is scored against the rendered truth."""
    argv = ["--demo", str(world_demo), "--split", "holdout25", "--max_videos", "1", "--lpips_random_backbone",
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
