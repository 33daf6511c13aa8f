"""Hostile input files: each is refused (or read exactly) where it is read, with one error that
names the file, the line and what is wrong; through ``rag-fast`` it is one ``rag-fast: error:``
line and exit status 2, never a traceback or an error naming nothing seconds later.

Covered: a UTF-8 BOM (dropped by every text reader), a lone surrogate from a JSON escape, bytes
that are not UTF-8, UTF-16 files, JSON nested too deeply or with too long a number, a carriage
return inside a line, a file name that is not UTF-8, and training options out of range.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rag_fast import cli
from rag_fast._jsonl import decoded_lines, read_objects
from rag_fast.evaluation import DatasetError, load_qa
from rag_fast.retrieval import Passage, read_passages
from rag_fast.retrieval.bundle import read_tuning_questions
from rag_fast.retrieval.passages import PassageFormatError
from rag_fast.training import TrainConfig

BOM = b"\xef\xbb\xbf"
SURROGATE = "\\ud800"  # a JSON escape json.loads accepts: half of a pair, alone


def _write(path: Path, data: bytes | str) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def _error_line(capsys) -> str:
    """The command's stderr, checked to be one ``rag-fast: error:`` line."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rag-fast: error: "), err
    assert "Traceback" not in err, err
    return lines[0]


def _eval(tmp_path, data: Path, predictions: str = "a\n") -> int:
    """``rag-fast eval --data DATA --predictions P``: reads the dataset, no model needed."""
    preds = _write(tmp_path / "preds.txt", predictions)
    return cli.main(["eval", "--data", str(data), "--predictions", str(preds), "--json"])


# ---- 1. a BOM is dropped by every text reader ---------------------------------------------

def test_a_qa_tsv_with_a_bom_keeps_no_header_as_an_example(tmp_path, capsys):
    path = _write(tmp_path / "qa.tsv", BOM + b'question\tanswers\nwho?\t["Ann"]\n')
    assert load_qa(str(path)) == load_qa(str(_write(tmp_path / "plain.tsv",
                                                    'question\tanswers\nwho?\t["Ann"]\n')))
    assert [e.question for e in load_qa(str(path))] == ["who?"]
    # one example for one prediction: a kept header would be a second example
    assert _eval(tmp_path, path, "ann\n") == 0
    assert json.loads(capsys.readouterr().out)["em"] == 1.0


def test_a_qa_tsv_header_after_blank_lines_is_still_the_header(tmp_path):
    path = _write(tmp_path / "qa.tsv", BOM + b'\n\nquestion\tanswers\nwho?\tAnn\n')
    assert [e.question for e in load_qa(str(path))] == ["who?"]


@pytest.mark.parametrize("name,body,expected", [
    ("qa.jsonl", '{"question": "q", "answers": ["a"]}\n', [("q", ("a",))]),
    ("qa.tsv", "q\ta\n", [("q", ("a",))]),
])
def test_a_bom_is_dropped_from_qa_files(tmp_path, name, body, expected):
    path = _write(tmp_path / name, BOM + body.encode())
    assert [(e.question, e.answers) for e in load_qa(str(path))] == expected


@pytest.mark.parametrize("name,body", [
    ("p.jsonl", '{"id": "1", "title": "T", "text": "one"}\n'),
    ("p.tsv", "id\ttext\ttitle\n1\tone\tT\n"),
    ("p.tsv", "1\tone\tT\n"),  # no header: the BOM must not join the first id
])
def test_a_bom_is_dropped_from_passage_files(tmp_path, name, body):
    path = _write(tmp_path / name, BOM + body.encode())
    assert list(read_passages(path)) == [Passage("1", "T", "one")]


def test_a_bom_is_dropped_from_txt_documents_and_query_files(tmp_path):
    doc = _write(tmp_path / "Doc.txt", BOM + b"first words")
    assert [p.text for p in read_passages(doc)] == ["first words"]
    queries = _write(tmp_path / "q.txt", BOM + b"who?\n")
    assert [line for _, line in decoded_lines(queries)] == ["who?\n"]
    assert read_tuning_questions(str(queries)) == ["who?"]
    jsonl = _write(tmp_path / "q.jsonl", BOM + b'{"question": "who?"}\n')
    assert read_tuning_questions(str(jsonl)) == ["who?"]


