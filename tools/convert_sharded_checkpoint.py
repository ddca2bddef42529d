"""Convert a sharded (DCP) checkpoint of an FSDP2 role into one consolidated safetensors file, for export
(docs/loop.md).

    python tools/convert_sharded_checkpoint.py RUN/training_latest.pt --out teacher.safetensors
    python tools/convert_sharded_checkpoint.py RUN/training_latest.pt --role generator --dtype bfloat16 --out g.safetensors
    python tools/convert_sharded_checkpoint.py RUN/training_latest.dcp --role teacher --out teacher.safetensors

A full-parameter run (`fvtools/train_*.py --train full` under FSDP2) writes its model and AdamW state as per-rank
shards into `training_latest.dcp/` next to `training_latest.pt` (predictor_training/runtime/sharded_checkpoint.py).
This reads the role's model (not the optimizer) as full tensors in one process, without a process group and at any
world size, and writes `{parameter name: tensor}` (the plain module's `state_dict()` keys) atomically, with the
training state's meta and step in the header. Given the `.pt`, the folder is the one holding its token (so an
interrupted save's leftovers are never read). Memory: the model in FP32 (34 GB at 8.6B parameters), then the
written dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from predictor_training.runtime.checkpoint import read_training_state
from predictor_training.runtime.errors import CommandParser, UserInputError, command
from predictor_training.runtime.flags import add_check_only_arg, report_check_only
from predictor_training.runtime.io import atomic_write, save_safetensors
from predictor_training.runtime.sharded_checkpoint import (
    SHARDED_SUFFIX,
    read_sharded_state,
    saved_roles,
    sharded_folder_for,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    parser = CommandParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="training_latest.pt (or training_prev.pt) of a run with a "
                        "sharded role, or a sharded folder (*.dcp) itself")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    parser.add_argument("--role", default=None, help="the role to convert (default: the only sharded role)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the floating tensors written (default %(default)s: the FP32 master weights)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file (default: refuse)")
    add_check_only_arg(parser, what="the role and the sharded folder it would read, and the file it would write")
    args = parser.parse_args(argv)
    if args.out.suffix != ".safetensors":
        parser.error(f"--out {args.out}: expected a path ending in .safetensors")
    if args.out.exists() and not args.overwrite:
        parser.error(f"--out {args.out}: exists; pass --overwrite to replace it, or another --out")
    if not args.checkpoint.exists():
        parser.error(f"checkpoint {args.checkpoint} does not exist")
    if args.checkpoint.suffix not in (".pt", SHARDED_SUFFIX):
        parser.error(f"checkpoint {args.checkpoint}: expected a training state (.pt) or a sharded folder "
                     f"({SHARDED_SUFFIX})")
    return args


def resolve(args) -> tuple[Path, str, dict]:
    """(sharded folder, role, header metadata) of the command line."""
    if args.checkpoint.suffix == ".pt":
        payload = read_training_state(args.checkpoint)
        sharded = sorted(name for name, entry in payload["roles"].items() if "sharded" in entry)
        if not sharded:
            raise UserInputError(f"{args.checkpoint} holds no sharded role (roles {sorted(payload['roles'])}); its "
                             "weights are in the file itself")
        role = args.role or (sharded[0] if len(sharded) == 1 else None)
        if role not in sharded:
            raise UserInputError(f"--role {args.role}: {args.checkpoint} holds the sharded roles {sharded}; name one")
        folder = sharded_folder_for(args.checkpoint, payload["roles"][role]["sharded"])
        metadata = {**payload["meta"], "role": role, "step": int(payload["run_state"]["global_step"])}
        return folder, role, metadata
    roles = saved_roles(args.checkpoint)
    role = args.role or (roles[0] if len(roles) == 1 else None)
    if role not in roles:
        raise UserInputError(f"--role {args.role}: {args.checkpoint} holds the roles {roles}; name one")
    return args.checkpoint, role, {"role": role}


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    folder, role, metadata = resolve(args)
    if args.check_only:
        return report_check_only(f"role {role!r} of {folder} -> {args.out} ({args.dtype})")
    model = read_sharded_state(folder, role, optimizer=False)["model"]
    dtype = DTYPES[args.dtype]
    tensors = {name: (tensor.to(dtype) if torch.is_floating_point(tensor) else tensor).contiguous()
               for name, tensor in model.items()}
    header = {"format": "predictor_training.consolidated_sharded_checkpoint", "source": str(folder),
              "dtype": args.dtype, "meta": json.dumps(metadata, sort_keys=True)}
    atomic_write(args.out, lambda tmp: save_safetensors(tensors, tmp, header))
    count = sum(tensor.numel() for tensor in tensors.values())
    print(f"wrote {args.out}: role {role!r}, {len(tensors)} tensors, {count:,} values in {args.dtype}, from {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
