"""The breaks found by the eleventh hostile pass (265 probes at c2abf1a, 9 breaks from 5
defects) and two of its notes; each test failed before the fix:

- T141, T144, T145: `generate --out` / `index search --out` onto an existing big file with no
  newline read the file whole to decide whether it was an earlier output;
- O68: `index eval --out` onto a folder whose retrieval.jsonl is a folder ran the whole
  evaluation, then named a temporary (the tenth pass's T64, fixed then for `eval` only);
- O93, O95, O96, O98: a 250-character output name (legal) failed naming the command's own
  temporary, whose name is longer;
- F50 (and note F49): no inode left: `tokenizer fit` named a file in its temporary folder, and
  `eval --out` a bare "No space left on device";
- T138: a (forged) object-dtype offsets file: "Array can't be memory-mapped", naming no file;
- note O69: `eval --predictions F --out DIR` ignored --out without a word.
"""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from conftest import TOKENIZER, one_error, run_cli


def test_an_existing_output_file_is_read_a_bounded_line_at_a_time(tmp_path):
    """A 1 GiB file with no newline at --out: refused having read at most one line's bound."""
    import tracemalloc

    from rag_fast.storage import check_output_file

    big = tmp_path / "answers.jsonl"
    with open(big, "wb") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of NUL bytes, no newline
    tracemalloc.start()
    try:
        with pytest.raises(FileExistsError, match="exists and is not an answers file"):
            check_output_file(str(big), "--out", lambda record: True, "an answers file")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB read"


def test_index_eval_out_with_a_file_that_is_a_folder_is_refused_first(world, tmp_path,
                                                                       monkeypatch):
    out = tmp_path / "ie"
    code, err = run_cli("index", "eval", "--data", world["dev"], "--index", world["kb"],
                        "--out", out)
    assert code == 0, err
    (out / "retrieval.jsonl").unlink()
    (out / "retrieval.jsonl").mkdir()
    from rag_fast.cli import index as index_command

    def report(*args, **kwargs):
        raise AssertionError("the evaluation ran before the refusal")

    monkeypatch.setattr(index_command, "retrieval_report", report)
    code, err = run_cli("index", "eval", "--data", world["dev"], "--index", world["kb"],
                        "--out", out)
    one_error(code, err, "--out", "retrieval.jsonl", "refused")
    assert (out / "retrieval.jsonl").is_dir()


@pytest.mark.parametrize("command", ["generate", "index search", "tokenizer fit", "init"])
def test_an_output_name_too_long_for_its_temporaries_is_refused_first(world, tmp_path,
                                                                      monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    name = "n" * 250  # a legal name (NAME_MAX 255), with no room for ".NAME.tmp-PID-HEX"
    args = {
        "generate": ["generate", "--model", world["model"], "--question", "x",
                     "--max-new-tokens", "2", "--device", "cpu"],
        "index search": ["index", "search", world["kb"], "--queries", world["dev"]],
        "tokenizer fit": ["tokenizer", "fit", "--passages", world["passages"],
                          "--vocab-size", "300"],
        "init": ["init", "--index", world["kb"], "--generator", world["root"] / "g.json",
                 "--generator-tokenizer", TOKENIZER],
    }[command]
    code, err = run_cli(*args, "--out", name)
    line = one_error(code, err, "--out", "limit on a name", "at most 223 bytes")
    assert ".tmp-" not in line
    assert sorted(os.listdir(tmp_path)) == []  # nothing made
    code, err = run_cli(*args, "--out", "n" * 223)  # the longest name that works
    assert code == 0, err


def test_tokenizer_fit_without_an_inode_names_the_output(world, tmp_path, monkeypatch):
    """F50: the file's creation in the temporary folder failed (ENOSPC) and was said naming
    the temporary; it is a full disk naming --out's file."""
    from rag_fast import tokenization

    real_open = os.open

    def no_inode(path, *args, **kwargs):
        if os.fspath(path).endswith("tokenizer.json"):
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(tokenization.os, "open", no_inode)
    out = tmp_path / "t"
    code, err = run_cli("tokenizer", "fit", "--passages", world["passages"], "--vocab-size",
                        "300", "--out", out)
    line = one_error(code, err, "no space left on device writing", f"{out}/tokenizer.json")
    assert ".tmp-" not in line
    assert not out.exists() and os.listdir(tmp_path) == []


def test_an_output_folder_without_an_inode_is_a_full_disk(tmp_path, monkeypatch):
    """F49 (a note): `eval --out` made its folder on a disk with no inode left and said a bare
    "No space left on device"; the output's folder is written as every file is."""
    from pathlib import Path

    from rag_fast.storage import NoSpaceError, write_marker

    def mkdir(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(NoSpaceError, match="no space left on device writing .*ev"):
        write_marker(tmp_path / "ev", "evaluation")


def test_an_offsets_file_holding_objects_names_the_file(world, tmp_path):
    """T138: a pickled object array in place of texts.offsets.npy (its seal forged) gave
    numpy's "Array can't be memory-mapped", naming nothing. Nothing is unpickled."""
    import shutil

    from rag_fast.storage import StorageError
    from rag_fast.storage.ragged import RaggedArray

    root = tmp_path / "passages"
    shutil.copytree(world["kb"] / "passages", root)
    np.save(root / "texts.offsets.npy", np.array([0, {"x": 1}], dtype=object),
            allow_pickle=True)
    with pytest.raises(StorageError, match=r"texts\.offsets\.npy.*not an offsets array"):
        RaggedArray.load(root, "texts", np.uint8)
    np.save(root / "texts.offsets.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(StorageError, match=r"texts\.offsets\.npy.*float32 values"):
        RaggedArray.load(root, "texts", np.uint8)


def test_eval_predictions_with_out_is_refused(world, tmp_path):
    """O69 (a note): --out was ignored with --predictions, and nothing said so."""
    predictions = tmp_path / "p.txt"
    predictions.write_text("seine\n" * len(world["dev"].read_text().splitlines()))
    code, err = run_cli("eval", "--data", world["dev"], "--predictions", predictions, "--out",
                        tmp_path / "ev")
    one_error(code, err, "--out needs --model")
    assert not (tmp_path / "ev").exists()
    code, err = run_cli("eval", "--data", world["dev"], "--predictions", predictions, "--json")
    assert code == 0, err
