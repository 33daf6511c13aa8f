"""On-disk helpers shared by the passage store and the index: atomic directories, manifests
with checksums, ragged arrays.

Every directory we write is assembled under a temporary sibling name and renamed into place
in one step, so a crash or an interrupt leaves either the old directory or nothing at the
output path, never a half-written one. Every manifest lists each file's size and SHA-256;
loading checks the sizes always and the checksums unless told not to.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

MANIFEST = "manifest.json"
_CHUNK = 1 << 23  # 8 MiB per read while hashing


class StorageError(ValueError):
    """A stored directory is missing, corrupt, truncated or does not match what was asked."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe_files(root: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size, "sha256": digest}} for files under ``root``."""
    return {n: {"bytes": (root / n).stat().st_size, "sha256": sha256_file(root / n)} for n in names}


def write_json(path: Path, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(root: Path, kind: str, verify: bool = True) -> dict:
    """Read ``root/manifest.json`` of the given ``kind`` and check the files it lists.

    Raises:
        StorageError: the directory or manifest is missing or unreadable, the kind differs,
            a file is missing, has the wrong size (truncated) or the wrong checksum (corrupt).
    """
    root = Path(root)
    if not root.is_dir():
        raise StorageError(f"path {str(root)!r} is not a directory (expected a saved {kind})")
    try:
        with open(root / MANIFEST) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise StorageError(
            f"{str(root)!r} has no {MANIFEST}: not a saved {kind}, or its build was interrupted"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StorageError(f"{root / MANIFEST} is corrupt (not valid JSON: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != kind:
        found = manifest.get("kind") if isinstance(manifest, dict) else None
        raise StorageError(f"{root / MANIFEST} describes a {found!r}, expected a {kind!r}")
    for name, meta in manifest.get("files", {}).items():
        path = root / name
        if not path.is_file():
            raise StorageError(f"{kind} file {str(path)!r} listed in the manifest is missing")
        size = path.stat().st_size
        if size != meta["bytes"]:
            raise StorageError(
                f"{kind} file {str(path)!r} has {size} bytes, the manifest says {meta['bytes']} "
                "(truncated or overwritten)"
            )
        if verify and sha256_file(path) != meta["sha256"]:
            raise StorageError(
                f"{kind} file {str(path)!r} fails its SHA-256 checksum (corrupt); rebuild it"
            )
    return manifest


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` when the block exits normally.

    On any exception (KeyboardInterrupt included) the temporary directory is removed and
    ``out`` is left untouched. With ``overwrite`` an existing ``out`` is replaced; without it,
    an existing ``out`` raises FileExistsError before any work starts.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output path {str(out)!r} already exists (pass overwrite=True)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, trash / "old")
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


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
        offsets = np.load(root / f"{name}.offsets.npy", mmap_mode="r")
        path = root / f"{name}.values.bin"
        count = path.stat().st_size // np.dtype(dtype).itemsize
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

    def close(self) -> int:
        """Flush the values and write the offsets; returns the number of rows."""
        self._values.flush()
        os.fsync(self._values.fileno())
        self._values.close()
        np.save(self.root / f"{self.name}.offsets.npy", np.asarray(self._offsets, dtype=np.int64))
        return len(self._offsets) - 1
