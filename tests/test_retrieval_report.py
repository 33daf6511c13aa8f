"""Retrieval measured on its own (rag_fast.evaluation.retrieval, behind `rag-fast index eval`):
gold-id and answer-string recall@k by their definitions, how lenient answer strings are, the
data formats it reads and the errors it names. No encoder: passages retrieved are given."""
from __future__ import annotations

import json

import pytest

from rag_fast.evaluation import DatasetError
from rag_fast.evaluation.retrieval import (RetrievalExample, format_table, load_retrieval_data,
                                           retrieval_report, write_retrieval_report)
from rag_fast.retrieval import Passage
from rag_fast.storage import RETRIEVAL_EVAL_KIND, folder_kind

# ten passages; "5" stands in six of them (as a word), "15" in one more (not the word "5")
CORPUS = [Passage(f"p{i}", f"title {i}", text) for i, text in enumerate([
    "The Nile flows north through Egypt into the Mediterranean.",
    "A hand has 5 fingers.",
    "Chess has 5 kinds of piece besides the king.",
    "Mount Everest is the highest mountain.",
    "The answer was 5.",
    "Pentagons have 5 sides.",
    "There are 5 oceans.",
    "Leonardo da Vinci painted the Mona Lisa.",
    "Five is written 5 in digits.",
    "The year 15 BC.",
])]


def _example(question, answers=(), gold=None):
    return RetrievalExample(question, tuple(answers), None if gold is None else tuple(gold), "t")


def _found(*rows):
    return [CORPUS[r] for r in rows], [1.0 - 0.1 * j for j in range(len(rows))]


