"""``rag-fast eval``: score a model directory, or a file of predictions, on a QA dataset.

    rag-fast eval --data dev.jsonl --model DIR [--index DIR] [--out DIR]   answers of a model
    rag-fast eval --data dev.jsonl --predictions preds.txt                 one answer per line

With a model, ``--out`` (default ``eval-<data name>``) receives ``predictions.jsonl`` (per
question: the question, the gold answers, the prediction, its EM and F1, and the retrieved
passages' titles, ids, scores and first 160 characters of text) and ``metrics.json`` (EM, F1, BLEU-1, ROUGE-L, recall@K, rounded
to 4 digits); the metrics are printed as a table. ``--model`` may be a model directory or the
``output_dir`` of ``rag-fast train``; ``--index`` defaults to the index the model records and
``--n-docs`` (the passages retrieved and marginalised over per question) to the model's.
A model's answers are decoded as ``rag-fast generate`` decodes them, with the same options and
the same default (beam search, 4 beams, at most 32 new tokens; ``--num-beams 1`` is greedy): the
same question gets the same answer from both. The settings are printed above the metrics and
recorded in ``metrics.json`` (``"decoding"``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rag_fast._jsonl import check_regular_file, cut_text, decoded_lines, warn_cut
from rag_fast.cli.common import (check_new_tokens, check_positive,
                                 decoding_settings, describe_decoding, load_model,
                                 resolve_device)
from rag_fast.evaluation import answer_metrics, evaluate, label_accuracy, load_qa
from rag_fast.evaluation.data import fields_read
from rag_fast.evaluation.report import check_evaluation_folder, round_metrics, write_evaluation
from rag_fast.storage import check_apart


def _print_metrics(metrics: dict, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(metrics))
        return
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        print(f"{key:<{width}}  {value:.4f}")
    recall = [k for k in metrics if k.startswith("recall@")]
    if recall:  # a table line a reader cannot take for gold-passage recall
        print(f"({recall[0]}: the share of questions with an answer string among their "
              f"{recall[0].split('@')[1]} passages, a lenient measure; `rag-fast index eval` "
              "gives recall against gold passage ids)")


def _check_out(out: Path, args) -> None:
    """``--out`` apart from the inputs, and empty or an evaluation's own folder (an earlier
    rag_fast's, holding only its two files, included)."""
    check_apart(out, "--out", {"--data": args.data, "--model": args.model, "--index": args.index})
    check_evaluation_folder(out, "--out")


def run(args: argparse.Namespace) -> int:
    if (args.predictions is None) == (args.model is None):
        raise ValueError("give exactly one of --predictions FILE and --model DIR")
    check_positive(("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens))
    if args.predictions is not None and args.out is not None:
        raise ValueError("--out needs --model: scoring --predictions writes nothing (the "
                         "metrics are printed; --json prints them as one JSON object)")
    if args.n_docs is not None:
        if args.model is None:
            raise ValueError("--n-docs needs --model (predictions retrieve nothing)")
        check_positive(("--n-docs", args.n_docs))
    out = Path(args.out or f"eval-{Path(args.data).stem}")
    if args.model is not None:  # before anything is read (a bad --device first: no I/O)
        resolve_device(args.device, "--device")
        _check_out(out, args)
    examples = load_qa(args.data)
    answers = [list(e.answers) for e in examples]
    if args.predictions is not None:
        check_regular_file(args.predictions, "--predictions", "a file of one answer per line")
        # each line cut as it is read (no model keeps more of one text), said once
        read = [cut_text(line.rstrip("\r\n")) for _, line in decoded_lines(args.predictions)]
        warn_cut(args.predictions, sum(cut for _, cut in read), "prediction")
        predictions = [text for text, _ in read]
        if len(predictions) != len(examples):
            raise ValueError(f"{args.predictions} has {len(predictions)} lines for "
                             f"{len(examples)} examples in {args.data}")
        metrics = answer_metrics(predictions, answers)
        if all(e.label is not None for e in examples):
            metrics["accuracy"] = label_accuracy(predictions, [e.label for e in examples])
        _print_metrics(round_metrics(metrics), args.json)
        return 0

    model = load_model(args.model, args.index, args.device, n_docs=args.n_docs,
                       retrieval_mode=args.retrieval_mode)
    check_new_tokens(model, args.max_new_tokens)
    check_apart(out, "--out", {"the model's index": getattr(model, "index_path", None)})
    settings, record = decoding_settings(args, model)
    if not args.json:
        print(describe_decoding(record))
        print(f"read {fields_read(args.data, examples)}")
    result = evaluate(model, examples, batch_size=args.batch_size,
                      progress=not args.no_progress, **settings)
    metrics, count = write_evaluation(out, examples, result, data=args.data, model=args.model,
                                      decoding=record)
    # a Ctrl-C from here on: what was written, not "nothing was written"
    args.on_interrupt = lambda: f"the evaluation was written whole to {args.out}"
    _print_metrics(metrics, args.json)
    if args.json:
        return 0
    print(f"{count} predictions: {out / 'predictions.jsonl'}; metrics: {out / 'metrics.json'}")
    return 0


