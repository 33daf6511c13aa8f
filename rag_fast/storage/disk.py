"""Single files written atomically (a temporary, fsynced, renamed), and a full disk said as
one error naming the file, the bytes needed and the bytes free."""
from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import IO, Iterator

from .swap import pid_alive


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make renames in ``folder`` durable (where the OS allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike, write, shown: str | os.PathLike | None = None) -> None:
    """``write(f)`` to a new file at ``path`` (binary), flushed and fsynced: one step of a
    protocol that renames the file itself (a training checkpoint's payload, then its
    manifest). A full disk is a :class:`NoSpaceError` naming ``shown`` (default ``path``): the
    file the temporary becomes."""
    with disk_errors(path if shown is None else shown), open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root`` (a folder written by a library's ``save_pretrained``,
    before it is swapped into place)."""
    for folder, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` (a newline added) to the file at ``path``, created if missing, never
    through a symbolic link in its place (``O_NOFOLLOW``). A full disk is a
    :class:`NoSpaceError` naming ``path``."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):  # O_NOFOLLOW met a link
            raise OSError(errno.ELOOP, f"{os.fspath(path)} is a symbolic link (to "
                          f"{os.readlink(path)!r}); refused: lines are never appended through "
                          "a link") from None
        raise
    with disk_errors(path), open(fd, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def atomic_write(path: str | os.PathLike, write) -> None:
    """``write(f)`` to a temporary file beside ``path`` (binary), fsync, then rename over
    ``path``; the temporary is removed on any failure (a full disk included). The folder of
    ``path`` is created when missing."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    with atomic_file(path, "wb") as f:
        write(f)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", hidden: bool = False) -> Iterator[IO]:
    """A file opened (``mode``: ``"w"`` text in UTF-8, or ``"wb"``) on a temporary beside
    ``path`` that becomes ``path`` when the block ends normally: flushed, fsynced, renamed
    over ``path``, the rename made durable. On any failure (a full disk: a
    :class:`NoSpaceError` naming ``path``; an interruption) the temporary is removed and
    ``path`` is as it was. The folder of ``path`` must exist. The temporary is
    ``PATH.tmp-PID-HEX``, or (``hidden``) ``.NAME.tmp-PID-HEX`` beside it, as an index build's
    staging folder names its writers' files (HEX: 8 random hexadecimal digits, so that a
    user's file named like ``PATH.tmp-PID`` is never taken for one)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tag = f"tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp = (os.path.join(folder, f".{os.path.basename(path)}.{tag}") if hidden
           else f"{path}.{tag}")
    encoding = None if "b" in mode else "utf-8"
    try:
        with disk_errors(path):
            with open(tmp, mode, encoding=encoding) as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        fsync_dir(folder)
        _remove_dead_temporaries(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


# the most a name written beside an output adds to the output's own name, with room to spare:
# a hidden temporary of its staging folder, ".NAME.staging.trash-PID-HEX" (a dot, ".staging",
# the longest tag ".trash-", a pid of up to 7 digits, "-", 8 hexadecimal digits)
NAME_ROOM = 1 + len(".staging") + len(".trash-") + 7 + 1 + 8


def check_name_length(out: str | os.PathLike, flag: str) -> None:
    """Refuse an output whose name leaves no room, under the filesystem's limit on a name
    (``NAME_MAX``, 255 bytes on Linux), for the temporaries and staging folders written beside
    it (:data:`NAME_ROOM` bytes more), before any work.

    Raises:
        ValueError: naming ``flag`` and ``out``, and the longest name that works.
    """
    name = os.path.basename(os.fspath(out).rstrip(os.sep))
    folder = os.path.dirname(os.path.abspath(os.fspath(out).rstrip(os.sep)))
    try:
        limit = os.pathconf(folder if os.path.isdir(folder) else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    size = len(os.fsencode(name))
    if size + NAME_ROOM > limit:
        raise ValueError(f"{flag} {os.fspath(out)!r}: its name is {size} bytes long, and the "
                         f"files rag_fast writes beside it while it works add up to {NAME_ROOM} "
                         f"more, past the filesystem's {limit}-byte limit on a name; use a "
                         f"name of at most {limit - NAME_ROOM} bytes")


# what atomic_file names its temporaries: NAME.tmp-PID-HEX (hidden: .NAME.tmp-PID-HEX)
TEMPORARY = re.compile(r"(?P<hidden>\.?)(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}")


def _remove_dead_temporaries(path: str) -> None:
    """Remove what atomic writes of ``path`` by processes that are gone left (``PATH.tmp-PID-HEX``
    and ``.NAME.tmp-PID-HEX``, killed before their rename): the path is written now. A file
    named otherwise (``PATH.tmp-PID``, say) is not rag_fast's and stays."""
    folder, name = os.path.split(os.path.abspath(path))
    for stale in (glob.glob(os.path.join(glob.escape(folder), glob.escape(name) + ".tmp-*"))
                  + glob.glob(os.path.join(glob.escape(folder), "." + glob.escape(name)
                                           + ".tmp-*"))):
        found = TEMPORARY.fullmatch(os.path.basename(stale))
        if found is None or found["name"] != name:
            continue
        if not pid_alive(int(found["pid"])) and os.path.isfile(stale) \
                and not os.path.islink(stale):
            with contextlib.suppress(OSError):
                os.remove(stale)


