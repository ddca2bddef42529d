"""Safetensors shards and the JSONL manifest of the predictor dataset.

One dataset file (a case or a trajectory) is one safetensors file, written atomically (``path.tmp`` then
``os.replace``) and with deterministic bytes: no metadata block (so no timestamps), contiguous CPU tensors, and the
tensor order that safetensors derives from the names and dtypes. Two builds of the same data therefore give
byte-identical files and the same sha256.

The manifest is JSONL, one canonical JSON object per finished file (keys sorted, no spaces):

    {"action_id": 3, "bytes": 123, "case_id": "c0001", "file": "trajectories/c0001__a3.safetensors",
     "kind": "trajectory", "sha256": "...", "split": "train", "tensor_crc32": {"name": "1a2b3c4d", ...},
     "tensors": {"name": [[shape...], "bfloat16"], ...}}

``tensor_crc32`` holds one CRC-32 per tensor, of the tensor's bytes in the file (its ``data_offsets`` range), so a
reader can check every tensor when it loads it, without hashing the whole file (``TensorChecksums``,
``check_tensor_crc32``). Manifests written before this field existed lack it; their tensors cannot be checked
one by one (the whole-file ``sha256`` of ``verify_file`` still can).

Appends (``append_jsonl``) are single ``write`` calls on a file opened with ``O_APPEND`` followed by ``fsync``; a
process killed in the middle of one leaves at most a last line without its newline, which ``read_jsonl`` reports
and (only when ``allow_torn_tail=True``) drops. Rewrites (``write_jsonl_atomic``) go through a temporary file.

Readers open shards lazily and memory-mapped (``safetensors.safe_open``): ``LazyShard`` opens the file on first use,
so it can be created in the parent process and pickled into DataLoader workers.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from safetensors.torch import save as safetensors_save

from predictor_training.runtime import io as atomic_io
from predictor_training.runtime.errors import MissingFieldError, MissingFileError, UserInputError
from predictor_training.runtime.io import HASH_BLOCK_BYTES, canonical_json, open_safetensors, sha256_bytes, sha256_file

MANIFEST_KINDS = ("case", "trajectory")
TENSOR_CHECKSUM_FIELD = "tensor_crc32"


class ShardVerificationError(UserInputError):
    """A dataset file disagrees with its manifest entry (missing, wrong size/checksum/tensor list)."""


class TensorChecksumError(ShardVerificationError):
    """A tensor read from a dataset file disagrees with the per-tensor checksum of its manifest entry."""


# ---- small helpers -----------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling used in manifests and configs)."""
    return str(dtype).removeprefix("torch.")


def crc32_hex(data) -> str:
    """CRC-32 (zlib) of a bytes-like object as 8 lowercase hex digits."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def tensor_crc32(tensor: torch.Tensor) -> str:
    """CRC-32 of a tensor's bytes in C order: on a little-endian host (x86, ARM), the bytes safetensors stores."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return crc32_hex(flat.view(torch.uint8).numpy())


def _safetensors_header(prefix: bytes, source: str) -> tuple[dict, int]:
    """(header dict, byte offset of the data section) from the first bytes of a safetensors file."""
    if len(prefix) < 8:
        raise ShardVerificationError(f"{source}: not a safetensors file (shorter than its 8-byte header length)")
    header_size = int.from_bytes(prefix[:8], "little")
    if len(prefix) < 8 + header_size:
        raise ShardVerificationError(f"{source}: not a safetensors file (header of {header_size} bytes is cut off)")
    header = json.loads(bytes(prefix[8 : 8 + header_size]))
    header.pop("__metadata__", None)
    return header, 8 + header_size


def safetensors_tensor_crc32(data: bytes) -> dict[str, str]:
    """``{name: crc32}`` of serialised safetensors bytes: each tensor's ``data_offsets`` range, names sorted."""
    header, start = _safetensors_header(data, "safetensors bytes")
    view = memoryview(data)
    checksums = {}
    for name in sorted(header):
        begin, end = header[name]["data_offsets"]
        checksums[name] = crc32_hex(view[start + begin : start + end])
    return checksums


