"""RAG-Token decoding: greedy and beam search over the per-token passage marginal.

Each step runs the decoder once for every (question, passage, beam) row, then the fused beam
step (rag_fast.ops.rag_token_beam_step) turns the ``[B, W, K, V]`` logits into the ``2W`` best
(score, beam, token) per question in two reads, without materialising log-probabilities.
The encoder runs once per (question, passage), its cross-attention keys/values are shared by
the W beams (never copied per beam), and the self-attention cache of row (b, k, j) is
reordered to (b, k, source beam) so each beam keeps the K passages it was built with.

Same settings, weights and passages give the same token ids as ``transformers``'
``RagTokenForGeneration.generate`` (``max_new_tokens`` is honoured here, ignored there).
BART generators run through the lean :class:`BartDecoder`; every other encoder-decoder
generator (T5, Pegasus, Marian, mBART, ...) through its own decoder module
(:class:`~rag_fast.generation._generic_decoder.GenericDecoder`).

Sampling (``do_sample`` with ``temperature``, ``top_k``, ``top_p``), ``repetition_penalty`` and
``no_repeat_ngram_size`` take a plain-PyTorch step instead of the fused one: the marginal
log-probabilities of each question/beam are materialised (``[B*W, V]``) and processed as
transformers processes them (``_search.apply_processors``).
"""
from __future__ import annotations

import torch

from rag_fast.generation._decoder import make_decoder
from rag_fast.generation._inputs import check_rng, resolve_inputs
from rag_fast.generation._search import (
    BeamState,
    DecodingSettings,
    MinLengthBias,
    apply_processors,
    beam_search,
    forced_token,
    pick_tokens,
    settings_from,
)
from rag_fast.ops.rag_token_beam_step import rag_token_beam_step
from rag_fast.reference_decoding import rag_token_beam_candidates


@torch.no_grad()
def rag_token_generate(
    model: torch.nn.Module,
    context_input_ids: torch.Tensor,
    context_attention_mask: torch.Tensor | None,
    doc_scores: torch.Tensor,
    *,
    n_docs: int | None = None,
    impl: str = "auto",
    rng: torch.Generator | None = None,
    **settings,
) -> torch.Tensor:
    """Generate answers with RAG-Token decoding.

    Args:
        model: a ``transformers`` ``RagTokenForGeneration`` (its generation config gives the
            defaults) or a bare encoder-decoder generator (BART, T5, Pegasus, Marian, ...).
        context_input_ids: ``[B*K, S]`` int64 passage-and-question ids, K rows per question.
        context_attention_mask: ``[B*K, S]`` (1: token, 0: padding), or None (all ones).
        doc_scores: ``[B, K]`` passage scores; ``-inf`` marks a missing passage.
        n_docs: K, optional check.
        impl: beam-step backend (``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"``).
        rng: the ``torch.Generator`` sampling draws from (None: torch's global generator, as
            ``transformers`` uses; seed it with ``torch.manual_seed``).
        **settings: ``num_beams``, ``max_length`` / ``max_new_tokens``, ``min_length`` /
            ``min_new_tokens``, ``length_penalty``, ``early_stopping``,
            ``num_return_sequences``, token ids, ``do_sample``, ``temperature``, ``top_k``,
            ``top_p``, ``repetition_penalty``, ``no_repeat_ngram_size`` (see
            generation._search.settings_from).

    Returns:
        ``[B * num_return_sequences, L]`` int64 token ids, starting with the decoder start
        token; finished hypotheses are padded.

    Raises:
        ValueError: bad shapes, num_beams above the vocabulary, max length not above the
            prompt, a generator without an encoder.
    """
    inp = resolve_inputs(model, context_input_ids, context_attention_mask, doc_scores, n_docs,
                         use_generator_config=False)
    check_rng(rng)
    dec = make_decoder(inp.generator)
    s = settings_from(inp.generation_config, dec.vocab_size, allow_processors=True,
                      **settings)
    enc = dec.encode(inp.context_input_ids, inp.context_attention_mask)
    cross = dec.cross_state(enc, inp.context_attention_mask)  # E = B*K encoder rows
    log_prior = torch.log_softmax(inp.doc_scores.float(), dim=1)
    if s.num_beams == 1:
        out = _greedy(dec, cross, log_prior, s, inp.B, inp.K, impl, rng)
    else:
        out = _beam(dec, cross, log_prior, s, inp.B, inp.K, impl, rng)
    return out


def _marginal(logits: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """``logsumexp_k (log p(z_k|x) + log p(v | z_k, prefix))`` of ``logits [B, W, K, V]``
    -> ``[B, W, V]`` float32: what transformers' RAG-Token forward hands its generate loop."""
    B, W = logits.shape[:2]
    zeros = torch.zeros((B, W), dtype=torch.float32, device=logits.device)
    return rag_token_beam_candidates(logits, log_prior, zeros)


def _step_logits(dec, tokens, pos, cache, cross, B, K, W) -> torch.Tensor:
    """Decoder step for rows (b, k, j) -> logits as a ``[B, W, K, V]`` strided view."""
    rows = tokens[:, None, :].expand(B, K, W).reshape(-1)  # [B*K*W], rows (b, k, j)
    hidden = dec.step(rows, pos, cache, cross, Q=W)
    logits = dec.step_logits(hidden)  # [B*K*W, V], a buffer reused every step
    return logits.view(B, K, W, -1).transpose(1, 2)


def _greedy(dec, cross, log_prior, s: DecodingSettings, B: int, K: int, impl: str, rng=None):
    V, device = dec.vocab_size, log_prior.device
    cache = dec.new_cache(B * K, s.max_length)
    seq = torch.full((B, 1), s.decoder_start_token_id, dtype=torch.long, device=device)
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    zeros = torch.zeros((B, 1), device=device)
    ban = MinLengthBias(s, B, V, device)
    for t in range(1, s.max_length):
        logits = _step_logits(dec, seq[:, -1:], t - 1, cache, cross, B, K, 1)
        forced = forced_token(s, t)
        if s.processed:  # the marginal, processed, then argmax or a draw (transformers' order)
            scores = apply_processors(s, seq, _marginal(logits, log_prior)[:, 0], t)
            nxt = pick_tokens(s, scores, rng)
        elif forced is not None:
            nxt = torch.full((B,), forced, dtype=torch.long, device=device)
        else:
            _, _, tok = rag_token_beam_step(logits, log_prior, zeros, ban.at(t),
                                            num_candidates=1, impl=impl)
            nxt = tok[:, 0]
        if s.eos_token_id is not None:
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, s.greedy_fill_token_id))
            unfinished &= nxt != s.eos_token_id
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        if not bool(unfinished.any()):
            break
    return seq


def _beam(dec, cross, log_prior, s: DecodingSettings, B: int, K: int, impl: str, rng=None):
    W, V, device = s.num_beams, dec.vocab_size, log_prior.device
    cache = dec.new_cache(B * K * W, s.max_length)
    base = (torch.arange(B * K, device=device) * W).view(B, K, 1)

    def reorder(sources, t):  # row (b, k, j) continues from row (b, k, sources[b, j])
        dec.reorder_cache(cache, (base + sources[:, None, :]).reshape(-1), t)

    state = beam_search(
        BeamState(B, s, device),
        lambda last, pos: _step_logits(dec, last, pos, cache, cross, B, K, W),
        log_prior, MinLengthBias(s, B * W, V, device), reorder, impl,
        log_probs=lambda logits: torch.log_softmax(_marginal(logits, log_prior), dim=-1),
        rng=rng)
    seqs, _ = state.result()
    return seqs.reshape(B * s.num_return_sequences, -1)
