"""``rag-fast tokenizer fit``: a generator tokenizer fitted to a corpus.

    rag-fast tokenizer fit --passages FILE [--data QA.jsonl ...] --vocab-size N --out DIR

Calls :func:`rag_fast.tokenization.fit_tokenizer_folder`: a byte-level BPE tokenizer whose
decoding gives back exactly the text it encoded, saved as a folder that ``rag-fast init
--generator-tokenizer`` and ``transformers.AutoTokenizer`` open.
"""
from __future__ import annotations

import argparse

from rag_fast.storage import TOKENIZER_KIND, check_apart, check_output_folder
from rag_fast.tokenization import (
    MAX_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    check_vocab_size,
    fit_tokenizer_folder,
)

# the library names its arguments; the command says the flags that gave them
_FLAGS = {"passages": "--passages", "data": "--data"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tokenizer`` and its sub-command ``fit`` to the ``rag-fast`` command's subparsers."""
    tokenizer = subparsers.add_parser("tokenizer", help="fit a generator tokenizer to a corpus")
    sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="{fit}")
    fit = sub.add_parser(
        "fit", help="fit a byte-level BPE tokenizer to passages and QA files",
        description="Fit a byte-level BPE tokenizer to a corpus and save it as a folder that "
                    "`rag-fast init --generator-tokenizer` and transformers' AutoTokenizer "
                    "open. Decoding gives back exactly the text that was encoded (no "
                    "lower-casing, accents, spaces and punctuation kept, no unknown token), so "
                    "answers such as '3.7.15' or 'Saint-Étienne' survive. The special tokens "
                    "are BART's: <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 4.")
    fit.add_argument("--passages", required=True, metavar="FILE",
                     help="The passages to fit on, as `rag-fast index build` reads them: a DPR "
                          ".tsv (id, text, title), a .jsonl, a .txt document or a folder of "
                          ".txt documents. Titles and texts are both used.")
    fit.add_argument("--data", action="append", default=[], metavar="QA.jsonl",
                     help="A QA file (JSONL with 'question' and 'answers', or TSV) whose "
                          "questions and answers are added to the text fitted on. Give the "
                          "option once per file.")
    fit.add_argument("--vocab-size", type=int, required=True, metavar="N",
                     help=f"The number of tokens, at least {MIN_VOCAB_SIZE} (the 256 byte "
                          f"values and 5 special tokens), at most {MAX_VOCAB_SIZE:,}. The tokenizer has fewer when the text "
                          "allows no more merges.")
    fit.add_argument("--out", required=True, metavar="DIR",
                     help="The folder to write. It must not exist, be empty, or (with "
                          "--overwrite) be a tokenizer folder this command wrote.")
    fit.add_argument("--overwrite", action="store_true",
                     help="Replace a tokenizer folder this command wrote at --out. A folder of "
                          "another kind, or one holding files the command did not write, is "
                          "never replaced.")
    fit.add_argument("--dedupe", action="store_true",
                     help="Keep the first passage of each repeated id, as `rag-fast index build "
                          "--dedupe` does (by default a repeated id is an error).")
    fit.add_argument("--no-progress", action="store_true",
                     help="Do not show the fitting's progress bars.")
    fit.set_defaults(func=run_fit)


def run_fit(args: argparse.Namespace) -> int:
    # before anything is read: the count, and --out apart from every input and only ever an
    # empty folder or (with --overwrite) a tokenizer folder of this command's
    check_vocab_size(args.vocab_size, "--vocab-size")
    check_apart(args.out, "--out", {"--passages": args.passages,
                                    **{f"--data {d}": d for d in args.data}})
    check_output_folder(args.out, TOKENIZER_KIND, overwrite=args.overwrite, flag="--out")
    try:
        summary = fit_tokenizer_folder(args.passages, args.out, vocab_size=args.vocab_size,
                                       data=args.data, overwrite=args.overwrite,
                                       dedupe=args.dedupe, progress=not args.no_progress)
    except (ValueError, OSError) as e:  # the library's argument names, said as the flags
        message = str(e)
        for name, flag in _FLAGS.items():
            if message.startswith(name + " ") or message.startswith(name + ":"):
                message = flag + message[len(name):]
                break
        else:
            raise
        raise type(e)(message) from None
    print(summary.line())
    return 0