# ---- 2. a lone surrogate is refused where it is read, naming file:line and the field ------

@pytest.mark.parametrize("name,line,field", [
    ("qa.jsonl", '{"question": "who%s?", "answers": ["a"]}', '"question"'),
    ("qa.jsonl", '{"question": "who?", "answers": ["a", "b%s"]}', '"answers"[1]'),
    ("qa.jsonl", '{"question": "who?", "answer": "%s"}', '"answer"'),
    ("qa.tsv", 'who?\t["a%s"]', '"answers"[0]'),
])
def test_a_lone_surrogate_in_a_dataset_names_the_file_line_and_field(tmp_path, capsys, name,
                                                                     line, field):
    good = '{"question": "q", "answers": ["a"]}' if name.endswith("jsonl") else "q\ta"
    path = _write(tmp_path / name, f"{good}\n{line % SURROGATE}\n")
    with pytest.raises(DatasetError) as exc:
        load_qa(str(path))
    message = str(exc.value)
    assert message.startswith(f"{path}:2: {field} is not valid Unicode"), message
    assert "lone surrogate \\ud800" in message, message
    assert _eval(tmp_path, path, "a\na\n") == 2  # `rag-fast eval` once gave a traceback
    assert _error_line(capsys) == f"rag-fast: error: {message}"


@pytest.mark.parametrize("obj,field", [
    ({"id": "1", "title": "T", "text": "one" + SURROGATE}, '"text"'),
    ({"id": "1", "title": SURROGATE, "text": "one"}, '"title"'),
    ({"id": SURROGATE, "text": "one"}, '"id"'),
])
def test_a_lone_surrogate_in_a_passage_names_the_file_line_and_field(tmp_path, obj, field):
    line = json.dumps(obj).replace("\\\\ud800", "\\ud800")  # the escape itself, not "\\ud800"
    path = _write(tmp_path / "p.jsonl", '{"text": "fine"}\n' + line + "\n")
    with pytest.raises(PassageFormatError, match=rf"^{path}:2: {field} is not valid Unicode: a "
                                                 r"lone surrogate \\ud800 at character \d+"):
        list(read_passages(path))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> str:
    """A tiny encoder for ``rag-fast index build``, which loads it before reading passages."""
    from utils import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("encoder"), ["one"])


@pytest.mark.parametrize("name,data,words", [
    ("p.jsonl", b'{"text": "one"}\n{"text": "one\\ud800"}\n',
     '"text" is not valid Unicode: a lone surrogate \\ud800 at character 4'),
    ("p.tsv", b"id\ttext\n2\tbad \xff\n",
     "not valid UTF-8 (byte 0xff at column 7, byte offset 14 of the file)"),
])
def test_index_build_names_the_passage_file_and_line(tmp_path, capsys, encoder, name, data,
                                                     words):
    path = _write(tmp_path / name, data)
    capsys.readouterr()
    code = cli.main(["index", "build", "--passages", str(path), "--encoder", encoder,
                     "--out", str(tmp_path / "kb"), "--no-progress"])
    assert code == 2
    assert _error_line(capsys).startswith(f"rag-fast: error: {path}:2: {words}")


def test_a_surrogate_pair_is_one_character_and_reads(tmp_path):
    path = _write(tmp_path / "qa.jsonl", '{"question": "smile \\ud83d\\ude00", "answers": ["a"]}\n')
    assert load_qa(str(path))[0].question == "smile \U0001F600"


def test_a_lone_surrogate_in_a_nested_value_or_key_is_named(tmp_path):
    path = _write(tmp_path / "q.jsonl", '{"question": "q", "passages": [{"text": "a%s"}]}\n'
                  % SURROGATE)
    with pytest.raises(ValueError, match=rf'^{path}:1: "passages"\[0\]\["text"\] is not valid'):
        list(read_objects(path))
    path = _write(tmp_path / "k.jsonl", '{"question": "q", "meta": {"%s": 1}}\n' % SURROGATE)
    with pytest.raises(ValueError, match=rf'^{path}:1: a key of "meta" is not valid Unicode'):
        list(read_objects(path))