def file_tensor_crc32(path: str | os.PathLike) -> dict[str, str]:
    """``safetensors_tensor_crc32`` of a file on disk, read in 4 MiB blocks (for entries written without it)."""
    with open(path, "rb") as handle:
        length = handle.read(8)
        header, start = _safetensors_header(length + handle.read(int.from_bytes(length, "little")), str(path))
        checksums = {}
        for name in sorted(header):
            begin, end = header[name]["data_offsets"]
            handle.seek(start + begin)
            value, remaining = 0, end - begin
            while remaining > 0:
                block = handle.read(min(remaining, HASH_BLOCK_BYTES))
                if not block:
                    raise ShardVerificationError(f"{path}: tensor {name!r} ends past the end of the file")
                value = zlib.crc32(block, value)
                remaining -= len(block)
            checksums[name] = f"{value & 0xFFFFFFFF:08x}"
    return checksums


def check_tensor_crc32(path: str | os.PathLike, name: str, tensor: torch.Tensor, expected: str) -> torch.Tensor:
    """Return ``tensor`` when its CRC-32 is ``expected``; else TensorChecksumError naming file, tensor and both."""
    found = tensor_crc32(tensor)
    if found != expected:
        raise TensorChecksumError(
            f"{path}: tensor {name!r}: field '{TENSOR_CHECKSUM_FIELD}': expected {expected}, found {found} (the file "
            "was damaged after it was written; rerun tools/build_predictor_dataset.py with the same arguments and "
            "--out to rebuild it)"
        )
    return tensor


