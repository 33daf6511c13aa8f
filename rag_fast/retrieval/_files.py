"""On-disk helpers shared by the passage store and the index: atomic directories, manifests
with checksums, ragged arrays.

Every directory we write is assembled under a temporary sibling name and swapped into place
in one step (``renameat2(RENAME_EXCHANGE)`` on Linux), so a crash, a kill or an interrupt
leaves either the old directory or the new one at the output path, never a half-written one
and never nothing. Where the exchange is unavailable the swap takes two renames; a writer
killed between them leaves the path empty for a moment, and the next open or save of that
path (:func:`recover_directory`) puts the complete directory back. Leftovers of killed writers
(siblings named ``.NAME.{tmp,new,old,trash}-PID-*`` whose PID is no longer alive) are removed
by the next save.

Every manifest lists each file's size and SHA-256; loading checks the sizes always and the
checksums unless told not to. Checksum cost, streamed SHA-256 in 8 MiB reads (OpenSSL via
hashlib, one core; measured on the development machine, a Xeon VM with 2 shared cores, on a
1 GiB file in the page cache): about 0.95 s per GiB (~1.05 GiB/s); in memory SHA-256 ran at
0.76 s/GB and BLAKE2b was slower (1.7 s/GB). A cold cache adds the disk's read time.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path, PurePosixPath
from typing import Iterator

import numpy as np

MANIFEST = "manifest.json"
_CHUNK = 1 << 23  # 8 MiB per read while hashing
_SHA256 = re.compile(r"[0-9a-f]{64}")


class StorageError(ValueError):
    """A stored directory is missing, corrupt, truncated or does not match what was asked."""


def sha256_file(path: Path) -> str:
    """Streamed SHA-256 of a file (constant memory; about 0.95 s per GiB, see the module doc)."""
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


def _check_files_entry(manifest_path: Path, files: object) -> dict[str, dict]:
    """The ``files`` entry of a manifest, validated: a non-empty {relative path: {"bytes": int
    >= 0, "sha256": 64 lowercase hex digits}}."""
    if not isinstance(files, dict) or not files:
        raise StorageError(f"{manifest_path}: key 'files' must be a non-empty object "
                           f"{{name: {{'bytes', 'sha256'}}}}, got {files!r:.80}")
    for name, meta in files.items():
        parts = PurePosixPath(name).parts
        if not name or name.startswith("/") or ".." in parts or "\\" in name:
            raise StorageError(f"{manifest_path}: key 'files' lists {name!r}, expected a relative "
                               "path inside the directory")
        if not isinstance(meta, dict):
            raise StorageError(f"{manifest_path}: key 'files.{name}' must be an object with 'bytes' "
                               f"and 'sha256', got {meta!r:.80}")
        size = meta.get("bytes")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise StorageError(f"{manifest_path}: key 'files.{name}.bytes' must be an int >= 0, "
                               f"got {size!r:.80}")
        digest = meta.get("sha256")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise StorageError(f"{manifest_path}: key 'files.{name}.sha256' must be 64 lowercase hex "
                               f"digits, got {digest!r:.80}")
    return files


# How errors name a kind of directory (the manifest's "kind" key) to a user.
KIND_WORDS = {"rag_fast.index_bundle": "an index directory from `rag-fast index build`",
              "rag_fast.passage_store": "a passage store (an index directory's passages/)",
              "rag_fast.dense_index": "a saved index (an index directory's index/)"}


def read_manifest(root: Path, kind: str, verify: bool = True) -> dict:
    """Read ``root/manifest.json`` of the given ``kind`` and check the files it lists.

    First recovers ``root`` if a killed save left it missing (see :func:`recover_directory`).

    Raises:
        StorageError: the directory or manifest is missing or unreadable, the kind differs,
            the ``files`` entry is missing or malformed, a file is missing, has the wrong size
            (truncated) or the wrong checksum (corrupt).
    """
    root = Path(root)
    recover_directory(root)
    if not root.is_dir():
        raise StorageError(f"path {str(root)!r} is not a directory (expected "
                           f"{KIND_WORDS.get(kind, f'a saved {kind}')})")
    try:
        with open(root / MANIFEST) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise StorageError(
            f"{str(root)!r} has no {MANIFEST}: not {KIND_WORDS.get(kind, f'a saved {kind}')}, or "
            "its build was interrupted"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StorageError(f"{root / MANIFEST} is corrupt (not valid JSON: {exc})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != kind:
        found = manifest.get("kind") if isinstance(manifest, dict) else None
        raise StorageError(f"{root / MANIFEST} describes a {found!r}, expected a {kind!r}")
    if "files" not in manifest:
        raise StorageError(f"{root / MANIFEST}: missing key 'files' (each file's bytes and sha256); "
                           "nothing could be checked")
    for name, meta in _check_files_entry(root / MANIFEST, manifest["files"]).items():
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


# ---- atomic directories ---------------------------------------------------------------------
_TAGS = ("tmp", "new", "old", "trash")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_renameat2 = None
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
except (AttributeError, OSError):  # not glibc >= 2.28 / not Linux
    _renameat2 = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the OS or file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, f"cannot swap {str(a)!r} and {str(b)!r}: {os.strerror(err)}")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def _leftovers(out: Path) -> list[tuple[str, Path]]:
    """(tag, path) of the siblings of ``out`` left by writers that are no longer alive."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.({'|'.join(_TAGS)})-(\d+)-[0-9a-f]+")
    found = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m and not _pid_alive(int(m.group(2))):
            found.append((m.group(1), entry))
    return found


