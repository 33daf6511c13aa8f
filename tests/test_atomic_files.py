"""atomic_directory replaces a directory without a gap: after a kill at any point the path
holds the old or the new directory (or the next open puts it back), and the next save removes
the leftovers of dead writers. Kills are real (SIGKILL in a subprocess) or simulated
(os.replace raising)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from rag_fast.retrieval import DenseIndex, StorageError
from rag_fast import storage
from rag_fast.storage import atomic_directory, describe_files, read_manifest, write_manifest

KIND = "rag_fast.test_payload"


def write_payload(tmp, value: str) -> None:
    (tmp / "v.txt").write_text(value)
    write_manifest(tmp / "manifest.json", {"kind": KIND, "files": describe_files(tmp, ["v.txt"])})


def save(out, value: str, overwrite: bool = True) -> None:
    with atomic_directory(out, overwrite=overwrite, kind=KIND) as tmp:
        write_payload(tmp, value)


def read(out) -> str:
    """Open ``out`` the way every load does (read_manifest, which recovers a missing path)."""
    read_manifest(out, KIND)
    return (out / "v.txt").read_text()


_KILLED_SAVE = r"""
import importlib.util, os, signal, sys
from pathlib import Path
# the storage package alone, from its folder (it needs only the standard library and numpy): a
# child that imported the rag_fast package would spend seconds importing torch before every kill
spec = importlib.util.spec_from_file_location(
    "rag_fast_files", sys.argv[5], submodule_search_locations=[os.path.dirname(sys.argv[5])])
storage = importlib.util.module_from_spec(spec)
sys.modules["rag_fast_files"] = storage  # (its modules import one another relatively)
spec.loader.exec_module(storage)
out, where, n, exchange = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
calls = {"replace": 0}
real_replace = os.replace

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def replace(a, b):
    calls["replace"] += 1
    if where == "replace" and calls["replace"] == n:
        die()
    return real_replace(a, b)

os.replace = replace
if hasattr(storage.swap, "exchange"):
    real_exchange = storage.swap.exchange
    def exchange_or_die(a, b):
        if where == "exchange":
            die()
        return real_exchange(a, b) if exchange else False
    storage.swap.exchange = exchange_or_die
with storage.atomic_directory(out, overwrite=True, kind="rag_fast.test_payload") as tmp:
    (tmp / "v.txt").write_text("new")
    storage.write_manifest(tmp / "manifest.json", {"kind": "rag_fast.test_payload",
                                              "files": storage.describe_files(tmp, ["v.txt"])})
    if where == "write":
        die()
