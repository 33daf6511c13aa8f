"""Retrieval on its own, without a model: recall@k of an index against gold passage ids and
against answer strings (``rag-fast index eval``).

Two measures, each over the questions that can have it:

- **gold recall@k**: the fraction of questions with gold passage ids (a ``"positive_ids"``,
  ``"gold"`` or ``"passage_id"`` field: a passage id or a list of them, as the passage file
  names its passages; or DPR's ``"positive_ctxs"``, objects with ``"passage_id"`` or ``"id"``)
  that have at least one of them among the top k passages retrieved.
- **answer recall@k**: the fraction of questions with answers that have an answer string in
  one of the top k passages (title and text, the answer's tokens found there as consecutive
  whole tokens, punctuation being tokens of its own as in DPR's ``has_answer``:
  :func:`~rag_fast.evaluation.metrics.answer_in_passage`, what ``evaluate``'s ``recall@K``
  counts).

Answer recall is lenient: a short answer ("5", "blue") is found in passages that say nothing
about the question. So the report counts, for every answer, the passages of the corpus that
hold it (every passage up to :data:`CORPUS_SAMPLE`, a seeded sample of that many beyond), and
gives beside answer recall@k what k passages drawn at random would score: per question, the
probability that k distinct random passages include one holding one of its answers, averaged.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from rag_fast._jsonl import GOLD_FIELDS, cut_texts, gold_ids, read_objects
from rag_fast.evaluation.data import DatasetError, read_answers, load_qa
from rag_fast.evaluation.metrics import passage_text, answer_in_passage, match_tokens
from rag_fast.storage import (
    RETRIEVAL_EVAL_KIND,
    atomic_write_bytes,
    new_folder_removed_on_failure,
    write_marker,
)

CORPUS_SAMPLE = 100_000  # passages read to count each answer's passages (a seeded sample beyond)
COMMON_ANSWER = 0.01  # an answer held by more than this fraction of passages is called common
RETRIEVAL_FILES = ("metrics.json", "retrieval.jsonl")


@dataclass(frozen=True)
class RetrievalExample:
    """A question, its answers (maybe none) and its gold passage ids (None: the line has none),
    with where it was read (``path:line``)."""

    question: str
    answers: tuple[str, ...]
    gold: tuple[str, ...] | None
    where: str
    gold_field: str | None = None  # the field the gold ids came from
    answer_field: str | None = None  # the field the answers came from


ANSWER_FIELDS = ("answers", "answer")
# a line's keys that say nothing about retrieval quality (not reported as unknown)
_OTHER_FIELDS = frozenset({"question", "id", "title", "text", "label", "negative_ctxs",
                           "hard_negative_ctxs", "dataset"})


def _near_miss(key: str) -> str | None:
    """The gold field an unknown ``key`` was probably meant to be (``doc_id``, ``gold_id``,
    ``positives``...), or None when it does not look like one."""
    lowered = key.lower()
    if not re.search(r"id|gold|positive|ctx|passage|doc", lowered):
        return None
    if "ctx" in lowered or "context" in lowered:
        return "positive_ctxs"
    close = difflib.get_close_matches(lowered, GOLD_FIELDS, n=1, cutoff=0.6)
    return close[0] if close else ("positive_ids" if lowered.endswith("s") else "passage_id")


def _fields_word(names) -> str:
    return ", ".join(repr(f) for f in names)


def _say_missing_gold(path: str, unknown: dict[str, int], lines: int) -> None:
    """Warn (one line) that no line of ``path`` has a gold field: the fields looked for, and a
    did-you-mean for each unknown key that looks like one."""
    hints = [f"{key!r} on {n} line(s): did you mean {_near_miss(key)!r}?"
             for key, n in sorted(unknown.items()) if _near_miss(key)]
    warnings.warn(
        f"{path}: none of its {lines} line(s) has gold passage ids (looked for "
        f"{_fields_word(GOLD_FIELDS)}), so recall is measured against answer strings only"
        + (f"; {'; '.join(hints)}" if hints else ""), UserWarning, stacklevel=3)


def load_retrieval_data(path: str) -> list[RetrievalExample]:
    """Questions with answers and/or gold passage ids: JSONL lines with ``"question"``,
    optional ``"answers"`` (or ``"answer"``: a string or a list of strings) and an optional
    gold field (:data:`GOLD_FIELDS`); each line needs one of the two. A ``.tsv`` dataset (see
    :func:`~rag_fast.evaluation.data.load_qa`) has answers only.

    Raises:
        DatasetError: naming the file and line: a line without a question, with neither
            answers nor gold ids, or with a field of the wrong type; an empty dataset.
        FileNotFoundError: no such file.
    """
    if Path(path).suffix.lower() not in (".jsonl", ".json") or not os.path.isfile(path):
        # TSV, or a path load_qa refuses with its own errors (missing, a folder, a pipe)
        return [RetrievalExample(e.question, e.answers, None, f"{path} example {n}")
                for n, e in enumerate(load_qa(path), 1)]
    examples = []
    unknown: dict[str, int] = {}  # keys no reader looks for -> lines holding them
    for _, where, obj in read_objects(path, DatasetError):
        question = obj.get("question")
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{where}: missing or empty 'question'")
        answer_field = next((f for f in ANSWER_FIELDS if f in obj), None)
        raw = obj.get(answer_field) if answer_field else None
        answers = read_answers(raw, where) if raw is not None else ()
        gold = gold_ids(obj, where, DatasetError)
        gold_field = next((f for f in GOLD_FIELDS if f in obj), None) if gold else None
        for key in obj.keys() - _OTHER_FIELDS - set(ANSWER_FIELDS) - set(GOLD_FIELDS):
            unknown[key] = unknown.get(key, 0) + 1
        if not answers and gold is None:
            hints = [f"{k!r}: did you mean {_near_miss(k)!r}?" for k in sorted(obj)
                     if k in unknown and _near_miss(k)]
            raise DatasetError(f"{where}: neither answers ({_fields_word(ANSWER_FIELDS)}) nor "
                               f"gold passage ids ({_fields_word(GOLD_FIELDS)}); expected at "
                               "least one to measure retrieval against"
                               + (f" ({'; '.join(hints)})" if hints else ""))
        examples.append(RetrievalExample(question, answers, gold, where, gold_field,
                                         answer_field if answers else None))
    if not examples:
        raise DatasetError(f"{path}: empty dataset (no examples)")
    questions = cut_texts([e.question for e in examples], path, "question")  # said once
    examples = [e if e.question == q else replace(e, question=q)
                for e, q in zip(examples, questions)]
    if all(e.gold is None for e in examples):
        _say_missing_gold(path, unknown, len(examples))
    return examples


def fields_used(examples: Sequence[RetrievalExample]) -> str | None:
    """Which fields the gold ids and the answers were read from, for the report's notes
    (``gold ids from 'positive_ids' (36 of 36 questions); answers from 'answers' (36)``)."""
    parts = []
    for what, attr in (("gold ids", "gold_field"), ("answers", "answer_field")):
        counts: dict[str, int] = {}
        for e in examples:
            if getattr(e, attr):
                counts[getattr(e, attr)] = counts.get(getattr(e, attr), 0) + 1
        if counts:
            parts.append(f"{what} from " + ", ".join(
                f"{name!r} ({n} of {len(examples)} questions)" for name, n in counts.items()))
    return "; ".join(parts) + "." if parts else None


@dataclass
class RetrievalReport:
    """What :func:`retrieval_report` measured.

    ks: the cut-offs, ascending. metrics: ``gold_recall@k`` (when some questions have gold
    ids), ``answer_recall@k`` and ``random_answer_recall@k`` (when some have answers).
    rows: per question, the ``retrieval.jsonl`` object. summary: counts, the answers'
    leniency and the definitions. notes: the lines that explain the table. warnings: what the
    data got wrong but did not stop the measurement (unknown gold ids).
    """

    ks: list[int]
    metrics: dict[str, float]
    rows: list[dict]
    summary: dict
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _corpus_id(corpus: Any, row: int) -> str:
    return corpus.id(row) if hasattr(corpus, "id") else str(corpus[row].id)


def _count_answers(corpus: Any, answers: dict[str, set[int]], sample: int,
                   seed: int) -> tuple[dict[str, int], dict[int, int], int]:
    """Passages of ``corpus`` holding each normalised answer (``answers``: normalised answer ->
    the questions it answers), and per question those holding any of its answers, over every
    passage or a seeded sample of ``sample``; and the number of passages read."""
    n = len(corpus)
    rows = (range(n) if n <= sample else
            np.sort(np.random.default_rng(seed).choice(n, sample, replace=False)).tolist())
    by_first: dict[str, list[str]] = {}
    for a in answers:
        by_first.setdefault(a.split(" ", 1)[0], []).append(a)
    per_answer = dict.fromkeys(answers, 0)
    per_question: dict[int, int] = {}
    for row in rows:
        text = match_tokens(passage_text(corpus[row]))
        padded = f" {text} "
        found = [a for token in set(text.split()) & by_first.keys() for a in by_first[token]
                 if f" {a} " in padded]
        questions = set()
        for a in found:
            per_answer[a] += 1
            questions |= answers[a]
        for q in questions:
            per_question[q] = per_question.get(q, 0) + 1
    return per_answer, per_question, len(rows)


def _random_hit(n: int, holding: int, k: int) -> float:
    """Probability that ``k`` distinct passages drawn at random from ``n``, ``holding`` of which
    hold an answer, include one of those."""
    miss = 1.0
    for i in range(k):
        if n - i <= 0:
            return 1.0 if holding else 0.0
        miss *= max(0, n - holding - i) / (n - i)
    return 1.0 - miss


def retrieval_report(examples: Sequence[RetrievalExample], passages: Sequence[Sequence[Any]],
                     scores: Sequence[Sequence[float]], corpus: Any, ks: Sequence[int], *,
                     sample: int = CORPUS_SAMPLE, seed: int = 0) -> RetrievalReport:
    """Gold and answer recall@k of retrieved ``passages`` (see the module docstring).

    Args:
        examples: the questions (:func:`load_retrieval_data`).
        passages: per question, the passages retrieved, best first (objects with ``id``,
            ``title`` and ``text``, as a PassageStore returns them), at least ``max(ks)`` of
            them unless the index holds fewer.
        scores: per question, the passages' scores.
        corpus: every passage of the index (a PassageStore, or a list of passages): gold ids
            are checked against its ids, and answers counted in its texts.
        ks: the cut-offs (ints >= 1).
        sample: passages read to count answers beyond which a seeded sample is read.
    Raises:
        ValueError: no examples, a bad ``ks``, lists of other lengths, or gold ids of which
            none is a passage id of ``corpus`` (the data names passages another way).
    """
    if not examples:
        raise ValueError("no examples to evaluate (empty dataset)")
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks must be integers >= 1, got {list(ks)!r}")
    if not len(examples) == len(passages) == len(scores):
        raise ValueError(f"{len(examples)} examples, retrieved passages for {len(passages)}, "
                         f"scores for {len(scores)}")
    ks = sorted(set(ks))
    n_corpus = len(corpus)
    warnings: list[str] = []

    gold_q = [i for i, e in enumerate(examples) if e.gold is not None]
    answer_q = [i for i, e in enumerate(examples) if e.answers]
    unknown: set[str] = set()
    if gold_q:
        wanted = {g for i in gold_q for g in examples[i].gold}
        known = {pid for pid in (_corpus_id(corpus, r) for r in range(n_corpus)) if pid in wanted}
        unknown = wanted - known
        if not known:
            example = next(iter(sorted(unknown)))
            raise ValueError(
                f"none of the {len(wanted)} gold passage ids is a passage id of the index (e.g. "
                f"{example!r}; its passages have ids such as {_corpus_id(corpus, 0)!r}): give "
                "gold ids as the passage file names its passages")
        if unknown:
            hit_q = sum(any(g in unknown for g in examples[i].gold) for i in gold_q)
            warnings.append(
                f"{len(unknown)} of the {len(wanted)} gold passage ids (of {hit_q} questions) "
                f"are not passage ids of the index, e.g. {sorted(unknown)[0]!r}: those "
                "questions can be found only through their other gold ids")

    # answers: each answer's passages in the corpus (a sample beyond `sample`), as token strings
    norm_answers: dict[str, set[int]] = {}
    for i in answer_q:
        for a in examples[i].answers:
            if match_tokens(a):
                norm_answers.setdefault(match_tokens(a), set()).add(i)
    per_answer, per_question, counted = (_count_answers(corpus, norm_answers, sample, seed)
                                         if answer_q else ({}, {}, 0))

    rows, gold_first, answer_first = [], {}, {}
    for i, (e, found, sc) in enumerate(zip(examples, passages, scores)):
        gold = set(e.gold or ())
        gold_hits = [r for r, p in enumerate(found, 1) if e.gold is not None and str(p.id) in gold]
        answer_hits = [r for r, p in enumerate(found, 1) if e.answers and
                       answer_in_passage(p, e.answers)]
        gold_first[i] = gold_hits[0] if gold_hits else math.inf
        answer_first[i] = answer_hits[0] if answer_hits else math.inf
        row = {"question": e.question, "answers": list(e.answers),
               "gold_ids": list(e.gold) if e.gold is not None else None,
               "retrieved": [{"rank": r, "id": p.id, "title": p.title, "score": round(float(s), 6)}
                             for r, (p, s) in enumerate(zip(found, sc), 1)],
               "hits": {"gold": gold_hits, "answer": answer_hits}}
        if e.answers:
            row["answer_passages"] = {a: per_answer.get(match_tokens(a), 0) for a in e.answers}
            row["answer_passages_any"] = per_question.get(i, 0)
        rows.append(row)

    metrics: dict[str, float] = {}
    if gold_q:
        for k in ks:
            metrics[f"gold_recall@{k}"] = sum(gold_first[i] <= k for i in gold_q) / len(gold_q)
    if answer_q:
        for k in ks:
            metrics[f"answer_recall@{k}"] = sum(answer_first[i] <= k for i in answer_q) / len(answer_q)
        for k in ks:
            metrics[f"random_answer_recall@{k}"] = sum(
                _random_hit(counted, per_question.get(i, 0), k) for i in answer_q) / len(answer_q)

    definitions = {}
    notes = []
    if gold_q:
        definitions["gold_recall@k"] = (
            "the fraction of the questions with gold passage ids that have at least one of them "
            "among the top k passages")
        notes.append(f"gold recall@k: the fraction of the {len(gold_q)} questions with gold "
                     "passage ids that have at least one of them among the top k passages.")
    leniency = None
    if answer_q:
        definitions["answer_recall@k"] = (
            "the fraction of the questions with answers that have an answer string (SQuAD-"
            "normalised, whole words, in the title or text) in one of the top k passages")
        definitions["random_answer_recall@k"] = (
            "the same for k distinct passages drawn at random: per question, the probability that "
            "they include one holding an answer, averaged")
        fractions = {i: per_question.get(i, 0) / counted for i in answer_q}
        top = max(answer_q, key=lambda i: fractions[i])
        common = sum(f > COMMON_ANSWER for f in fractions.values())
        where = (f"all {counted:,} passages" if counted == n_corpus else
                 f"a seeded sample of {counted:,} of the {n_corpus:,} passages")
        leniency = {
            "passages_counted": counted, "corpus_passages": n_corpus,
            "sampled": counted != n_corpus,
            "mean_fraction": round(float(np.mean(list(fractions.values()))), 6),
            "max_fraction": round(fractions[top], 6),
            "max_question": examples[top].question, "max_answers": list(examples[top].answers),
            "common_threshold": COMMON_ANSWER, "common_questions": common,
        }
        notes.append(
            f"answer recall@k: the fraction of the {len(answer_q)} questions with answers that "
            "have an answer string (lower case, as consecutive whole tokens, punctuation a token "
            "of its own; title or text) in one of the "
            "top k passages. It is lenient: over " + where + ", a question's answers are in "
            f"{leniency['mean_fraction']:.1%} of the passages on average (at most "
            f"{fractions[top]:.1%}: {', '.join(repr(a) for a in examples[top].answers[:3])}), "
            f"and {common} of the {len(answer_q)} questions have answers in more than "
            f"{COMMON_ANSWER:.0%} of them; the random column is what k passages drawn at random "
            "would score.")
    used = fields_used(examples)
    if used is not None:
        notes.insert(0, f"read: {used}")
    summary = {"questions": len(examples), "gold_questions": len(gold_q),
               "answer_questions": len(answer_q), "unknown_gold_ids": len(unknown),
               "definitions": definitions, "answer_leniency": leniency}
    return RetrievalReport(ks, metrics, rows, summary, notes, warnings)


def format_table(report: RetrievalReport) -> str:
    """The report's metrics as a table, one row per k (then its notes, one per line)."""
    columns = [("k", None)]
    if report.summary["gold_questions"]:
        columns.append(("gold recall@k", "gold_recall@{}"))
    if report.summary["answer_questions"]:
        columns += [("answer recall@k", "answer_recall@{}"),
                    ("k random passages", "random_answer_recall@{}")]
    lines = ["  ".join(f"{name:>{max(len(name), 4)}}" for name, _ in columns)]
    for k in report.ks:
        cells = [f"{k:>4}"]
        for name, key in columns[1:]:
            cells.append(f"{report.metrics[key.format(k)]:>{len(name)}.4f}")
        lines.append("  ".join(cells))
    return "\n".join(lines + report.notes)


