r"""Render the demo world: procedural 3D scenes seen along exact camera paths, as video-latent clip tables.

Writes W/frames/{clip_id}/ (PNG frames; --video_format mp4: W/videos/{clip_id}.mp4, lossless), W/poses/{clip_id}.json
(inference-format pose JSON, one key per latent), W/train.jsonl, W/holdout.jsonl and W/world_config.json (every
setting, the split rule, each clip's scene seed and pose string). Held out: the last --holdout_scenes scenes (all
their paths) and --holdout_paths new paths of every train scene. Layout and splits: docs/demo_world.md; the code:
predictor_training.world.

    python tools/render_world.py --out demo_data/world
    python tools/build_video_latent_dataset.py --clips demo_data/world/train.jsonl,demo_data/world/holdout.jsonl \
        --encoders ENCODERS --out demo_data/world_latents --height 32 --width 48 --num_frames 125

Deterministic: the same arguments give byte-identical files. Rerunning with the same settings reuses W (no work);
other settings are refused with the differing fields named.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_check_only_arg, report_check_only
from predictor_training.world.clips import (
    VIDEO_FORMATS,
    WorldConfigError,
    WorldSettings,
    check_existing_world,
    make_world,
    plan_world,
    render_clip,
)
from predictor_training.world.render import contact_sheet

DEFAULTS = WorldSettings()


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="world folder W to create (or reuse)")
    parser.add_argument("--num_scenes", type=int, default=DEFAULTS.num_scenes)
    parser.add_argument("--paths_per_scene", type=int, default=DEFAULTS.paths_per_scene,
                        help="camera paths per scene (train paths of train scenes; all paths of held-out scenes)")
    parser.add_argument("--holdout_scenes", type=int, default=DEFAULTS.holdout_scenes,
                        help="the last this many scenes go to holdout with all their paths")
    parser.add_argument("--holdout_paths", type=int, default=DEFAULTS.holdout_paths,
                        help="extra paths (new path seeds) per train scene, in holdout")
    parser.add_argument("--height", type=int, default=DEFAULTS.height)
    parser.add_argument("--width", type=int, default=DEFAULTS.width)
    parser.add_argument("--num_frames", type=int, default=DEFAULTS.num_frames, help="4k+1 (k+1 latents)")
    parser.add_argument("--revisit_paths", type=int, default=DEFAULTS.revisit_paths,
                        help="the last this many of each scene's --paths_per_scene paths come back exactly to earlier "
                        "cameras (turn away and back, forward and back, loops, look-around); also every other new "
                        "path of a train scene (default %(default)s: generator paths only)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--video_format", choices=VIDEO_FORMATS, default=DEFAULTS.video_format,
                        help="png: a folder of PNG frames per clip; mp4: lossless H.264 RGB")
    parser.add_argument("--preview", type=Path, help="also save contact sheets (frames 0, 1/3, 2/3, last; x4 "
                        "nearest) of the first --preview_clips clips of each table into this folder")
    parser.add_argument("--preview_clips", type=int, default=2)
    add_check_only_arg(parser, what="the clips it would render and whether --out is reused")
    return parser.parse_args(argv)


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    settings = WorldSettings(
        num_scenes=args.num_scenes, paths_per_scene=args.paths_per_scene, holdout_scenes=args.holdout_scenes,
        holdout_paths=args.holdout_paths, height=args.height, width=args.width, num_frames=args.num_frames,
        seed=args.seed, video_format=args.video_format, revisit_paths=args.revisit_paths,
    )
    start = time.perf_counter()
    try:
        if args.check_only:  # the settings, the clips' plan and a world already in --out
            settings.validate()
            reused = args.out.exists() and check_existing_world(args.out, settings)
            clips = plan_world(settings)
            return report_check_only(f"{len(clips)} clips -> {args.out} "
                                     f"({'reused: same settings' if reused else 'new'})")
        result = make_world(args.out, settings)
    except WorldConfigError as error:
        print(f"render_world: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    counts = {split: sum(clip.split == split for clip in result.clips) for split in ("train", "holdout")}
    action = "reused (same settings, nothing rendered)" if result.reused else f"written in {seconds:.1f} s"
    print(f"{result.root}: {len(result.clips)} clips ({counts['train']} train, {counts['holdout']} holdout), {action}")
    print(f"clip tables: {','.join(str(table) for table in result.tables)}")
    if args.preview:
        from PIL import Image

        args.preview.mkdir(parents=True, exist_ok=True)
        last = settings.num_frames - 1
        indices = [0, round(last / 3), round(2 * last / 3), last]
        for split in ("train", "holdout"):
            for clip in [clip for clip in result.clips if clip.split == split][: args.preview_clips]:
                sheet = contact_sheet(render_clip(clip, settings), indices, scale=4)
                path = args.preview / f"{clip.clip_id}.png"
                Image.fromarray(sheet).save(path)
                print(f"preview {path}: frames {indices} of {clip.clip_id} ({split}; {clip.pose_string})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
