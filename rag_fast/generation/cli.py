"""``rag-fast generate``: answer a question, or a JSONL file of questions, with a RAG model.

    rag-fast generate --model DIR --question "who wrote hamlet?" --index INDEX_DIR
    rag-fast generate --model DIR --questions FILE.jsonl [--out answers.jsonl]

``--model`` is a ``transformers`` RAG folder (``save_pretrained`` of RagTokenForGeneration or
RagSequenceForGeneration; ``--mode`` picks the decoding, default from the folder's
architecture) whose generator tokenizer is in ``DIR`` or ``DIR/generator_tokenizer``.
Passages come from ``--index`` (an index directory of ``rag-fast index build``), or from each
JSONL line: ``{"question": ..., "passages": [{"title": ..., "text": ...}, ...],
"scores": [...]}``. Contexts are joined as ``title / text // question``, as the Hugging Face
retriever does. One JSON line per question is printed (or written to ``--out``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rag_fast._jsonl import read_objects


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` sub-command (sets ``func``)."""
    p = subparsers.add_parser("generate", help="answer questions with RAG-Token/RAG-Sequence")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--question", help="one question")
    src.add_argument("--questions", metavar="FILE", help="JSONL file, one {'question': ...} a line")
    p.add_argument("--model", required=True, metavar="DIR", help="transformers RAG model folder")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="generator tokenizer (default: DIR/generator_tokenizer, else DIR)")
    p.add_argument("--index", metavar="DIR", default=None,
                   help="index directory to retrieve passages from (else from the JSONL)")
    p.add_argument("--mode", choices=["token", "sequence"], default=None,
                   help="RAG-Token or RAG-Sequence decoding (default: the model's kind)")
    p.add_argument("--decoding", choices=["thorough", "fast"], default="thorough",
                   help="RAG-Sequence decoding (default thorough)")
    p.add_argument("--n-docs", type=int, default=5, help="passages per question (default 5)")
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8, help="questions decoded together")
    p.add_argument("--max-context-tokens", type=int, default=300)
    p.add_argument("--out", metavar="FILE", default=None, help="write JSONL here (default stdout)")
    p.set_defaults(func=run)


def join_context(title: str, text: str, question: str, prefix: str = "") -> str:
    """The generator input of one (passage, question), as the Hugging Face retriever builds it."""
    return f"{prefix}{title} / {text} // {question}"


def read_questions(args) -> list[dict]:
    """Questions as dicts with "question" (and optional "passages", "scores")."""
    if args.question is not None:
        if not args.question.strip():
            raise ValueError("--question must not be empty")
        return [{"question": args.question}]
    path = Path(args.questions)
    if not path.is_file():
        raise FileNotFoundError(f"--questions: no such file {path}")
    rows = []
    for _, where, row in read_objects(path):
        if not isinstance(row.get("question"), str):
            raise ValueError(f"{where}: expected an object with a string 'question'")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no questions")
    return rows


def _retrieve(rows: list[dict], index_dir: str | None, k: int) -> None:
    """Fill each row's "passages" and "scores" from the index (when given) and check them."""
    if index_dir is not None:
        from rag_fast.cli import _load_bundle
        from rag_fast.retrieval.encoders import Encoder

        manifest, store, index = _load_bundle(index_dir)
        spec = manifest["query_encoder"]
        encoder = Encoder(spec["name"], pooling=spec["pooling"], normalize=spec["normalize"],
                          max_length=spec["max_length"])
        q = encoder.encode_queries([r["question"] for r in rows])
        scores, ids = index.search(q, k)
        for r, srow, irow in zip(rows, scores.tolist(), ids.tolist()):
            found = [(s, store[i]) for s, i in zip(srow, irow) if i >= 0]
            r["passages"] = [{"title": p.title, "text": p.text} for _, p in found]
            r["scores"] = [s for s, _ in found]
    for n, r in enumerate(rows, 1):
        if not r.get("passages"):
            raise ValueError(f"question {n} has no passages: give --index or 'passages' in the JSONL")


def _batch_inputs(rows: list[dict], k: int, tokenizer, max_tokens: int, prefix: str):
    """``context_input_ids [B*k, S]``, mask, ``doc_scores [B, k]``; missing passages get -inf."""
    import torch

    texts, scores = [], []
    for r in rows:
        passages = list(r["passages"])[:k]
        given = r.get("scores") or [0.0] * len(passages)
        for i in range(k):
            p = passages[i] if i < len(passages) else {"title": "", "text": ""}
            texts.append(join_context(p.get("title", ""), p.get("text", ""), r["question"], prefix))
            scores.append(float(given[i]) if i < len(passages) else float("-inf"))
    enc = tokenizer(texts, max_length=max_tokens, truncation=True, padding=True, return_tensors="pt")
    doc_scores = torch.tensor(scores, dtype=torch.float32).view(len(rows), k)
    return enc["input_ids"], enc["attention_mask"], doc_scores


def _load(args):
    from transformers import AutoConfig, AutoTokenizer, RagSequenceForGeneration
    from transformers import RagTokenForGeneration

    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"--model: no such directory {model_dir}")
    config = AutoConfig.from_pretrained(model_dir)
    archs = getattr(config, "architectures", None) or []
    mode = args.mode or ("sequence" if "RagSequenceForGeneration" in archs else "token")
    cls = RagSequenceForGeneration if mode == "sequence" else RagTokenForGeneration
    model = cls.from_pretrained(model_dir).eval()
    tok_dir = args.tokenizer or (model_dir / "generator_tokenizer"
                                 if (model_dir / "generator_tokenizer").is_dir() else model_dir)
    return model, AutoTokenizer.from_pretrained(tok_dir), mode


def run(args) -> int:
    from rag_fast.generation import rag_sequence_generate, rag_token_generate

    if args.n_docs < 1 or args.batch_size < 1:
        raise ValueError("--n-docs and --batch-size must be >= 1")
    rows = read_questions(args)
    _retrieve(rows, args.index, args.n_docs)
    model, tokenizer, mode = _load(args)
    prefix = getattr(model.config.generator, "prefix", None) or ""
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        for start in range(0, len(rows), args.batch_size):
            batch = rows[start:start + args.batch_size]
            ids, mask, scores = _batch_inputs(batch, args.n_docs, tokenizer,
                                              args.max_context_tokens, prefix)
            settings = dict(num_beams=args.num_beams, max_new_tokens=args.max_new_tokens)
            if mode == "sequence":
                answers = rag_sequence_generate(model, ids, mask, scores, decoding=args.decoding,
                                                **settings)
            else:
                answers = rag_token_generate(model, ids, mask, scores, **settings)
            texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
            for r, text in zip(batch, texts):
                out.write(json.dumps({"question": r["question"], "answer": text.strip()}) + "\n")
    finally:
        if args.out:
            out.close()
    return 0
