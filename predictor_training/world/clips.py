"""Demo-world clips: scenes x camera paths rendered into clip tables of the video-latent builder's input format.

``make_world(out, WorldSettings(...))`` writes (``tools/render_world.py`` is the command line)::

    out/frames/{clip_id}/00000.png ...   the rendered video frames (video_format "png", the default), or
    out/videos/{clip_id}.mp4             lossless H.264 RGB (video_format "mp4", ``video_io.write_video``)
    out/poses/{clip_id}.json             inference-format pose JSON = camera.pose_string_to_json(pose_string):
                                         one key per latent ("extrinsic" camera-to-world, "K" = POSE_STRING_K)
    out/train.jsonl, out/holdout.jsonl   clip tables {"clip_id", "video", "pose", "caption"}, paths relative
    out/world_config.json                settings, the split rule, and every clip's scene seed and pose string

Clips and splits. Scene s (0 <= s < num_scenes) is ``make_scene(scene_seed(s))``; path p of scene s is a pose string
``make_pose_string(path_seed(s, p, attempt))`` (attempt = the first that keeps the camera ``PATH_CLEARANCE`` away
from every box footprint in every video frame). The seeds derive from ``seed`` by hashing (``derive_seed``), so
every clip is independent of the clip counts.

* held-out scenes: the last ``holdout_scenes`` scene indices. All their paths p < paths_per_scene are in
  ``holdout``; no frame of these scenes is in ``train``.
* train scenes (the others): paths p < paths_per_scene are in ``train``; paths paths_per_scene <= p <
  paths_per_scene + holdout_paths (new path seeds, never used in train, and pose strings that differ from every
  train path of that scene) are in ``holdout``.

Path kinds (``path_kind``): with ``revisit_paths`` = 0 (the default) every path is a generator path
(``paths.make_pose_string``). Otherwise the last ``revisit_paths`` of a scene's ``paths_per_scene`` paths are revisit
paths (``paths.make_revisit_pose_string``: turn away and back, forward and back, a loop, a look-around; their camera
comes back exactly to earlier cameras), the four kinds cycling over (scene, slot), in train scenes and held-out
scenes alike; and every other held-out new path of a train scene is a revisit path. ``revisits.revisits(pose)``
lists the latents of a pose JSON whose camera was seen before.

The clip id is ``s{scene:03d}_p{path:02d}``. Every clip's caption is its scene's caption (``WorldScene.caption``).
Everything is deterministic: the same settings give byte-identical files (on the same machine and library
versions). The folder is written in a staging folder next to ``out`` (``.{name}.building``) and renamed into place
at the end, so ``out`` either is complete or does not exist. An existing ``out`` with the same settings is reused
without any work; one with other settings is refused, naming every differing field.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from tqdm import tqdm

from predictor_training.rollout.camera import POSE_STRING_K, pose_string_to_json
from predictor_training.data.shards import write_bytes_atomic
from predictor_training.runtime.errors import UserInputError
from predictor_training.video.io import write_video
from predictor_training.world.paths import REVISIT_KINDS, make_path_pose_string, video_frame_cameras
from predictor_training.world.render import render_frames
from predictor_training.world.scene import WorldScene, footprint_distance, make_scene

WORLD_VERSION = 1  # bump when the scene, path or render rules change the pixels
CONFIG_NAME = "world_config.json"
TABLE_NAMES = ("train", "holdout")
VIDEO_FORMATS = ("png", "mp4")
FPS = 24
SUPERSAMPLE = 2
SHADOWS = True
PATH_CLEARANCE = 0.5  # camera centres stay at least this far (in x, z) from every box footprint
MAX_PATH_ATTEMPTS = 200


class WorldConfigError(UserInputError):
    """Bad world settings, or an output folder that cannot be reused; the message names the fields."""


@dataclass(frozen=True)
class WorldSettings:
    """What a world folder is made from (the tool's flags; all recorded in ``world_config.json``)."""

    num_scenes: int = 48
    paths_per_scene: int = 4
    holdout_scenes: int = 8
    holdout_paths: int = 1
    height: int = 32
    width: int = 48
    num_frames: int = 125
    seed: int = 0
    video_format: str = "png"
    revisit_paths: int = 0  # the last this many of a scene's paths_per_scene paths come back to earlier cameras

    def validate(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name != "video_format" and (not isinstance(value, int) or isinstance(value, bool)):
                raise WorldConfigError(f"{field.name} must be an int, got {value!r}")
        if self.num_scenes < 1 or self.paths_per_scene < 1:
            raise WorldConfigError(f"num_scenes ({self.num_scenes}) and paths_per_scene ({self.paths_per_scene}) "
                                   "must be >= 1")
        if not 0 <= self.holdout_scenes < self.num_scenes:
            raise WorldConfigError(f"holdout_scenes must be in [0, num_scenes={self.num_scenes}) so that train keeps "
                                   f"a scene, got {self.holdout_scenes}")
        if self.holdout_paths < 0:
            raise WorldConfigError(f"holdout_paths must be >= 0, got {self.holdout_paths}")
        if self.holdout_scenes == 0 and self.holdout_paths == 0:
            raise WorldConfigError("holdout would be empty: set holdout_scenes >= 1 or holdout_paths >= 1")
        if self.height < 1 or self.width < 1:
            raise WorldConfigError(f"height and width must be >= 1, got {self.height} x {self.width}")
        if self.num_frames < 5 or (self.num_frames - 1) % 4:
            raise WorldConfigError(f"num_frames must be 4k+1 with k >= 1 (5, 9, ..., 125), got {self.num_frames}")
        if not 0 <= self.revisit_paths <= self.paths_per_scene:
            raise WorldConfigError(f"revisit_paths must be in [0, paths_per_scene={self.paths_per_scene}], got "
                                   f"{self.revisit_paths}")
        if self.revisit_paths and self.num_frames < 33:
            raise WorldConfigError(f"revisit paths need num_frames >= 33 (9 latents), got {self.num_frames}")
        if self.video_format not in VIDEO_FORMATS:
            raise WorldConfigError(f"video_format must be one of {VIDEO_FORMATS}, got {self.video_format!r}")

    @property
    def num_latents(self) -> int:
        return (self.num_frames - 1) // 4 + 1

    def recorded(self) -> dict:
        """The settings as stored (and compared) in ``world_config.json``, with the fixed render constants.
        ``revisit_paths`` is recorded only when it is not 0, so worlds made before it existed read back unchanged."""
        recorded = {"version": WORLD_VERSION, **asdict(self), "fps": FPS, "supersample": SUPERSAMPLE,
                    "shadows": SHADOWS, "path_clearance": PATH_CLEARANCE}
        if not self.revisit_paths:
            del recorded["revisit_paths"]
        return recorded


@dataclass(frozen=True)
class WorldClip:
    clip_id: str
    split: str
    scene_index: int
    scene_seed: int
    path_index: int
    path_seed: int
    pose_string: str
    caption: str
    path_kind: str = "generator"  # paths.PATH_KINDS; recorded in world_config.json only when not "generator"

    def record(self) -> dict:
        """The clip's line in ``world_config.json``."""
        record = asdict(self)
        if self.path_kind == "generator":
            del record["path_kind"]
        return record

    def video_path(self, video_format: str) -> str:
        return f"frames/{self.clip_id}" if video_format == "png" else f"videos/{self.clip_id}.mp4"

    @property
    def pose_path(self) -> str:
        return f"poses/{self.clip_id}.json"


@dataclass(frozen=True)
class WorldOutput:
    root: Path
    tables: list[Path]
    clips: list[WorldClip]
    reused: bool


def derive_seed(seed: int, *labels) -> int:
    """A 31-bit seed from ``seed`` and labels (sha256 of their JSON): stable across runs, machines and versions."""
    digest = hashlib.sha256(json.dumps([seed, *labels]).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFFFFFF


def scene_seed(seed: int, scene_index: int) -> int:
    return derive_seed(seed, "scene", scene_index)


def path_is_clear(scene: WorldScene, c2w: np.ndarray, clearance: float = PATH_CLEARANCE) -> bool:
    """True when every camera centre of ``c2w`` [F, 4, 4] keeps ``clearance`` from every box footprint."""
    centres = np.asarray(c2w)[:, :3, 3]
    return all(footprint_distance(box, x, z) >= clearance for box in scene.boxes for x, _, z in centres)


def path_kind(settings: WorldSettings, scene_index: int, path_index: int) -> str:
    """The kind of path ``path_index`` of scene ``scene_index`` (``paths.PATH_KINDS``).

    Paths p < paths_per_scene (the train paths of train scenes and the paths of held-out scenes): the last
    ``revisit_paths`` of them are revisit paths, their kinds cycling through ``REVISIT_KINDS`` over (scene, slot), so
    every kind is in train and in the held-out scenes. The held-out new paths of train scenes (p >= paths_per_scene):
    when ``revisit_paths`` > 0, every other one (scene_index + j odd, j = p - paths_per_scene) is a revisit path.
    """
    if not settings.revisit_paths:
        return "generator"
    if path_index < settings.paths_per_scene:
        slot = path_index - (settings.paths_per_scene - settings.revisit_paths)
        if slot < 0:
            return "generator"
        return REVISIT_KINDS[(scene_index * settings.revisit_paths + slot) % len(REVISIT_KINDS)]
    extra = path_index - settings.paths_per_scene
    if (scene_index + extra) % 2 == 0:
        return "generator"
    return REVISIT_KINDS[(scene_index // 2 + extra) % len(REVISIT_KINDS)]


def choose_path(scene: WorldScene, seed: int, scene_index: int, path_index: int, num_latents: int,
                exclude: frozenset = frozenset(), kind: str = "generator", seed_label: str = "path"):
    """(path seed, pose string) of path ``path_index`` of a scene: the first attempt whose camera stays clear of the
    boxes and whose pose string is not in ``exclude``. The attempt's seed is ``derive_seed(seed, seed_label,
    scene_index, path_index, attempt)`` (the world's paths: "path"; the demo's final scenes: "final_path")."""
    num_frames = 4 * (num_latents - 1) + 1
    for attempt in range(MAX_PATH_ATTEMPTS):
        path_seed = derive_seed(seed, seed_label, scene_index, path_index, attempt)
        pose_string = make_path_pose_string(path_seed, num_latents, kind)
        if pose_string not in exclude and path_is_clear(scene, video_frame_cameras(pose_string, num_frames)):
            return path_seed, pose_string
    raise RuntimeError(f"scene {scene_index}: no clear camera path in {MAX_PATH_ATTEMPTS} attempts")  # pragma: no cover


def plan_world(settings: WorldSettings) -> list[WorldClip]:
    """Every clip of the world, in table order (scene index, then path index); see the module docstring."""
    settings.validate()
    first_holdout_scene = settings.num_scenes - settings.holdout_scenes
    clips = []
    for scene_index in range(settings.num_scenes):
        seed_of_scene = scene_seed(settings.seed, scene_index)
        scene = make_scene(seed_of_scene)
        held_out_scene = scene_index >= first_holdout_scene
        num_paths = settings.paths_per_scene + (0 if held_out_scene else settings.holdout_paths)
        train_pose_strings: set[str] = set()
        for path_index in range(num_paths):
            split = "holdout" if held_out_scene or path_index >= settings.paths_per_scene else "train"
            exclude = frozenset(train_pose_strings) if split == "holdout" else frozenset()
            kind = path_kind(settings, scene_index, path_index)
            path_seed, pose_string = choose_path(scene, settings.seed, scene_index, path_index, settings.num_latents,
                                                 exclude, kind)
            if split == "train":
                train_pose_strings.add(pose_string)
            clips.append(WorldClip(
                clip_id=f"s{scene_index:03d}_p{path_index:02d}", split=split, scene_index=scene_index,
                scene_seed=seed_of_scene, path_index=path_index, path_seed=path_seed, pose_string=pose_string,
                caption=scene.caption(), path_kind=kind,
            ))
    return clips


def split_rule(settings: WorldSettings) -> dict:
    """The split rule as recorded in ``world_config.json``."""
    first_holdout_scene = settings.num_scenes - settings.holdout_scenes
    train_paths = list(range(settings.paths_per_scene))
    rule = {
        "train": {"scenes": list(range(first_holdout_scene)), "paths": train_paths},
        "holdout": {
            "held_out_scenes": list(range(first_holdout_scene, settings.num_scenes)),
            "held_out_scene_paths": train_paths,
            "new_paths_of_train_scenes": list(
                range(settings.paths_per_scene, settings.paths_per_scene + settings.holdout_paths)
            ),
        },
    }
    if settings.revisit_paths:
        rule["path_kinds"] = (f"paths {settings.paths_per_scene - settings.revisit_paths}..{settings.paths_per_scene - 1}"
                              f" of every scene are revisit paths, kind = {list(REVISIT_KINDS)}[(scene * "
                              f"{settings.revisit_paths} + path - {settings.paths_per_scene - settings.revisit_paths})"
                              f" % {len(REVISIT_KINDS)}]; new path j of a train scene: a generator path when scene + j "
                              f"is even, else kind {list(REVISIT_KINDS)}[(scene // 2 + j) % {len(REVISIT_KINDS)}]; "
                              "each clip's path_kind is on its line (absent = generator)")
    return rule


def render_clip(clip: WorldClip, settings: WorldSettings) -> np.ndarray:
    """uint8 [num_frames, height, width, 3] frames of one clip."""
    cameras = video_frame_cameras(clip.pose_string, settings.num_frames)
    return render_frames(make_scene(clip.scene_seed), cameras, POSE_STRING_K, settings.height, settings.width,
                         supersample=SUPERSAMPLE, shadows=SHADOWS)


def _json_bytes(value, indent=None) -> bytes:
    return (json.dumps(value, indent=indent) + "\n").encode("utf-8")


def _config_bytes(config: dict) -> bytes:
    """JSON of the config: indented, but one line per clip."""
    head = {key: value for key, value in config.items() if key != "clips"}
    text = json.dumps(head, indent=2)[:-2]  # drop the closing "\n}"
    clip_lines = ",\n".join("    " + json.dumps(clip) for clip in config["clips"])
    return (text + ',\n  "clips": [\n' + clip_lines + "\n  ]\n}\n").encode("utf-8")


def check_existing_world(out: Path, settings: WorldSettings) -> bool:
    """True when ``out`` holds a world with these settings (reuse it); raises when it cannot be used."""
    config_path = out / CONFIG_NAME
    if not config_path.is_file():
        if out.is_dir() and not any(out.iterdir()):
            return False
        raise WorldConfigError(f"{out}: exists but has no {CONFIG_NAME}, so render_world did not make it; use another "
                               "--out (render_world never replaces files it did not write)")
    existing = json.loads(config_path.read_text(encoding="utf-8")).get("settings", {})
    wanted = settings.recorded()
    differing = [f"{name}: {existing.get(name, '<missing>')!r} there, {wanted.get(name, '<missing>')!r} asked"
                 for name in sorted(set(existing) | set(wanted)) if existing.get(name) != wanted.get(name)]
    if differing:
        raise WorldConfigError(f"{config_path}: this world was made with other settings ({'; '.join(differing)}); "
                               "use another --out, or the same settings to reuse it")
    return True


def make_world(out: str | Path, settings: WorldSettings = WorldSettings(), progress: bool = True) -> WorldOutput:
    """Write (or reuse) the world folder ``out``; see the module docstring."""
    settings.validate()
    out = Path(out)
    tables = [out / f"{name}.jsonl" for name in TABLE_NAMES]
    if out.exists():
        if check_existing_world(out, settings):
            config = json.loads((out / CONFIG_NAME).read_text(encoding="utf-8"))
            return WorldOutput(out, tables, [WorldClip(**clip) for clip in config["clips"]], reused=True)
        out.rmdir()  # an empty folder
    clips = plan_world(settings)
    staging = out.parent / f".{out.name}.building"
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "poses").mkdir(parents=True)
    rows: dict[str, list[dict]] = {name: [] for name in TABLE_NAMES}
    for clip in tqdm(clips, desc="render world", unit="clip", disable=not progress):
        frames = render_clip(clip, settings)
        video = clip.video_path(settings.video_format)
        write_video(staging / video, frames, fps=FPS, lossless=True)
        write_bytes_atomic(staging / clip.pose_path, _json_bytes(pose_string_to_json(clip.pose_string)))
        rows[clip.split].append({"clip_id": clip.clip_id, "video": video, "pose": clip.pose_path,
                                 "caption": clip.caption})
    for name in TABLE_NAMES:
        write_bytes_atomic(staging / f"{name}.jsonl", b"".join(_json_bytes(row) for row in rows[name]))
    config = {
        "settings": settings.recorded(),
        "splits": split_rule(settings),
        "counts": {name: len(rows[name]) for name in TABLE_NAMES},
        "intrinsics": "pose JSON K = camera.POSE_STRING_K (1920 x 1080 pixels); frames rendered with its normalised "
                      "focal lengths fx/(2cx), fy/(2cy) times width, height and a centred principal point",
        "clips": [clip.record() for clip in clips],
    }
    write_bytes_atomic(staging / CONFIG_NAME, _config_bytes(config))
    staging.rename(out)
    return WorldOutput(out, tables, clips, reused=False)
