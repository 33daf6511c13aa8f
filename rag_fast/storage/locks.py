"""One writer at a time: the lock of an output a command writes, and the shared lock of the
staging folder the ``--shard`` builds of one index write together."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
from pathlib import Path
from typing import Callable, Iterator


# ---- one writer at a time ------------------------------------------------------------------
# An output is locked while a command writes it: a second command given the same output (the
# same folder by any path: the lock is keyed by its real path) is refused at once, naming the
# holder, instead of racing the first for the temporary files. The lock is filelock's (flock on
# Unix), on a file in a folder of this user's under the system's temporary folder, so that
# nothing is written beside or inside the output; the kernel drops it when the holder exits,
# however it ends. It is one machine's lock: two machines writing one network folder are not
# kept apart.
_LOCKS = "rag_fast-locks"


class OutputLockedError(FileExistsError):
    """Another process writes the same output now."""


def _lock_folder() -> Path:
    """This user's lock folder (created 0700), refused unless it is a folder the user owns."""
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"{_LOCKS}-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if not folder.is_dir() or folder.is_symlink() or info.st_uid != os.getuid():
        raise OSError(errno.EPERM, f"the lock folder {folder} is not a folder of this user's "
                      "(a symbolic link, or another user's); remove it or set TMPDIR")
    return folder


def _lock_holder(lock_file: Path) -> int | None:
    """The process id holding a flock on ``lock_file`` (/proc/locks, Linux), else None."""
    try:
        inode = lock_file.stat().st_ino
        with open("/proc/locks") as f:
            for line in f:  # "1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF"
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and \
                        fields[5].rsplit(":", 1)[-1] == str(inode):
                    return int(fields[4])
    except (OSError, ValueError):
        return None
    return None


@contextlib.contextmanager
def output_lock(out: str | os.PathLike, flag: str = "output") -> Iterator[None]:
    """Hold the lock of the output ``out`` (a folder or a file, existing or not) for the block.

    Raises:
        OutputLockedError: another process holds it; the message names ``flag``, ``out`` as
            given and the holder's process id where the system tells it.
    """
    from filelock import FileLock, Timeout

    real = os.path.realpath(os.path.abspath(os.fspath(out)))
    key = hashlib.sha256(os.fsencode(real)).hexdigest()[:32]
    lock_file = _lock_folder() / f"{key}.lock"
    lock = FileLock(str(lock_file), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        holder = _lock_holder(lock_file)
        who = f"process {holder}" if holder is not None else "another process"
        raise OutputLockedError(
            f"{flag} {os.fspath(out)!r} is being written by {who} (another rag-fast command "
            "with the same output); refused: wait for it to end, or choose another "
            "path") from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def shared_lock(path: str | os.PathLike, shared: bool, flag: str,
                who: str) -> Iterator[Callable[[], bool]]:
    """Hold a lock on ``path`` (a folder, existing or not; keyed like :func:`output_lock`)
    for the block: ``shared`` with the other holders of a shared lock, or exclusive. The
    ``--shard`` builds of one index hold it shared on its staging folder and a full build
    exclusive, so a full build never discards or removes a staging folder that a shard build
    is writing, and a shard build never writes one a full build is working in.

    Yields ``alone()``: whether this holder is now the only one, the lock made exclusive
    (a shared holder that fails its work asks before it removes what it created; a False may
    leave it holding no lock, which is fine for one that is about to end).

    Raises:
        OutputLockedError: the other kind is held; the message names ``flag``, ``path`` as
            given, ``who`` holds it and its process id where the system tells it.
    """
    import fcntl

    real = os.path.realpath(os.path.abspath(os.fspath(path)))
    key = hashlib.sha256(b"shared:" + os.fsencode(real)).hexdigest()[:32]
    lock_file = _lock_folder() / f"{key}.lock"
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(lock_file)
            pid = f" (process {holder})" if holder is not None else ""
            raise OutputLockedError(
                f"{flag} {os.fspath(path)!r} is in use by {who}{pid}; refused: wait for it to "
                "end") from None

        def alone() -> bool:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False
            return True

        yield alone
    finally:
        os.close(fd)  # (the lock goes with it)
