"""RAG decoding with a decoder-only generator (any Hugging Face ``*ForCausalLM``).

Each (question, passage) prompt is left-padded to S columns (see ``rag_fast.models._causal``)
and prefilled once; its key/value cache is then shared by the W beams: copied W times after
the first step (when every beam still holds the bare prompt) and reordered after the beams
from then on. Each step feeds one token per (question, passage, beam) row with position id
``real prompt length + answer index`` and the prompt's padding masked.

* RAG-Token: the K passages' step logits of a (question, beam) meet in the fused beam step
  (``rag_fast.ops.rag_token_beam_step``), as ``rag_fast.generation.rag_token`` does for BART;
  greedy (one beam) or beam search with the shared bookkeeping of ``generation._search``.
* RAG-Sequence: one search per (question, passage) (greedy or W beams), the union of each
  question's hypotheses (first occurrence first), then either every hypothesis scored against
  every passage by teacher forcing (``decoding="thorough"``: ``logsumexp_k (log p(z_k|x) +
  sum_t log p(y_t | x, z_k, y<t))``, EOS included, nothing after it), or only against the
  passages whose search produced it, with the search's own sum (``"fast"``).

Returned sequences are the answer tokens only (no prompt, no start token) ``[B*R, L]``,
padded with the generator's pad token after each answer's EOS (or its last token); L is the
longest returned answer.

Lengths: ``max_new_tokens`` (or ``max_length``, which here also counts answer tokens only, the
prompts' lengths differing) bounds the answer; ``min_new_tokens`` / ``min_length`` likewise.

Sampling (``do_sample`` with ``temperature``, ``top_k``, ``top_p``), ``repetition_penalty`` and
``no_repeat_ngram_size`` take a plain-PyTorch step instead of the fused one, with the seq2seq
path's semantics: RAG-Token processes the passage-marginal log-probabilities of each
(question, beam); RAG-Sequence processes each passage's own search (the generator's logits when
greedy, their log-softmax in beam search, as ``transformers``' ``generate`` does). As
``transformers`` does for a causal LM, the repetition penalty and the n-gram ban read the whole
sequence, the prompt's real tokens (not its padding) followed by the answer so far. RAG-Token
has K prompts per question: a token counts as seen, or an n-gram as present, when it is in any
of the K sequences ``prompt_k ++ answer`` (with one passage: exactly ``transformers``' rule).
Draws come from ``rng`` (a ``torch.Generator``; None: torch's global one), one draw per step for
all rows together: RAG-Token's questions, or all (question, passage) searches of RAG-Sequence.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from rag_fast._validation import check_decoding_scores
from rag_fast.generation._generic_decoder import cache_argument
from rag_fast.generation._inputs import check_rng
from rag_fast.generation._search import (
    BeamState,
    DecodingSettings,
    MinLengthBias,
    apply_processors,
    beam_search,
    forced_token,
    pick_tokens,
    processed_candidates,
    settings_from,
)
from rag_fast.models import _causal
from rag_fast.ops import rag_sequence_nll
from rag_fast.ops.rag_token_beam_step import rag_token_beam_step


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


# Rescoring (RAG-Sequence, thorough) materialises the logits of at most this many bytes at
# once: a cap on its peak memory (lower it to bound memory, at the cost of smaller matmuls).
SCORE_CHUNK_BYTES = 256 * 2**20


class _Prompts:
    """The prefilled prompts of N (question, passage) rows and their incremental decoder."""

    def __init__(self, generator: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 max_new: int) -> None:
        self.generator = generator
        self.body = _causal.backbone(generator)
        self.cache_arg = cache_argument(self.body)
        self.head = _causal.lm_head(generator)
        N, S = ids.shape
        self.S, self.rows = S, N
        mask = mask.to(torch.long)
        self.prompt_ids, self.prompt_mask = ids, mask  # [N, S]: what the processors read
        # the attention mask of every step: the prompt's, then ones for the answer tokens
        self.mask = torch.cat([mask, mask.new_ones((N, max_new))], dim=1)
        self.lengths = mask.sum(1)  # real prompt tokens per row: the first answer position
        out = self.body(input_ids=ids, attention_mask=mask, position_ids=_causal.position_ids(mask),
                        use_cache=True, return_dict=True)
        self.cache = _cache_of(out)
        self.first_logits = self.logits(out.last_hidden_state[:, -1])  # [N, V]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, self.head.weight, self.head.bias)

    def expand(self, W: int) -> None:
        """Copy every row's cache W times (rows (n, j) consecutively)."""
        if W > 1:
            self.cache.batch_repeat_interleave(W)
            self.mask = self.mask.repeat_interleave(W, dim=0)
            self.lengths = self.lengths.repeat_interleave(W)
        self.rows *= W

    def reorder(self, index: torch.Tensor) -> None:
        """Row r continues from row ``index[r]`` (same prompt: mask and lengths unchanged)."""
        self.cache.reorder_cache(index)

    def step(self, tokens: torch.Tensor, answer_index: int) -> torch.Tensor:
        """Feed answer token ``answer_index`` of every row -> next-token logits ``[rows, V]``."""
        width = self.S + answer_index + 1
        kwargs = {self.cache_arg: self.cache}
        out = self.body(input_ids=tokens.reshape(-1, 1), attention_mask=self.mask[:, :width],
                        position_ids=(self.lengths + answer_index)[:, None],
                        use_cache=True, return_dict=True, **kwargs)
        self.cache = _cache_of(out)
        return self.logits(out.last_hidden_state[:, -1])