class TensorChecksums:
    """Expected per-tensor CRC-32 of dataset files; each (file, tensor) is checked once per process.

    Args:
        expected: ``{file path: {tensor name: crc32}}``. A file without an entry (a manifest written before
            per-tensor checksums) is not checked.

    ``check`` after a fork starts a fresh record of what this process verified; pickling (DataLoader workers under
    spawn) keeps the expected values and drops that record.
    """

    def __init__(self, expected: Mapping[str | os.PathLike, Mapping[str, str]]):
        self.expected = {str(path): dict(values) for path, values in expected.items()}
        self._owner_pid = os.getpid()
        self._verified: set[tuple[str, str]] = set()

    def _verified_here(self) -> set[tuple[str, str]]:
        if self._owner_pid != os.getpid():
            self._owner_pid = os.getpid()
            self._verified = set()
        return self._verified

    def pending(self, path: str | os.PathLike, name: str) -> bool:
        """True when this process still has to check ``name`` of ``path`` (a checksum exists, not yet checked)."""
        key = str(path)
        return key in self.expected and (key, name) not in self._verified_here()

    def check(self, path: str | os.PathLike, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Check ``tensor`` (the whole stored tensor ``name`` of ``path``) unless done already; returns it.

        Raises:
            TensorChecksumError naming the file, the tensor and the expected and found values; also when the
            manifest lists checksums for the file but none for this tensor.
        """
        if not self.pending(path, name):
            return tensor
        values = self.expected[str(path)]
        if name not in values:
            raise TensorChecksumError(
                f"{path}: tensor {name!r}: field '{TENSOR_CHECKSUM_FIELD}' of its manifest entry has no value for it"
            )
        check_tensor_crc32(path, name, tensor, values[name])
        self._verified.add((str(path), name))
        return tensor

    def __getstate__(self):
        return {"expected": self.expected}

    def __setstate__(self, state):
        self.__init__(state["expected"])


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
        ``{"bytes": int, "sha256": str, "tensor_crc32": {name: crc32}, "tensors": {name: [shape, dtype]}}`` - the
        file facts of a manifest entry.
    """
    data = serialize_tensors(tensors)
    write_bytes_atomic(path, data)
    return {"bytes": len(data), "sha256": sha256_bytes(data), TENSOR_CHECKSUM_FIELD: safetensors_tensor_crc32(data),
            "tensors": tensor_specs(tensors)}


def read_tensor_specs(path: str | os.PathLike) -> dict[str, list]:
    """``{name: [shape, dtype name]}`` of a safetensors file, read from its header only."""
    specs = {}
    with open_safetensors(path) as handle:
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


def load_tensors(path: str | os.PathLike, names: Iterable[str] | None = None, device: str = "cpu",
                 checksums: TensorChecksums | None = None) -> dict:
    """Load ``names`` (default: all) from a safetensors file; a missing name raises KeyError naming the file.

    With ``checksums`` every loaded tensor is checked against the manifest's per-tensor CRC-32 (once per process;
    TensorChecksumError naming file and tensor on a mismatch).
    """
    with open_safetensors(path, device=device) as handle:
        available = set(handle.keys())
        wanted = sorted(available) if names is None else list(names)
        missing = [name for name in wanted if name not in available]
        if missing:
            raise MissingFieldError(f"{path}: missing tensor(s) {missing}")
        tensors = {name: handle.get_tensor(name) for name in wanted}
    if checksums is not None:
        for name, tensor in tensors.items():
            checksums.check(path, name, tensor)
    return tensors


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
                raise MissingFileError(f"dataset shard {self.path} does not exist")
            self._handle = open_safetensors(self.path)
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
            raise MissingFieldError(f"{self.path}: no tensor named {name!r}")
        return handle.get_tensor(name)

    def __getstate__(self):
        return {"path": self.path, "_handle": None}

    def __setstate__(self, state):
        self.__dict__.update(state)


# ---- manifest ----------------------------------------------------------------------------------------------
def make_manifest_entry(
    kind: str, file: str, file_facts: Mapping[str, Any], case_id: str, action_id: int | None, split: str
) -> dict[str, Any]:
    """A manifest record. ``file`` is relative to the dataset root (POSIX separators).

    ``file_facts`` is what ``write_safetensors_atomic`` returns; its per-tensor checksums (``tensor_crc32``) are
    copied when present.
    """
    if kind not in MANIFEST_KINDS:
        raise ValueError(f"manifest kind must be one of {MANIFEST_KINDS}, got {kind!r}")
    if Path(file).is_absolute():
        raise ValueError(f"manifest file paths are relative to the dataset root, got absolute {file!r}")
    entry = {
        "kind": kind,
        "file": Path(file).as_posix(),
        "case_id": case_id,
        "action_id": action_id,
        "split": split,
        "bytes": int(file_facts["bytes"]),
        "sha256": str(file_facts["sha256"]),
        "tensors": dict(file_facts["tensors"]),
    }
    if TENSOR_CHECKSUM_FIELD in file_facts:
        entry[TENSOR_CHECKSUM_FIELD] = dict(file_facts[TENSOR_CHECKSUM_FIELD])
    return entry


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
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as error:
        raise UserInputError(f"{path}: byte {error.start} is not ASCII; expected canonical JSON lines") from None
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    if tail:
        if not allow_torn_tail:
            raise UserInputError(f"{path}: last line has no newline (torn append?): {tail[:80]!r}")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise UserInputError(f"{path}:{number}: empty line in a JSONL file")
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise UserInputError(f"{path}:{number}: not valid JSON ({error})") from error
    return records


def check_listed_file(root: str | os.PathLike, file: str, recorded_bytes: int, manifest: str | os.PathLike) -> None:
    """The check every reader makes when it opens a dataset, for each file it will read: the file exists and has the
    size its manifest entry records (a stat, no read), so a file cut short or replaced is named at the start, not
    when a step reaches it. The sha256 and every tensor's checksum are checked on read (and with --verify_dataset)."""
    path = Path(root) / file
    if not path.is_file():
        raise MissingFileError(f"{manifest} lists {file!r} but {path} does not exist")
    size = path.stat().st_size
    if size != int(recorded_bytes):
        raise ShardVerificationError(f"{path}: {size} bytes, but {manifest} records {int(recorded_bytes)}; expected "
                                     "the file as the builder wrote it (cut short or replaced since: rerun the "
                                     "builder with the same arguments and --out to rebuild it)")


def verify_file(entry: Mapping[str, Any], root: str | os.PathLike, check_sha256: bool = True) -> None:
    """Check that ``root / entry["file"]`` exists and matches the entry's bytes, sha256 and tensor list.

    When the entry has per-tensor checksums (``tensor_crc32``), they must name exactly the listed tensors (their
    values are checked when the tensors are read, and they are implied by a matching sha256).

    Raises:
        ShardVerificationError naming the file and the field (``file``, ``bytes``, ``sha256``, ``tensors``,
        ``tensor_crc32``) that disagrees, with the expected and found values.
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
    if TENSOR_CHECKSUM_FIELD in entry and sorted(entry[TENSOR_CHECKSUM_FIELD]) != sorted(expected):
        raise ShardVerificationError(
            f"{path}: field '{TENSOR_CHECKSUM_FIELD}' names tensors {sorted(entry[TENSOR_CHECKSUM_FIELD])}, "
            f"the file has {sorted(expected)}"
        )

