"""The break found by the ninth hostile pass, one test per reader; they failed before the fix:
questions longer than any model keeps were passed whole, without the one warning per file that
`eval --data` and `train` give, by `generate --questions`, `index search --queries` and
`index eval --data` (I09, I27, I28)."""
from __future__ import annotations

import json

import pytest

from conftest import run_cli

LONG = "where " * 20  # 120 characters, past the bound the test sets
pytestmark = pytest.mark.filterwarnings("default::UserWarning")  # the command says it, one line


@pytest.fixture
def small_bound(monkeypatch):
    """MAX_TEXT_CHARS at 50 characters (the bound is 1 Mi; the readers read it from _jsonl)."""
    from rag_fast import _jsonl

    monkeypatch.setattr(_jsonl, "MAX_TEXT_CHARS", 50)
    return 50


def _said_once(err: str) -> None:
    cut = [line for line in err.splitlines() if "longer than 50 characters" in line]
    assert len(cut) == 1 and cut[0].startswith("rag-fast: warning: "), err
    assert "cut 1 question " in cut[0], err


def test_generate_cuts_a_long_question_and_says_so_once(world, tmp_path, small_bound):
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": LONG}) + "\n"
                         + json.dumps({"question": "which river"}) + "\n")
    out = tmp_path / "a.jsonl"
    code, err = run_cli("generate", "--model", world["model"], "--questions", questions,
                        "--max-new-tokens", "2", "--device", "cpu", "--out", out,
                        "--no-progress")
    assert code == 0, err
    _said_once(err)
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["question"] for r in records] == [LONG[:50], "which river"]


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_index_search_cuts_a_long_query_and_says_so_once(world, tmp_path, small_bound, suffix):
    queries = tmp_path / f"q{suffix}"
    queries.write_text(json.dumps({"question": LONG}) + "\n" if suffix == ".jsonl"
                       else LONG + "\n")
    out = tmp_path / "found.jsonl"
    code, err = run_cli("index", "search", world["kb"], "--queries", queries, "--out", out)
    assert code == 0, err
    _said_once(err)
    assert json.loads(out.read_text())["question"] == LONG[:50]


def test_index_eval_cuts_a_long_question_and_says_so_once(world, tmp_path, small_bound):
    data = tmp_path / "dev.jsonl"
    data.write_text(json.dumps({"question": LONG, "answers": ["seine"]}) + "\n")
    out = tmp_path / "ev"
    code, err = run_cli("index", "eval", "--data", data, "--index", world["kb"], "--out", out)
    assert code == 0, err
    _said_once(err)
    row = json.loads((out / "retrieval.jsonl").read_text().splitlines()[0])
    assert row["question"] == LONG[:50]