# ---- a full disk ---------------------------------------------------------------------------
# fewer free inodes than this, said with a full disk's error: a writer's removed temporaries
# give back a few before the count is read
FEW_INODES = 64


class NoSpaceError(OSError):
    """The disk (or the user's quota) has no room for a file being written: one line naming
    the file, the bytes it needs and the bytes free (``errno`` is ``ENOSPC`` or ``EDQUOT``)."""

    def __init__(self, path: str | os.PathLike, needed: int | None, free: int | None,
                 code: int = errno.ENOSPC):
        what = "disk quota exceeded" if code == errno.EDQUOT else "no space left on device"
        message = f"{what} writing {os.fspath(path)}"
        if needed is not None:
            message += f": needs {needed} bytes ({_mib(needed)})"
        if free is not None:
            message += f"{',' if needed is not None else ':'} {free} free ({_mib(free)})"
        inodes = inodes_free(path) if code == errno.ENOSPC else None
        if inodes is not None and inodes < FEW_INODES:  # bytes left, but hardly room for files
            # (counted once the writer removed its temporaries: a few may be free again)
            message += (f"; {'no' if inodes == 0 else f'only {inodes}'} inode"
                        f"{'' if inodes == 1 else 's'} free: the filesystem can hold no more "
                        "files")
        super().__init__(code, message)
        self.path, self.needed, self.free = os.fspath(path), needed, free

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):
        return type(self), (self.path, self.needed, self.free, self.errno)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _existing(path: str | os.PathLike) -> Path:
    """``path``, or its nearest existing parent (what a filesystem query can be asked of)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_free(path: str | os.PathLike) -> int | None:
    """Bytes free for an unprivileged writer on the filesystem of ``path`` (or of its nearest
    existing parent), or None where the system cannot say."""
    try:
        return int(shutil.disk_usage(_existing(path)).free)
    except OSError:
        return None


def inodes_free(path: str | os.PathLike) -> int | None:
    """Inodes (files) an unprivileged writer may still create on the filesystem of ``path``
    (or of its nearest existing parent), or None where the system cannot say (a filesystem
    without a fixed count reports 0 files in all)."""
    try:
        st = os.statvfs(_existing(path))
    except (OSError, AttributeError):
        return None
    return None if st.f_files == 0 else int(st.f_favail)


def is_no_space(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the quota) is full."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def no_space(exc: OSError, path: str | os.PathLike, needed: int | None = None) -> OSError:
    """``exc`` as a :class:`NoSpaceError` naming ``path`` when it says the disk is full, else
    ``exc`` itself. The free space is read now (after the caller removed its temporary
    files); a :class:`NoSpaceError` keeps the file and the bytes it names."""
    if isinstance(exc, NoSpaceError):  # (the caller's ``needed`` where the writer knew none)
        return NoSpaceError(exc.path, exc.needed if exc.needed is not None else needed,
                            disk_free(exc.path), exc.errno)
    if not is_no_space(exc):
        return exc
    return NoSpaceError(path, needed, disk_free(path), exc.errno)


def reserve_space(fd: int, path: str | os.PathLike, nbytes: int) -> None:
    """Allocate ``nbytes`` on disk for the open file ``fd`` (written as ``path``) before any
    of it is written, so that a full disk is reported now, as one :class:`NoSpaceError`,
    rather than part-way through (or, for a file written through a memory map, as a SIGBUS
    that kills the process). On a filesystem that cannot allocate ahead, the free space is
    checked instead and the file extended, and the writes themselves report a full disk.

    Raises:
        NoSpaceError: the filesystem has fewer than ``nbytes`` free.
        OSError: another error of the filesystem.
    """
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except AttributeError:  # no posix_fallocate on this platform
        pass
    except OSError as exc:
        if is_no_space(exc):
            raise NoSpaceError(path, nbytes, disk_free(path), exc.errno) from None
        if exc.errno == errno.EFBIG:  # the process's file size limit (ulimit -f)
            raise _too_large(path) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            raise
    free = disk_free(path)
    if free is not None and free < nbytes:
        raise NoSpaceError(path, nbytes, free)
    try:
        os.ftruncate(fd, nbytes)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            raise _too_large(path) from None
        raise


_NEARLY_FULL = 64 << 20  # free bytes below which a failed write is taken for a full disk


@contextlib.contextmanager
def disk_errors(path: str | os.PathLike) -> Iterator[None]:
    """Say a full disk as a :class:`NoSpaceError` naming ``path`` when a library writing
    ``path`` fails its own way: its message names the full disk (safetensors, faiss), or it is
    a RuntimeError while the disk holding ``path`` is nearly full (``torch.save``, whose error
    gives no reason). Other failures pass unchanged."""
    try:
        yield
    except NoSpaceError:
        raise
    except OSError as e:
        if is_no_space(e) or _copies_found_no_space(e):
            raise NoSpaceError(path, None, disk_free(path), e.errno or errno.ENOSPC) from None
        if e.errno == errno.EFBIG:
            raise _too_large(path) from None
        raise
    except Exception as e:
        if _interrupted(e):  # Ctrl-C inside the library's write, hidden by its own error
            raise KeyboardInterrupt from None
        if isinstance(e, RuntimeError) and _file_size_limit() is not None:
            # torch.save's writer met the process's file size limit (EFBIG, no reason given)
            raise _too_large(path) from None
        text = str(e)
        if "os error 27" in text or "File too large" in text:  # safetensors' EFBIG
            raise _too_large(path) from None
        free = disk_free(path)
        says_so = "No space left" in text or "os error 28" in text or "ENOSPC" in text
        # torch.save's RuntimeError on a full disk names no reason ("unexpected pos ...")
        guess = isinstance(e, RuntimeError) and free is not None and free < _NEARLY_FULL
        if says_so or guess:
            raise NoSpaceError(path, None, free) from None
        raise


def _copies_found_no_space(exc: OSError) -> bool:
    """Whether ``exc`` is ``shutil.copytree``'s list of failed copies (a ``shutil.Error``,
    whose errno is None) holding one that found the disk full."""
    if not isinstance(exc, shutil.Error) or not exc.args or not isinstance(exc.args[0], list):
        return False
    return any(isinstance(failed, tuple) and any(
        f"[Errno {code}]" in str(part) for part in failed for code in (errno.ENOSPC, errno.EDQUOT))
        for failed in exc.args[0])


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a KeyboardInterrupt was being handled (torch.save's
    zip writer, interrupted mid-write, raises "unexpected pos" on its way out)."""
    seen: set[int] = set()
    cause = exc.__context__ or exc.__cause__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return True
        seen.add(id(cause))
        cause = cause.__context__ or cause.__cause__
    return False


def _file_size_limit() -> int | None:
    """The most bytes this process may write to one file (``ulimit -f``), None: no limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _too_large(path: str | os.PathLike) -> OSError:
    """The one-line error of a write stopped by the file size limit (``ulimit -f``)."""
    limit = _file_size_limit()
    most = f" of {limit} bytes ({_mib(limit)})" if limit is not None else ""
    return OSError(errno.EFBIG, f"file too large writing {os.fspath(path)}: this process may "
                   f"write files{most} at most (ulimit -f); raise the limit")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    atomic_write(path, lambda f: f.write(data))
