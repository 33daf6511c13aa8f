"""``rag-fast eval``: score a model directory, or a file of predictions, on a QA dataset.

    rag-fast eval --data dev.jsonl --model DIR [--index DIR] [--out DIR]   answers of a model
    rag-fast eval --data dev.jsonl --predictions preds.txt                 one answer per line

With a model, ``--out`` (default ``eval-<data name>``) receives ``predictions.jsonl`` (per
question: the question, the gold answers, the prediction, its EM and F1, and the retrieved
passages' titles and scores) and ``metrics.json`` (EM, F1, BLEU-1, ROUGE-L, recall@K, rounded
to 4 digits); the metrics are printed as a table. ``--model`` may be a model directory or the
``output_dir`` of ``rag-fast train``; ``--index`` defaults to the index the model records.
A model's answers are decoded greedily (``rag-fast generate`` uses beam search, 4 beams by
default; ``--num-beams 1`` there gives the same answer).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def _round(metrics: dict) -> dict:
    return {k: round(float(v), 4) for k, v in metrics.items()}


def _print_metrics(metrics: dict, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(metrics))
        return
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        print(f"{key:<{width}}  {value:.4f}")


def _write_atomic(path: Path, text: str) -> None:
    """``text`` to a temporary file beside ``path``, then renamed over it (never half written)."""
    from rag_fast.storage import atomic_write_bytes

    atomic_write_bytes(path, text.encode("utf-8"))


_EVAL_FILES = {"predictions.jsonl", "metrics.json"}


def _check_out(out: Path, args) -> None:
    """``--out`` apart from the inputs, and empty or an evaluation's own folder (an earlier
    rag_fast's, holding only its two files, included)."""
    from rag_fast.storage import EVAL_KIND, check_apart, check_output_folder, folder_kind

    check_apart(out, "--out", {"--data": args.data, "--model": args.model, "--index": args.index})
    legacy = (out.is_dir() and folder_kind(out) is None
              and {p.name for p in out.iterdir()} <= _EVAL_FILES)
    if not legacy:
        check_output_folder(out, EVAL_KIND, reuse=True, flag="--out")


def check_new_tokens(model, max_new_tokens: int, flag: str = "--max-new-tokens") -> None:
    """Refuse more new tokens than the generator has positions (with a decoder-only one, the
    prompt's longest context included), before decoding allocates for them."""
    config = getattr(getattr(model, "generator", None), "config", None)
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int):
        positions = getattr(config, "n_positions", None)
    if not isinstance(positions, int):
        return  # relative positions (T5): no fixed bound
    room = positions - (int(model.max_context_length) if getattr(model, "is_causal", False)
                        else 0)
    if max_new_tokens > room:
        raise ValueError(f"{flag} {max_new_tokens} is more than the generator can place "
                         f"({positions} positions" + (f", {model.max_context_length} of them the "
                                                      "prompt" if room != positions else "")
                         + f"); use at most {max(room, 1)}")


def load_model_for_cli(model_dir: str, index: str | None, device: str | None,
                       require_index: bool = True):
    """A model directory with its retriever (``index``, else the one the model records; none
    when the model records none and ``require_index`` is False) on ``device`` (default: CUDA
    when available), for ``eval`` and ``generate``."""
    from rag_fast.models import RagModel
    from rag_fast.models.retriever_io import load_retriever
    from rag_fast.training.trainer import resolve_device

    device = resolve_device(device, "--device")  # a bad --device fails before the model loads
    model = RagModel.load(model_dir)
    index = index or model.index_path
    if index is None:
        if require_index:
            raise ValueError(f"--model {model_dir!r} records no index directory: pass --index DIR")
    else:
        if not os.path.isdir(index):
            raise FileNotFoundError(f"index directory {index!r} does not exist (the model "
                                    "records it; pass --index DIR if it moved)")
        model.retriever = load_retriever(index, n_docs=model.n_docs,
                                         n_docs_from=f"the model {model_dir!r}")
        model.index_path = index
    return model.to(device).eval()


def run(args: argparse.Namespace) -> int:
    from rag_fast.evaluation import answer_metrics, evaluate, label_accuracy, load_qa
    from rag_fast.evaluation.metrics import exact_match_one, f1_one
    from rag_fast.storage import EVAL_KIND, check_apart, write_marker

    if (args.predictions is None) == (args.model is None):
        raise ValueError("give exactly one of --predictions FILE and --model DIR")
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens",
                                                            args.max_new_tokens)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    out = Path(args.out or f"eval-{Path(args.data).stem}")
    if args.model is not None:  # before anything is read (a bad --device first: no I/O)
        from rag_fast.training.trainer import resolve_device

        resolve_device(args.device, "--device")
        _check_out(out, args)
    examples = load_qa(args.data)
    answers = [list(e.answers) for e in examples]
    if args.predictions is not None:
        from rag_fast._jsonl import decoded_lines

        predictions = [line.rstrip("\r\n") for _, line in decoded_lines(args.predictions)]
        if len(predictions) != len(examples):
            raise ValueError(f"{args.predictions} has {len(predictions)} lines for "
                             f"{len(examples)} examples in {args.data}")
        metrics = answer_metrics(predictions, answers)
        if all(e.label is not None for e in examples):
            metrics["accuracy"] = label_accuracy(predictions, [e.label for e in examples])
        _print_metrics(_round(metrics), args.json)
        return 0

    model = load_model_for_cli(args.model, args.index, args.device)
    check_new_tokens(model, args.max_new_tokens)
    check_apart(out, "--out", {"the model's index": getattr(model, "index_path", None)})
    result = evaluate(model, examples, batch_size=args.batch_size,
                      max_new_tokens=args.max_new_tokens, progress=not args.no_progress)
    write_marker(out, EVAL_KIND)
    rows = []
    for e, prediction, passages, scores in zip(examples, result.predictions, result.passages,
                                               result.doc_scores):
        rows.append({
            "question": e.question, "answers": list(e.answers), "prediction": prediction,
            "em": exact_match_one(prediction, e.answers), "f1": round(f1_one(prediction, e.answers), 4),
            "passages": [{"title": getattr(p, "title", ""), "id": getattr(p, "id", None),
                          "score": round(float(s), 4)} for p, s in zip(passages, scores)],
        })
    _write_atomic(out / "predictions.jsonl",
                  "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    metrics = _round(result.metrics)
    _write_atomic(out / "metrics.json", json.dumps({
        "data": str(args.data), "model": str(args.model), "examples": len(examples),
        "metrics": metrics}, indent=1) + "\n")
    _print_metrics(metrics, args.json)
    if args.json:
        return 0
    print(f"{len(rows)} predictions: {out / 'predictions.jsonl'}; metrics: {out / 'metrics.json'}")
    return 0


_DESCRIPTION = __doc__.splitlines()[0].replace("``", "")


def register(subparsers) -> None:
    """Add ``eval`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser("eval", help="evaluate a model or predictions (EM, F1, BLEU-1, "
                              "ROUGE-L, recall@K)", description=_DESCRIPTION)
    p.add_argument("--data", required=True, help="JSONL (question, answers) or TSV dataset")
    p.add_argument("--predictions", help="one predicted answer per line, in dataset order")
    p.add_argument("--model", metavar="DIR", help="model directory (or rag-fast train's output)")
    p.add_argument("--index", metavar="DIR", default=None,
                   help="index directory (default: the one the model records)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where predictions.jsonl and metrics.json go (default eval-<data name>)")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.set_defaults(func=run)
