"""Lazily opened, per-process safetensors handles of the dataset readers: files open memory-mapped in the process
that reads them (so a reader is safe to hand to DataLoader workers, fork or spawn), at most ``max_open`` at a time,
and every tensor checked against its manifest CRC-32 on its first read in the process (``shards.TensorChecksums``)
and for NaN/Inf."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from predictor_training.data.shards import TensorChecksums
from predictor_training.runtime.errors import MissingFieldError, UserInputError
from predictor_training.runtime.io import open_safetensors


def check_finite_tensor(tensor: torch.Tensor, path: Path, name: str) -> None:
    """A stored input or target with NaN/Inf (written so by the builder: its checksums match) is named with its
    file, not found later as a non-finite loss."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise UserInputError(f"{path}: tensor {name!r} holds NaN/Inf; expected finite values (rebuild this file "
                             "with tools/build_predictor_dataset.py, or leave its trajectory out of the split)")


class SafetensorsHandles:
    """A small LRU of open ``safe_open`` handles that belongs to one process.

    After a fork (DataLoader workers) the cache notices the new pid and starts empty; pickling (spawn) drops it.
    With ``checksums``, the first read of every tensor in a process reads it whole and checks its CRC-32
    (``shards.TensorChecksumError`` naming file and tensor on a mismatch); later reads are not checked again.
    """

    def __init__(self, max_open: int = 32, checksums: TensorChecksums | None = None):
        if max_open < 1:
            raise ValueError(f"max_open must be >= 1, got {max_open}")
        self.max_open = max_open
        self.checksums = checksums
        self._owner_pid = os.getpid()
        self._handles: OrderedDict[str, tuple[object, frozenset[str]]] = OrderedDict()

    def get(self, path: str | Path):
        """The open handle of ``path`` (framework "pt", CPU)."""
        return self._entry(path)[0]

    def _entry(self, path: str | Path) -> tuple[object, frozenset[str]]:
        """(handle, tensor names) of ``path``, opening it on first use in this process."""
        if self._owner_pid != os.getpid():
            self._owner_pid = os.getpid()
            self._handles = OrderedDict()
        key = str(path)
        if key in self._handles:
            self._handles.move_to_end(key)
            return self._handles[key]
        handle = open_safetensors(key)
        self._handles[key] = (handle, frozenset(handle.keys()))
        if len(self._handles) > self.max_open:
            self._handles.popitem(last=False)
        return self._handles[key]

    def _checked_entry(self, path: str | Path, name: str):
        handle, names = self._entry(path)
        if name not in names:
            raise MissingFieldError(f"{path}: no tensor {name!r}")
        return handle

    def read(self, path: str | Path, name: str) -> torch.Tensor:
        """One tensor (a copy out of the mapping); KeyError naming file and tensor when it is absent."""
        tensor = self._checked_entry(path, name).get_tensor(name)
        if self.checksums is not None:
            self.checksums.check(path, name, tensor)
        return tensor

    def read_rows(self, path: str | Path, name: str, rows: Sequence[int]) -> torch.Tensor:
        """``tensor[rows]`` along the first axis, reading only those rows (the whole tensor on its first, checked
        read). -> [len(rows), ...]"""
        handle = self._checked_entry(path, name)
        if self.checksums is not None and self.checksums.pending(path, name):
            whole = self.checksums.check(path, name, handle.get_tensor(name))
            return torch.cat([whole[row : row + 1] for row in rows], dim=0)
        view = handle.get_slice(name)
        return torch.cat([view[row : row + 1] for row in rows], dim=0)

    def __getstate__(self):
        return {"max_open": self.max_open, "checksums": self.checksums}

    def __setstate__(self, state):
        self.__init__(state["max_open"], state.get("checksums"))
