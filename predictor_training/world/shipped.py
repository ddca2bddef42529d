"""The shipped demo world: the trained VAE and 4-step Teacher in `predictor_training/world/weights/`, and the demo's
sample rows drawn from its clips.

`tools/build_demo_world.py --stages ship` writes the folder; `tools/make_demo_assets.py` (the default `--kind world`)
reads it to assemble the demo every launcher and the eval use:

    weights/vae/                 AutoencoderKLHunyuanVideo15 folder (the world VAE)
    weights/teacher/             WorldPlayTransformer folder (the 4-step world Teacher, shift 5)
    weights/world_config.json    the world the two were trained on (settings + every clip: seeds, pose string, caption)

Demo rows (`demo_split_clips`): a case is a scene (every path of a scene starts from the same camera, so its first
frame is the scene's image), an action is one of its camera paths, and the row's ground truth is that clip's render.

    train       the first `num_train` train scenes x their train paths (the Teacher trained on these clips)
    holdout25   the first `num_holdout25` held-out scenes x their paths (scenes no model has seen)
    holdout50   the new path of the next `num_holdout50` train scenes (a new camera path in a scene the Teacher
                knows; these scenes are not in the demo's train split)
    final       `num_final` new scenes x their paths (`final_clips`): scenes that are not in the world at all, made
                as the world makes its held-out scenes, from seeds of their own; the split nothing is chosen on

The final split's seeds: scene i (0, 1, ...) is `make_scene(derive_seed(seed, "final_scene", i))` and its path p is
`clips.choose_path(..., seed_label="final_path")`, i.e. the first attempt of `derive_seed(seed, "final_path", i, p,
attempt)` that keeps the camera clear of the boxes; `seed` is the world's. The world's own seeds hash other labels
("scene", "path"), so none is shared; `final_clips` checks it, and a path whose pose string is already a world
clip's or an earlier final clip's is redrawn (the next attempt). Everything else is the held-out scenes' rule: the
same scene generator, render settings, clearance and path kinds (`clips.path_kind` of scene i: the last
`revisit_paths` of the `paths_per_scene` paths are revisit paths, their kinds cycling over (i, slot)). The case is
`f{i:03d}`, the clip `f{i:03d}_p{p:02d}`, its split "final".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path

from predictor_training.data.sample_table import FINAL_SPLIT
from predictor_training.runtime.errors import MissingFileError
from predictor_training.runtime.io import read_json_file
from predictor_training.world.assets import WORLD_WEIGHTS
from predictor_training.world.clips import (
    WorldClip,
    WorldConfigError,
    WorldSettings,
    choose_path,
    derive_seed,
    path_kind,
)
from predictor_training.world.scene import make_scene

WORLD_CONFIG_NAME = "world_config.json"
OPTIONAL_CLIP_FIELDS = frozenset({"path_kind"})  # absent in worlds without revisit paths
FINAL_SCENE_LABEL, FINAL_PATH_LABEL = "final_scene", "final_path"  # derive_seed labels of the final split


@dataclass(frozen=True)
class ShippedWorld:
    """A folder of world weights, checked to be complete."""

    root: Path
    settings: WorldSettings
    clips: list[WorldClip]

    @property
    def vae(self) -> Path:
        return self.root / "vae"

    @property
    def teacher(self) -> Path:
        return self.root / "teacher"

    @property
    def captions(self) -> list[str]:
        """Every clip's caption in table order (the tiny tokenizer's vocabulary is built from them)."""
        return [clip.caption for clip in self.clips]


def load_shipped_world(root: str | Path = WORLD_WEIGHTS) -> ShippedWorld:
    """Read and check a world-weights folder; the error names the missing file or the bad field."""
    root = Path(root)
    for required in ("vae/config.json", "teacher/config.json", WORLD_CONFIG_NAME):
        if not (root / required).is_file():
            hint = (" (the shipped Teacher is written by `python tools/build_demo_world.py --out demo_data/world`; "
                    "see docs/demo_world.md)")
            raise MissingFileError(f"world weights {root}: {required} is missing{hint}")
    config_path = root / WORLD_CONFIG_NAME
    config = read_json_file(config_path, WorldConfigError)
    known = {field.name for field in fields(WorldSettings)}
    recorded = config.get("settings")
    if not isinstance(recorded, dict):
        raise WorldConfigError(f"{config_path}: field 'settings' must be an object of the world's settings")
    settings = WorldSettings(**{name: value for name, value in recorded.items() if name in known})
    if settings.recorded() != recorded:
        raise WorldConfigError(f"{config_path}: field 'settings' was written by another version of the world "
                               f"renderer (expected {settings.recorded()}, found {recorded})")
    clip_fields = {field.name for field in fields(WorldClip)}
    clips = []
    for index, clip in enumerate(config.get("clips", [])):
        if not clip_fields - OPTIONAL_CLIP_FIELDS <= set(clip) <= clip_fields:
            raise WorldConfigError(f"{config_path}: clips[{index}] must have the fields {sorted(clip_fields)} "
                                   f"({sorted(OPTIONAL_CLIP_FIELDS)} optional), got {sorted(clip)}")
        clips.append(WorldClip(**clip))
    if not clips:
        raise WorldConfigError(f"{config_path}: field 'clips' is empty")
    return ShippedWorld(root, settings, clips)


def scene_case_id(clip: WorldClip) -> str:
    """The demo case of a clip: its scene (`s000`; a final scene `f000`)."""
    return f"f{clip.scene_index:03d}" if clip.split == FINAL_SPLIT else f"s{clip.scene_index:03d}"


def demo_split_clips(world: ShippedWorld, num_train: int, num_holdout25: int, num_holdout50: int
                     ) -> dict[str, list[WorldClip]]:
    """The clips of each demo split (see the module docstring), in table order."""
    settings = world.settings
    train_scenes = sorted({clip.scene_index for clip in world.clips if clip.split == "train"})
    held_out_scenes = sorted({clip.scene_index for clip in world.clips
                              if clip.split == "holdout" and clip.path_index < settings.paths_per_scene})
    new_path_scenes = train_scenes[num_train:]
    wanted = {"train": (num_train, len(train_scenes) - (1 if settings.holdout_paths else 0)),
              "holdout25": (num_holdout25, len(held_out_scenes)),
              "holdout50": (num_holdout50, len(new_path_scenes) if settings.holdout_paths else 0)}
    for split, (count, available) in wanted.items():
        if not 1 <= count <= available:
            raise ValueError(f"--num_{split} must be in [1, {available}] for the world in {world.root} "
                             f"({len(train_scenes)} train scenes, {len(held_out_scenes)} held-out scenes), got {count}")
    chosen = {"train": set(train_scenes[:num_train]), "holdout25": set(held_out_scenes[:num_holdout25]),
              "holdout50": set(new_path_scenes[:num_holdout50])}
    splits = {name: [] for name in chosen}
    for clip in world.clips:
        new_path = clip.path_index >= settings.paths_per_scene
        if clip.scene_index in chosen["train"] and clip.split == "train":
            splits["train"].append(clip)
        elif clip.scene_index in chosen["holdout25"]:
            splits["holdout25"].append(clip)
        elif clip.scene_index in chosen["holdout50"] and new_path:
            splits["holdout50"].append(clip)
    return splits


def final_clips(world: ShippedWorld, num_final: int) -> list[WorldClip]:
    """The clips of the demo's final split: `num_final` new scenes x their `paths_per_scene` paths, in order (see the
    module docstring for the seeds and the rule)."""
    if num_final < 0:
        raise ValueError(f"--num_final must be >= 0, got {num_final}")
    settings = world.settings
    world_scene_seeds = {clip.scene_seed for clip in world.clips}
    taken_pose_strings = {clip.pose_string for clip in world.clips}
    known_words = {word for caption in world.captions for word in re.findall(r"\w+", caption)}
    clips = []
    for index in range(num_final):
        seed_of_scene = derive_seed(settings.seed, FINAL_SCENE_LABEL, index)
        if seed_of_scene in world_scene_seeds:  # pragma: no cover - a 31-bit hash collision
            raise RuntimeError(f"final scene {index}: its seed {seed_of_scene} is also a scene seed of the world in "
                               f"{world.root}; the final split must be new scenes")
        scene = make_scene(seed_of_scene)
        unknown = sorted(set(re.findall(r"\w+", scene.caption())) - known_words)
        if unknown:  # the tiny tokenizer knows the world's caption words only (assets.write_world_encoders)
            raise ValueError(f"--num_final {num_final}: final scene f{index:03d}'s caption {scene.caption()!r} uses "
                             f"{unknown}, which no caption of the world in {world.root} uses, so the Teacher's "
                             f"tokenizer does not know it; use --num_final <= {index}")
        for path_index in range(settings.paths_per_scene):
            kind = path_kind(settings, index, path_index)
            path_seed, pose_string = choose_path(scene, settings.seed, index, path_index, settings.num_latents,
                                                 frozenset(taken_pose_strings), kind, seed_label=FINAL_PATH_LABEL)
            taken_pose_strings.add(pose_string)
            clips.append(WorldClip(
                clip_id=f"f{index:03d}_p{path_index:02d}", split=FINAL_SPLIT, scene_index=index,
                scene_seed=seed_of_scene, path_index=path_index, path_seed=path_seed, pose_string=pose_string,
                caption=scene.caption(), path_kind=kind,
            ))
    return clips