def test_gold_and_answer_recall_follow_their_definitions():
    examples = [
        _example("where does the nile flow?", ["Egypt"], ["p0"]),       # gold at 2, answer at 2
        _example("who painted the mona lisa?", ["da Vinci"], ["p7", "p3"]),  # gold at 1
        _example("highest mountain?", ["Everest"], ["p3"]),             # neither in the top 3
        _example("gold only", gold=["p8"]),                              # gold at 3
        _example("answer only", ["Mona Lisa"]),                          # answer at 1
    ]
    retrieved = [_found(5, 0, 1), _found(7, 3, 2), _found(1, 2, 4), _found(1, 2, 8),
                 _found(7, 1, 2)]
    report = retrieval_report(examples, [p for p, _ in retrieved], [s for _, s in retrieved],
                              CORPUS, [3, 1, 2, 2])
    assert report.ks == [1, 2, 3]
    # gold: 4 questions with gold ids; answers: 4 with answers
    assert report.summary["gold_questions"] == 4 and report.summary["answer_questions"] == 4
    assert [report.metrics[f"gold_recall@{k}"] for k in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert [report.metrics[f"answer_recall@{k}"] for k in (1, 2, 3)] == [0.5, 0.75, 0.75]
    assert [r["hits"] for r in report.rows] == [
        {"gold": [2], "answer": [2]}, {"gold": [1, 2], "answer": [1]},
        {"gold": [], "answer": []}, {"gold": [3], "answer": []}, {"gold": [], "answer": [1]}]
    row = report.rows[0]
    assert row["gold_ids"] == ["p0"] and row["answers"] == ["Egypt"]
    assert row["retrieved"][1] == {"rank": 2, "id": "p0", "title": "title 0", "score": 0.9}
    assert report.rows[3]["gold_ids"] == ["p8"] and "answer_passages" not in report.rows[3]
    assert report.rows[4]["gold_ids"] is None
    assert report.warnings == []
    table = format_table(report).splitlines()
    assert table[0] == "   k  gold recall@k  answer recall@k  k random passages"
    assert table[1].split() == ["1", "0.2500", "0.5000", f"{report.metrics['random_answer_recall@1']:.4f}"]
    assert table[4].startswith("gold recall@k: the fraction of the 4 questions with gold passage ids")


def test_a_common_answer_shows_how_lenient_answer_recall_is():
    """The user's case: the answer "5" is in many passages, so a passage holding it says little.
    The report counts the passages holding each answer (whole words: not "15") and what k
    random passages would score: 1 - C(n - c, k) / C(n, k)."""
    examples = [_example("how many fingers on a hand?", ["5", "five"]),
                _example("where does the nile flow?", ["Egypt"])]
    retrieved = [_found(3, 1), _found(0, 3)]
    report = retrieval_report(examples, [p for p, _ in retrieved], [s for _, s in retrieved],
                              CORPUS, [1, 2])
    # "5" in p1, p2, p4 ("5."), p5, p6, p8 ("Five is written 5": both answers, counted once)
    assert report.rows[0]["answer_passages"] == {"5": 6, "five": 1}
    assert report.rows[0]["answer_passages_any"] == 6 and report.rows[1]["answer_passages_any"] == 1
    assert report.metrics["answer_recall@1"] == 0.5 and report.metrics["answer_recall@2"] == 1.0
    chance_1 = (6 / 10 + 1 / 10) / 2
    chance_2 = ((1 - 4 / 10 * 3 / 9) + (1 - 9 / 10 * 8 / 9)) / 2
    assert report.metrics["random_answer_recall@1"] == pytest.approx(chance_1)
    assert report.metrics["random_answer_recall@2"] == pytest.approx(chance_2)
    leniency = report.summary["answer_leniency"]
    assert leniency == {**leniency, "passages_counted": 10, "sampled": False, "max_fraction": 0.6,
                        "mean_fraction": 0.35, "common_questions": 2,
                        "max_question": "how many fingers on a hand?", "max_answers": ["5", "five"]}
    note = report.notes[-1]
    assert "over all 10 passages, a question's answers are in 35.0% of the passages on average" in note
    assert "(at most 60.0%: '5', 'five'), and 2 of the 2 questions have answers in more than 1%" in note
    # a corpus beyond the sample: a seeded sample is counted, and the note says so
    sampled = retrieval_report(examples, [p for p, _ in retrieved], [s for _, s in retrieved],
                               CORPUS, [1], sample=5)
    assert sampled.summary["answer_leniency"]["passages_counted"] == 5
    assert sampled.summary["answer_leniency"]["sampled"] is True
    assert "over a seeded sample of 5 of the 10 passages" in sampled.notes[-1]


def test_unknown_gold_ids_are_counted_and_none_known_is_an_error():
    examples = [_example("a", gold=["p0", "nope"]), _example("b", gold=["p1"]),
                _example("c", gold=["gone", "nope"])]
    found = [_found(0), _found(2), _found(3)]
    report = retrieval_report(examples, [p for p, _ in found], [s for _, s in found], CORPUS, [1])
    assert report.summary["unknown_gold_ids"] == 2
    assert report.warnings == [
        "2 of the 4 gold passage ids (of 2 questions) are not passage ids of the index, e.g. "
        "'gone': those questions can be found only through their other gold ids"]
    assert report.metrics["gold_recall@1"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match=r"^none of the 2 gold passage ids is a passage id of the "
                                         r"index \(e.g. '0'; its passages have ids such as 'p0'\)"):
        retrieval_report([_example("a", gold=["0", "1"])], [[CORPUS[0]]], [[1.0]], CORPUS, [1])
    with pytest.raises(ValueError, match=r"ks must be integers >= 1, got \[0\]"):
        retrieval_report(examples, [p for p, _ in found], [s for _, s in found], CORPUS, [0])
    with pytest.raises(ValueError, match="3 examples, retrieved passages for 1"):
        retrieval_report(examples, [[CORPUS[0]]], [[1.0]], CORPUS, [1])


def test_data_formats_and_their_errors(tmp_path):
    path = tmp_path / "qa.jsonl"
    lines = [
        {"question": "q1", "answers": ["a"], "positive_ids": [3, "p4"]},
        {"question": "q2", "gold": "p5"},
        {"question": "q3", "answer": "b", "passage_id": "p6"},
        {"question": "q4", "answers": ["c"],
         "positive_ctxs": [{"title": "t", "text": "x", "passage_id": "p7"}, {"id": 8}]},
        {"question": "q5", "answers": "d", "positive_ids": []},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = load_retrieval_data(str(path))
    assert [(e.question, e.answers, e.gold) for e in got] == [
        ("q1", ("a",), ("3", "p4")), ("q2", (), ("p5",)), ("q3", ("b",), ("p6",)),
        ("q4", ("c",), ("p7", "8")), ("q5", ("d",), None)]
    assert got[1].where == f"{path}:2"
    tsv = tmp_path / "qa.tsv"
    tsv.write_text('q1\t["a", "b"]\n')
    assert [(e.answers, e.gold) for e in load_retrieval_data(str(tsv))] == [(("a", "b"), None)]

    def refused(line: dict | str) -> str:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"question": "fine", "answers": ["x"]}\n'
                       + (line if isinstance(line, str) else json.dumps(line)) + "\n")
        with pytest.raises(DatasetError) as e:
            load_retrieval_data(str(bad))
        assert str(e.value).startswith(f"{bad}:2: "), e.value
        return str(e.value).split(": ", 1)[1]

    assert refused({"question": "no answers or gold"}) == (
        "neither answers ('answers', 'answer') nor gold passage ids ('positive_ids', 'gold', 'passage_id', "
        "'positive_ctxs'); expected at least one to measure retrieval against")
    assert refused({"question": "q", "gold": [1.5]}).startswith(
        "'gold' must be a passage id (a string or an integer) or a list of them, got [1.5]")
    assert refused({"question": "q", "positive_ctxs": {"passage_id": "1"}}).startswith(
        "'positive_ctxs' must be a list of objects with a 'passage_id'")
    assert refused({"question": "q", "positive_ctxs": [{"title": "no id"}]}) == (
        "'positive_ctxs'[0] must be an object with a 'passage_id' (or 'id'), a string or an "
        "integer")
    assert refused({"answers": ["a"], "gold": ["p1"]}) == "missing or empty 'question'"
    assert refused('{"question": "q", ') .startswith("malformed JSON line")
    with pytest.raises(FileNotFoundError, match="dataset file not found"):
        load_retrieval_data(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="empty dataset"):
        load_retrieval_data(str(tmp_path / "empty.jsonl"))


def test_written_report_files(tmp_path):
    examples = [_example("where does the nile flow?", ["Egypt"], ["p0"])]
    report = retrieval_report(examples, [[CORPUS[0], CORPUS[3]]], [[0.9, 0.5]], CORPUS, [1, 2])
    write_retrieval_report(tmp_path / "out", report, data="qa.jsonl", index="kb")
    assert folder_kind(tmp_path / "out") == RETRIEVAL_EVAL_KIND
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "metrics.json", "rag_fast-output.json", "retrieval.jsonl"]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["data"] == "qa.jsonl" and metrics["index"] == "kb" and metrics["k"] == [1, 2]
    assert metrics["questions"] == 1 and metrics["gold_questions"] == 1
    assert metrics["metrics"]["gold_recall@1"] == 1.0 and "gold_recall@k" in metrics["definitions"]
    rows = [json.loads(x) for x in (tmp_path / "out" / "retrieval.jsonl").read_text().splitlines()]
    assert rows == report.rows
