"""A data file's fields are named: when no line has any of the fields a reader looks for, it
says which it looked for, with a did-you-mean for a key that looks like one (`doc_id`,
`gold_id`), and the report says which fields it read.

A newcomer put gold passage ids under `doc_id`: `index eval` printed only answer-string
recall, with no word that no gold field was found.
"""
from __future__ import annotations

import json

import pytest

from conftest import run_cli

from rag_fast.evaluation.retrieval import fields_used, load_retrieval_data


def _lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.filterwarnings("always::UserWarning")  # the command says it in one line
@pytest.mark.parametrize("key,meant", [("doc_id", "passage_id"), ("gold_ids", "gold"),
                                       ("positives_ctx", "positive_ctxs")])
def test_index_eval_names_the_gold_fields_and_the_near_miss(world, tmp_path, key, meant):
    data = _lines(tmp_path / "q.jsonl", [{"question": "which river is paris on",
                                          "answers": ["seine"], key: "p1"}])
    code, err = run_cli("index", "eval", "--data", data, "--index", world["kb"], "-k", "1,2")
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("rag-fast: warning:")]
    assert len(warning) == 1, err
    for word in ("none of its 1 line(s) has gold passage ids", "'positive_ids'", "'passage_id'",
                 f"{key!r} on 1 line(s): did you mean {meant!r}?"):
        assert word in warning[0], warning[0]


def test_a_line_with_neither_names_the_near_miss(world, tmp_path):
    data = _lines(tmp_path / "q.jsonl", [{"question": "which river is paris on", "doc_id": "p1"}])
    code, err = run_cli("index", "eval", "--data", data, "--index", world["kb"])
    assert code == 2, err
    assert "q.jsonl:1: neither answers" in err and "'doc_id': did you mean 'passage_id'?" in err


def test_the_report_says_which_fields_it_read(world, tmp_path, capsys):
    data = _lines(tmp_path / "q.jsonl", [
        {"question": "which river is paris on", "answers": ["seine"], "positive_ids": ["p1"]},
        {"question": "which river is rome on", "answer": "tiber"}])
    code, err = run_cli("index", "eval", "--data", data, "--index", world["kb"], "-k", "1")
    assert code == 0 and "warning" not in err, err
    out = capsys.readouterr().out
    assert ("read: gold ids from 'positive_ids' (1 of 2 questions); answers from 'answers' "
            "(1 of 2 questions), 'answer' (1 of 2 questions).") in out, out


def test_no_warning_when_a_gold_field_is_there(tmp_path, recwarn):
    examples = load_retrieval_data(str(_lines(tmp_path / "q.jsonl", [
        {"question": "q", "gold": "p1", "doc_id": "x"}])))
    assert not [w for w in recwarn if "gold passage ids" in str(w.message)]
    assert fields_used(examples) == "gold ids from 'gold' (1 of 1 questions)."


# ---- the QA reader of eval and train ---------------------------------------------------------
@pytest.mark.parametrize("row,words", [
    ({"query": "which river is paris on", "answers": ["seine"]},
     ["no 'question' field", "'query': did you mean 'question'?"]),
    ({"question": "which river is paris on", "answer_text": "seine"},
     ["no answers: looked for 'answers', 'answer', 'label'",
      "'answer_text': did you mean 'answers'?"]),
])
def test_eval_and_train_name_the_fields_they_looked_for(world, tmp_path, row, words):
    data = _lines(tmp_path / "q.jsonl", [row])
    for args in (["eval", "--data", data, "--model", world["model"], "--out", tmp_path / "e"],
                 ["train", "--config", world["config"], "--model", world["model"],
                  "--output-dir", tmp_path / "r", "--set", f"data.train={data}"]):
        code, err = run_cli(*args)
        assert code == 2, err
        for word in words:
            assert word in err, err


def test_eval_and_train_say_which_fields_they_read(world, tmp_path, capsys):
    data = _lines(tmp_path / "q.jsonl", [
        {"question": "which river is paris on", "answers": ["seine"]},
        {"question": "which river is rome on", "answer": "tiber"}])
    code, err = run_cli("eval", "--data", data, "--model", world["model"], "--out",
                        tmp_path / "e", "--no-progress", "--max-new-tokens", "2")
    assert code == 0, err
    assert (f"read {data}: 2 examples (answers from 'answers' (1), 'answer' (1))"
            in capsys.readouterr().out)
    code, err = run_cli("train", "--config", world["config"], "--model", world["model"],
                        "--output-dir", tmp_path / "r", "--set", f"data.train={data}")
    assert code == 0, err
    assert (f"data.train: {data}: 2 examples (answers from 'answers' (1), 'answer' (1))"
            in capsys.readouterr().out)