def test_a_lone_surrogate_in_query_questions_names_the_file(tmp_path, capsys):
    queries = _write(tmp_path / "q.jsonl", '{"question": "who%s"}\n' % SURROGATE)
    # --queries is read before the encoder loads: no model needed
    code = cli.main(["index", "build", "--passages", str(tmp_path / "p.jsonl"), "--queries",
                     str(queries), "--encoder", str(tmp_path / "no-encoder"),
                     "--out", str(tmp_path / "kb"), "--no-progress"])
    assert code == 2
    assert f'{queries}:1: "question" is not valid Unicode' in _error_line(capsys)


# ---- 3. bytes that are not UTF-8 name the file, the line and the byte ----------------------

def test_invalid_utf8_in_a_qa_tsv_names_the_file_line_and_byte(tmp_path, capsys):
    path = _write(tmp_path / "qa.tsv", b"q1\ta\nq2\tb\xffc\n")
    expected = (f"{path}:2: not valid UTF-8 (byte 0xff at column 5, byte offset 9 of the "
                "file); expected a UTF-8 text file")
    with pytest.raises(DatasetError) as exc:
        load_qa(str(path))
    assert str(exc.value) == expected
    assert _eval(tmp_path, path, "a\nb\n") == 2
    assert _error_line(capsys) == f"rag-fast: error: {expected}"


def test_the_byte_offset_counts_a_dropped_bom(tmp_path):
    path = _write(tmp_path / "qa.jsonl", BOM + b'{"question": "\xc3"}\n')
    with pytest.raises(DatasetError, match=r":1: not valid UTF-8 \(byte 0xc3 at column 15, "
                                           r"byte offset 17 of the file\)"):
        load_qa(str(path))


@pytest.mark.parametrize("encoding,words", [
    ("utf-16", "the file starts with a UTF-16 byte order mark: save it as UTF-8"),
    ("utf-16-le", "a NUL character at column 2"),  # no BOM: UTF-8 with a NUL after each letter
])
def test_a_utf16_file_is_refused_not_read_as_garbage(tmp_path, capsys, encoding, words):
    path = _write(tmp_path / "qa.tsv", "question\tanswers\nq\ta\n".encode(encoding))
    with pytest.raises(DatasetError, match=rf"^{path}:1: .*{words}"):
        load_qa(str(path))
    queries = _write(tmp_path / "q.txt", "who?\n".encode(encoding))
    with pytest.raises(ValueError, match=rf"^{queries}:1: .*{words}"):
        read_tuning_questions(str(queries))
    passages = _write(tmp_path / "p.tsv", "id\ttext\n1\tone\n".encode(encoding))
    with pytest.raises(PassageFormatError, match=rf"^{passages}:1: .*{words}"):
        list(read_passages(passages))


# ---- other malformed input a reader could pass on unnamed -----------------------------------

@pytest.mark.parametrize("value,words", [
    ("[" * 100_000, "nested too deeply to read"),
    ("1" * 5000, "Exceeds the limit (4300 digits) for integer string conversion"),
])
def test_json_that_json_loads_cannot_take_names_the_line(tmp_path, value, words):
    path = _write(tmp_path / "qa.jsonl", '{"question": "q", "answers": ["a"]}\n'
                  f'{{"question": "q", "answers": ["a"], "x": {value}}}\n')
    with pytest.raises(DatasetError) as exc:
        load_qa(str(path))
    assert str(exc.value).startswith(f"{path}:2: malformed JSON line (") and words in str(exc.value)
    tsv = _write(tmp_path / "qa.tsv", f"q\t[{value}]\n")
    with pytest.raises(DatasetError) as exc:
        load_qa(str(tsv))
    assert str(exc.value).startswith(f"{tsv}:1: malformed JSON answer list (")
    assert words in str(exc.value)


def test_a_carriage_return_inside_a_qa_tsv_line_is_refused(tmp_path):
    # old Mac line endings: one line holding every row would mix questions into answers
    path = _write(tmp_path / "qa.tsv", "q1\ta1\rq2\ta2\r")
    with pytest.raises(DatasetError, match=rf"^{path}:1: a carriage return inside the line"):
        load_qa(str(path))
    crlf = _write(tmp_path / "crlf.tsv", "q1\ta1\r\nq2\ta2\r\n")
    assert [e.answers for e in load_qa(str(crlf))] == [("a1",), ("a2",)]


