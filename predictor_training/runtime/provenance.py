"""Where a weights file came from, by hash (its provenance), and the run config it carries without the machine's
paths (docs/runs.md § Provenance).

Every weights file a recipe writes (predictor_step_XXXXX.safetensors and its `_ema_` twin, a method's LoRA file or
model folder) records `provenance` in its metadata (the inference file's `meta`, the LoRA's and model folder's
`metadata`):

    {"format": 1,
     "teacher_sha256":             sha256 of the Teacher's weights file (what `sha256sum
                                   teacher/diffusion_pytorch_model.safetensors` prints; a Teacher of several weight
                                   files: the sha256 of their `sha256sum` listing, in name order),
     "teacher_config_sha256":      the toolkit's Teacher config hash (`teacher.source.teacher_config_sha256`, the one
                                   a dataset records and `load_teacher` checks),
     "teacher_action_ckpt_sha256": sha256 of the action checkpoint loaded on the Teacher, or null (none),
     "parent_sha256":              sha256 of the weights the run started from (--init_from), or null (none: it
                                   started from the Teacher or from scratch),
     "dataset_config_sha256":      sha256 of the training data's config JSON (dataset_config.json,
                                   ode_cache_config.json or video_dataset_config.json), or null (none),
     "names": {"teacher": ..., "parent": ..., "dataset_config": ...}: each input's last two path components, for
                                   a reader (a name is no identity: `init_from` has named two files; the hash is),
     "unknown": {key: why}:        only for a value that is null because nobody recorded it (a file whose
                                   provenance was written afterwards, tools/fix_provenance.py)}

Paths. The run config a weights file carries holds no absolute path of the machine: every absolute path in it is
written relative to the file's folder (its run directory) as `$RUN_DIR/<relative path>`, e.g. the dataset of a run
in /data/runs/r1 becomes `$RUN_DIR/../../datasets/d1` (`portable_paths`). A reader expands `$RUN_DIR` to the folder
the file is read from (`expand_run_dir`): a file in its run directory still finds its Teacher and dataset, a copied
one names them, and the hashes say what they were. A path with no relative form (a Windows drive) keeps its last
two components after `$ELSEWHERE/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from predictor_training.runtime.errors import UserInputError
from predictor_training.runtime.io import HASH_BLOCK_BYTES, atomic_write, sha256_bytes, sha256_file

PROVENANCE_KEY = "provenance"
PROVENANCE_FORMAT = 1
RUN_DIR_MARK = "$RUN_DIR"  # the folder the weights file sits in
ELSEWHERE_MARK = "$ELSEWHERE"  # a path with no relative form: its last two components follow
NOT_RECORDED = "no provenance recorded"
HASHED_INPUTS = ("teacher", "parent", "dataset_config")  # the inputs named in `names` (their *_sha256 keys)
_WINDOWS_PATH = re.compile(r"^(?:[A-Za-z]:[\\/]|\\\\[^\\]+\\)")
# An absolute path inside a longer text: '/' after a start, space, quote, '=', ':', '(' or ',', two components at
# least (so "fx/(2cx)" and "a / b" are not paths), or a drive letter.
_EMBEDDED_PATH = re.compile(r"(?:^|(?<=[\s'\"=:(,\[]))(?:/[\w.+@~-]+/[\w.+@~/-]*|[A-Za-z]:[\\/][\w.+@~\\/ -]+)")


# ---------------------------------------------------------------------------------------------------------------
# 1. Hashes of the inputs
# ---------------------------------------------------------------------------------------------------------------
_SHA256_CACHE: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, remembered per (real path, size, mtime) in this process: a real Teacher (tens of GB) is
    read once however many files record it."""
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = (real, stat.st_size, stat.st_mtime_ns)
    if key not in _SHA256_CACHE:
        _SHA256_CACHE[key] = sha256_file(real)
    return _SHA256_CACHE[key]


def weight_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of a model: `path` itself when a file, else the folder's *.safetensors (or, lacking any,
    *.bin) in name order. A folder without weights raises UserInputError."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not files:
        raise UserInputError(f"{path}: no weight files (*.safetensors or *.bin); expected a model folder or file")
    return files


