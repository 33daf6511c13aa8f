"""``rag-fast eval``: score predictions, or a RagModel, on a JSONL/TSV dataset.

    rag-fast eval --data dev.jsonl --predictions preds.txt          one answer per line
    rag-fast eval --data dev.jsonl --model DIR --retriever DIR      greedy answers of a model

Prints the metrics as JSON (em, f1, bleu1, rougeL; recall@K with a model; accuracy when the
dataset has labels).
"""
from __future__ import annotations

import argparse
import json


def run(args: argparse.Namespace) -> int:
    from rag_fast.evaluation import answer_metrics, evaluate, label_accuracy, load_qa

    examples = load_qa(args.data)
    if (args.predictions is None) == (args.model is None):
        raise ValueError("give exactly one of --predictions FILE and --model DIR")
    if args.predictions is not None:
        with open(args.predictions, encoding="utf-8") as f:
            predictions = [line.rstrip("\n") for line in f]
        if len(predictions) != len(examples):
            raise ValueError(f"{args.predictions} has {len(predictions)} lines for "
                             f"{len(examples)} examples in {args.data}")
        metrics = answer_metrics(predictions, [list(e.answers) for e in examples])
        if all(e.label is not None for e in examples):
            metrics["accuracy"] = label_accuracy(predictions, [e.label for e in examples])
    else:
        from rag_fast.models import RagModel
        from rag_fast.training.cli import load_retriever

        retriever = load_retriever({"path": args.retriever} if args.retriever else None)
        model = RagModel.load(args.model, retriever=retriever)
        metrics = evaluate(model, examples, batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens).metrics
    print(json.dumps(metrics, indent=1))
    return 0


def register(subparsers) -> None:
    """Add ``eval`` to the ``rag-fast`` command's subparsers."""
    p = subparsers.add_parser("eval", help="evaluate answers (EM, F1, BLEU-1, ROUGE-L, ...)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="JSONL (question, answers) or TSV dataset")
    p.add_argument("--predictions", help="one predicted answer per line, in dataset order")
    p.add_argument("--model", help="a RagModel checkpoint directory")
    p.add_argument("--retriever", help="retriever directory (rag_fast.retrieval)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.set_defaults(func=run)