def test_a_dataset_path_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(DatasetError, match=r"is a directory; expected a dataset file"):
        load_qa(str(tmp_path))


@pytest.mark.skipif(os.name != "posix", reason="needs a file name of arbitrary bytes")
def test_a_document_file_name_that_is_not_utf8_is_named(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    try:
        with open(os.fsencode(docs) + b"/bad\xff.txt", "wb") as f:
            f.write(b"some words")
    except OSError:
        pytest.skip("this file system refuses a name that is not UTF-8")
    with pytest.raises(PassageFormatError, match=r"bad\\udcff\.txt'?: the file name is not "
                                                 r"valid UTF-8"):
        list(read_passages(docs))


# ---- 4./5. training options a run would refuse only after loading the model ------------------

@pytest.mark.parametrize("values,message", [
    ({"seed": -1}, "seed must be an int in [0, 2**32 - 1] (NumPy's seed range), got -1"),
    ({"seed": 2**40}, f"seed must be an int in [0, 2**32 - 1] (NumPy's seed range), got {2**40}"),
    ({"seed": 1.5}, "seed must be an int, got 1.5"),
    ({"seed": True}, "seed must be an int, got True"),
    ({"max_steps": 0}, "max_steps must be >= 1, got 0"),
    ({"micro_batch_size": -2}, "micro_batch_size must be >= 1, got -2"),
    ({"grad_accum": 0}, "grad_accum must be >= 1, got 0"),
    ({"warmup_steps": -1}, "warmup_steps must be in [0, max_steps], got -1"),
    ({"checkpoint_every": -1}, "checkpoint_every must be >= 0, got -1"),
    ({"eval_every": -1}, "eval_every must be >= 0, got -1"),
    ({"log_every": -1}, "log_every must be >= 0, got -1"),
    ({"refresh_index_every": -5}, "refresh_index_every must be >= 0, got -5"),
    ({"output_dir": ""}, "output_dir must be a non-empty path or None, got ''"),
    ({"output_dir": "  "}, "output_dir must be a non-empty path or None, got '  '"),
    ({"metrics_file": ""}, "metrics_file must be a non-empty path or None, got ''"),
    ({"output_dir": "run\0"}, "output_dir must be a path without NUL characters, got 'run\\x00'"),
    ({"output_dir": "run\ud800"}, "output_dir is not a valid path (not valid Unicode: a lone "
                                  "surrogate), got 'run\\ud800'"),
])
def test_train_config_names_the_key_of_a_value_out_of_range(values, message):
    with pytest.raises(ValueError) as exc:
        TrainConfig.from_dict(values)
    assert str(exc.value) == message


def test_train_config_takes_the_whole_seed_range():
    assert TrainConfig.from_dict({"seed": 0}).seed == 0
    assert TrainConfig.from_dict({"seed": 2**32 - 1}).seed == 2**32 - 1


def _train_config(tmp_path, train: dict) -> Path:
    _write(tmp_path / "qa.jsonl", '{"question": "q", "answers": ["a"]}\n')
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"model": "no-model", "index": "kb", "data": {"train": "qa.jsonl"},
                                "train": {"output_dir": "run", **train}}))
    return path


@pytest.mark.parametrize("seed", [-1, 2**40])
def test_train_refuses_a_seed_out_of_range_before_loading_anything(tmp_path, capsys, seed):
    path = _train_config(tmp_path, {"seed": seed})
    assert cli.main(["train", "--config", str(path)]) == 2
    assert _error_line(capsys) == (f"rag-fast: error: {path}: train: seed must be an int in "
                                   f"[0, 2**32 - 1] (NumPy's seed range), got {seed}")


def test_train_refuses_an_empty_output_dir(tmp_path, capsys):
    # "" is not the config file's folder: refused in the file as TrainConfig refuses it
    path = _train_config(tmp_path, {"output_dir": ""})
    assert cli.main(["train", "--config", str(path)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"rag-fast: error: {path}: train.output_dir: ") and "''" in line, line