def weights_sha256(path: str | os.PathLike) -> str:
    """sha256 of a model's weights (`weight_files`): one file's own sha256 (`sha256sum FILE`); several files' the
    sha256 of their `sha256sum` listing ("<sha256>  <name>\\n" per file, name order)."""
    files = weight_files(path)
    if len(files) == 1:
        return file_sha256(files[0])
    listing = "".join(f"{file_sha256(file)}  {file.name}\n" for file in files)
    return sha256_bytes(listing.encode("utf-8"))


def path_name(path: str | os.PathLike | None) -> str | None:
    """The last two components of a path, e.g. "teacher/diffusion_pytorch_model.safetensors" (None stays None)."""
    if path is None:
        return None
    parts = PurePosixPath(Path(os.path.abspath(path)).as_posix()).parts
    return "/".join(parts[-2:])


def make_provenance(*, teacher_sha256: str | None, teacher_config_sha256: str | None,
                    teacher_action_ckpt_sha256: str | None, parent_sha256: str | None,
                    dataset_config_sha256: str | None, names: dict, unknown: dict | None = None) -> dict:
    """The provenance record (module docstring); `unknown`: {key: why} for the values nobody recorded."""
    record = {
        "format": PROVENANCE_FORMAT,
        "teacher_sha256": teacher_sha256,
        "teacher_config_sha256": teacher_config_sha256,
        "teacher_action_ckpt_sha256": teacher_action_ckpt_sha256,
        "parent_sha256": parent_sha256,
        "dataset_config_sha256": dataset_config_sha256,
        "names": {key: names.get(key) for key in HASHED_INPUTS},
    }
    if unknown:
        wrong = sorted(set(unknown) - {key for key in record if key.endswith("_sha256")})
        if wrong:
            raise ValueError(f"provenance unknown keys {wrong}: expected *_sha256 keys of the record")
        if any(record[key] is not None for key in unknown):
            raise ValueError(f"provenance: {sorted(unknown)} are said to be unknown but have values")
        record["unknown"] = dict(unknown)
    return record


# ---------------------------------------------------------------------------------------------------------------
# 2. Reading it back
# ---------------------------------------------------------------------------------------------------------------
def config_provenance(config: dict | None) -> dict | None:
    """The provenance a run config carries (`derived.provenance`, written by `data.provenance.run_provenance`);
    None for a config that records none (a run made before provenance existed, a test's bare config)."""
    derived = (config or {}).get("derived") or {}
    return derived.get(PROVENANCE_KEY)


def with_provenance(metadata: dict | None, config: dict | None) -> dict:
    """`metadata` plus `provenance`: the run config's (`config_provenance`), when it records one: what a weights
    file written from that run stores."""
    provenance = config_provenance(config)
    return dict(metadata or {}) if provenance is None else {**(metadata or {}), PROVENANCE_KEY: provenance}


def recorded_provenance(metadata: dict) -> dict | None:
    """The provenance in a weights file's metadata (meta / metadata dict), or None when it records none (a file
    written before provenance existed)."""
    provenance = metadata.get(PROVENANCE_KEY)
    if provenance is not None and provenance.get("format") != PROVENANCE_FORMAT:
        raise UserInputError(f"provenance format {provenance.get('format')!r}; this code reads {PROVENANCE_FORMAT}")
    return provenance


def describe_provenance(provenance: dict | None) -> str:
    """One line: each input's short hash and name, "unknown" or "none"; "no provenance recorded" for None."""
    if provenance is None:
        return NOT_RECORDED
    unknown = provenance.get("unknown", {})
    parts = []
    for key in HASHED_INPUTS:
        sha = provenance[f"{key}_sha256"]
        name = provenance["names"].get(key)
        label = key.replace("_", " ")
        if sha is not None:
            parts.append(f"{label} {sha[:12]}" + (f" ({name})" if name else ""))
        elif f"{key}_sha256" in unknown:
            parts.append(f"{label} unknown")
        else:
            parts.append(f"{label} none")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# 3. Paths: no absolute path of the machine in what a weights file carries
# ---------------------------------------------------------------------------------------------------------------
def is_absolute_path(text: str) -> bool:
    """A POSIX absolute path ("/data/x") or a Windows one ("C:\\data", "C:/data", "\\\\server\\share")."""
    return text.startswith("/") or bool(_WINDOWS_PATH.match(text))


