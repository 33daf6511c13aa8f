"""RAG with a decoder-only generator, in plain PyTorch: the oracle of tests/test_causal.py.

Everything here runs the generator's own forward (its own LM head) once per (question,
passage[, hypothesis]) on the unpadded token sequence ``prompt ++ answer``, with no cache, no
padding, no batching, and computes in float64 (the logits are cast; build the generator in
float64 for an fp64 oracle). It is written to be obviously right, not fast.

Conventions (docs/decoder_only.md): ``prompts[b][k]`` is the 1-D token ids of question b's
prompt for passage k (``join_context`` text, tokenised, no padding); ``labels [B, T]`` are the
answer token ids padded at the end with ``pad_token_id`` or -100; answer position t is
predicted from the token before it (the prompt's last token for t = 0).

* Losses: the per-passage logits ``[B, K, T, V]`` go to ``rag_fast.reference``'s
  ``rag_token_nll`` / ``rag_sequence_nll``.
* RAG-Token greedy decoding: per step, the marginal ``logsumexp_k (log p(z_k|x) + log p(v | x,
  z_k, y<t))`` from a fresh forward per passage, argmax (lowest id on ties), stop at EOS.
* RAG-Token beam search and the per-passage beam searches of RAG-Sequence: the step logits of
  every (question, beam, passage) from a fresh forward, the candidates from
  ``rag_fast.reference_decoding.rag_token_beam_step`` (plain PyTorch), and the shared beam
  bookkeeping (``rag_fast.generation._search.BeamState``, itself checked against
  ``transformers`` elsewhere).
* RAG-Sequence: the union of the K beams' hypotheses, each scored against every passage with
  the RAG-Sequence log-likelihood ``logsumexp_k (log p(z_k|x) + sum_t log p(y_t | x, z_k, y<t))``
  (thorough) or only against the passages whose beam found it with the beam's own sum (fast).
* Logits processors (sampling, ``repetition_penalty``, ``no_repeat_ngram_size``;
  :func:`processed_scores`): the repetition penalty and the n-gram ban written out token by
  token over Python lists of the sequences ``prompt_k ++ answer`` (every passage k of a
  question for RAG-Token, the one passage of a RAG-Sequence search), then min length, forced
  tokens and the sampling warpers of ``generation._search.apply_processors`` (checked against
  ``transformers`` by the seq2seq tests), then a draw ``torch.multinomial(softmax(scores), 1,
  generator=rng)`` per step over all rows at once (RAG-Token: the questions; RAG-Sequence: all
  (question, passage) searches), or the argmax. Beam search with processors takes its
  candidates from ``generation._search.processed_candidates`` on the processed fp64
  log-probabilities (cast to float32, as the processors work in float32).
"""
from __future__ import annotations

from typing import Sequence

import torch

from dataclasses import replace

from rag_fast import reference
from rag_fast.generation._search import (
    BeamState,
    DecodingSettings,
    MinLengthBias,
    apply_processors,
    forced_token,
    processed_candidates,
)
from rag_fast.reference_decoding import rag_token_beam_step

__all__ = ["answer_log_probs", "processed_scores", "prompt_rules", "rag_loss",
           "rag_token_greedy", "rag_token_beam", "rag_token_processed_greedy",
           "rag_sequence_decode"]


def _logits(generator, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, V]`` (float64) of the unpadded 1-D sequence ``ids``."""
    out = generator(input_ids=ids[None].long(), use_cache=False, return_dict=True)
    return out.logits[0].double()


def answer_log_probs(generator, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Logits ``[n, V]`` of the n answer positions of ``prompt ++ answer`` (row t predicts
    ``answer[t]``), float64."""
    n = answer.shape[0]
    ids = torch.cat([prompt.long(), answer[: max(n - 1, 0)].long()])
    return _logits(generator, ids)[prompt.shape[0] - 1: prompt.shape[0] - 1 + n]


