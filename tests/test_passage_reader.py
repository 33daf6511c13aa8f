"""The passage readers never change data silently: a malformed TSV record, a stray BOM,
undecodable bytes, duplicate ids or non-string JSONL fields are errors naming file:line
(or are handled exactly: a BOM is stripped, ``dedupe=True`` keeps the first of each id)."""
from __future__ import annotations

import json

import pytest

from rag_fast import cli
from rag_fast.retrieval import Passage, read_passages
from rag_fast.retrieval.passages import PassageFormatError, read_dpr_tsv, read_jsonl
from utils import save_tiny_bert

BOM = "\ufeff"


def _write(path, text: str | bytes):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_tsv_unbalanced_quote_spanning_lines_is_an_error(tmp_path):
    # the quote on line 2 never closes: csv merged lines 2-5 into one passage (4 rows -> 1)
    tsv = _write(tmp_path / "p.tsv", 'id\ttext\ttitle\n1\t"unclosed text\tT1\n2\ttwo\tT2\n'
                                     '3\tthree\tT3\n4\tfour\tT4\n')
    with pytest.raises(ValueError, match=r"p\.tsv:2: .*spans lines 2-5"):
        list(read_dpr_tsv(tsv))


def test_tsv_quoted_field_with_text_after_the_quote_is_an_error(tmp_path):
    tsv = _write(tmp_path / "p.tsv", 'id\ttext\ttitle\n1\t"quoted" then more\tT\n')
    with pytest.raises(ValueError, match=r"p\.tsv:2: "):
        list(read_dpr_tsv(tsv))


def test_tsv_wrong_column_count_is_an_error(tmp_path):
    tsv = _write(tmp_path / "p.tsv", "id\ttext\ttitle\n1\tone\tT1\n2\ttwo\textra\tT2\n")
    with pytest.raises(ValueError, match=r"p\.tsv:3: expected 3 tab-separated columns \(id, text, "
                                         r"title\), got 4"):
        list(read_dpr_tsv(tsv))
    tsv = _write(tmp_path / "q.tsv", "1\tone\tT1\n2\ttwo\n")  # no header: the first row decides
    with pytest.raises(ValueError, match=r"q\.tsv:2: expected 3 tab-separated columns"):
        list(read_dpr_tsv(tsv))
    assert list(read_dpr_tsv(_write(tmp_path / "r.tsv", "1\tone\n2\ttwo\n"))) == [
        Passage("1", "", "one"), Passage("2", "", "two")]


def test_tsv_of_text_and_title_without_ids_is_refused(tmp_path):
    # 2 columns without a header are (id, text): a first column of prose is no id
    tsv = _write(tmp_path / "p.tsv", "The Nile flows north.\tNile\nParis is in France.\tParis\n")
    with pytest.raises(PassageFormatError, match=r"p\.tsv:1: 2 tab-separated columns without a "
                                                 r"header are read as \(id, text\), but the "
                                                 r"first column holds 'The Nile flows north\.'"):
        list(read_dpr_tsv(tsv))
    # every row is checked, not only the first
    tsv = _write(tmp_path / "s.tsv", "n1\tThe Nile.\nParis is in France.\tParis\n")
    with pytest.raises(PassageFormatError, match=r"s\.tsv:2: .*'Paris is in France\.', which "
                                                 r"looks like text, not an id; .*id<TAB>text"):
        list(read_dpr_tsv(tsv))
    # a header of known names without an id column is refused, not read as data
    tsv = _write(tmp_path / "t.tsv", "text\ttitle\nThe Nile flows north.\tNile\n")
    with pytest.raises(PassageFormatError, match=r"t\.tsv:1: the header row names text, title; "
                                                 r"a passage TSV needs an id and a text column"):
        list(read_dpr_tsv(tsv))
    # a header naming id and text allows ids with spaces; ids without spaces need none
    assert list(read_dpr_tsv(_write(tmp_path / "q.tsv", "text\tid\nThe Nile.\tn1\n"))) == [
        Passage("n1", "", "The Nile.")]
    assert list(read_dpr_tsv(_write(tmp_path / "u.tsv", "id\ttext\nAlbert Einstein\tA "
                                                        "physicist.\n"))) == [
        Passage("Albert Einstein", "", "A physicist.")]
    assert list(read_dpr_tsv(_write(tmp_path / "r.tsv", "doc-7\tThe Nile.\n"))) == [
        Passage("doc-7", "", "The Nile.")]


def test_tsv_quoting_is_still_honoured(tmp_path):
    tsv = _write(tmp_path / "p.tsv", 'id\ttext\ttitle\n1\t"A ""quoted""\ttext"\tT\n\n2\tb\t"x"\n')
    assert list(read_dpr_tsv(tsv)) == [Passage("1", "T", 'A "quoted" text'), Passage("2", "x", "b")]


