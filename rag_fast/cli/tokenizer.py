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
    check_vocab_size,
    fit_tokenizer_folder,
)

# the library names its arguments; the command says the flags that gave them
_FLAGS = {"passages": "--passages", "data": "--data"}


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
