"""``rag-fast init``: a starting model directory from a question encoder and a generator.

The model is built by :func:`rag_fast.models.build.build_rag_model`; this module checks the
options first (named as the flags that gave them) and writes the model directory.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from rag_fast.models.build import build_rag_model, check_n_docs
from rag_fast.models.checkpoint import KIND
from rag_fast.models.options import check_arguments
from rag_fast.storage import check_apart, check_output_folder


def run(args: argparse.Namespace) -> int:
    # before anything is read: --out apart from every input, and only ever an empty folder or a
    # model directory (replaced with --overwrite)
    check_apart(args.out, "--out", {"--index": args.index, "--generator": args.generator,
                                    "--generator-from-encoder": args.generator_from_encoder,
                                    "--generator-tokenizer": args.generator_tokenizer,
                                    "--question-encoder": args.question_encoder})
    check_output_folder(args.out, KIND, overwrite=args.overwrite, flag="--out")
    # build_rag_model's checks (RagModel's), named as the flags that gave the values
    flags = {"n_docs": ("--n-docs", args.n_docs), "epsilon": ("--label-smoothing",
                                                              args.label_smoothing),
             "max_context_length": ("--max-context-length", args.max_context_length)}
    for name, (flag, value) in flags.items():
        try:
            check_arguments(**{name: value})
        except ValueError as e:
            raise ValueError(f"{flag}{str(e).removeprefix(name)}") from None
    if args.index is not None:
        check_n_docs(args.n_docs, args.index, name="--n-docs")
    if (args.generator is not None and os.path.isfile(args.generator)
            and args.generator.endswith(".json") and args.generator_tokenizer is None):
        raise ValueError(f"--generator {args.generator!r} is a config file: give "
                         "--generator-tokenizer (a tokenizer name or folder) for its vocabulary")
    if not 0 <= args.seed < 2**63:  # torch's generator takes a 64-bit seed
        raise ValueError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.question_encoder is None and args.index is None:
        raise ValueError("give --question-encoder (a name or folder) or --index (an index "
                         "directory whose question encoder to use)")
    out = Path(args.out)
    try:
        model = build_rag_model(generator=args.generator,
                                generator_from_encoder=args.generator_from_encoder,
                                question_encoder=args.question_encoder,
                                index=args.index, generator_tokenizer=args.generator_tokenizer,
                                mode=args.mode, n_docs=args.n_docs, epsilon=args.label_smoothing,
                                max_context_length=args.max_context_length, seed=args.seed)
    except ValueError as e:  # an error about an argument, said as the flag that gave it
        message = str(e)
        for name in ("generator_from_encoder", "generator", "generator_tokenizer",
                     "question_encoder", "max_context_length"):
            if message.startswith(f"{name} "):
                raise ValueError("--" + name.replace("_", "-") + message[len(name):]) from None
        raise
    model.save(str(out))
    args.on_interrupt = lambda: f"the model directory was written whole to {args.out}"
    params = sum(p.numel() for p in model.parameters())
    kind = f"{model.family.name} " if model.family.decoder_only else ""
    print(f"initialised a {kind}RAG-{args.mode.capitalize()} model "
          f"({params / 1e6:.1f}M parameters, n_docs={model.n_docs}) -> {out}")
    return 0
