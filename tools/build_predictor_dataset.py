r"""Build the Predictor training dataset: the Teacher's F-F-F-F rollouts, stored as safetensors + a JSONL manifest.

Per case (image-caption pair): one text prefill (text K/V of every double block, valid tokens only) and the
image-condition latent -> ``cases/{case_id}.safetensors``. Per trajectory (case x camera action, one sample-table
row): the 8-chunk autoregressive rollout of ``predictor_training.rollout.ar_rollout`` with noise and memory points from the
row's seed, recorded step by step -> ``trajectories/{case_id}__a{action_id}.safetensors``. Layout: docs/dataset.md.

Demo (CPU, seconds):
    python tools/make_demo_assets.py --out demo_data/D
    python tools/build_predictor_dataset.py --demo demo_data/D --out demo_data/DS
    torchrun --nproc_per_node 2 tools/build_predictor_dataset.py --demo demo_data/D --out demo_data/DS

Real data (one node, 8 GPUs; the paths of docs/walkthrough.md § Paths: $TEACHER the base transformer
$CKPTS/HunyuanVideo-1.5/transformer/480p_i2v, $ACTION_CKPT the action model
$CKPTS/HY-WorldPlay/ar_distilled_action_model/diffusion_pytorch_model.safetensors):
    torchrun --nproc_per_node 8 tools/build_predictor_dataset.py --teacher $TEACHER --action_ckpt $ACTION_CKPT \
        --samples $SAMPLES/train.jsonl,$SAMPLES/holdout25.jsonl,$SAMPLES/holdout50.jsonl \
        --encoded $ENCODED --out $DATASET

Planning (no weights loaded): add ``--dry_run`` to print the trajectory count and the estimated size;
``--check_only`` checks every input (tables, encoder outputs, the Teacher's config, the action checkpoint, a dataset
already in --out) and says what a build would do.

Distribution: trajectory i (in table order) is built by rank i % world_size; rank 0 builds the case files first
(the other ranks wait, then read them). Every rank appends one manifest line per finished file to its own part file
``manifest_parts/rank{r}.jsonl``; at the end rank 0 merges all parts into ``manifest.jsonl`` (sorted by file name, so
it does not depend on the world size) and removes the parts. Resume: rerun the same command; a file whose manifest
(or part) entry matches it (size, sha256, tensor list) is skipped, everything else is (re)built.

This file is the command line; the builder is ``predictor_training.data.builder`` (``run``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from predictor_training.data.builder import DTYPES, BuildOptions, run
from predictor_training.data.sample_table import FINAL_SPLIT
from predictor_training.rollout.ar_rollout import RolloutConfig
from predictor_training.runtime.cpu_threads import set_cpu_threads
from predictor_training.runtime.errors import CommandParser, command
from predictor_training.runtime.flags import add_check_only_arg, add_threads_arg, check_cuda_flag, settings_from_flags
from predictor_training.runtime.io import read_json_file


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_argument_group("inputs (either --demo D, or --teacher/--samples/--encoded)")
    source.add_argument("--demo", type=Path, help="demo asset folder of tools/make_demo_assets.py: uses D/teacher, "
                        "every D/samples/*.jsonl table but final.jsonl (the split nothing is chosen on never enters "
                        "a dataset) and D/encoded")
    source.add_argument("--teacher", type=Path, help="Teacher transformer folder (config.json + safetensors, "
                        "diffusers layout): the base transformer, $CKPTS/HunyuanVideo-1.5/transformer/480p_i2v")
    source.add_argument("--action_ckpt", type=Path, help="WorldPlay action checkpoint loaded on top of --teacher "
                        "(strict): $CKPTS/HY-WorldPlay/ar_distilled_action_model/diffusion_pytorch_model.safetensors")
    source.add_argument("--samples", type=str, help="comma-separated sample tables (JSONL); the split of a row is "
                        "its table's file stem (train.jsonl -> 'train'); a final.jsonl is refused")
    source.add_argument("--encoded", type=Path, help="folder of encoder outputs {case_id}.pt (upstream .pt layout)")
    parser.add_argument("--out", type=Path, required=True, help="dataset root to create or resume")
    parser.add_argument("--num_latents", type=int, default=None, help="latent frames per trajectory (pose files must "
                        "have exactly this many); default 32 (= 125 video frames = 8 chunks), with --demo the "
                        "num_latents of D/demo_config.json")
    parser.add_argument("--prefeature_layers", type=str, default=None, help="comma-separated double blocks whose "
                        "input hidden state is stored for every context prefill; default: 0,1,depth-2,depth-1 "
                        "(= 0,1,52,53 for the real 54-block Teacher, i.e. the source blocks (1,52) and (0,53))")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="Teacher compute dtype: "
                        "bfloat16 = the real pipeline (bf16 weights, bf16 autocast, bf16 running latents); "
                        "float32 = exact fp32 rollout")
    parser.add_argument("--storage_dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the stored "
                        "floating tensors (poses, timesteps and sigmas are always float32)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto = cuda:LOCAL_RANK "
                        "when CUDA is available, else cpu (the process group uses nccl / gloo accordingly)")
    parser.add_argument("--dry_run", action="store_true", help="print the trajectory count and the estimated "
                        "dataset size, then exit (reads only the Teacher config, the tables and the encoder masks)")
    parser.add_argument("--assume_grid", type=str, default=None, help="dry run without encoder outputs: latent grid "
                        "HxW (e.g. 30x52 for 480x832)")
    parser.add_argument("--assume_text_tokens", type=int, default=None, help="dry run without encoder outputs: "
                        "text tokens kept per case (SigLIP + valid ByT5 + valid LLM)")
    parser.add_argument("--stop_after", type=int, default=None, help="debug: each rank stops after building this "
                        "many trajectories (no manifest is written; rerun to resume)")
    add_check_only_arg(parser, what="the trajectory and case counts and whether --out is a new dataset or one to "
                       "resume")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    check_cuda_flag(parser, "--device", args.device)

    if args.demo is not None:
        conflicting = [flag for flag in ("teacher", "action_ckpt", "samples", "encoded") if getattr(args, flag)]
        if conflicting:
            parser.error(f"--demo replaces --{', --'.join(conflicting)}; give one or the other")
        if not (args.demo / "teacher").is_dir():
            parser.error(f"--demo {args.demo}: no teacher folder {args.demo / 'teacher'}")
        args.teacher = args.demo / "teacher"
        tables = sorted(path for path in (args.demo / "samples").glob("*.jsonl") if path.stem != FINAL_SPLIT)
        if not tables:
            parser.error(f"--demo {args.demo}: no sample tables {args.demo / 'samples'}/*.jsonl")
        args.samples = [str(path) for path in tables]
        args.encoded = args.demo / "encoded"
        if args.num_latents is None:
            demo_config = read_json_file(args.demo / "demo_config.json")
            args.num_latents = int(demo_config["num_latents"])
    else:
        missing = [flag for flag in ("teacher", "samples", "encoded") if getattr(args, flag) is None]
        if missing and not (args.dry_run and missing == ["encoded"]):
            parser.error(f"missing --{', --'.join(missing)} (or use --demo D)")
        args.samples = [item for item in args.samples.split(",") if item]
    if args.num_latents is None:
        args.num_latents = 32
    if args.num_latents < 1 or args.num_latents % RolloutConfig.chunk_latents:
        parser.error(f"--num_latents must be a positive multiple of {RolloutConfig.chunk_latents} (latents per "
                     f"chunk), got {args.num_latents}")
    if args.stop_after is not None and args.stop_after < 1:
        parser.error(f"--stop_after must be >= 1, got {args.stop_after}")
    if args.prefeature_layers is not None:
        try:
            args.prefeature_layers = tuple(int(item) for item in args.prefeature_layers.split(",") if item)
        except ValueError:
            parser.error(f"--prefeature_layers must be comma-separated ints, got {args.prefeature_layers!r}")
    if args.assume_grid is not None:
        try:
            height, width = (int(item) for item in args.assume_grid.lower().split("x"))
        except ValueError:
            parser.error(f"--assume_grid must be HxW (e.g. 30x52), got {args.assume_grid!r}")
        args.assume_grid = (height, width)
    return args


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    set_cpu_threads(args.threads, tool="build_predictor_dataset", load_aware=False)
    return run(settings_from_flags(BuildOptions, args))


if __name__ == "__main__":
    sys.exit(main())
