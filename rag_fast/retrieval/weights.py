"""The weighted fusion's weight (mode ``weighted``), tuned when ``rag-fast index build --bm25``
builds the BM25 part.

The weight is the one of :data:`~rag_fast.retrieval.lexical.WEIGHTS` whose fused top
:data:`~rag_fast.retrieval.lexical.TUNE_K` holds the most gold passages of the build's tuning
questions (:func:`~rag_fast.retrieval.lexical.tune_weight`), recorded with what it was tuned on
in the part's sealed manifest (``"fusion"``). The tuning questions with gold passages are:

the ``--queries`` file's, where its JSONL objects name gold passages as ``index eval``'s data
do (:data:`~rag_fast._jsonl.GOLD_FIELDS`: a passage id or a list of them, or DPR's
``positive_ctxs``);
questions whose gold ids are none of the corpus's are left out. Without any, the weight stays
:data:`~rag_fast.retrieval.lexical.DEFAULT_WEIGHT` (untuned, and the build says so): the
stand-in questions that measure the dense index (a sentence of a sampled passage each) repeat
their passage's words and tune a weight that leans to BM25 (:func:`tune_part`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from rag_fast._jsonl import gold_ids, read_objects
from rag_fast.retrieval.lexical import (DEFAULT_WEIGHT, HYBRID_DEPTH, TUNE_K, BM25Index,
                                        tune_weight)
from rag_fast.retrieval.passages import stand_in_questions, stand_in_rows

def read_gold_questions(path: str, store) -> tuple[list[str], list[set[int]]]:
    """The questions of the ``--queries`` JSONL file ``path`` whose gold ids (see the module
    docstring) name passages of ``store``, with those passages' rows; empty lists for a .txt
    file or one without gold ids. (The file was already read whole by the build, so its
    lines are known to be objects with a ``question``.)

    Raises:
        ValueError: a gold field of the wrong type (naming the line), or gold ids of which
            none is a passage id of ``store`` (the file names passages another way).
    """
    if Path(path).suffix.lower() == ".txt":
        return [], []
    wanted: list[tuple[str, list[str]]] = []
    for _, where, row in read_objects(path):
        ids = gold_ids(row, f"--queries {where}")
        if ids:
            wanted.append((row["question"], list(ids)))
    if not wanted:
        return [], []
    names = {i for _, ids in wanted for i in ids}
    rows: dict[str, set[int]] = {}
    for r in range(len(store)):
        pid = store.id(r)
        if pid in names:
            rows.setdefault(pid, set()).add(r)
    if not rows:
        raise ValueError(f"--queries {path}: none of the {len(names)} gold passage ids is a "
                         f"passage id of the corpus (e.g. {sorted(names)[0]!r}; its passages "
                         f"have ids such as {store.id(0)!r}): give gold ids as the passage "
                         "file names its passages")
    questions, gold = [], []
    for question, ids in wanted:
        found = set().union(*(rows.get(i, set()) for i in ids))
        if found:
            questions.append(question)
            gold.append(found)
    return questions, gold


def tune_part(part: BM25Index, store, encode: Callable[[list[str]], np.ndarray], search,
              queries: str | None, stand_ins: int = 0,
              gold: tuple[list[str], list[set[int]]] | None = None) -> str:
    """Tune ``part``'s weight (sets ``part.fusion``) on the gold questions of ``queries`` and
    return a line saying what was done. Without any, the weight is left untuned
    (:data:`~rag_fast.retrieval.lexical.DEFAULT_WEIGHT`) unless ``stand_ins`` > 0 asks for
    that many stand-in questions: their words are their passage's own, and the weight they
    tune leans to BM25 (on the hybrid bench's documentation questions it put recall@5 below
    dense alone; docs/benchmarks.md), so a build does not use them.

    Args:
        encode: questions -> ``[Q, d]`` float32 question vectors.
        search: ``(vectors, k) -> (scores, rows)``, the dense index's search.
        queries: the build's ``--queries`` file (None: none given).
        stand_ins: tune on this many stand-in questions when ``queries`` has no gold ids.
        gold: what :func:`read_gold_questions` gave for ``queries``, when it was read already.
    """
    if gold is None:
        gold = read_gold_questions(queries, store) if queries else ([], [])
    questions, gold = gold
    if questions:
        source = f"{len(questions)} questions with gold passages from {queries}"
    elif stand_ins > 0:
        rows = stand_in_rows(store, stand_ins)
        questions = stand_in_questions(store, stand_ins)
        gold = [{r} for r in rows.tolist()]
        source = (f"{len(questions)} stand-in questions (a sentence of each of "
                  f"{len(questions)} sampled passages)")
    else:
        part.fusion = None
        return (f"weighted fusion: dense weight {DEFAULT_WEIGHT} (not tuned: no --queries "
                "with gold passage ids, \"positive_ids\", to tune it on)")
    depth = min(len(store), HYBRID_DEPTH)
    k = min(TUNE_K, depth)
    dense = search(encode(questions), depth)
    weight, recall = tune_weight(dense, part.search(questions, depth), gold, k)
    part.fusion = {"weight": weight, "k": k, "tuned_on": source,
                   "recall": {f"{w:.2f}": round(r, 4) for w, r in recall.items()}}
    return (f"weighted fusion: dense weight {weight:.2f} (recall@{k} {recall[weight]:.3f}; "
            f"dense alone {recall[1.0]:.3f}, BM25 alone {recall[0.0]:.3f}) tuned on {source}")


def tuning_summary(fusion: dict | None) -> str:
    """One line on a part's fusion record (``index info``)."""
    if not fusion:
        return (f"weight {DEFAULT_WEIGHT} (not tuned: build with --queries naming gold "
                "passages to tune it)")
    return f"weight {float(fusion['weight']):.2f}, tuned on {fusion.get('tuned_on', '?')}"


__all__ = ["read_gold_questions", "tune_part", "tuning_summary"]
