"""Rows of different lengths stored as one flat file plus offsets, memory-mapped on load."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from .manifests import StorageError

class RaggedArray:
    """Rows of different lengths as one flat array plus offsets: row i is
    ``values[offsets[i]:offsets[i+1]]``.

    Stored as ``<name>.values.bin`` (raw, the dtype is the caller's) and ``<name>.offsets.npy``
    (int64, N+1 entries), both memory-mapped on load, so millions of rows need no RAM until
    they are read.
    """

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values = values
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    @staticmethod
    def files(name: str) -> list[str]:
        return [f"{name}.values.bin", f"{name}.offsets.npy"]

    @classmethod
    def load(cls, root: Path, name: str, dtype: np.dtype) -> "RaggedArray":
        where = root / f"{name}.offsets.npy"
        try:  # object arrays (a pickle) cannot be mapped, nor can a bad header be read
            offsets = np.load(where, mmap_mode="r")
        except (ValueError, EOFError) as e:
            raise StorageError(f"{str(where)!r} is not an offsets array ({e})") from None
        path = root / f"{name}.values.bin"
        count = path.stat().st_size // np.dtype(dtype).itemsize
        if offsets.dtype.kind not in "iu":
            raise StorageError(f"{str(where)!r} holds {offsets.dtype} values, not integer offsets")
        if offsets.ndim != 1 or len(offsets) < 1 or int(offsets[-1]) != count:
            raise StorageError(f"ragged array {name!r} under {str(root)!r}: offsets do not match values")
        # np.memmap cannot map an empty file.
        values = np.memmap(path, dtype=dtype, mode="r") if count else np.zeros(0, dtype)
        return cls(values, offsets)


class RaggedWriter:
    """Append rows to a ragged array on disk without holding the values in memory."""

    def __init__(self, root: Path, name: str, dtype: np.dtype):
        self.root, self.name, self.dtype = root, name, np.dtype(dtype)
        self._values = open(root / f"{name}.values.bin", "wb")
        self._offsets = [0]

    def append(self, row: bytes | np.ndarray) -> None:
        data = row if isinstance(row, bytes) else np.ascontiguousarray(row, self.dtype).tobytes()
        self._values.write(data)
        self._offsets.append(self._offsets[-1] + len(data) // self.dtype.itemsize)

    def abandon(self) -> None:
        """Close the values file after a failure, dropping what it buffered (the folder it
        lies in is discarded): a full disk is said once, by the write that found it."""
        with contextlib.suppress(OSError):
            self._values.close()  # (once closed, a second close does nothing)

    def close(self) -> int:
        """Flush the values and write the offsets; returns the number of rows."""
        self._values.flush()
        os.fsync(self._values.fileno())
        self._values.close()
        np.save(self.root / f"{self.name}.offsets.npy", np.asarray(self._offsets, dtype=np.int64))
        return len(self._offsets) - 1
