"""Safetensors shards and the JSONL manifest of the predictor dataset.

One dataset file (a case or a trajectory) is one safetensors file, written atomically (``path.tmp`` then
``os.replace``) and with deterministic bytes: no metadata block (so no timestamps), contiguous CPU tensors, and the
tensor order that safetensors derives from the names and dtypes. Two builds of the same data therefore give
byte-identical files and the same sha256.

The manifest is JSONL, one canonical JSON object per finished file (keys sorted, no spaces):

    {"action_id": 3, "bytes": 123, "case_id": "c0001", "file": "trajectories/c0001__a3.safetensors",
     "kind": "trajectory", "sha256": "...", "split": "train", "tensors": {"name": [[shape...], "bfloat16"], ...}}

Appends (``append_jsonl``) are single ``write`` calls on a file opened with ``O_APPEND`` followed by ``fsync``; a
process killed in the middle of one leaves at most a last line without its newline, which ``read_jsonl`` reports
and (only when ``allow_torn_tail=True``) drops. Rewrites (``write_jsonl_atomic``) go through a temporary file.

Readers open shards lazily and memory-mapped (``safetensors.safe_open``): ``LazyShard`` opens the file on first use,
so it can be created in the parent process and pickled into DataLoader workers.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from predictor_training import atomic_io

MANIFEST_KINDS = ("case", "trajectory")
_HASH_BLOCK_BYTES = 1 << 22


class ShardVerificationError(RuntimeError):
    """A dataset file disagrees with its manifest entry (missing, wrong size/checksum/tensor list)."""


# ---- small helpers -----------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling used in manifests and configs)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; raises ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}: expected a torch dtype such as 'bfloat16' or 'float32'")
    return dtype


def canonical_json(record: Any) -> str:
    """One-line JSON with sorted keys and no spaces (the byte form used for manifests)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(record: Any) -> str:
    """Hex sha256 of `canonical_json(record)`: a fingerprint of a config that ignores key order."""
    return sha256_bytes(canonical_json(record).encode("utf-8"))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_HASH_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> dict[str, list]:
    """``{name: [shape, dtype name]}`` for a tensor dict, names sorted."""
    return {name: [list(tensors[name].shape), dtype_name(tensors[name].dtype)] for name in sorted(tensors)}


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``atomic_io``), creating its folder first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_io.write_bytes_atomic(path, data)