def _resolve_settings(generator: nn.Module, generation_config, V: int, pad: int,
                      settings: dict) -> DecodingSettings:
    """``settings_from`` with the lengths counted in answer tokens and a placeholder start
    token (the hypotheses' column 0, dropped before returning).

    ``max_length`` given here counts answer tokens. From a generation config only
    ``max_new_tokens`` is read (default 20): a decoder-only config's ``max_length`` counts the
    prompt too (often the whole context window), which is no answer length."""
    cfg = generation_config if generation_config is not None else getattr(
        generator, "generation_config", None)
    settings = dict(settings)
    max_length = settings.pop("max_length", None)
    if settings.get("max_new_tokens") is None:
        if max_length is None:
            max_length = getattr(cfg, "max_new_tokens", None) or 20
        settings["max_new_tokens"] = int(max_length)
    min_length = settings.pop("min_length", None)
    if settings.get("min_new_tokens") is None:
        if min_length is None:
            min_length = (getattr(cfg, "min_new_tokens", None) or getattr(cfg, "min_length", None)
                          or 0)
        settings["min_new_tokens"] = int(min_length)
    settings["decoder_start_token_id"] = pad
    return settings_from(cfg, V, allow_processors=True, **settings)


def prompt_processors(s: DecodingSettings, scores: torch.Tensor, prompt_ids: torch.Tensor,
                      prompt_mask: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """``scores [E, W, V]`` (cast to float32) after the repetition penalty and the no-repeat
    n-gram ban of ``s``, over the sequences ``prompt_(e,k) ++ answer_(e,w)`` for every k.

    ``prompt_ids`` / ``prompt_mask`` ``[E, K, S]`` (left-padded; padding is not a token of the
    sequence), ``answers [E, W, A]`` the answer tokens so far (A >= 0, no placeholder).
    Repetition penalty p: a token present in any of the K sequences has its score x become
    ``x * p`` if ``x < 0`` else ``x / p`` (once). No-repeat n-grams n: a token that would
    complete an n-gram already present in one of the K sequences (its last n-1 tokens followed
    by that token) gets ``-inf``.
    """
    scores = scores.float()
    E, W, V = scores.shape
    K, S = prompt_ids.shape[1:]
    A = answers.shape[2]
    device = scores.device
    real = prompt_mask.bool()
    if s.repetition_penalty != 1.0:
        counts = torch.zeros((E, V), dtype=torch.int32, device=device)
        counts.scatter_add_(1, prompt_ids.reshape(E, K * S), real.reshape(E, K * S).int())
        seen = (counts > 0)[:, None, :].expand(E, W, V)
        if A:
            in_answer = torch.zeros((E, W, V), dtype=torch.int32, device=device)
            in_answer.scatter_add_(2, answers, torch.ones_like(answers, dtype=torch.int32))
            seen = seen | (in_answer > 0)
        p = s.repetition_penalty
        scores = torch.where(seen, torch.where(scores < 0, scores * p, scores / p), scores)
    n = s.no_repeat_ngram_size
    if n > 0 and S + A >= n:
        full = torch.cat([prompt_ids[:, None].expand(E, W, K, S),
                          answers[:, :, None].expand(E, W, K, A)], dim=3)  # [E, W, K, S+A]
        valid = torch.cat([real[:, None].expand(E, W, K, S),
                           real.new_ones((E, W, K, A))], dim=3)
        windows = full.unfold(3, n, 1)  # [E, W, K, S+A-n+1, n]
        inside = valid.unfold(3, n, 1).all(dim=-1)  # windows of real tokens only
        tail = full[..., S + A - (n - 1):]  # the last n-1 tokens (real whenever a window is)
        hit = (windows[..., : n - 1] == tail[..., None, :]).all(dim=-1) & inside
        banned = torch.zeros((E, W, V), dtype=torch.int32, device=device)
        banned.scatter_add_(2, windows[..., n - 1].reshape(E, W, -1),
                            hit.reshape(E, W, -1).int())
        scores = scores.masked_fill(banned > 0, float("-inf"))
    return scores


def _without_prompt_processors(s: DecodingSettings) -> DecodingSettings:
    """``s`` with the repetition penalty and the n-gram ban off (applied by
    :func:`prompt_processors`); min length, forced tokens and the sampling warpers stay."""
    return replace(s, repetition_penalty=1.0, no_repeat_ngram_size=0)


@torch.no_grad()
def causal_generate(
    generator: nn.Module,
    context_input_ids: torch.Tensor,
    context_attention_mask: torch.Tensor | None,
    doc_scores: torch.Tensor,
    *,
    mode: str = "token",
    decoding: str = "thorough",
    impl: str = "auto",
    generation_config=None,
    n_docs: int | None = None,
    num_return_sequences: int | None = None,
    rng: torch.Generator | None = None,
    **settings,
) -> torch.Tensor:
    """Answer with RAG-Token (``mode="token"``) or RAG-Sequence (``"sequence"``) decoding over a
    decoder-only generator.

    Args:
        generator: a ``*ForCausalLM`` (see ``rag_fast.models._causal.check_causal``).
        context_input_ids: ``[B*K, S]`` prompts (passage and question), left-padded, K rows
            per question.
        context_attention_mask: ``[B*K, S]`` (1: token, 0: padding), or None (all ones).
        doc_scores: ``[B, K]`` passage scores; ``-inf`` marks a missing passage.
        mode: ``"token"`` or ``"sequence"``; decoding: RAG-Sequence's ``"thorough"`` or
            ``"fast"``.
        impl: beam-step backend (``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"``).
        generation_config: defaults (None: the generator's ``generation_config``).
        num_return_sequences: answers per question (RAG-Token: at most num_beams).
        rng: the ``torch.Generator`` sampling draws from (None: torch's global generator).
        **settings: ``num_beams``, ``max_new_tokens`` / ``max_length`` (answer tokens),
            ``min_new_tokens`` / ``min_length``, ``length_penalty``, ``early_stopping``,
            ``eos_token_id``, ``pad_token_id``, ``forced_bos_token_id`` (the first answer
            token), ``forced_eos_token_id``, ``do_sample``, ``temperature``, ``top_k``,
            ``top_p``, ``repetition_penalty``, ``no_repeat_ngram_size`` (see the module
            docstring for what the last two read).

    Returns:
        ``[B*R, L]`` int64 answer token ids (R answers per question, best first), padded with
        the pad token; a RAG-Sequence question with fewer than R distinct hypotheses gets rows
        of padding.

    Raises:
        ValueError: a generator RagModel cannot drive, bad shapes, prompts not left-padded,
            a NaN or all -inf passage scores, prompt plus answer longer than the positions.
    """
    if mode not in ("token", "sequence"):
        raise ValueError(f"mode must be 'token' or 'sequence', got {mode!r}")
    if decoding not in ("thorough", "fast"):
        raise ValueError(f"decoding must be 'thorough' or 'fast', got {decoding!r}")
    _causal.check_causal(generator)
    check_rng(rng)
    if not isinstance(doc_scores, torch.Tensor) or doc_scores.dim() != 2 \
            or not doc_scores.is_floating_point():
        raise ValueError("doc_scores must be a [B, K] floating tensor")
    B, K = doc_scores.shape
    if n_docs is not None and n_docs != K:
        raise ValueError(f"n_docs={n_docs} does not match doc_scores.shape[1]={K}")
    if not isinstance(context_input_ids, torch.Tensor) or context_input_ids.dim() != 2 \
            or context_input_ids.shape[0] != B * K:
        raise ValueError(f"context_input_ids must be [B*K, S] = [{B}*{K}, S], got "
                         f"{tuple(getattr(context_input_ids, 'shape', ()))}")
    if context_attention_mask is None:
        context_attention_mask = torch.ones_like(context_input_ids)
    _causal.check_prompts(context_input_ids, context_attention_mask)
    check_decoding_scores(doc_scores.detach())
    pad = int(generator.config.pad_token_id)
    head = _causal.lm_head(generator)
    V = int(head.weight.shape[0])
    if mode == "sequence":
        R = int(num_return_sequences or 1)
        if settings.get("num_beams") is None:
            settings["num_beams"] = 1
        settings["num_return_sequences"] = settings["num_beams"]
    elif num_return_sequences is not None:
        settings["num_return_sequences"] = num_return_sequences
    s = _resolve_settings(generator, generation_config, V, pad, settings)
    max_new = s.max_length - 1
    limit = getattr(generator.config, "max_position_embeddings", None)
    if limit and context_input_ids.shape[1] + max_new - 1 > int(limit):
        raise ValueError(
            f"prompts of {context_input_ids.shape[1]} tokens and up to {max_new} answer tokens "
            f"need {context_input_ids.shape[1] + max_new - 1} positions but the generator has "
            f"{limit} (config.max_position_embeddings); shorten the prompts or max_new_tokens")
    dtype = torch.float64 if head.weight.dtype == torch.float64 else torch.float32
    log_prior = torch.log_softmax(doc_scores.detach().to(dtype), dim=1)
    prompts = _Prompts(generator, context_input_ids.long(), context_attention_mask, max_new)
    if mode == "token":
        if s.num_beams == 1:
            seqs, lengths = _token_greedy(prompts, log_prior, s, B, K, impl, rng)
        else:
            seqs, lengths = _token_beam(prompts, log_prior, s, B, K, impl, rng)
        return _pad_answers(seqs, lengths, pad)
    if s.num_beams == 1:
        hyps, lengths, logp = _greedy_per_passage(prompts, s, impl, rng)
    else:
        hyps, lengths, logp = _beam_per_passage(prompts, s, impl, rng)
    return _rag_sequence(generator, context_input_ids.long(), context_attention_mask, log_prior,
                         hyps, lengths, logp, B, K, R, pad, decoding, impl)


def _pad_answers(seqs: torch.Tensor, lengths: torch.Tensor, pad: int) -> torch.Tensor:
    """Hypotheses ``[M, 1 + L]`` (placeholder column 0) with lengths ``[M]`` -> answers
    ``[M, max length]`` padded with ``pad``."""
    width = max(1, int(lengths.max())) if lengths.numel() else 1
    out = seqs[:, 1:1 + width]
    cols = torch.arange(out.shape[1], device=out.device)
    return out.masked_fill(cols[None, :] >= lengths[:, None], pad)


def _marginal(logits: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """``logsumexp_k (log p(z_k|x) + log_softmax(logits)_k)`` of ``logits [B, W, K, V]`` ->
    ``[B, W, V]`` in the prior's dtype."""
    logp = torch.log_softmax(logits.to(log_prior.dtype), dim=-1)
    return torch.logsumexp(logp + log_prior[:, None, :, None], dim=2)


def _record(s: DecodingSettings, seq: torch.Tensor, nxt: torch.Tensor,
            unfinished: torch.Tensor, lengths: torch.Tensor, t: int):
    """Write step t's tokens ``nxt`` into ``seq[:, t]`` (finished rows get the fill token),
    mark rows that just produced EOS finished (``unfinished`` in place) and record their
    length. Returns ``(nxt, lengths)``."""
    nxt = torch.where(unfinished, nxt, torch.full_like(nxt, s.fill_token_id))
    seq[:, t] = nxt
    if s.eos_token_id is not None:
        ended = unfinished & (nxt == s.eos_token_id)
        lengths = torch.where(ended, torch.full_like(lengths, t), lengths)
        unfinished &= ~ended
    return nxt, lengths


def _token_greedy(prompts: _Prompts, log_prior, s: DecodingSettings, B: int, K: int, impl: str,
                  rng: torch.Generator | None = None):
    device = log_prior.device
    seq = torch.full((B, s.max_length), s.fill_token_id, dtype=torch.long, device=device)
    lengths = torch.full((B,), s.max_length - 1, dtype=torch.long, device=device)
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    zeros = log_prior.new_zeros((B, 1))
    ban = MinLengthBias(s, B, int(prompts.head.weight.shape[0]), device)
    logits = prompts.first_logits
    t = 1
    rest = _without_prompt_processors(s)
    S = prompts.S
    for t in range(1, s.max_length):
        forced = forced_token(s, t)
        if s.processed:  # the marginal, processed, then argmax or a draw
            marginal = _marginal(logits.view(B, 1, K, -1), log_prior)  # [B, 1, V]
            scores = prompt_processors(s, marginal, prompts.prompt_ids.view(B, K, S),
                                       prompts.prompt_mask.view(B, K, S), seq[:, None, 1:t])
            nxt = pick_tokens(s, apply_processors(rest, seq[:, :t], scores[:, 0], t), rng)
        elif forced is not None:
            nxt = torch.full((B,), forced, dtype=torch.long, device=device)
        else:
            step = logits.view(B, K, 1, -1).transpose(1, 2)  # [B, 1, K, V]
            _, _, tok = rag_token_beam_step(step, log_prior, zeros, ban.at(t), num_candidates=1,
                                            impl=impl)
            nxt = tok[:, 0]
        nxt, lengths = _record(s, seq, nxt, unfinished, lengths, t)
        if not bool(unfinished.any()) or t == s.max_length - 1:
            break
        logits = prompts.step(nxt.repeat_interleave(K), t - 1)
    return seq, torch.minimum(lengths, torch.full_like(lengths, t))


def _beam_driver(prompts: _Prompts, E: int, K: int, W: int):
    """``(step_logits, reorder)`` for ``beam_search`` over E searches of K passages each
    (prompt rows (e, k); decoder rows (e, k, j))."""
    device = prompts.first_logits.device
    base = (torch.arange(E * K, device=device) * W).view(E, K, 1)

    def step_logits(last: torch.Tensor, pos: int) -> torch.Tensor:
        if pos == 0:  # the prefill's logits, the same for every beam
            return prompts.first_logits.view(E, K, 1, -1).expand(E, K, W, -1).transpose(1, 2)
        rows = last[:, None, :].expand(E, K, W).reshape(-1)  # rows (e, k, j)
        return prompts.step(rows, pos - 1).view(E, K, W, -1).transpose(1, 2)

    def reorder(sources: torch.Tensor, t: int) -> None:
        if t == 1:  # every beam still holds the bare prompt: copy it W times
            prompts.expand(W)
        else:
            prompts.reorder((base + sources[:, None, :]).reshape(-1))

    return step_logits, reorder


def _processed_beam_search(state: BeamState, step_logits, log_probs, prompt_ids, prompt_mask,
                           reorder, rng) -> BeamState:
    """``beam_search``'s processor path with the prompt-aware repetition penalty and n-gram
    ban: per step the ``[E, W, V]`` log-probabilities (``log_probs(logits)``), processed over
    ``prompt_(e,k) ++ answer_(e,w)`` (``prompt_ids`` / ``prompt_mask`` ``[E, K, S]``), then the
    shared candidates (min length, forced tokens, warpers, the 2W best or 2W draws)."""
    s = state.s
    rest = _without_prompt_processors(s)
    while not state.done:
        t = state.cur_len
        running = state.running[:, :, :t]
        lp = prompt_processors(s, log_probs(step_logits(running[:, :, t - 1], t - 1)),
                               prompt_ids, prompt_mask, running[:, :, 1:])
        cand = processed_candidates(rest, lp, state.running_scores, running, t, rng)
        sources = state.advance(*cand)
        if not state.done:
            reorder(sources, t)
    return state


def _token_beam(prompts: _Prompts, log_prior, s: DecodingSettings, B: int, K: int, impl: str,
                rng: torch.Generator | None = None):
    W, V = s.num_beams, int(prompts.head.weight.shape[0])
    step_logits, reorder = _beam_driver(prompts, B, K, W)
    if s.processed:
        S = prompts.S
        state = _processed_beam_search(
            BeamState(B, s, log_prior.device), step_logits,
            lambda logits: torch.log_softmax(_marginal(logits, log_prior), dim=-1),
            prompts.prompt_ids.view(B, K, S), prompts.prompt_mask.view(B, K, S), reorder, rng)
    else:
        state = beam_search(BeamState(B, s, log_prior.device), step_logits, log_prior,
                            MinLengthBias(s, B * W, V, log_prior.device), reorder, impl)
    seqs, _ = state.result()
    R = s.num_return_sequences
    return seqs.reshape(B * R, -1), state.finished_len[:, :R].reshape(-1)


def _greedy_per_passage(prompts: _Prompts, s: DecodingSettings, impl: str,
                        rng: torch.Generator | None = None):
    """One greedy answer per prompt row: ``(hyps [N, 1, 1+L], lengths [N, 1], logp [N, 1])``."""
    N = prompts.rows
    logits = prompts.first_logits
    device = logits.device
    seq = torch.full((N, s.max_length), s.fill_token_id, dtype=torch.long, device=device)
    seq[:, 0] = s.decoder_start_token_id
    lengths = torch.full((N,), s.max_length - 1, dtype=torch.long, device=device)
    zero = torch.zeros((N, 1), dtype=logits.dtype, device=device)
    logp = torch.zeros(N, dtype=logits.dtype, device=device)
    unfinished = torch.ones(N, dtype=torch.bool, device=device)
    ban = MinLengthBias(s, N, logits.shape[-1], device)
    t = 1
    rest = _without_prompt_processors(s)
    S = prompts.S
    for t in range(1, s.max_length):
        forced = forced_token(s, t)
        if s.processed:  # the generator's logits, processed, then argmax or a draw
            scores = prompt_processors(s, logits[:, None], prompts.prompt_ids.view(N, 1, S),
                                       prompts.prompt_mask.view(N, 1, S), seq[:, None, 1:t])
            nxt = pick_tokens(s, apply_processors(rest, seq[:, :t], scores[:, 0], t), rng)
            step_logp = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])[:, 0]
            step_logp = step_logp.to(logp.dtype)
        elif forced is not None:
            nxt = torch.full((N,), forced, dtype=torch.long, device=device)
            step_logp = torch.zeros_like(logp)
        else:
            sc, _, tok = rag_token_beam_step(logits.view(N, 1, 1, -1), zero, zero, ban.at(t),
                                             num_candidates=1, impl=impl)
            nxt, step_logp = tok[:, 0], sc[:, 0].to(logp.dtype)
        logp = logp + torch.where(unfinished, step_logp, torch.zeros_like(step_logp))
        nxt, lengths = _record(s, seq, nxt, unfinished, lengths, t)
        if not bool(unfinished.any()) or t == s.max_length - 1:
            break
        logits = prompts.step(nxt, t - 1)
    lengths = torch.minimum(lengths, torch.full_like(lengths, t))
    return seq[:, None, :], lengths[:, None], logp[:, None]