def rag_loss(
    generator,
    prompts: Sequence[Sequence[torch.Tensor]],
    doc_scores: torch.Tensor,
    labels: torch.Tensor,
    *,
    mode: str,
    pad_token_id: int,
    epsilon: float = 0.0,
    reduction: str = "none",
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """The RAG-Token (``mode="token"``) or RAG-Sequence loss of ``labels [B, T]`` given the
    unpadded ``prompts[b][k]`` and ``doc_scores [B, K]`` (float64). Ignored: -100, and the pad
    token unless it is ``eos_token_id`` (then it is the EOS target)."""
    ignored = labels == -100
    if pad_token_id != eos_token_id:
        ignored |= labels == pad_token_id
    ids = labels.masked_fill(labels == -100, pad_token_id)
    targets = labels.masked_fill(ignored, -100)
    B, T = labels.shape
    K = doc_scores.shape[1]
    rows = []
    for b in range(B):
        real = (~ignored[b]).nonzero()
        n = int(real.max()) + 1 if real.numel() else 1  # up to the last real answer token
        per_k = []
        for k in range(K):
            x = answer_log_probs(generator, prompts[b][k], ids[b, :n])
            per_k.append(torch.cat([x, x.new_zeros(T - n, x.shape[1])]))  # ignored positions
        rows.append(torch.stack(per_k))
    logits = torch.stack(rows)  # [B, K, T, V]
    fn = reference.rag_token_nll if mode == "token" else reference.rag_sequence_nll
    return fn(logits, doc_scores.double(), targets, epsilon=epsilon, ignore_index=-100,
              reduction=reduction)


def _log_prior(doc_scores: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(doc_scores.double(), dim=1)


@torch.no_grad()
def rag_token_greedy(generator, prompts, doc_scores: torch.Tensor, *, max_new_tokens: int,
                     eos_token_id: int | None, pad_token_id: int) -> list[list[int]]:
    """RAG-Token greedy answers (token ids, EOS included when produced), one list per question."""
    a = _log_prior(doc_scores)
    answers = []
    for b in range(len(prompts)):
        seq: list[int] = []
        for _ in range(max_new_tokens):
            per_k = []
            for k in range(len(prompts[b])):
                ids = torch.cat([prompts[b][k].long(), torch.tensor(seq, dtype=torch.long)])
                per_k.append(torch.log_softmax(_logits(generator, ids)[-1], -1) + a[b, k])
            marginal = torch.logsumexp(torch.stack(per_k), 0)
            tok = int(torch.argmax(marginal))  # first maximum: lowest id on ties
            seq.append(tok)
            if tok == eos_token_id:
                break
        answers.append(seq)
    return answers


def processed_scores(s: DecodingSettings, scores: torch.Tensor, sequences: list[list[int]],
                     cur_len: int) -> torch.Tensor:
    """One row's step ``scores [V]`` (cast to float32) after the logits processors of ``s``:

    - repetition penalty p: every token of any of ``sequences`` (a question's ``prompt_k ++
      answer`` token lists, prompt padding excluded) has its score x become ``x * p`` if
      ``x < 0`` else ``x / p``, once;
    - no-repeat n-grams n: in each sequence, every n-token window whose first n-1 tokens equal
      the sequence's last n-1 tokens bans the token that ends it (``-inf``);
    - then min length, forced tokens and (sampling) temperature / top-k / top-p, as
      ``generation._search.apply_processors`` defines them, at length ``cur_len`` (answer
      tokens + 1).
    """
    rest = replace(s, repetition_penalty=1.0, no_repeat_ngram_size=0)
    placeholder = torch.zeros((1, cur_len), dtype=torch.long)  # read only by the two below
    return apply_processors(rest, placeholder, prompt_rules(s, scores, sequences)[None],
                            cur_len)[0]


def prompt_rules(s: DecodingSettings, scores: torch.Tensor,
                 sequences: list[list[int]]) -> torch.Tensor:
    """The repetition penalty and the n-gram ban of :func:`processed_scores` alone (float32)."""
    x = scores.float().clone()
    p = s.repetition_penalty
    if p != 1.0:
        for tok in sorted({t for seq in sequences for t in seq}):
            v = x[tok]
            x[tok] = v * p if bool(v < 0) else v / p
    n = s.no_repeat_ngram_size
    if n > 0:
        banned = set()
        for seq in sequences:
            tail = seq[len(seq) - (n - 1):] if n > 1 else []
            for i in range(len(seq) - n + 1):
                if seq[i:i + n - 1] == tail:
                    banned.add(seq[i + n - 1])
        for tok in banned:
            x[tok] = float("-inf")
    return x


def _draw(s: DecodingSettings, scores: torch.Tensor, rng) -> list[int]:
    """The next token of every row of ``scores [R, V]``: one multinomial draw over all rows
    when sampling, else the first argmax of each row."""
    if s.do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=rng)[:, 0].tolist()
    return torch.argmax(scores, dim=-1).tolist()


@torch.no_grad()
def rag_token_processed_greedy(generator, prompts, doc_scores: torch.Tensor,
                               s: DecodingSettings, rng=None) -> list[list[int]]:
    """RAG-Token with one beam and processors: per step and question, the marginal
    ``logsumexp_k (log p(z_k|x) + log p(v | x, z_k, y<t))`` from fresh forwards, processed
    over the K sequences ``prompt_k ++ answer`` (:func:`processed_scores`), then a draw (all
    questions at once; a finished question draws from a uniform row) or the argmax. Answers
    as token lists, EOS included when produced."""
    a = _log_prior(doc_scores)
    B = len(prompts)
    V = int(generator.get_output_embeddings().weight.shape[0])
    answers: list[list[int]] = [[] for _ in range(B)]
    done = [False] * B
    for t in range(1, s.max_length):
        rows = []
        for b in range(B):
            if done[b]:
                rows.append(torch.zeros(V))
                continue
            per_k = []
            for k in range(len(prompts[b])):
                ids = torch.cat([prompts[b][k].long(), torch.tensor(answers[b], dtype=torch.long)])
                per_k.append(torch.log_softmax(_logits(generator, ids)[-1], -1) + a[b, k])
            marginal = torch.logsumexp(torch.stack(per_k), 0)
            seqs = [prompts[b][k].tolist() + answers[b] for k in range(len(prompts[b]))]
            rows.append(processed_scores(s, marginal, seqs, t))
        for b, tok in enumerate(_draw(s, torch.stack(rows), rng)):
            if not done[b]:
                answers[b].append(tok)
                done[b] = tok == s.eos_token_id
        if all(done):
            break
    return answers


def _beam_search(generator, prompt_rows, log_prior: torch.Tensor, s: DecodingSettings,
                 rng=None, marginal: bool = True) -> BeamState:
    """The shared beam bookkeeping driven by fresh, unpadded forwards: ``prompt_rows[b][k]``,
    ``log_prior [B, K]``. Column 0 of the hypotheses is a placeholder start token.
    With processors: the log-probabilities (the log-softmax of the passage marginal, or with
    ``marginal=False`` of the one passage's logits) processed by :func:`processed_scores`,
    candidates from ``processed_candidates``."""
    B, K, W = len(prompt_rows), log_prior.shape[1], s.num_beams
    state = BeamState(B, s, log_prior.device)
    V = int(generator.get_output_embeddings().weight.shape[0])
    ban = MinLengthBias(s, B * W, V, log_prior.device)
    rest = replace(s, repetition_penalty=1.0, no_repeat_ngram_size=0)
    while not state.done:
        t = state.cur_len
        rows = []
        for b in range(B):
            beams = []
            for j in range(W):
                answer = state.running[b, j, 1:t]
                beams.append(torch.stack([
                    _logits(generator, torch.cat([prompt_rows[b][k].long(), answer]))[-1]
                    for k in range(K)]))
            rows.append(torch.stack(beams))
        logits = torch.stack(rows)  # [B, W, K, V]
        if s.processed:
            if marginal:
                lp = torch.log_softmax(torch.logsumexp(
                    torch.log_softmax(logits, -1) + log_prior[:, None, :, None], dim=2), -1)
            else:
                lp = torch.log_softmax(logits[:, :, 0], -1)
            # the prompt rules here, the rest inside processed_candidates
            processed = torch.stack([torch.stack([
                prompt_rules(s, lp[b, j], [prompt_rows[b][k].tolist()
                                           + state.running[b, j, 1:t].tolist()
                                           for k in range(K)])
                for j in range(W)]) for b in range(B)])  # [B, W, V] float32
            cand = processed_candidates(rest, processed, state.running_scores,
                                        state.running[:, :, :t], t, rng)
            state.advance(*cand)
            continue
        forced = forced_token(s, t)
        if forced is not None:
            raise NotImplementedError("the reference has no forced tokens")
        cand = rag_token_beam_step(logits, log_prior, state.running_scores.double(), ban.at(t))
        state.advance(*cand)
    return state


@torch.no_grad()
def rag_token_beam(generator, prompts, doc_scores: torch.Tensor,
                   s: DecodingSettings, rng=None) -> list[list[int]]:
    """RAG-Token beam search: the R = ``s.num_return_sequences`` best answers of each question
    (token ids, EOS included when produced), question by question, best first."""
    state = _beam_search(generator, prompts, _log_prior(doc_scores), s, rng)
    R = s.num_return_sequences
    return [state.finished[b, r, 1:1 + int(state.finished_len[b, r])].tolist()
            for b in range(len(prompts)) for r in range(R)]


def _answers_of(state: BeamState, s: DecodingSettings) -> list[list[tuple[list[int], float]]]:
    """Per search, its W finished hypotheses as (tokens, summed log-probability)."""
    out = []
    for e in range(state.B):
        hyps = []
        for j in range(state.W):
            n = int(state.finished_len[e, j])
            logp = float(state.finished_scores[e, j]) * max(n, 1) ** s.length_penalty
            hyps.append((state.finished[e, j, 1:1 + n].tolist(), logp))
        out.append(hyps)
    return out


def _greedy_per_passage(generator, prompt: torch.Tensor, s: DecodingSettings):
    seq, logp = [], 0.0
    for _ in range(s.max_length - 1):
        lp = torch.log_softmax(_logits(generator, torch.cat(
            [prompt.long(), torch.tensor(seq, dtype=torch.long)]))[-1], -1)
        if s.eos_token_id is not None and len(seq) + 1 < s.min_length:
            lp[s.eos_token_id] = float("-inf")
        tok = int(torch.argmax(lp))
        seq.append(tok)
        logp += float(lp[tok].detach())
        if tok == s.eos_token_id:
            break
    return [(seq, logp)]


def _processed_greedy_all(generator, rows: list[torch.Tensor], s: DecodingSettings, rng):
    """Greedy (or sampled) searches of all prompt ``rows`` in lockstep, with processors: per
    step each row's own logits processed over ``prompt ++ answer``, one draw for all rows (a
    finished row draws from a uniform row). Per row ``[(tokens, sum of log-softmax)]``."""
    V = int(generator.get_output_embeddings().weight.shape[0])
    answers: list[list[int]] = [[] for _ in rows]
    logps = [0.0] * len(rows)
    done = [False] * len(rows)
    for t in range(1, s.max_length):
        scores, logsm = [], []
        for i, prompt in enumerate(rows):
            if done[i]:
                scores.append(torch.zeros(V))
                logsm.append(None)
                continue
            x = _logits(generator, torch.cat([prompt.long(),
                                              torch.tensor(answers[i], dtype=torch.long)]))[-1]
            logsm.append(torch.log_softmax(x, -1))
            scores.append(processed_scores(s, x, [prompt.tolist() + answers[i]], t))
        for i, tok in enumerate(_draw(s, torch.stack(scores), rng)):
            if not done[i]:
                answers[i].append(tok)
                logps[i] += float(logsm[i][tok])
                done[i] = tok == s.eos_token_id
        if all(done):
            break
    return [[(a, lp)] for a, lp in zip(answers, logps)]


def sequence_log_likelihood(generator, prompt: torch.Tensor, answer: list[int]) -> float:
    """``sum_t log p(answer_t | prompt, answer_<t)`` (float64)."""
    y = torch.tensor(answer, dtype=torch.long)
    lp = torch.log_softmax(answer_log_probs(generator, prompt, y), -1)
    return float(lp.gather(1, y[:, None]).sum())


@torch.no_grad()
def rag_sequence_decode(generator, prompts, doc_scores: torch.Tensor, s: DecodingSettings, *,
                        decoding: str = "thorough", num_return_sequences: int = 1, rng=None
                        ) -> list[list[tuple[list[int], float]]]:
    """RAG-Sequence answers: per question the ``num_return_sequences`` best (tokens, score)
    with a finite score, best first (ties: first found first). With processors the B*K
    searches run in lockstep (question-major), drawing for all of them at once."""
    a = _log_prior(doc_scores)
    B, K = a.shape
    searched = None
    if s.processed:
        flat = [prompts[b][k] for b in range(B) for k in range(K)]
        if s.num_beams == 1:
            searched = _processed_greedy_all(generator, flat, s, rng)
        else:
            state = _beam_search(generator, [[p] for p in flat],
                                 torch.zeros(len(flat), 1, dtype=torch.float64), s, rng,
                                 marginal=False)
            searched = _answers_of(state, s)
    out = []
    for b in range(B):
        found: list[list[tuple[list[int], float]]] = []
        for k in range(K):
            if searched is not None:
                found.append(searched[b * K + k])
            elif s.num_beams == 1:
                found.append(_greedy_per_passage(generator, prompts[b][k], s))
            else:
                state = _beam_search(generator, [[prompts[b][k]]],
                                     torch.zeros(1, 1, dtype=torch.float64), s)
                found.append(_answers_of(state, s)[0])
        union: list[tuple[int, ...]] = []
        for hyps in found:
            for tokens, _ in hyps:
                if tuple(tokens) not in union:
                    union.append(tuple(tokens))
        scored = []
        for hyp in union:
            if decoding == "fast":
                terms = [float(a[b, k]) + logp for k in range(K) for tokens, logp in found[k]
                         if tuple(tokens) == hyp]
            else:
                terms = [float(a[b, k])
                         + sequence_log_likelihood(generator, prompts[b][k], list(hyp))
                         for k in range(K)]
            scored.append((list(hyp), float(torch.logsumexp(torch.tensor(terms), 0))))
        # a hypothesis found only by a missing passage scores -inf under "fast": never returned
        scored = [(h, v) for h, v in scored if v > float("-inf")]
        order = sorted(range(len(scored)), key=lambda i: (-scored[i][1], i))
        out.append([scored[i] for i in order[:num_return_sequences]])
    return out
