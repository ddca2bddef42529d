"""The offline dataset's manifest (``manifest.jsonl``, layout: docs/dataset.md): one entry per file (kind, file,
case, action, split, size, sha256 and the per-tensor CRC-32s), read with the last entry of a file winning; the listed
files checked to exist, their whole-file checksums verified, and the per-tensor checksums handed to the readers
(a manifest written before per-tensor checksums existed loads with one ``UncheckedTensorsWarning``)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from predictor_training.data.shards import (
    MANIFEST_KINDS,
    TENSOR_CHECKSUM_FIELD,
    TensorChecksums,
    check_listed_file,
    read_jsonl,
    verify_file,
)
from predictor_training.runtime.errors import MissingFieldError, MissingFileError, UserInputError

MANIFEST_NAME = "manifest.jsonl"
MANIFEST_FIELDS = ("kind", "file", "case_id", "action_id", "split", "bytes", "sha256", "tensors")
_HEX_DIGITS = set("0123456789abcdef")


class UncheckedTensorsWarning(UserWarning):
    """Dataset files whose manifest entries have no per-tensor checksums: their tensors are read unchecked."""


@dataclass(frozen=True)
class ManifestEntry:
    """One line of ``manifest.jsonl``: a finished case or trajectory file.

    ``tensors`` maps a tensor name to ``(shape, dtype)`` as recorded by the builder, so shapes (for example the number
    of context frames of a chunk) are known without reading any tensor. ``tensor_crc32`` maps every tensor name to
    its CRC-32 (None for a manifest written before per-tensor checksums).
    """

    kind: str
    file: str
    case_id: str
    action_id: int | None
    split: str
    bytes: int
    sha256: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    record: dict = field(repr=False, compare=False)
    tensor_crc32: dict[str, str] | None = field(default=None, repr=False)

    def shape(self, tensor_name: str) -> tuple[int, ...]:
        """Recorded shape of one tensor; KeyError naming the file and tensor when the builder did not record it."""
        if tensor_name not in self.tensors:
            raise MissingFieldError(f"manifest entry for {self.file!r} lists no tensor {tensor_name!r}")
        return self.tensors[tensor_name][0]


def read_manifest(root: str | Path) -> list[ManifestEntry]:
    """Parse ``root/manifest.jsonl`` (``shards.read_jsonl``). A file listed twice keeps its last entry.

    Raises:
        FileNotFoundError: no manifest; ValueError naming the line and field for a malformed line.
    """
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise MissingFileError(f"dataset manifest not found: {path}")
    by_file: dict[str, ManifestEntry] = {}
    for line_number, record in enumerate(read_jsonl(path), start=1):
        entry = _parse_manifest_record(record, f"{path} line {line_number}")
        by_file.pop(entry.file, None)
        by_file[entry.file] = entry
    return list(by_file.values())


def _parse_manifest_record(record: dict, where: str) -> ManifestEntry:
    missing = [name for name in MANIFEST_FIELDS if name not in record]
    if missing:
        raise UserInputError(f"{where}: missing field(s) {missing}; expected fields {list(MANIFEST_FIELDS)}")
    if record["kind"] not in MANIFEST_KINDS:
        raise UserInputError(f"{where}: field 'kind' is {record['kind']!r}, expected one of {MANIFEST_KINDS}")
    if record["kind"] == "trajectory" and not isinstance(record["action_id"], int):
        raise UserInputError(f"{where}: field 'action_id' is {record['action_id']!r}, expected an int for a trajectory")
    tensors = {}
    for name, spec in record["tensors"].items():
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)):
            raise UserInputError(f"{where}: tensors[{name!r}] is {spec!r}, expected [shape list, dtype string]")
        tensors[name] = (tuple(int(size) for size in spec[0]), str(spec[1]))
    checksums = record.get(TENSOR_CHECKSUM_FIELD)
    if checksums is not None:
        valid = isinstance(checksums, dict) and all(
            isinstance(value, str) and len(value) == 8 and set(value) <= _HEX_DIGITS for value in checksums.values()
        )
        if not valid:
            raise UserInputError(f"{where}: field {TENSOR_CHECKSUM_FIELD!r} must map tensor names to 8 hex digits")
        if sorted(checksums) != sorted(tensors):
            raise UserInputError(
                f"{where}: field {TENSOR_CHECKSUM_FIELD!r} names {sorted(checksums)[:6]}, field 'tensors' names "
                f"{sorted(tensors)[:6]}: they must list the same tensors"
            )
        checksums = dict(checksums)
    return ManifestEntry(
        kind=record["kind"],
        file=record["file"],
        case_id=str(record["case_id"]),
        action_id=record["action_id"],
        split=str(record["split"]),
        bytes=int(record["bytes"]),
        sha256=str(record["sha256"]),
        tensors=tensors,
        record=record,
        tensor_crc32=checksums,
    )


def check_files_exist(root: str | Path, entries: Sequence[ManifestEntry]) -> None:
    """`shards.check_listed_file` for every entry: FileNotFoundError naming the first entry whose file is missing,
    ShardVerificationError naming the first whose size differs from the manifest's (a stat per file, no read)."""
    for entry in entries:
        check_listed_file(root, entry.file, entry.bytes, Path(root) / MANIFEST_NAME)


def verify_checksums(root: str | Path, entries: Sequence[ManifestEntry]) -> None:
    """``shards.verify_file`` (size, sha256, tensor list) for every entry; ShardVerificationError naming the file."""
    check_files_exist(root, entries)
    for entry in entries:
        verify_file(entry.record, root, check_sha256=True)


def tensor_checksums(root: str | Path, entries: Sequence[ManifestEntry], verified: bool = False) -> TensorChecksums:
    """The per-tensor CRC-32 of ``entries`` keyed by file path (``root / entry.file``), for checking on read.

    Entries without per-tensor checksums (a manifest written before they existed) are left out and reported in one
    ``UncheckedTensorsWarning``, unless ``verified`` (their whole files were just checked with ``verify_checksums``).
    """
    unchecked = [entry.file for entry in entries if entry.tensor_crc32 is None]
    if unchecked and not verified:
        warnings.warn(
            f"{Path(root) / MANIFEST_NAME}: {len(unchecked)} of {len(entries)} dataset files (e.g. {unchecked[0]}) "
            f"have no per-tensor checksums ({TENSOR_CHECKSUM_FIELD}; manifest written by an older builder), so their "
            "tensors are read unchecked. Rerun tools/build_predictor_dataset.py with the same arguments and --out to "
            "add them, or check the whole files up front with verify=True (--verify_dataset).",
            UncheckedTensorsWarning,
            stacklevel=3,
        )
    return TensorChecksums({Path(root) / entry.file: entry.tensor_crc32 for entry in entries if entry.tensor_crc32})
