"""Encoder stage: every (source image, caption) of a cases file -> `{case_id}.pt` encoder outputs for the Teacher.

Calls diffusers' HunyuanVideo-1.5 i2v pipeline methods (Qwen2.5-VL + ByT5 `encode_prompt`, SigLIP `encode_image`,
the VAE image latent) on encoders loaded from a local diffusers-format folder; the transformer is never loaded.
Output layout (upstream trainer's `.pt`, batch dim 1) and the differences from upstream: docs/encoders.md.

Demo (CPU, seconds; make_demo_assets.py already runs this stage into D/encoded):
    python tools/encode_cases.py --encoders D/encoders --cases D/cases.jsonl --out D/encoded \
        --height 64 --width 96 --device cpu --dtype float32

Real encoders (one node, 8 GPUs; each rank encodes cases[rank::8]):
    torchrun --nproc_per_node 8 tools/encode_cases.py --encoders ckpts/HunyuanVideo-1.5-480p_i2v-diffusers \
        --cases data/cases.jsonl --out data/encoded --height 480 --width 832 --device cuda

`cases.jsonl`: one {"case_id", "source_image", "caption"} per line (a relative source_image is relative to the
file). Every image is checked before anything is encoded. Resume: rerun the same command; finished `{case_id}.pt`
files are skipped, and `encode_config.json` in --out must match this run's settings.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from predictor_training.data.encoders import (
    VISION_CROPS,
    CaseEncoder,
    check_or_write_encode_config,
    encode_cases_to_folder,
    encode_settings,
    encoded_path,
    jobs_from_cases,
)
from predictor_training.data.sample_table import read_cases
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.distributed import (
    barrier,
    cleanup_distributed,
    init_distributed,
    log0,
)
from predictor_training.runtime.errors import CommandParser, MissingFileError, UserInputError, command
from predictor_training.runtime.flags import add_check_only_arg, add_threads_arg, check_cuda_flag, report_check_only
from predictor_training.runtime.io import check_output_folder_kind

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoders", type=Path, required=True,
                        help="diffusers-format HunyuanVideo-1.5 i2v folder (model_index.json, text_encoder, tokenizer, "
                        "text_encoder_2, tokenizer_2, image_encoder, feature_extractor, vae; transformer not needed)")
    parser.add_argument("--cases", type=Path, required=True,
                        help="JSONL with case_id, source_image, caption per line")
    parser.add_argument("--out", type=Path, required=True, help="output folder for {case_id}.pt and encode_config.json")
    parser.add_argument("--height", type=int, default=480, help="image-condition height in pixels (multiple of 16)")
    parser.add_argument("--width", type=int, default=832, help="image-condition width in pixels (multiple of 16)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: one GPU per rank (cuda:LOCAL_RANK); cpu: CPU only")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float16",
                        help="dtype of Qwen2.5-VL and SigLIP (upstream: float16)")
    parser.add_argument("--byt5_dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the ByT5 glyph encoder (upstream: float32)")
    parser.add_argument("--vae_dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the VAE (upstream trainer's producer: float32)")
    parser.add_argument("--vision_crop", choices=VISION_CROPS, default="bucket",
                        help="crop SigLIP sees: 'bucket' = the 480p bucket nearest the image's aspect ratio (upstream "
                        "inference), 'target' = the same --height x --width crop as the VAE condition")
    add_check_only_arg(parser, what="the cases it would encode and how many --out already holds")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    check_cuda_flag(parser, "--device", args.device)
    for flag in ("height", "width"):
        value = getattr(args, flag)
        if value < 16 or value % 16:
            parser.error(f"--{flag} must be a positive multiple of 16 (the VAE's spatial factor), got {value}")
    if not args.encoders.is_dir():
        parser.error(f"--encoders {args.encoders}: folder does not exist")
    if not args.cases.is_file():
        parser.error(f"--cases {args.cases}: file does not exist")
    return args


@command
def main(argv=None) -> dict:
    args = parse_args(argv)
    check_output_folder_kind(args.out, flag="--out", marker=None)  # a folder of encoder outputs, no other kind
    if args.check_only:
        jobs = jobs_from_cases(read_cases(args.cases))  # every image must exist
        done = sum(encoded_path(args.out, job.case_id).is_file() for job in jobs)  # every case_id a file name
        if not (args.encoders / "model_index.json").is_file():
            raise MissingFileError(f"--encoders {args.encoders}: no model_index.json; expected the diffusers "
                                   "HunyuanVideo-1.5 i2v folder (text_encoder/, image_encoder/, vae/, ...)")
        if args.out.exists() and not args.out.is_dir():
            raise UserInputError(f"--out {args.out}: a file; expected a folder for the {{case_id}}.pt files")
        report_check_only(f"{len(jobs)} cases from {args.cases} -> {args.out} ({done} already encoded)")
        return {"cases": len(jobs), "finished": done}
    set_cpu_threads(args.threads, tool="encode_cases", load_aware=False)
    env = init_distributed("nccl" if args.device == "cuda" else "gloo")
    try:
        # 1. cases (every image must exist) and encoders
        started = time.time()
        cases = read_cases(args.cases)
        jobs = jobs_from_cases(cases)
        for job in jobs:
            encoded_path(args.out, job.case_id)  # every case_id must be a usable file name
        encoder = CaseEncoder.from_pretrained(
            args.encoders, env.device, DTYPES[args.dtype], byt5_dtype=DTYPES[args.byt5_dtype],
            vae_dtype=DTYPES[args.vae_dtype], vision_crop=args.vision_crop,
        )
        settings = encode_settings(encoder, args.height, args.width)
        log0(f"encode_cases: {len(jobs)} cases from {args.cases} -> {args.out} on {env.world_size} rank(s); "
             f"grid {settings['grid']}, dtypes text {args.dtype} / byt5 {args.byt5_dtype} / vae {args.vae_dtype}")

        # 2. settings file: rank 0 writes (or checks) it, the others check it after
        if env.is_main:
            check_or_write_encode_config(args.out, settings, write=True)
        barrier()
        if not env.is_main:
            check_or_write_encode_config(args.out, settings, write=False)

        # 3. this rank's share
        report = encode_cases_to_folder(
            encoder, jobs, args.out, args.height, args.width, rank=env.rank, world_size=env.world_size,
            show_progress=env.is_main,
        )
        print(f"rank {env.rank}: wrote {report.written}, skipped {report.skipped} existing", flush=True)
        barrier()
        finished = sum(encoded_path(args.out, job.case_id).is_file() for job in jobs)
        log0(f"encode_cases: {finished}/{len(jobs)} cases encoded in {args.out} ({time.time() - started:.1f} s)")
        return {"written": report.written, "skipped": report.skipped, "finished": finished, "cases": len(jobs)}
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main()