# ---- safetensors -------------------------------------------------------------------------------------------
def serialize_tensors(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Deterministic safetensors bytes: CPU, contiguous, no metadata."""
    if not tensors:
        raise ValueError("refusing to write a safetensors file without tensors")
    prepared = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        prepared[name] = tensor.detach().to("cpu").contiguous()
    return safetensors_save(prepared, metadata=None)


def write_safetensors_atomic(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write ``tensors`` atomically to ``path``.

    Returns:
        ``{"bytes": int, "sha256": str, "tensors": {name: [shape, dtype]}}`` - the file facts of a manifest entry.
    """
    data = serialize_tensors(tensors)
    write_bytes_atomic(path, data)
    return {"bytes": len(data), "sha256": sha256_bytes(data), "tensors": tensor_specs(tensors)}


def read_tensor_specs(path: str | os.PathLike) -> dict[str, list]:
    """``{name: [shape, dtype name]}`` of a safetensors file, read from its header only."""
    specs = {}
    with safe_open(str(path), framework="pt") as handle:
        for name in handle.keys():
            tensor_slice = handle.get_slice(name)
            specs[name] = [list(tensor_slice.get_shape()), _safetensors_dtype_name(tensor_slice.get_dtype())]
    return dict(sorted(specs.items()))


_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


def _safetensors_dtype_name(code: str) -> str:
    if code not in _SAFETENSORS_DTYPES:
        raise ValueError(f"safetensors dtype {code!r} is not supported by the dataset format")
    return _SAFETENSORS_DTYPES[code]


def load_tensors(path: str | os.PathLike, names: Iterable[str] | None = None, device: str = "cpu") -> dict:
    """Load ``names`` (default: all) from a safetensors file; a missing name raises KeyError naming the file."""
    with safe_open(str(path), framework="pt", device=device) as handle:
        available = set(handle.keys())
        wanted = sorted(available) if names is None else list(names)
        missing = [name for name in wanted if name not in available]
        if missing:
            raise KeyError(f"{path}: missing tensor(s) {missing}")
        return {name: handle.get_tensor(name) for name in wanted}


class LazyShard:
    """Memory-mapped, lazily opened view of one safetensors file.

    The handle is opened on the first access and dropped when pickled, so one instance per file can be shared
    with DataLoader worker processes.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._handle = None

    def _open(self):
        if self._handle is None:
            if not self.path.is_file():
                raise FileNotFoundError(f"dataset shard {self.path} does not exist")
            self._handle = safe_open(str(self.path), framework="pt")
        return self._handle

    def keys(self) -> list[str]:
        return list(self._open().keys())

    def __contains__(self, name: str) -> bool:
        return name in self._open().keys()

    def shape(self, name: str) -> list[int]:
        return list(self._open().get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        handle = self._open()
        if name not in handle.keys():
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        return handle.get_tensor(name)

    def __getstate__(self):
        return {"path": self.path, "_handle": None}

    def __setstate__(self, state):
        self.__dict__.update(state)


# ---- manifest ----------------------------------------------------------------------------------------------
def make_manifest_entry(
    kind: str, file: str, file_facts: Mapping[str, Any], case_id: str, action_id: int | None, split: str
) -> dict[str, Any]:
    """A manifest record. ``file`` is relative to the dataset root (POSIX separators)."""
    if kind not in MANIFEST_KINDS:
        raise ValueError(f"manifest kind must be one of {MANIFEST_KINDS}, got {kind!r}")
    if Path(file).is_absolute():
        raise ValueError(f"manifest file paths are relative to the dataset root, got absolute {file!r}")
    return {
        "kind": kind,
        "file": Path(file).as_posix(),
        "case_id": case_id,
        "action_id": action_id,
        "split": split,
        "bytes": int(file_facts["bytes"]),
        "sha256": str(file_facts["sha256"]),
        "tensors": dict(file_facts["tensors"]),
    }


def append_jsonl(path: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Append one canonical JSON line with a single ``write`` on an ``O_APPEND`` descriptor, then fsync."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (canonical_json(record) + "\n").encode("ascii")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(f"{path}: short append ({written} of {len(line)} bytes)")
        os.fsync(fd)
    finally:
        os.close(fd)


def write_jsonl_atomic(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Rewrite a JSONL file atomically (canonical JSON, one record per line)."""
    payload = "".join(canonical_json(record) + "\n" for record in records).encode("ascii")
    write_bytes_atomic(path, payload)


def read_jsonl(path: str | os.PathLike, allow_torn_tail: bool = False) -> list[dict[str, Any]]:
    """Records of a JSONL file.

    A last line without its newline is what a process killed during ``append_jsonl`` leaves behind: with
    ``allow_torn_tail`` it is dropped (the file it described is then rebuilt), otherwise it raises. A malformed
    complete line always raises, naming the file and line number.
    """
    path = Path(path)
    text = path.read_text(encoding="ascii")
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    if tail:
        if not allow_torn_tail:
            raise ValueError(f"{path}: last line has no newline (torn append?): {tail[:80]!r}")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"{path}:{number}: empty line in a JSONL file")
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not valid JSON ({error})") from error
    return records


def verify_file(entry: Mapping[str, Any], root: str | os.PathLike, check_sha256: bool = True) -> None:
    """Check that ``root / entry["file"]`` exists and matches the entry's bytes, sha256 and tensor list.

    Raises:
        ShardVerificationError naming the file and the field (``file``, ``bytes``, ``sha256``, ``tensors``) that
        disagrees, with the expected and found values.
    """
    for field in ("file", "bytes", "sha256", "tensors"):
        if field not in entry:
            raise ShardVerificationError(f"manifest entry {dict(entry)!r} has no field {field!r}")
    path = Path(root) / entry["file"]
    if not path.is_file():
        raise ShardVerificationError(f"{path}: field 'file': the file listed in the manifest does not exist")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ShardVerificationError(f"{path}: field 'bytes': expected {entry['bytes']}, found {size}")
    if check_sha256:
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ShardVerificationError(f"{path}: field 'sha256': expected {entry['sha256']}, found {digest}")
    found = read_tensor_specs(path)
    expected = {name: [list(spec[0]), spec[1]] for name, spec in entry["tensors"].items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))
        extra = sorted(set(found) - set(expected))
        changed = sorted(name for name in set(found) & set(expected) if found[name] != expected[name])
        details = [f"missing {missing}" if missing else "", f"unexpected {extra}" if extra else ""]
        details += [f"{name}: expected {expected[name]}, found {found[name]}" for name in changed[:5]]
        raise ShardVerificationError(
            f"{path}: field 'tensors' disagrees with the manifest: " + "; ".join(d for d in details if d)
        )