print("not killed")
"""

# (where the writer dies, n-th call, exchange available, must the path exist right after the kill)
KILL_POINTS = [
    ("write", 0, True, True),  # while writing the new directory
    ("exchange", 0, True, True),  # just before the atomic swap
    ("replace", 1, True, True),  # the first rename of the old code (out -> .old-*)
    ("replace", 2, True, True),  # its second rename (.old-* aside, tmp not yet in place)
    ("replace", 1, False, True),  # no exchange: tmp -> .new-*
    ("replace", 2, False, True),  # no exchange: out -> .old-*
    ("replace", 3, False, False),  # no exchange: .new-* -> out (the gap: the next open recovers)
    ("replace", 4, False, True),  # no exchange: .old-* -> .trash-*
]


@pytest.mark.parametrize("where, n, exchange, present", KILL_POINTS,
                         ids=[f"{w}{n}-{'xchg' if x else 'renames'}" for w, n, x, _ in KILL_POINTS])
def test_killed_save_leaves_old_or_new_and_no_leftovers(tmp_path, where, n, exchange, present):
    """Defect: a kill between the two renames left no directory at the path (the old one sat
    in ``.DIR.old-*``), and killed saves left ``.DIR.tmp-*`` folders forever."""
    out = tmp_path / "out"
    save(out, "old", overwrite=False)
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(out), where, str(n),
                           str(int(exchange)), storage.__file__],
                          capture_output=True, text=True, timeout=120)
    # (with the exchange the save makes no n-th rename: it is not killed and installs "new")
    completed = proc.returncode == 0 and "not killed" in proc.stdout
    assert proc.returncode == -9 or completed, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    if present:
        assert out.is_dir() and (out / "manifest.json").is_file(), os.listdir(tmp_path)
    assert read(out) in (("new",) if completed else ("old", "new")), os.listdir(tmp_path)  # the next open
    save(out, "third")  # the next save removes what the dead writer left
    assert read(out) == "third"
    assert sorted(os.listdir(tmp_path)) == ["out"]


# (n-th rename of a directory that fails, what the path holds after it): without the exchange
# the swap is tmp -> .new-*, out -> .old-*, .new-* -> out, .old-* -> .trash-*
SECOND_RENAME_FAILURES = [(1, "old"), (2, "old"), (3, "old"), (4, "new")]


@pytest.mark.parametrize("n, holds", SECOND_RENAME_FAILURES, ids=[f"rename{n}" for n, _ in SECOND_RENAME_FAILURES])
def test_exception_at_second_rename_keeps_the_index(tmp_path, monkeypatch, n, holds):
    """Defect: os.replace failing at the second call left no index at the path. The renames
    run only where the OS cannot exchange two directories, so the exchange is made to fail
    (Linux has it); only the renames of directories beside the index count (not the atomic
    writes of the files inside the new one)."""
    x = np.random.default_rng(0).standard_normal((100, 8)).astype(np.float32)
    old, new = DenseIndex.build(x, "exact", progress=False), DenseIndex.build(-x, "exact", progress=False)
    path = old.save(tmp_path / "idx")
    real, calls = os.replace, []

    def failing(a, b):
        if os.path.dirname(os.fspath(a)) == os.fspath(tmp_path):
            calls.append((os.path.basename(a), os.path.basename(b)))
            if len(calls) == n:
                raise OSError("simulated failure at a rename")
        return real(a, b)

    monkeypatch.setattr(storage.swap, "exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="simulated failure at a rename"):
        new.save(path, overwrite=True)
    monkeypatch.setattr(os, "replace", real)
    assert len(calls) >= n, calls  # the n-th rename was reached
    loaded = DenseIndex.load(path).embeddings
    assert np.array_equal(loaded, (old if holds == "old" else new).embeddings), (n, holds, calls)
    assert sorted(os.listdir(tmp_path)) == ["idx"]


def test_exception_between_renames_without_exchange_restores_the_old(tmp_path, monkeypatch):
    out = tmp_path / "out"
    save(out, "old", overwrite=False)
    real, calls = os.replace, []

    def failing(a, b):
        calls.append(1)
        if len(calls) == 3:  # .new-* -> out, after out -> .old-*
            raise OSError("simulated")
        return real(a, b)

    monkeypatch.setattr(storage.swap, "exchange", lambda a, b: False)
    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError, match="simulated"):
        save(out, "new")
    monkeypatch.setattr(os, "replace", real)
    assert read(out) == "old"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_next_save_removes_dead_writers_temp_folders_only(tmp_path):
    out = tmp_path / "out"
    save(out, "old", overwrite=False)
    dead = tmp_path / f".out.tmp-{_dead_pid()}-0123abcd"
    live = tmp_path / f".out.tmp-{os.getpid()}-4567cdef"  # a writer still running
    for d in (dead, live):
        d.mkdir()
        (d / "part.bin").write_bytes(b"x")
    save(out, "new")
    assert not dead.exists() and live.exists()
    assert read(out) == "new"


def test_open_restores_the_old_directory_a_killed_save_moved_aside(tmp_path):
    out = tmp_path / "out"
    save(out, "old", overwrite=False)
    aside = tmp_path / f".out.old-{_dead_pid()}-89abcdef"
    os.rename(out, aside)
    assert read(out) == "old"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_open_restores_what_earlier_versions_left_aside(tmp_path):
    """The state the defect left behind (``.DIR.old-XXXX/old``, no DIR) is recovered too."""
    x = np.random.default_rng(0).standard_normal((100, 8)).astype(np.float32)
    index = DenseIndex.build(x, "exact", progress=False)
    path = index.save(tmp_path / "idx")
    (tmp_path / ".idx.old-k2j4_x9q").mkdir()
    os.rename(path, tmp_path / ".idx.old-k2j4_x9q" / "old")
    assert np.array_equal(DenseIndex.load(path).embeddings, index.embeddings)
    assert sorted(os.listdir(tmp_path)) == ["idx"]


def test_missing_path_without_leftovers_is_still_a_clear_error(tmp_path):
    with pytest.raises(StorageError, match="not a directory"):
        DenseIndex.load(tmp_path / "nothing")
