"""Greedy answer decoding for RagModel, for evaluation during training and in examples.

RAG-Token: at each step the next token maximises the passage-marginal log-probability
``logsumexp_k (a[b,k] + log p(v | z_k, prefix))``.
RAG-Sequence: a greedy hypothesis per passage, then every distinct hypothesis is scored against
all K passages (teacher forced, the RAG-Sequence loss) and the most probable one wins (the
paper's "thorough" decoding with beam width 1).

Beam search and ``transformers``-identical decoding live in ``rag_fast.generation``; this module
keeps no cache (the decoder re-reads the prefix each step), which suits short answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rag_fast.models import _seq2seq
from rag_fast.models.rag_model import RagModel


@dataclass
class Decoded:
    """texts: B answers; token_ids: B lists of ids (no start/eos); passages and doc_scores
    ``[B, K]`` as retrieved."""

    texts: list[str]
    token_ids: list[list[int]]
    passages: list[list[Any]]
    doc_scores: torch.Tensor


def start_token_id(model: RagModel) -> int:
    """The first decoder token of a label sequence (BOS, or the decoder start token for T5)."""
    if model.bos_token_id is not None:
        return int(model.bos_token_id)
    return int(model.generator.config.decoder_start_token_id)


def _greedy_rows(model, enc, mask, prefix, log_prior, max_new_tokens, eos, marginal):
    """Greedy continuation of ``prefix`` ``[N, 1]`` for N = B*K rows -> ``[N, steps]`` ids."""
    head = _seq2seq.lm_head(model.generator)
    K = model.n_docs
    done = torch.zeros(prefix.shape[0], dtype=torch.bool, device=prefix.device)
    for _ in range(max_new_tokens):
        states = _seq2seq.decode(model.generator, prefix, enc, mask)[:, -1]  # [N, d]
        logp = torch.log_softmax(_seq2seq.lm_logits(head, states).float(), dim=-1)  # [N, V]
        if marginal:  # RAG-Token: one token per question, shared by its K rows
            joint = logp.view(-1, K, logp.shape[-1]) + log_prior[:, :, None]
            nxt = torch.logsumexp(joint, dim=1).argmax(-1).repeat_interleave(K)
        else:
            nxt = logp.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, model.pad_token_id), nxt)
        prefix = torch.cat([prefix, nxt[:, None]], dim=1)
        done |= nxt == eos
        if bool(done.all()):
            break
    return prefix[:, 1:]


def _strip(ids: list[int], eos: int, pad: int) -> list[int]:
    out = []
    for t in ids:
        if t == eos:
            break
        if t != pad:
            out.append(t)
    return out


@torch.no_grad()
def greedy_decode(
    model: RagModel,
    questions: Sequence[str],
    *,
    max_new_tokens: int = 16,
    passages: Sequence[Sequence[Any]] | None = None,
    passage_embeddings: torch.Tensor | None = None,
) -> Decoded:
    """Answers to ``questions`` (retrieving with the model's retriever unless ``passages`` and
    ``passage_embeddings`` ``[B, K, d]`` are given). Needs both tokenizers."""
    if not questions:
        raise ValueError("no questions to answer")
    if getattr(model, "is_causal", False):
        return _greedy_causal(model, questions, max_new_tokens, passages, passage_embeddings)
    q_inputs = model.tokenize_questions(questions)
    q = model.encode_questions(q_inputs["input_ids"], q_inputs["attention_mask"])
    if passages is None:
        found = model.retrieve(q)
        passages, passage_embeddings = found.passages, found.embeddings
    scores = model.score_passages(q, passages, passage_embeddings)  # [B, K]
    ctx = model.build_contexts(questions, passages)
    B, K = scores.shape
    log_prior = torch.log_softmax(scores.float(), dim=1)
    eos = int(model.generator.config.eos_token_id)
    pad = model.pad_token_id
    enc = _seq2seq.encode(model.generator, ctx["input_ids"], ctx["attention_mask"])
    start = torch.full((B * K, 1), start_token_id(model), dtype=torch.long, device=enc.device)
    rows = _greedy_rows(model, enc, ctx["attention_mask"], start, log_prior, max_new_tokens, eos,
                        marginal=model.mode == "token")
    rows = [_strip(r, eos, pad) for r in rows.tolist()]
    if model.mode == "token":
        best = [rows[b * K] for b in range(B)]
    else:
        best = _rescore_sequences(model, ctx, scores, rows, start_token_id(model), eos)
    tok = model.generator_tokenizer
    texts = [tok.decode(ids, skip_special_tokens=True).strip() for ids in best]
    return Decoded(texts, best, [list(p) for p in passages], scores)


def _greedy_causal(model, questions, max_new_tokens, passages, passage_embeddings) -> Decoded:
    """A decoder-only generator: ``RagModel.generate`` with one beam (RAG-Token: the marginal
    argmax per step; RAG-Sequence: a greedy answer per passage, rescored thoroughly), no
    sampling and no penalties whatever the generation config says, as for seq2seq here."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if model.generator_tokenizer is None:
        raise ValueError("greedy_decode needs the model's generator_tokenizer (to write the "
                         "prompts and decode the answers)")
    out = model.generate(list(questions), passages=passages,
                         passage_embeddings=passage_embeddings, num_beams=1,
                         num_return_sequences=1, max_new_tokens=max_new_tokens,
                         min_new_tokens=0, decoding="thorough", do_sample=False,
                         repetition_penalty=1.0, no_repeat_ngram_size=0)
    eos = model.generator.config.eos_token_id
    eos = -1 if eos is None else int(eos[0] if isinstance(eos, (list, tuple)) else eos)
    token_ids = [_strip(row, eos, model.pad_token_id) for row in out.sequences.tolist()]
    tok = model.generator_tokenizer
    texts = [tok.decode(ids, skip_special_tokens=True).strip() for ids in token_ids]
    return Decoded(texts, token_ids, [list(p) for p in out.passages], out.doc_scores)


def _rescore_sequences(model, ctx, scores, rows, start, eos) -> list[list[int]]:
    """Per question, the hypothesis (one per passage) with the highest marginal likelihood."""
    B, K = scores.shape
    owners, hyps = [], []
    for b in range(B):
        seen = []
        for ids in rows[b * K:(b + 1) * K]:
            if ids not in seen:
                seen.append(ids)
        owners += [b] * len(seen)
        hyps += seen
    T = max(len(h) for h in hyps) + 2
    labels = torch.full((len(hyps), T), model.pad_token_id, dtype=torch.long)
    for i, h in enumerate(hyps):
        labels[i, :len(h) + 2] = torch.tensor([start, *h, eos])
    index = torch.tensor(owners)
    rows_idx = (index[:, None] * K + torch.arange(K)[None, :]).reshape(-1)  # [P*K]
    device = ctx["input_ids"].device
    nll = model.loss_from_contexts(ctx["input_ids"][rows_idx.to(device)],
                                   ctx["attention_mask"][rows_idx.to(device)],
                                   scores[index.to(device)], labels.to(device), reduction="none")
    best: list[list[int]] = [[] for _ in range(B)]
    best_nll = [float("inf")] * B
    for i, (b, value) in enumerate(zip(owners, nll.tolist())):
        if value < best_nll[b]:
            best_nll[b], best[b] = value, hyps[i]
    return best