def format_modes(reports: dict[str, RetrievalReport]) -> str:
    """Reports of the same questions searched in several modes, side by side: one row per k,
    a column per measure and mode (then the first report's notes, which do not depend on the
    mode)."""
    first = next(iter(reports.values()))
    measures = []
    if first.summary["gold_questions"]:
        measures.append(("gold", "gold_recall@{}"))
    if first.summary["answer_questions"]:
        measures.append(("answer", "answer_recall@{}"))
    columns = [(f"{name} {mode}", key, report) for name, key in measures
               for mode, report in reports.items()]
    if first.summary["answer_questions"]:
        columns.append(("k random", "random_answer_recall@{}", first))
    lines = ["recall@k of " + " and ".join(f"{name} passages" if name == "gold" else
                                           "answer strings" for name, _ in measures),
             "  ".join(f"{name:>{max(len(name), 6)}}" for name in ["k"] + [c[0] for c in columns])]
    for k in first.ks:
        cells = [f"{k:>6}"]
        for name, key, report in columns:
            cells.append(f"{report.metrics[key.format(k)]:>{max(len(name), 6)}.4f}")
        lines.append("  ".join(cells))
    return "\n".join(lines + first.notes)


def write_retrieval_report(out: str | Path, report: RetrievalReport, *, data: str,
                           index: str, mode: str = "dense") -> None:
    """Mark ``out`` as a retrieval evaluation's folder and write ``metrics.json`` (the data,
    index and retrieval mode, the counts, the metrics rounded to 4 digits, their definitions,
    the answers' leniency) and ``retrieval.jsonl`` (one object per question), each
    atomically."""
    out = Path(out)
    with new_folder_removed_on_failure(out, RETRIEVAL_FILES):
        write_marker(out, RETRIEVAL_EVAL_KIND)
        atomic_write_bytes(out / "retrieval.jsonl", "".join(
            json.dumps(row, ensure_ascii=False) + "\n" for row in report.rows).encode("utf-8"))
        summary = dict(report.summary)
        atomic_write_bytes(out / "metrics.json", (json.dumps({
            "data": str(data), "index": str(index), "mode": mode, "k": report.ks,
            "questions": summary.pop("questions"),
            "metrics": {key: round(float(v), 4) for key, v in report.metrics.items()},
            **summary}, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))


def write_mode_reports(out: str | Path, reports: dict[str, RetrievalReport], *, data: str,
                       index: str) -> None:
    """:func:`write_retrieval_report` for the same questions searched in several modes:
    ``metrics.json`` holds ``"modes"`` (their names) and ``"metrics"`` per mode; each line of
    ``retrieval.jsonl`` a question with ``"modes"``: per mode its ``"retrieved"`` and
    ``"hits"``."""
    if len(reports) == 1:
        [(mode, report)] = reports.items()
        write_retrieval_report(out, report, data=data, index=index, mode=mode)
        return
    out = Path(out)
    first = next(iter(reports.values()))
    with new_folder_removed_on_failure(out, RETRIEVAL_FILES):
        write_marker(out, RETRIEVAL_EVAL_KIND)
        lines = []
        for i, row in enumerate(first.rows):
            merged = {key: v for key, v in row.items() if key not in ("retrieved", "hits")}
            merged["modes"] = {mode: {"retrieved": r.rows[i]["retrieved"],
                                      "hits": r.rows[i]["hits"]} for mode, r in reports.items()}
            lines.append(json.dumps(merged, ensure_ascii=False) + "\n")
        atomic_write_bytes(out / "retrieval.jsonl", "".join(lines).encode("utf-8"))
        summary = dict(first.summary)
        atomic_write_bytes(out / "metrics.json", (json.dumps({
            "data": str(data), "index": str(index), "modes": list(reports), "k": first.ks,
            "questions": summary.pop("questions"),
            "metrics": {mode: {key: round(float(v), 4) for key, v in r.metrics.items()}
                        for mode, r in reports.items()},
            **summary}, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))


__all__ = ["ANSWER_FIELDS", "CORPUS_SAMPLE", "GOLD_FIELDS", "RETRIEVAL_FILES",
           "RetrievalExample", "RetrievalReport", "fields_used", "format_modes",
           "format_table", "load_retrieval_data", "retrieval_report", "write_mode_reports",
           "write_retrieval_report"]
