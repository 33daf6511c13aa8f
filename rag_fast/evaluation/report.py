"""An evaluation's files: ``predictions.jsonl`` and ``metrics.json`` in an output folder.

``predictions.jsonl`` holds, per question, the question, the gold answers, the prediction,
its EM and F1, and the retrieved passages' titles and scores; ``metrics.json`` the data and
model it scored and the metrics rounded to 4 digits. Both are written atomically, in a folder
marked as an evaluation's (``rag_fast.storage.EVAL_KIND``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rag_fast.evaluation.data import QAExample
from rag_fast.evaluation.metrics import exact_match_one, f1_one
from rag_fast.storage import EVAL_KIND, atomic_write_bytes, write_marker

if TYPE_CHECKING:
    from rag_fast.evaluation.evaluate import EvalResult

EVAL_FILES = ("predictions.jsonl", "metrics.json")


def round_metrics(metrics: dict) -> dict:
    """Every metric as a float rounded to 4 digits."""
    return {k: round(float(v), 4) for k, v in metrics.items()}


def prediction_rows(examples: Sequence[QAExample], result: EvalResult) -> list[dict]:
    """One ``predictions.jsonl`` object per example."""
    rows = []
    for e, prediction, passages, scores in zip(examples, result.predictions, result.passages,
                                               result.doc_scores):
        rows.append({
            "question": e.question, "answers": list(e.answers), "prediction": prediction,
            "em": exact_match_one(prediction, e.answers), "f1": round(f1_one(prediction, e.answers), 4),
            "passages": [{"title": getattr(p, "title", ""), "id": getattr(p, "id", None),
                          "score": round(float(s), 4)} for p, s in zip(passages, scores)],
        })
    return rows


def write_evaluation(out: str | Path, examples: Sequence[QAExample], result: EvalResult, *,
                     data: str, model: str) -> tuple[dict, int]:
    """Mark ``out`` as an evaluation's folder and write its two files (see the module
    docstring); ``data`` and ``model`` are recorded in ``metrics.json``. Returns the rounded
    metrics and the number of predictions written."""
    out = Path(out)
    write_marker(out, EVAL_KIND)
    rows = prediction_rows(examples, result)
    atomic_write_bytes(out / "predictions.jsonl", "".join(
        json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))
    metrics = round_metrics(result.metrics)
    atomic_write_bytes(out / "metrics.json", (json.dumps({
        "data": str(data), "model": str(model), "examples": len(examples),
        "metrics": metrics}, indent=1) + "\n").encode("utf-8"))
    return metrics, len(rows)


__all__ = ["EVAL_FILES", "prediction_rows", "round_metrics", "write_evaluation"]
