"""An evaluation's files: ``predictions.jsonl`` and ``metrics.json`` in an output folder.

``predictions.jsonl`` holds, per question, the question, the gold answers, the prediction,
its EM and F1, and the retrieved passages (title, id, score and the first
:data:`PASSAGE_TEXT_CHARS` characters of the text, :func:`passage_record`, which ``rag-fast
generate`` writes too); ``metrics.json`` the data and model it scored and the metrics rounded
to 4 digits. Both are written atomically, in a folder
marked as an evaluation's (``rag_fast.storage.EVAL_KIND``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rag_fast.evaluation.data import QAExample
from rag_fast.evaluation.metrics import exact_match_one, f1_one
from rag_fast.storage import (
    EVAL_KIND,
    atomic_write_bytes,
    check_output_folder,
    folder_kind,
    new_folder_removed_on_failure,
    read_json_file,
    write_marker,
)

if TYPE_CHECKING:
    from rag_fast.evaluation.evaluate import EvalResult

EVAL_FILES = ("predictions.jsonl", "metrics.json")
PASSAGE_TEXT_CHARS = 160  # characters of a retrieved passage's text in an answer's record


def passage_record(passage, score: float) -> dict:
    """A retrieved passage as ``eval`` and ``generate`` write it: ``{"title", "id", "score",
    "text"}``, the score rounded to 4 digits, the text cut at its first
    :data:`PASSAGE_TEXT_CHARS` characters, the id None where the passage has none (given as
    text in a question file). ``passage``: an object with ``title``, ``text`` (and ``id``), a
    dict with those keys, or a string (its text)."""
    if isinstance(passage, str):
        title, text, pid = "", passage, None
    elif isinstance(passage, dict):
        title, text, pid = passage.get("title", ""), passage["text"], passage.get("id")
    else:
        title, text, pid = (getattr(passage, "title", ""), passage.text,
                            getattr(passage, "id", None))
    return {"title": str(title or ""), "id": None if pid is None else str(pid),
            "score": round(float(score), 4), "text": str(text)[:PASSAGE_TEXT_CHARS]}


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
            "passages": [passage_record(p, s) for p, s in zip(passages, scores)],
        })
    return rows


def write_evaluation(out: str | Path, examples: Sequence[QAExample], result: EvalResult, *,
                     data: str, model: str, decoding: dict | None = None) -> tuple[dict, int]:
    """Mark ``out`` as an evaluation's folder and write its two files (see the module
    docstring); ``data``, ``model`` and the ``decoding`` settings (when given) are recorded in
    ``metrics.json``. Returns the rounded metrics and the number of predictions written."""
    out = Path(out)
    with new_folder_removed_on_failure(out, EVAL_FILES):
        write_marker(out, EVAL_KIND)
        rows = prediction_rows(examples, result)
        atomic_write_bytes(out / "predictions.jsonl", "".join(
            json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))
        metrics = round_metrics(result.metrics)
        atomic_write_bytes(out / "metrics.json", (json.dumps({
            "data": str(data), "model": str(model), "examples": len(examples),
            **({"decoding": decoding} if decoding is not None else {}),
            "metrics": metrics}, indent=1) + "\n").encode("utf-8"))
    return metrics, len(rows)


def _earlier_evaluation(out: Path) -> bool:
    """Whether ``out`` is an evaluation folder of an earlier rag_fast (no marker): exactly its
    two files, regular files (no link), which read as what eval writes (metrics.json an object
    with "examples" and a "metrics" object; predictions.jsonl's first line an object with a
    "question"). A user's files of those names are not."""
    if not out.is_dir() or out.is_symlink() or folder_kind(out) is not None:
        return False
    if sorted(p.name for p in out.iterdir()) != sorted(EVAL_FILES):
        return False
    metrics, predictions = out / "metrics.json", out / "predictions.jsonl"
    if metrics.is_symlink() or predictions.is_symlink() or not predictions.is_file():
        return False
    try:
        record = read_json_file(metrics)
        with open(predictions, "rb") as f:
            first = json.loads(f.readline(1 << 20).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return (isinstance(record, dict) and isinstance(record.get("metrics"), dict)
            and "examples" in record and isinstance(first, dict) and "question" in first)


def check_evaluation_folder(out: str | Path, flag: str = "--out") -> None:
    """Refuse an evaluation output folder that writing could destroy what rag_fast did not
    write in: it may be missing, empty, an evaluation folder (its marker says so, and it holds
    no symbolic link), or an earlier rag_fast's evaluation folder without a marker.

    Its files (:data:`EVAL_FILES`), where there, must be regular files.

    Raises:
        FileExistsError: naming ``flag`` and ``out`` (and the file).
    """
    if not _earlier_evaluation(Path(out)):
        # its files: refused now if not files, not after the whole evaluation ran
        check_output_folder(out, EVAL_KIND, reuse=True, flag=flag, files=EVAL_FILES)


__all__ = ["EVAL_FILES", "PASSAGE_TEXT_CHARS", "check_evaluation_folder", "passage_record",
           "prediction_rows", "round_metrics", "write_evaluation"]