def recover_directory(out: str | os.PathLike) -> bool:
    """Put back a directory that a save killed between its two renames left missing.

    When ``out`` does not exist: the newest complete new directory of a dead writer
    (``.NAME.new-PID-*``) is renamed into place, else the newest old directory one moved aside
    (``.NAME.old-PID-*``, or the ``.NAME.old-*/old`` of earlier versions of this library).
    Best effort: returns whether ``out`` was restored and never raises (a read-only parent is
    left alone).
    """
    out = Path(out)
    try:
        if out.exists() or out.is_symlink() or not out.parent.is_dir():
            return False
        dead = _leftovers(out)

        def by_age(paths) -> list[Path]:
            return sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True)

        legacy = re.compile(rf"\.{re.escape(out.name)}\.old-[A-Za-z0-9_]+")
        candidates = (by_age(p for tag, p in dead if tag == "new")
                      + by_age(p for tag, p in dead if tag == "old")
                      + by_age(p / "old" for p in out.parent.iterdir()
                               if legacy.fullmatch(p.name) and (p / "old").is_dir()))
        if not candidates:
            return False
        os.rename(candidates[0], out)
        if candidates[0].name == "old":  # legacy: drop the now empty holder
            with contextlib.suppress(OSError):
                candidates[0].parent.rmdir()
        return True
    except OSError:
        return False


def _remove_leftovers(out: Path) -> None:
    """Remove the temporary siblings of ``out`` whose writers are no longer alive."""
    for _, path in _leftovers(out):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` when the block exits normally.

    On any exception (KeyboardInterrupt included) the temporary directory is removed and
    ``out`` is left untouched. With ``overwrite`` an existing ``out`` is replaced atomically:
    after a kill at any point ``out`` holds the old or the new directory, or (only where the
    OS cannot exchange two directories) is restored by the next open or save, see
    :func:`recover_directory`. Before any work, a missing ``out`` is recovered and the
    leftovers of dead writers (``.NAME.{tmp,new,old,trash}-PID-*``) are removed.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False (before any work starts).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(out)
    _remove_leftovers(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output path {str(out)!r} already exists (pass overwrite=True)")
    tmp = _sibling(out, "tmp")
    tmp.mkdir()
    mine = [tmp]  # what to remove at the end
    moved_aside: Path | None = None
    try:
        yield tmp
        if not out.exists():
            os.replace(tmp, out)
        elif not _exchange(tmp, out):  # (exchanged: out is the new directory, tmp the old one)
            new, old, trash = _sibling(out, "new"), _sibling(out, "old"), _sibling(out, "trash")
            mine += [new, trash]
            os.replace(tmp, new)  # complete: recover_directory may install a dead writer's .new-*
            os.replace(out, old)
            moved_aside = old
            os.replace(new, out)
            moved_aside = None
            mine.append(old)
            os.replace(old, trash)  # so that an .old-* is always a complete directory
    finally:
        if moved_aside is not None and not out.exists():
            with contextlib.suppress(OSError):  # failed between the renames: put the old one back
                os.replace(moved_aside, out)
        for path in mine:
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)


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