@pytest.mark.parametrize("name,body", [
    ("p.tsv", "id\ttext\ttitle\n1\tone\tT\n"),
    ("p.jsonl", json.dumps({"id": "1", "title": "T", "text": "one"}) + "\n"),
])
def test_bom_is_stripped(tmp_path, name, body):
    path = _write(tmp_path / name, BOM + body)
    assert list(read_passages(path)) == [Passage("1", "T", "one")]


def test_bom_is_stripped_from_txt_documents(tmp_path):
    _write(tmp_path / "Doc.txt", BOM + "first words here")
    assert [p.text for p in read_passages(tmp_path)] == ["first words here"]
    assert [p.text for p in read_passages(tmp_path / "Doc.txt")] == ["first words here"]


@pytest.mark.parametrize("name,good,bad", [
    ("p.tsv", b"id\ttext\ttitle\n", b"2\tbad \xff byte\tT\n"),
    ("p.jsonl", b'{"text": "one"}\n', b'{"text": "bad \xff byte"}\n'),
    ("Doc.txt", b"one two\n", b"bad \xff byte\n"),
])
def test_undecodable_bytes_name_the_file_and_line(tmp_path, name, good, bad):
    path = _write(tmp_path / name, good + bad)
    with pytest.raises(PassageFormatError, match=rf"{name.replace('.', '[.]')}:2: .*not valid UTF-8"):
        list(read_passages(path))


@pytest.mark.parametrize("name,body", [
    ("p.tsv", "id\ttext\ttitle\n7\tone\tT\n8\ttwo\tT\n7\tthree\tT\n"),
    ("p.jsonl", "".join(json.dumps({"id": i, "text": t}) + "\n"
                        for i, t in [(7, "one"), (8, "two"), (7, "three")])),
])
def test_duplicate_ids_are_an_error_unless_dedupe(tmp_path, name, body):
    path = _write(tmp_path / name, body)
    first = 2 if name.endswith(".tsv") else 1
    with pytest.raises(PassageFormatError, match=rf"duplicate passage id '7'.*line {first + 2}.*line {first}"):
        list(read_passages(path))
    assert [(p.id, p.text) for p in read_passages(path, dedupe=True)] == [("7", "one"), ("8", "two")]


def test_duplicate_default_jsonl_ids_are_caught(tmp_path):
    # the default id is the line number - 1; an explicit id may collide with it
    path = _write(tmp_path / "p.jsonl", '{"text": "a"}\n{"id": "0", "text": "b"}\n')
    with pytest.raises(PassageFormatError, match=r"p\.jsonl:2: duplicate passage id '0'"):
        list(read_jsonl(path))


@pytest.mark.parametrize("obj,message", [
    ({"text": 5}, r'"text" must be a string, got int'),
    ({"text": None}, r'"text" must be a string, got null'),
    ({"text": "ok", "title": 3.5}, r'"title" must be a string or null, got float'),
    ({"text": "ok", "title": ["a"]}, r'"title" must be a string or null, got list'),
    ({"text": "ok", "id": True}, r'"id" must be a string or an integer, got bool'),
    ({"text": "ok", "id": None}, r'"id" must be a string or an integer, got null'),
    ({"text": "ok", "id": 1.5}, r'"id" must be a string or an integer, got float'),
])
def test_jsonl_non_string_fields_are_errors(tmp_path, obj, message):
    path = _write(tmp_path / "p.jsonl", '{"text": "fine"}\n' + json.dumps(obj) + "\n")
    with pytest.raises(PassageFormatError, match=r"p\.jsonl:2: " + message):
        list(read_jsonl(path))


def test_jsonl_null_title_is_empty_and_int_id_is_text(tmp_path):
    path = _write(tmp_path / "p.jsonl", json.dumps({"id": 12, "title": None, "text": "t"}) + "\n")
    assert list(read_jsonl(path)) == [Passage("12", "", "t")]


def test_cli_reports_reader_errors_in_one_line_and_dedupes(tmp_path, capsys):
    tsv = _write(tmp_path / "p.tsv", "id\ttext\ttitle\n1\tone\tT\n1\tagain\tT\n")
    (tmp_path / "enc").mkdir()
    encoder = save_tiny_bert(tmp_path / "enc", ["one", "again"])  # loaded before the passages
    capsys.readouterr()  # the saving's own progress output
    code = cli.main(["index", "build", "--passages", str(tsv), "--encoder", encoder,
                     "--out", str(tmp_path / "idx"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "duplicate passage id '1'" in err and len(err.strip().splitlines()) == 1
    args = cli.build_parser().parse_args(["index", "build", "--passages", str(tsv), "--encoder", "x",
                                          "--out", "o", "--dedupe"])
    assert args.dedupe is True