def _beam_per_passage(prompts: _Prompts, s: DecodingSettings, impl: str,
                      rng: torch.Generator | None = None):
    """W beams per prompt row: ``(hyps [N, W, 1+L], lengths [N, W], logp [N, W])``."""
    N, W = prompts.rows, s.num_beams
    device = prompts.first_logits.device
    V = prompts.first_logits.shape[-1]
    step_logits, reorder = _beam_driver(prompts, N, 1, W)
    if s.processed:
        S = prompts.S
        state = _processed_beam_search(
            BeamState(N, s, device), step_logits,
            lambda logits: torch.log_softmax(logits[:, :, 0], dim=-1),
            prompts.prompt_ids.view(N, 1, S), prompts.prompt_mask.view(N, 1, S), reorder, rng)
    else:
        state = beam_search(BeamState(N, s, device), step_logits,
                            torch.zeros((N, 1), dtype=prompts.first_logits.dtype,
                                        device=device),
                            MinLengthBias(s, N * W, V, device), reorder, impl)
    lengths = state.finished_len
    # the length penalty undone: each hypothesis' summed log-probability
    logp = state.finished_scores * lengths.clamp(min=1).to(state.finished_scores.dtype) \
        ** s.length_penalty
    return state.finished, lengths, logp


def _rag_sequence(generator, ids, mask, log_prior, hyps, lengths, logp, B, K, R, pad, decoding,
                  impl) -> torch.Tensor:
    """Union of each question's hypotheses, scored (thorough or fast), the R best returned."""
    W = hyps.shape[1]
    device = ids.device
    hyps, lengths, logp = hyps.view(B, K, W, -1), lengths.view(B, K, W), logp.view(B, K, W)
    hyps_l, lengths_l = hyps.tolist(), lengths.tolist()
    union: list[list[tuple[int, ...]]] = []
    owners: list[list[list[tuple[int, int]]]] = []  # per hypothesis: its (k, j) searches
    for b in range(B):
        seen: dict[tuple[int, ...], int] = {}
        found, who = [], []
        for k in range(K):
            for j in range(W):
                n = lengths_l[b][k][j]
                key = tuple(hyps_l[b][k][j][1:1 + n])
                if key not in seen:
                    seen[key] = len(found)
                    found.append(key)
                    who.append([])
                who[seen[key]].append((k, j))
        union.append(found)
        owners.append(who)
    N = max(len(u) for u in union)
    L = max(len(h) for u in union for h in u)
    answers = torch.full((B, N, L), pad, dtype=torch.long, device=device)
    targets = torch.full((B, N, L), -100, dtype=torch.long, device=device)
    valid = torch.zeros((B, N), dtype=torch.bool, device=device)
    for b, found in enumerate(union):
        for n, h in enumerate(found):
            answers[b, n, :len(h)] = torch.tensor(h, dtype=torch.long)
            targets[b, n, :len(h)] = torch.tensor(h, dtype=torch.long)
            valid[b, n] = True
    if decoding == "fast":
        scores = torch.full((B, N), float("-inf"), dtype=log_prior.dtype, device=device)
        for b in range(B):
            for n, who in enumerate(owners[b]):
                terms = torch.stack([log_prior[b, k] + logp[b, k, j] for k, j in who])
                scores[b, n] = torch.logsumexp(terms, 0)
    else:
        # teacher forcing: rows (b, n, k) = prompt (b, k) ++ hypothesis (b, n), a chunk of
        # questions at a time (the chunk's logits stay under SCORE_CHUNK_BYTES)
        head = _causal.lm_head(generator)
        V = int(head.weight.shape[0])
        per_question = N * K * L * V * head.weight.element_size()
        step = max(1, SCORE_CHUNK_BYTES // max(1, per_question))
        scores = torch.empty((B, N), dtype=log_prior.dtype, device=device)
        for b0 in range(0, B, step):
            b1 = min(B, b0 + step)
            nb = b1 - b0
            prompt_row = (torch.arange(b0, b1, device=device)[:, None, None] * K
                          + torch.arange(K, device=device)[None, None, :]).expand(nb, N, K)
            prompt_row = prompt_row.reshape(-1)
            states = _causal.run_answers(
                generator, ids[prompt_row], mask[prompt_row],
                answers[b0:b1].repeat_interleave(K, dim=1).reshape(nb * N * K, L))
            logits = nn.functional.linear(states, head.weight, head.bias)  # [nb*N*K, L, V]
            prior = log_prior[b0:b1, None, :].expand(nb, N, K).reshape(nb * N, K)
            nll = rag_sequence_nll(logits, prior, targets[b0:b1].reshape(nb * N, L), n_docs=K,
                                   ignore_index=-100, reduction="none", impl=impl)
            scores[b0:b1] = (-nll).view(nb, N).to(log_prior.dtype)
            del logits, states
    scores = scores.masked_fill(~valid, float("-inf"))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :R]
    best = scores.gather(1, order)
    out_rows, out_lengths = [], []
    for b in range(B):
        for r in range(R):
            if r < order.shape[1] and bool(torch.isfinite(best[b, r])):
                h = union[b][int(order[b, r])]
            else:
                h = ()
            out_rows.append(h)
            out_lengths.append(len(h))
    width = max(1, max(out_lengths))
    out = torch.full((B * R, width), pad, dtype=torch.long, device=device)
    for i, h in enumerate(out_rows):
        if h:
            out[i, :len(h)] = torch.tensor(h, dtype=torch.long)
    return out


__all__ = ["causal_generate"]