def portable_path(text: str, run_dir: str | os.PathLike) -> str:
    """`text` as a weights file in `run_dir` records it: an absolute path becomes `$RUN_DIR/<path relative to
    run_dir>` (both real paths, so `..` means the same as on disk), a Windows path `$ELSEWHERE/<last two
    components>`; anything else is kept."""
    if not isinstance(text, str) or not is_absolute_path(text):
        return text
    if _WINDOWS_PATH.match(text):
        return f"{ELSEWHERE_MARK}/" + "/".join(PureWindowsPath(text).parts[-2:])
    relative = os.path.relpath(os.path.realpath(text), os.path.realpath(run_dir))
    return RUN_DIR_MARK if relative == "." else f"{RUN_DIR_MARK}/{Path(relative).as_posix()}"


def portable_paths(value: Any, run_dir: str | os.PathLike) -> Any:
    """`value` (plain JSON data) with every string that is an absolute path made `portable_path`."""
    if isinstance(value, dict):
        return {key: portable_paths(item, run_dir) for key, item in value.items()}
    if isinstance(value, list):
        return [portable_paths(item, run_dir) for item in value]
    if isinstance(value, str):
        return portable_path(value, run_dir)
    return value


def expand_run_dir(value: Any, folder: str | os.PathLike) -> Any:
    """The inverse a reader applies: every `$RUN_DIR[/...]` string made a path under `folder` (the folder the
    weights file is read from); older files' absolute paths and everything else are kept."""
    if isinstance(value, dict):
        return {key: expand_run_dir(item, folder) for key, item in value.items()}
    if isinstance(value, list):
        return [expand_run_dir(item, folder) for item in value]
    if isinstance(value, str) and value == RUN_DIR_MARK:
        return str(folder)
    if isinstance(value, str) and value.startswith(RUN_DIR_MARK + "/"):
        return str(Path(folder) / value[len(RUN_DIR_MARK) + 1:])
    return value


def absolute_paths_in(value: Any) -> list[str]:
    """Every string in `value` (plain JSON data) that is an absolute path or holds one (a POSIX path of two
    components at least, or a Windows drive): what a shipped file may not contain."""
    if isinstance(value, dict):
        return [found for item in value.values() for found in absolute_paths_in(item)]
    if isinstance(value, list):
        return [found for item in value for found in absolute_paths_in(item)]
    if isinstance(value, str):
        if is_absolute_path(value):
            return [value]
        return _EMBEDDED_PATH.findall(value)
    return []


# ---------------------------------------------------------------------------------------------------------------
# 4. A safetensors file's header, rewritten without touching its tensors
# ---------------------------------------------------------------------------------------------------------------
def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(the JSON header: "__metadata__" and each tensor's dtype, shape and data offsets; the byte offset where the
    tensor data starts) of a safetensors file."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise UserInputError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", prefix)
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise UserInputError(f"{path}: not a safetensors file (its header is not JSON: {error})") from None
    return header, 8 + length


def tensor_bytes_sha256(path: str | os.PathLike) -> str:
    """sha256 of a safetensors file's tensor data (everything after the header), byte for byte."""
    _, start = read_safetensors_header(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        handle.seek(start)
        for block in iter(lambda: handle.read(HASH_BLOCK_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def rewrite_safetensors_metadata(path: str | os.PathLike, metadata: dict[str, str]) -> Path:
    """Replace a safetensors file's "__metadata__" (string values) and nothing else: the tensor entries and the
    data bytes are copied as they are (atomically: temp file + rename). The header is padded with spaces to a
    multiple of 8 bytes, as safetensors writes it."""
    header, start = read_safetensors_header(path)
    if not all(isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()):
        raise TypeError("safetensors metadata must map strings to strings")
    header = {"__metadata__": dict(metadata), **{key: value for key, value in header.items() if key != "__metadata__"}}
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)

    def write(tmp: Path) -> None:
        with open(path, "rb") as source, open(tmp, "wb") as target:
            target.write(struct.pack("<Q", len(encoded)))
            target.write(encoded)
            source.seek(start)
            for block in iter(lambda: source.read(HASH_BLOCK_BYTES), b""):
                target.write(block)

    return atomic_write(path, write)
