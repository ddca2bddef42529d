"""Atomic file writes, the one implementation every writer of the toolkit uses.

`<name>.tmp` in the target's folder, fsync, `os.replace` over the target, then fsync of the folder so the rename
itself is durable. A crash (even SIGKILL) at any point leaves the previous target untouched; on an exception the
temp file is removed and the exception propagates.

The written file gets the ordinary permissions of a new file, 0666 minus the process umask (0644 under umask 022),
whatever the writer gave its temp file (safetensors' `save_file`, for one, creates 0600 files).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable


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
