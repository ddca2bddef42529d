"""File writes, fingerprints, safetensors reads and secrets: the one implementation of each that the toolkit uses.

Atomic writes:

`<name>.tmp` in the target's folder, fsync, `os.replace` over the target, then fsync of the folder so the rename
itself is durable. A crash (even SIGKILL) at any point leaves the previous target untouched; on an exception the
temp file is removed and the exception propagates.

The written file gets the ordinary permissions of a new file, 0666 minus the process umask (0644 under umask 022),
whatever the writer gave its temp file (safetensors' `save_file`, for one, creates 0600 files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

import safetensors
import safetensors.torch

from predictor_training.runtime.errors import UserInputError

SWANLAB_KEY_ENV = "SWANLAB_API_KEY"
_SECRET_KEY_MARKERS = ("api_key", "apikey", "token", "secret", "password")
REDACTED = "<redacted>"
HASH_BLOCK_BYTES = 1 << 22


def _new_file_mode() -> int:
    """0o666 minus the current umask (os.umask can only be read by setting it, so it is set back at once)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write_fn: Callable[[Path], None]) -> Path:
    """Write `path` via `write_fn(tmp_path)` into `<path>.tmp` in the same folder, fsync, then `os.replace`.
    Returns `path` as a Path."""
    path = Path(path)
    tmp_path = path.with_name(path.name + ".tmp")
    try:
        write_fn(tmp_path)
        os.chmod(tmp_path, _new_file_mode())
        with open(tmp_path, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """`data` to `path`, atomically (the folder must exist)."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def write_text_atomic(path: str | os.PathLike, text: str, *, newline: str | None = None) -> Path:
    """UTF-8 `text` to `path`, atomically (the folder must exist); `newline` as for `open` ("" writes it as is)."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8", newline=newline))


def write_json_atomic(path: str | os.PathLike, obj) -> Path:
    """`json.dump(obj, indent=2)` to `path`, atomically (raises on values JSON cannot hold, NaN included)."""
    text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False) + "\n"
    return write_text_atomic(path, text)


