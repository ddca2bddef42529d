r"""Build the video-latent dataset: per clip, VAE latents, camera/action, caption encoder outputs, first-frame latent.

Input: clip tables (JSONL, one clip per line; the split of a clip is its table's file stem):

    {"clip_id": "c0001", "video": "videos/c0001.mp4", "pose": "poses/c0001.json", "caption": "..."}

``video`` is a folder of PNG frames or an mp4 with exactly --num_frames frames (4k+1); ``pose`` a WorldPlay pose JSON
with one entry per latent frame (k+1); relative paths are relative to the table. Output: ``OUT/clips/{clip_id}
.safetensors``, ``OUT/manifest.jsonl`` (sha256 + per-tensor CRC-32), ``OUT/video_dataset_config.json``. Layout, fields
and the VAE scaling convention: docs/video_latents.md.

Your own videos (one node, 8 GPUs; 125 frames -> 32 latents at 480 x 832):
    torchrun --nproc_per_node 8 tools/build_video_latent_dataset.py \
        --encoders $ENCODERS --clips $WORK/clips/train.jsonl,$WORK/clips/holdout.jsonl \
        --out $VIDEO_LATENTS --height 480 --width 832 --num_frames 125

Demo (CPU, seconds): tiny procedural clips (29 frames at 32 x 48 -> 8 latents at 2 x 3) through the demo's tiny random
encoders (D/encoders of tools/make_demo_assets.py when D is a demo asset folder, else made in D):
    python tools/build_video_latent_dataset.py --demo demo_data/V --out demo_data/VDS
    torchrun --nproc_per_node 2 tools/build_video_latent_dataset.py --demo demo_data/V --out demo_data/VDS

Distribution and resume: clip i (in table order) is encoded by rank i % world size, one clip at a time; each rank
appends one line per finished clip to ``manifest_parts/rank{r}.jsonl``, and rank 0 merges them into
``manifest.jsonl`` at the end (sorted by file, so it does not depend on the world size). Rerun the same command to
resume: a clip whose file matches a known entry (size, sha256, tensor list) made from the same inputs is skipped.
A folder built with other settings is refused, listing the differing fields.

This file is the command line; the builder is ``predictor_training.data.video_latent_build`` (``run``), the
demo inputs ``predictor_training.world.video_latent_demo``, the reader ``predictor_training.data.video_latents``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from predictor_training.data.encoders import VISION_CROPS
from predictor_training.data.video_latent_build import (
    ENCODER_DTYPES,
    STORAGE_DTYPES,
    VideoBuildOptions,
    run,
)
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import SEED, add_check_only_arg, add_threads_arg, check_cuda_flag, settings_from_flags
from predictor_training.world.video_latent_demo import (
    DEMO_ENCODERS_DIR,
    DEMO_HEIGHT,
    DEMO_NUM_FRAMES,
    DEMO_WIDTH,
    demo_tables,
    prepare_demo_inputs,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("inputs (either --demo D, or --clips and --encoders)")
    source.add_argument("--demo", type=Path, help="demo folder: makes D/video_clips (procedural clips, poses, tables "
                        "train.jsonl / holdout.jsonl) and D/encoders (tiny random encoders) when absent, then builds "
                        "from them; defaults become --height 32 --width 48 --num_frames 29 --dtype float32")
    source.add_argument("--clips", type=str, help="comma-separated clip tables (JSONL with clip_id, video, pose, "
                        "caption); the split of a clip is its table's file stem (train.jsonl -> 'train')")
    source.add_argument("--encoders", type=Path, help="diffusers-format HunyuanVideo-1.5 i2v folder (model_index.json, "
                        "text_encoder, tokenizer, text_encoder_2, tokenizer_2, image_encoder, feature_extractor, vae; "
                        "the transformer is not loaded)")
    parser.add_argument("--out", type=Path, required=True, help="dataset root to create or resume")
    parser.add_argument("--height", type=int, default=None, help="encoded height in pixels, a multiple of 16; frames "
                        "are resized to cover and centre-cropped (default 480; --demo 32)")
    parser.add_argument("--width", type=int, default=None, help="encoded width in pixels, a multiple of 16 (default "
                        "832; --demo 48)")
    parser.add_argument("--num_frames", type=int, default=None, help="frames of every clip, 4k+1 -> k+1 latents "
                        "(default 125 -> 32 latents; --demo 29 -> 8)")
    parser.add_argument("--dtype", choices=sorted(ENCODER_DTYPES), default=None, help="dtype of Qwen2.5-VL and "
                        "SigLIP (default float16 as upstream; --demo float32)")
    parser.add_argument("--byt5_dtype", choices=sorted(ENCODER_DTYPES), default="float32", help="dtype of the ByT5 "
                        "glyph encoder (upstream: float32)")
    parser.add_argument("--vae_dtype", choices=sorted(ENCODER_DTYPES), default="float32", help="dtype of the VAE "
                        "(upstream trainer's producer: float32)")
    parser.add_argument("--vision_crop", choices=VISION_CROPS, default="bucket", help="crop SigLIP sees of the first "
                        "frame: 'bucket' = the 480p bucket nearest its aspect ratio (upstream), 'target' = the "
                        "--height x --width crop")
    parser.add_argument("--vae_tiling", action="store_true", help="encode with vae.enable_tiling() (less memory for "
                        "large frames; recorded in the config, since tiles change the latents slightly)")
    parser.add_argument("--storage_dtype", choices=STORAGE_DTYPES, default="keep", help="dtype of the stored floating "
                        "tensors: keep = the dtype of the encoder that made each one (as the encoder stage's .pt "
                        "files); cameras are always float32")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto = cuda:LOCAL_RANK "
                        "when CUDA is available, else cpu (the process group uses nccl / gloo accordingly)")
    add_check_only_arg(parser, what="the clips it would encode (every table, pose and frame count checked in one "
                       "process, under torchrun too; the encoders folder's kind) and whether --out is new or resumed")
    parser.add_argument("--stop_after", type=int, default=None, help="debug: each rank stops after encoding this "
                        "many clips (no manifest is written; rerun to resume)")
    parser.add_argument("--demo_clips", type=int, default=6, help="--demo: number of procedural clips")
    parser.add_argument("--demo_holdout", type=int, default=2, help="--demo: how many of them go to holdout.jsonl")
    parser.add_argument("--demo_seed", type=SEED, default=0, help="--demo: seed of the scenes and of the tiny encoders "
                        "(0 = the encoders of tools/make_demo_assets.py --seed 0)")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    check_cuda_flag(parser, "--device", args.device)

    if args.demo is not None:
        conflicting = [flag for flag in ("clips", "encoders") if getattr(args, flag) is not None]
        if conflicting:
            parser.error(f"--demo replaces --{', --'.join(conflicting)}; give one or the other")
        if not 1 <= args.demo_holdout < args.demo_clips:
            parser.error(f"--demo_holdout must be in [1, --demo_clips), got {args.demo_holdout} of {args.demo_clips}")
        args.encoders = args.demo / DEMO_ENCODERS_DIR
        args.clips = demo_tables(args.demo)
        defaults = {"height": DEMO_HEIGHT, "width": DEMO_WIDTH, "num_frames": DEMO_NUM_FRAMES, "dtype": "float32"}
    else:
        missing = [flag for flag in ("clips", "encoders") if getattr(args, flag) is None]
        if missing:
            parser.error(f"missing --{', --'.join(missing)} (or use --demo D)")
        if not args.encoders.is_dir():
            parser.error(f"--encoders {args.encoders}: folder does not exist")
        args.clips = [Path(item) for item in args.clips.split(",") if item]
        if not args.clips:
            parser.error("--clips names no table")
        defaults = {"height": 480, "width": 832, "num_frames": 125, "dtype": "float16"}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for flag in ("height", "width"):
        value = getattr(args, flag)
        if value < 16 or value % 16:
            parser.error(f"--{flag} must be a positive multiple of 16 (the VAE's spatial factor), got {value}")
    if args.num_frames < 1 or (args.num_frames - 1) % 4:
        parser.error(f"--num_frames must be 4k+1 (1, 5, ..., 125: the causal VAE maps 4k+1 frames to k+1 latents), "
                     f"got {args.num_frames}")
    if args.stop_after is not None and args.stop_after < 1:
        parser.error(f"--stop_after must be >= 1, got {args.stop_after}")
    return args


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    set_cpu_threads(args.threads, tool="build_video_latent_dataset", load_aware=False)
    return run(settings_from_flags(VideoBuildOptions, args), prepare_demo=prepare_demo_inputs)


if __name__ == "__main__":
    sys.exit(main())
