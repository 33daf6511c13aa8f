"""Directories swapped into place in one step (``renameat2(RENAME_EXCHANGE)`` on Linux, two
renames elsewhere), and what killed writers left beside them recovered or removed."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator


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


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False where the OS or file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, f"cannot swap {str(a)!r} and {str(b)!r}: {os.strerror(err)}")


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def sibling(out: Path, tag: str) -> Path:
    """A new temporary sibling of ``out`` for this process: ``.NAME.TAG-PID-HEX``."""
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
        if m and not pid_alive(int(m.group(2))):
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


def remove_leftovers(out: Path) -> None:
    """Remove the temporary siblings of ``out`` whose writers are no longer alive."""
    for _, path in _leftovers(out):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def private_folder(parent: Path, name: str) -> Iterator[Path]:
    """A new folder ``parent/.NAME.tmp-PID-HEX`` that only this writer uses (several threads or
    processes may build the same ``name`` beside one another), removed with what it still
    holds on every way out: what is finished is moved out of it first."""
    tmp = Path(parent) / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