# ------------------------------------------------------------------------------------------------ fingerprints
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
        for block in iter(lambda: handle.read(HASH_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ files users write
def read_json_file(path: str | os.PathLike, error: type[UserInputError] = UserInputError):
    """The JSON value in `path`; a file that is not UTF-8 or not JSON raises `error` naming it (a missing file
    stays FileNotFoundError)."""
    data = Path(path).read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as problem:
        raise error(f"{path}: byte {problem.start} ({data[problem.start:problem.start + 1]!r}) is not UTF-8; "
                    "expected UTF-8 JSON") from None
    except json.JSONDecodeError as problem:
        raise error(f"{path}: not valid JSON ({problem})") from None


def read_jsonl_objects(path: str | os.PathLike, error: type[UserInputError] = UserInputError,
                       what: str = "") -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL table; a line that is not UTF-8, not JSON or not a
    JSON object raises `error` naming `what` (e.g. "clip table "), the file and the line."""
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{what}{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as problem:
                raise error(f"{where}: byte {problem.start} ({raw[problem.start:problem.start + 1]!r}) is not "
                            "UTF-8; expected UTF-8 text (save the file as UTF-8)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as problem:
                raise error(f"{where}: not valid JSON ({problem})") from None
            if not isinstance(record, dict):
                raise error(f"{where}: expected a JSON object, got {type(record).__name__}")
            yield number, record


# ------------------------------------------------------------------------------------------------ folder kinds
# The file that marks each kind of folder the toolkit writes (at the folder's top level), and what to call it. A
# builder writes only into a new or empty folder or one of its own kind (`check_output_folder_kind`).
FOLDER_KINDS = {
    "dataset_config.json": "a Predictor dataset (tools/build_predictor_dataset.py)",
    "video_dataset_config.json": "a video-latent dataset (tools/build_video_latent_dataset.py)",
    "ode_cache_config.json": "an ODE cache (tools/build_ode_cache.py)",
    "demo_config.json": "demo assets (tools/make_demo_assets.py)",
    "world_config.json": "a demo world (tools/build_demo_world.py)",
    "train_config.json": "a run directory",
    "eval_config.json": "an eval run (tools/eval_predictor.py)",
    "model_index.json": "a diffusers pipeline folder",
    "config.json": "a model folder",
}
TEMP_SUFFIX = ".tmp"  # what `atomic_write` leaves behind when it is killed


def folder_kind(folder: str | os.PathLike, markers=None) -> str | None:
    """What `folder` holds by the marker files at its top level (`FOLDER_KINDS`, or those of `markers`; several
    joined by " and "), or None when it holds none."""
    markers = FOLDER_KINDS if markers is None else markers
    kinds = [FOLDER_KINDS[marker] for marker in markers if (Path(folder) / marker).is_file()]
    return " and ".join(kinds) or None


def check_output_folder_kind(folder: str | os.PathLike, *, flag: str, marker: str | None,
                             layout: frozenset[str] | None = None) -> None:
    """Refuse (one `UserInputError` naming `flag`, the folder and what it holds) an output folder that is neither
    new, nor empty, nor of the kind marked by `marker` alone (None: a kind without a marker, which takes a folder
    that holds no marked kind). With `layout` (every top-level name the kind writes, its marker included) a folder
    of the kind that also holds other top-level names is refused too, so that a build never mixes its files into,
    replaces or prunes anything else. Call it before anything is created."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise UserInputError(f"{flag} {folder}: is a file; expected a new or empty folder")
    names = sorted(path.name for path in folder.iterdir())
    if not names:
        return
    own = None if marker is None else FOLDER_KINDS[marker]
    wanted = "a new or empty folder" + (f", or {own} to resume" if own else "")
    others = folder_kind(folder, [name for name in FOLDER_KINDS if name != marker])
    if others is not None:
        raise UserInputError(f"{flag} {folder}: holds {others}; expected {wanted}")
    if marker is not None and marker not in names:
        raise UserInputError(f"{flag} {folder}: holds {len(names)} entr{'y' if len(names) == 1 else 'ies'} (e.g. "
                             f"{names[0]!r}) but no {marker}, so it is not {own}; expected {wanted}")
    foreign = [] if layout is None else [name for name in names if name.removesuffix(TEMP_SUFFIX) not in layout]
    if foreign:
        raise UserInputError(f"{flag} {folder}: {own} that also holds {foreign[:3]}, which the build does not "
                             f"write; expected {wanted}, with nothing else in it")


class CreatedPaths:
    """What a command is about to create under `folder`, so that a refusal found only after it began writing (a
    damaged input read at step 1, a Teacher whose weights do not fit) can take it back and leave the disk as it
    was: `snapshot()` before the first write, `remove()` on the refusal. Removes only the top-level entries of
    `folder` that were not there at the snapshot, then `folder` and the ancestors it made if they are left empty;
    nothing that existed before is touched."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.first_missing: Path | None = None
        self.before: frozenset[str] = frozenset()

    def snapshot(self) -> "CreatedPaths":
        missing = None
        for path in (self.folder, *self.folder.parents):
            if path.exists():
                break
            missing = path
        self.first_missing = missing
        self.before = frozenset(os.listdir(self.folder)) if self.folder.is_dir() else frozenset()
        return self

    def remove(self) -> None:
        if not self.folder.is_dir():
            return
        for name in sorted(set(os.listdir(self.folder)) - self.before):
            path = self.folder / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        if self.first_missing is None:
            return
        for path in (self.folder, *self.folder.parents):
            if not path.is_dir() or any(path.iterdir()):
                break
            path.rmdir()
            if path == self.first_missing:
                break


# ------------------------------------------------------------------------------------------------ safetensors reads
def damaged_safetensors(path: str | os.PathLike, error: Exception) -> UserInputError:
    """The one-line error of a .safetensors file that cannot be read (empty, cut off, not safetensors at all)."""
    return UserInputError(f"{path}: damaged or not a .safetensors file ({error}); expected a complete safetensors "
                          "file")


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """`safetensors.torch.save_file`, with the header's metadata in sorted key order: the same tensors and metadata
    give the same bytes in every process (safetensors keeps the metadata in a hash map whose order changes from
    process to process). The header is rewritten in place; reordering keeps its length."""
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    if not metadata:
        return
    with open(path, "r+b") as handle:
        length = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(length))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) > length:
            raise RuntimeError(f"{path}: the sorted safetensors header is longer than the written one")
        handle.seek(8)
        handle.write(text + b" " * (length - len(text)))


def open_safetensors(path: str | os.PathLike, *, device: str = "cpu"):
    """`safetensors.safe_open(path, framework="pt")` (a context manager), a damaged file reported by name."""
    try:
        return safetensors.safe_open(str(path), framework="pt", device=device)
    except safetensors.SafetensorError as error:
        raise damaged_safetensors(path, error) from None


def load_safetensors(path: str | os.PathLike, *, device: str = "cpu") -> dict:
    """`safetensors.torch.load_file`, a damaged file reported by name."""
    try:
        return safetensors.torch.load_file(str(path), device=device)
    except safetensors.SafetensorError as error:
        raise damaged_safetensors(path, error) from None


# ------------------------------------------------------------------------------------------------ secrets
def _looks_secret(key: str) -> bool:
    lowered = key.lower()
    return any(marker in lowered for marker in _SECRET_KEY_MARKERS)


def redact_secrets(obj):
    """Copy of a JSON-like `obj` with secret-looking keys dropped and the SwanLab key's value masked anywhere."""
    secret_value = os.environ.get(SWANLAB_KEY_ENV, "")
    if isinstance(obj, dict):
        return {key: redact_secrets(value) for key, value in obj.items() if not _looks_secret(str(key))}
    if isinstance(obj, (list, tuple)):
        return [redact_secrets(value) for value in obj]
    if isinstance(obj, str) and secret_value and secret_value in obj:
        return REDACTED
    return obj
