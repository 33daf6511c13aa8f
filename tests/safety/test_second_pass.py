"""Breaks found by the second hostile pass over #41's fixes, one test each (they failed before
the fix): argparse usage errors in one line, --split 0, inputs that are not files, a merge
build whose settings differ from its shards', ..."""
from __future__ import annotations

import pytest

from conftest import one_error, run_cli



@pytest.mark.parametrize("argv,words", [
    (["train", "--config", "c.json", "--set", "train.lr"], "argument --set: expected KEY=VALUE"),
    (["train", "--config", "c.json", "--set", "=5"], "got '=5'"),
    (["generate", "--model", "m", "--question", "q", "--threads", "two"],
     "argument --threads: invalid int value: 'two'"),
    (["eval", "--data", "d.jsonl", "--num-beams", "1e3"],
     "argument --num-beams: invalid int value: '1e3'"),
    (["index", "build", "--passages", "p.jsonl", "--out", "kb"],
     "the following arguments are required: --encoder"),
    ([], "the following arguments are required"),
    (["index"], "the following arguments are required"),
])
def test_a_usage_error_is_one_line(capsys, argv, words):
    """argparse's own errors (a value of the wrong type, a malformed --set, a missing
    argument) are one line naming the command and its --help, as every other error is; they
    were argparse's usage block of 5-14 lines."""
    from rag_fast import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    command = " ".join(["rag-fast", *[a for a in argv[:2] if not a.startswith("-")]][:3])
    if argv[:1] != ["index"]:
        command = " ".join(["rag-fast", *argv[:1]])
    assert exit_.value.code == 2 and err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(f"{command}: error: ") and f"(see `{command} --help`)" in err, err
    assert words in err


@pytest.mark.parametrize("vocab_size", ["1000000000", "2147483648", str((1 << 20) + 1)])
def test_tokenizer_fit_refuses_a_vocabulary_too_large_to_set_aside(world, tmp_path, vocab_size):
    """`--vocab-size 10**9` made the tokenizers library ask for 70 GB before reading a text,
    then abort (exit 134 under `ulimit -v`): refused in one line, nothing written."""
    from test_long_lines import capped

    done = capped("tokenizer", "fit", "--passages", world["passages"], "--vocab-size",
                      vocab_size, "--out", tmp_path / "tok")
    line = one_error(done.returncode, done.stderr, "--vocab-size must be at most 1,048,576")
    assert f"{int(vocab_size):,}" in line
    assert not (tmp_path / "tok").exists()


@pytest.mark.parametrize("kind", ["device", "folder", "fifo"])
@pytest.mark.parametrize("command", ["search", "build"])
def test_queries_that_are_not_a_file_are_named_as_what_they_are(world, tmp_path, kind, command):
    """`--queries /dev/zero`, a folder or a FIFO said "no such file"."""
    import os

    path, what = {"device": ("/dev/zero", "is a character device"),
                  "folder": (tmp_path / "questions", "is a folder"),
                  "fifo": (tmp_path / "questions.fifo", "is a named pipe")}[kind]
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    if command == "search":
        code, err = run_cli("index", "search", world["kb"], "--queries", path)
    else:
        code, err = run_cli("index", "build", "--passages", world["passages"], "--encoder",
                            world["encoder"], "--out", tmp_path / "kb", "--queries", path)
    one_error(code, err, f"--queries: {str(path)!r} {what}, not a regular file")
    assert not (tmp_path / "kb").exists() and not (tmp_path / "kb.staging").exists()
