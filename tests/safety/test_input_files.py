"""Input paths that are not files to read, stores whose offsets point outside their data, and
`tokenizer fit` onto a full disk: each is one ``rag-fast: error:`` line and exit status 2.

A device or a named pipe given where a file is read (`--passages`, `tokenizer fit`'s
`--data`, a ``*.txt`` document of a passages folder) hung the command: /dev/zero is read
forever (hashed for the staging key, then read as one endless line) and opening a named pipe
waits for a writer that never comes. Such paths are refused before anything is read, naming
the flag, the path and what it is. Each test runs under a deadline, so that the old hang fails
it instead of stopping the suite.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, run_cli
from test_long_lines import capped

from rag_fast.retrieval import PassageStore, read_passages
from rag_fast.retrieval.passages import passages_digest
from rag_fast.storage import StorageError

DEADLINE_S = 30


class Hung(BaseException):
    """The command was still running at the deadline (a BaseException: the command line's
    error contract does not catch it as a failure of its own)."""


@contextlib.contextmanager
def deadline(seconds: int = DEADLINE_S):
    """Raise :class:`Hung` in this thread after ``seconds`` (a blocked ``open`` of a named
    pipe and a loop reading /dev/zero both return to Python for the signal)."""
    def expire(signum, frame):
        raise Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _one_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rag-fast: error: "), err
    assert "Traceback" not in err, err
    return lines[0]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _not_files(root: Path) -> dict[str, tuple[Path, str]]:
    """{case: (path, what the error calls it)}: a symbolic link to /dev/zero and to /dev/null
    named as passage files, a named pipe, and a folder of documents holding a named pipe."""
    root.mkdir(exist_ok=True)
    zero, null = root / "zero.jsonl", root / "null.tsv"
    zero.symlink_to("/dev/zero")
    null.symlink_to("/dev/null")
    docs = root / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("the city of paris lies on the seine\n")
    _fifo(docs / "b.txt")
    return {"dev-zero": (zero, "a character device"), "dev-null": (null, "a character device"),
            "fifo": (_fifo(root / "pipe.jsonl"), "a named pipe"),
            "folder-with-fifo": (docs / "b.txt", "a named pipe")}


CASES = ["dev-zero", "dev-null", "fifo", "folder-with-fifo"]


def _passages_arg(case: str, path: Path) -> Path:
    return path.parent if case == "folder-with-fifo" else path


@pytest.mark.parametrize("case", CASES)
def test_index_build_refuses_passages_that_are_not_files(world, tmp_path, case):
    path, what = _not_files(tmp_path / "in")[case]
    out = tmp_path / "kb"
    with deadline():
        code, err = run_cli("index", "build", "--passages", _passages_arg(case, path),
                            "--encoder", world["encoder"], "--out", out, "--no-progress",
                            "--device", "cpu")
    line = _one_line(code, err)
    assert "passages: " in line and repr(str(path)) in line, line
    assert f"is {what}" in line and "not a regular file" in line, line
    assert not out.exists() and not out.with_name("kb.staging").exists()


@pytest.mark.parametrize("case", CASES)
def test_tokenizer_fit_refuses_passages_that_are_not_files(tmp_path, case):
    """In a capped subprocess: the old reading of /dev/zero as one endless line grew without
    bound inside one C call, where no deadline reaches it."""
    path, what = _not_files(tmp_path / "in")[case]
    out = tmp_path / "tok"
    done = capped("tokenizer", "fit", "--passages", _passages_arg(case, path), "--vocab-size",
                  "300", "--out", out, "--no-progress", timeout=DEADLINE_S)
    line = _one_line(done.returncode, done.stderr)
    assert line.startswith(f"rag-fast: error: --passages: {str(path)!r} is {what}"), line
    assert "not a regular file" in line and not out.exists()


@pytest.mark.parametrize("case", ["dev-zero", "fifo", "folder"])
def test_tokenizer_fit_refuses_data_that_is_not_a_file(world, tmp_path, case):
    root = tmp_path / "in"
    root.mkdir()
    path, what = {"dev-zero": (root / "zero.jsonl", "a character device"),
                  "fifo": (root / "pipe.jsonl", "a named pipe"),
                  "folder": (root / "qa.jsonl", "a folder")}[case]
    if case == "dev-zero":
        path.symlink_to("/dev/zero")
    elif case == "fifo":
        _fifo(path)
    else:
        path.mkdir()
    out = tmp_path / "tok"
    with deadline():
        code, err = run_cli("tokenizer", "fit", "--passages", world["passages"], "--data",
                            world["train"], "--data", path, "--vocab-size", "300", "--out", out,
                            "--no-progress")
    line = _one_line(code, err)
    assert line.startswith(f"rag-fast: error: --data: {str(path)!r} is {what}"), line
    assert "not a regular file" in line and not out.exists()


def test_a_symbolic_link_to_a_device_says_where_it_points(tmp_path):
    path, _ = _not_files(tmp_path / "in")["dev-zero"]
    with deadline(), pytest.raises(ValueError) as e:
        passages_digest(path)
    assert str(e.value).startswith(f"passages: {str(path)!r} is a character device (a symbolic "
                                   "link to /dev/zero), not a regular file"), e.value
    with deadline(), pytest.raises(ValueError, match="not a regular file"):
        read_passages(path)


def test_eval_refuses_a_named_pipe_as_data(world, tmp_path):
    pipe = _fifo(tmp_path / "dev.jsonl")
    with deadline():
        code, err = run_cli("eval", "--data", pipe, "--model", world["model"], "--out",
                            tmp_path / "e", "--no-progress")
    line = _one_line(code, err)
    assert str(pipe) in line and "not a regular file" in line, line


def test_regular_files_and_links_to_them_are_read(tmp_path):
    real = tmp_path / "p.jsonl"
    real.write_text(json.dumps({"id": "a", "text": "the seine"}) + "\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    assert [p.text for p in read_passages(link)] == ["the seine"]
    passages_digest(link)  # no error
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").symlink_to(real)
    assert [p.text for p in read_passages(docs)] == ['{"id": "a", "text": "the seine"}']


# ---- a passage store whose offsets point outside its data --------------------------------

def _corrupt_offsets(store: Path, field: str = "texts") -> int:
    """Point every inner offset of ``store``'s ``field`` past its data (the last one, which
    loading checks against the data's size, kept): same size, so only a checksum sees it.
    Returns the size of the data."""
    path = store / f"{field}.offsets.npy"
    offsets = np.load(path)
    size = int(offsets[-1])
    offsets[1:-1] = size + 1000
    np.save(path, offsets)
    return size


def test_store_offsets_out_of_range_are_an_error_without_verification(world, copy_of):
    kb = copy_of(world["kb"])
    size = _corrupt_offsets(kb / "passages")
    store = PassageStore.load(kb / "passages", verify=False)
    with pytest.raises(StorageError) as e:
        store.text(3)
    message = str(e.value)
    assert message.startswith(f"{kb / 'passages' / 'texts.offsets.npy'}: row 3 "), message
    assert f"bytes {size + 1000}..{size + 1000} of texts.values.bin, which holds {size}" in message
    with pytest.raises(StorageError, match=r"row 0 .* bytes 0\.\."):
        store[0]
    assert store.id(3) == "p3" and store.title(3) == "paris"  # the other fields are intact
    with pytest.raises(StorageError, match="checksum|SHA-256|sha256"):
        PassageStore.load(kb / "passages", verify=True)


def test_index_search_with_no_verify_names_the_corrupt_file(world, copy_of):
    kb = copy_of(world["kb"])
    _corrupt_offsets(kb / "passages", "titles")
    code, err = run_cli("index", "search", kb, "which river is paris on", "-k", "2",
                        "--no-verify", "--device", "cpu")
    line = _one_line(code, err)
    assert str(kb / "passages" / "titles.offsets.npy") in line and ": row " in line, line
    assert "titles.values.bin" in line, line


def test_a_decreasing_offset_is_an_error_too(world, copy_of):
    kb = copy_of(world["kb"])
    path = kb / "passages" / "ids.offsets.npy"
    offsets = np.load(path)
    offsets[5] = offsets[4] - 1  # row 4 ends before it starts
    np.save(path, offsets)
    store = PassageStore.load(kb / "passages", verify=False)
    with pytest.raises(StorageError, match=r"ids\.offsets\.npy: row 4 gives bytes"):
        store.id(4)
    assert store.id(6) == "p6"


# ---- tokenizer fit onto a full disk ------------------------------------------------------

def test_tokenizer_fit_onto_a_full_disk_is_one_line_and_leaves_nothing(disk, tmp_path):
    """The tokenizers library's own error on a full disk ("No space left on device (os error
    28)", not an OSError) took the "unexpected error, please report it" path. The bytes the
    error says tokenizer.json needs are those the same fit writes where there is room."""
    out = disk.path / "tok"
    passages = REPO / "examples" / "workflow" / "passages.jsonl"
    args = ("tokenizer", "fit", "--passages", passages, "--vocab-size", "4000", "--no-progress")
    line = _one_line(*run_cli(*args, "--out", out))
    assert line.startswith(f"rag-fast: error: no space left on device writing "
                           f"{out / 'tokenizer.json'}: needs "), line
    assert " free (" in line, line
    assert not out.exists() and list(disk.path.iterdir()) == []
    assert run_cli(*args, "--out", tmp_path / "room")[0] == 0
    needed = int(line.split(": needs ", 1)[1].split(" ", 1)[0])
    assert needed == os.path.getsize(tmp_path / "room" / "tokenizer.json") > disk.kib * 1024
