"""Answering a list of questions with a loaded model, as ``rag-fast generate`` does: question
files read and checked line by line, questions answered in batches, each answer a record with
its passages.

A question is a dict: ``{"question": str}``, optionally with its own passages (``"passages"``:
``[{"title", "text"}, ...]``, ``"scores"``: one number per passage) for a model without an
index. A record is ``{"question", "answer", "passages": [{"title", "id", "score", "text"},
...]}`` (:func:`rag_fast.evaluation.report.passage_record`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch

from rag_fast._jsonl import cut_texts, read_objects
from rag_fast._stages import OnStage, StageClock
from rag_fast._validation import not_a_file
from rag_fast.evaluation.report import passage_record


def is_answer_record(row: object) -> bool:
    """Whether ``row`` (one JSON line) is a record as ``rag-fast generate`` writes it: exactly
    "question", "answer" (a string), "passages" (a list) and "decoding" (absent in files of
    earlier versions)."""
    return (isinstance(row, dict) and set(row) - {"decoding"} == {"question", "answer", "passages"}
            and isinstance(row["answer"], str) and isinstance(row["passages"], list))


def read_question_file(path: str | Path, flag: str = "--questions") -> list[dict]:
    """The questions of a JSONL file, each with ``"where"`` (file and line) added.

    Raises:
        FileNotFoundError: ``path`` is not a regular file (named with ``flag``).
        ValueError: a line that is not a question object (naming its file and line), or a
            file without questions.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: {not_a_file(path)}")
    rows = []
    for _, where, row in read_objects(path):
        if not isinstance(row.get("question"), str) or not row["question"].strip():
            raise ValueError(f"{where}: expected an object with a non-empty string 'question'")
        if "passages" in row and not (isinstance(row["passages"], list) and all(
                isinstance(p, dict) and isinstance(p.get("text"), str) for p in row["passages"])):
            raise ValueError(f"{where}: 'passages' must be a list of {{'title', 'text'}} objects")
        if "scores" in row and not (isinstance(row["scores"], list) and all(
                isinstance(s, (int, float)) for s in row["scores"])
                and len(row["scores"]) == len(row.get("passages", []))):
            raise ValueError(f"{where}: 'scores' must be a list of numbers, one per passage")
        row["where"] = where
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no questions")
    # texts longer than any model keeps are cut (said once for the file), as eval's data is
    for row, question in zip(rows, cut_texts([r["question"] for r in rows], path, "question")):
        row["question"] = question
    given = [p for r in rows for p in r.get("passages", [])]
    for p, text in zip(given, cut_texts([p["text"] for p in given], path, "passage text")):
        p["text"] = text
    return rows


def _given_passages(model: Any, rows: list[dict]):
    """Contexts and scores of questions that bring their own passages (no index)."""
    K = model.n_docs
    passages, scores = [], []
    for n, r in enumerate(rows):
        found = list(r.get("passages") or [])[:K]
        if not found:
            raise ValueError(f"{r.get('where', f'question {n + 1}')}: no passages: give --index "
                             "(or record one in the model) or 'passages' in the JSONL")
        given = list(r.get("scores") or [0.0] * len(found))[:K]
        passages.append(found)
        scores.append(given + [float("-inf")] * (K - len(found)))
    ctx = model.build_contexts([r["question"] for r in rows], passages)
    doc_scores = torch.tensor(scores, dtype=torch.float32, device=ctx["input_ids"].device)
    return ctx, doc_scores, passages


def answer_questions(model: Any, rows: list[dict], settings: dict, batch_size: int = 8,
                     on_stage: OnStage | None = None) -> Iterator[list[dict]]:
    """Answer ``rows`` ``batch_size`` at a time with ``model.generate(**settings)``: through
    the model's retriever, or over each question's own passages when it has none. Yields, per
    batch, the records of its questions in order. ``on_stage``: told each batch's stages and
    their seconds (``rag_fast._stages``; ``contexts`` for the given passages' tokenising)."""
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        questions = [r["question"] for r in batch]
        if model.retriever is not None:
            result = model.generate(questions, on_stage=on_stage, **settings)
        else:
            clock = StageClock(on_stage)
            ctx, doc_scores, passages = _given_passages(model, batch)
            clock.lap("contexts")
            result = model.generate(questions, passages=None,
                                    context_input_ids=ctx["input_ids"],
                                    context_attention_mask=ctx["attention_mask"],
                                    doc_scores=doc_scores, on_stage=on_stage, **settings)
            result.passages = passages
        records = []
        for i, (r, text) in enumerate(zip(batch, result.texts)):
            found = result.passages[i] if result.passages is not None else []
            records.append({"question": r["question"], "answer": text,
                            "passages": [passage_record(p, s) for p, s in
                                         zip(found, result.doc_scores[i].tolist())]})
        yield records


__all__ = ["answer_questions", "is_answer_record", "read_question_file"]
