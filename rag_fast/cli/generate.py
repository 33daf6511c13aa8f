"""``rag-fast generate``: answer a question, or a JSONL file of questions, with a model directory.

    rag-fast generate --model DIR --question "who wrote hamlet?"
    rag-fast generate --model DIR --questions FILE.jsonl [--out answers.jsonl]

``--model`` is a model directory (``rag-fast init`` / ``train``, or the ``output_dir`` of
``train``, or any ``transformers`` RAG folder). Questions are embedded with the model's own
question encoder and passages retrieved from ``--index`` (default: the index the model records)
with the model's ``n_docs`` (``--n-docs N`` replaces it); RAG-Token or RAG-Sequence decoding
follows the model's mode, by default with beam search (4 beams, at most 32 new tokens), as
``rag-fast eval`` decodes: the same question gets the same answer from both; the settings are
said in a last line on stderr and recorded in each answer's ``"decoding"``. Without an index, each
JSONL line may bring its passages:
``{"question": ..., "passages": [{"title": ..., "text": ...}, ...], "scores": [...]}`` (scores
default to equal). ``--do-sample`` (with ``--temperature``, ``--top-k``, ``--top-p``, ``--seed``),
``--repetition-penalty`` and ``--no-repeat-ngram-size`` apply to seq2seq and decoder-only
generators alike. One JSON line per question is printed (or written to ``--out``):
``{"question", "answer", "passages": [{"title", "id", "score", "text"}, ...], "decoding":
{...}}``, each passage's text cut at its first 160 characters (``id`` null for a passage given
without one).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys

from tqdm.auto import tqdm

from rag_fast._stages import Timings
from rag_fast._validation import brief_error, not_a_folder
from rag_fast.cli.common import (check_new_tokens, check_positive,
                                 check_text, decoding_settings, describe_decoding, load_model,
                                 said_on_interrupt)
from rag_fast.evaluation.answers import answer_questions, is_answer_record, read_question_file
from rag_fast.models.checkpoint import resolve_model_dir
from rag_fast.storage import atomic_file, check_apart, check_output_file


def _check_out(args) -> None:
    """``--out`` apart from the inputs, and missing or an earlier answers file of ``rag-fast
    generate`` (:func:`rag_fast.evaluation.answers.is_answer_record` for every line): a file it
    did not write is never replaced."""
    check_apart(args.out, "--out", {"--questions": args.questions, "--model": args.model,
                                    "--index": args.index, "--tokenizer": args.tokenizer})
    check_output_file(args.out, "--out", is_answer_record, "an answers file of `rag-fast generate`")


def read_questions(args) -> list[dict]:
    """``--question`` as one question, or the questions of ``--questions``."""
    if args.question is not None:
        if not args.question.strip():
            raise ValueError("--question must not be empty")
        check_text("--question", args.question)
        return [{"question": args.question}]
    return read_question_file(args.questions)


def _load(args):
    model_dir = resolve_model_dir(args.model)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"--model {model_dir}: {not_a_folder(model_dir)} (expected a "
                                "model directory or a training run)")
    model = load_model(model_dir, args.index, args.device, require_index=False,
                       n_docs=args.n_docs, retrieval_mode=args.retrieval_mode)
    if args.tokenizer is not None:
        from transformers import AutoTokenizer  # deferred: import time

        if not os.path.isdir(args.tokenizer):  # a tokenizer is a folder (or a hub name)
            if os.path.exists(args.tokenizer) or os.sep in args.tokenizer:
                raise ValueError(f"--tokenizer {args.tokenizer!r} {not_a_folder(args.tokenizer)} "
                                 "(expected a tokenizer's folder)")
        try:
            model.generator_tokenizer = AutoTokenizer.from_pretrained(
                args.tokenizer, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001  (whatever the library says: the flag's fault)
            raise ValueError(f"--tokenizer {args.tokenizer!r}: not a tokenizer transformers can "
                             f"load ({brief_error(e, 200)})") from None
    if model.generator_tokenizer is None:
        raise ValueError(f"--model {model_dir} has no generator tokenizer: pass --tokenizer DIR")
    return model


def run(args) -> int:
    timings = Timings() if args.timings else None
    check_positive(("--batch-size", args.batch_size), ("--num-beams", args.num_beams),
                   ("--max-new-tokens", args.max_new_tokens))
    if args.n_docs is not None:
        check_positive(("--n-docs", args.n_docs))
    if args.out:
        _check_out(args)
    rows = read_questions(args)
    if timings:
        timings.lap("reading questions")
    model = _load(args)
    check_new_tokens(model, args.max_new_tokens)
    settings, record = decoding_settings(args, model)
    if timings:
        timings.lap("model and index load")
    bar = None
    if args.out and not args.no_progress:
        bar = tqdm(total=len(rows), desc="generate", unit="q", dynamic_ncols=True)
    if args.out:  # a Ctrl-C once the answers are renamed into place says so
        args.on_interrupt = said_on_interrupt([args.out],
                                              f"the answers were written whole to {args.out}")
    with atomic_file(args.out) if args.out else contextlib.nullcontext(sys.stdout) as out:
        _answer_all(model, rows, args, settings, record, out, bar, timings)
    if bar is not None:
        bar.close()
    if timings:
        timings.lap("writing")  # the last records, the file's flush and rename
    # how the answers were decoded, said once they are out (each line records it too)
    where = f" -> {args.out}" if args.out else ""
    print(f"rag-fast: {len(rows)} answer(s){where}; {describe_decoding(record)}", file=sys.stderr)
    if timings:
        print(f"rag-fast: timings: {timings.words()}", file=sys.stderr)
    return 0


def _answer_all(model, rows, args, settings, record, out, bar, timings=None) -> None:
    """Decode ``rows`` in batches and write one JSON line per question to ``out``, each with
    the decoding settings (``record``) that made it; ``timings``: each batch's stages added."""
    on_stage = None if timings is None else timings.add
    for records in answer_questions(model, rows, settings, args.batch_size, on_stage=on_stage):
        for answer in records:
            out.write(json.dumps({**answer, "decoding": record}, ensure_ascii=False) + "\n")
        if bar is not None:
            bar.update(len(records))
        if timings:
            timings.lap("writing")
