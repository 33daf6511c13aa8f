"""RAG-Token decoding: greedy and beam search over the per-token passage marginal, for every
generator family (written once over :class:`~rag_fast.generation._search.GeneratorAdapter`).

Each step runs the decoder once for every (question, passage, beam) row, then the fused beam
step (rag_fast.ops.rag_token_beam_step) turns the ``[B, W, K, V]`` logits into the ``2W`` best
(score, beam, token) per question in two reads, without materializing log-probabilities.
The contexts are encoded (or prefilled) once per (question, passage) and shared by the W beams;
the decoder cache of row (b, k, j) is reordered to (b, k, source beam) so each beam keeps the K
passages it was built with.

Same settings, weights and passages give the same token ids as ``transformers``'
``RagTokenForGeneration.generate`` (``max_new_tokens`` is honoured here, ignored there).

Sampling (``do_sample`` with ``temperature``, ``top_k``, ``top_p``), ``repetition_penalty`` and
``no_repeat_ngram_size`` take a plain-PyTorch step instead of the fused one: the marginal
log-probabilities of each question/beam are materialized (``[B*W, V]``) and processed as
transformers processes them (``_search.apply_processors``; the repetition penalty and the
n-gram ban through the adapter, which knows what a row's history is).
"""
from __future__ import annotations

import torch

from rag_fast.generation._inputs import check_rng, resolve_inputs
from rag_fast.generation._search import (
    BeamState,
    DecodingSettings,
    GeneratorAdapter,
    MinLengthBias,
    apply_processors,
    beam_search,
    forced_token,
    pick_tokens,
    settings_from,
)
from rag_fast.generation.encoder_decoder import EncoderDecoder
from rag_fast.ops.rag_token_beam_step import rag_token_beam_step


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
    """Generate answers with RAG-Token decoding over an encoder-decoder generator.

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
    adapter = EncoderDecoder(inp.generator, inp.context_input_ids, inp.context_attention_mask,
                             inp.K, rag_config=inp.rag_config)
    s = settings_from(inp.generation_config, adapter.vocab_size, allow_processors=True,
                      **settings)
    log_prior = torch.log_softmax(inp.doc_scores.float(), dim=1)
    return rag_token_search(adapter, log_prior, s, inp.B, inp.K, impl, rng)


def rag_token_search(adapter: GeneratorAdapter, log_prior: torch.Tensor, s: DecodingSettings,
                     B: int, K: int, impl: str, rng: torch.Generator | None = None) -> torch.Tensor:
    """RAG-Token decoding of B questions with K passages each (``log_prior [B, K]``) through
    ``adapter``: greedy for one beam, else beam search; the adapter's output format."""
    if s.num_beams == 1:
        seqs, lengths = _greedy(adapter, log_prior, s, B, K, impl, rng)
    else:
        seqs, lengths = _beam(adapter, log_prior, s, B, K, impl, rng)
    return adapter.token_output(seqs, lengths)


def _marginal(logits: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """``logsumexp_k (log p(z_k|x) + log p(v | z_k, prefix))`` of ``logits [B, W, K, V]``
    -> ``[B, W, V]`` (float64 for float64 logits, else float32): what transformers' RAG-Token
    forward hands its generate loop."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(dtype), dim=-1)  # [B, W, K, V]
    # a missing passage's -inf prior adds nothing (logsumexp handles it without NaN)
    return torch.logsumexp(logp + log_prior.to(dtype)[:, None, :, None], dim=2)


def _greedy(adapter: GeneratorAdapter, log_prior, s: DecodingSettings, B: int, K: int,
            impl: str, rng=None):
    """``(sequences [B, 1+L], answer lengths [B])``, the start token first."""
    V, device = adapter.vocab_size, log_prior.device
    session = adapter.session(1, s.max_length)
    seq = torch.full((B, 1), s.decoder_start_token_id, dtype=torch.long, device=device)
    lengths = torch.full((B,), s.max_length - 1, dtype=torch.long, device=device)
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    zeros = log_prior.new_zeros((B, 1))
    ban = MinLengthBias(s, B, V, device)
    rest = s.without_history()
    t = 1
    for t in range(1, s.max_length):
        logits = session.logits(seq[:, -1].repeat_interleave(K), t - 1)  # [B*K, 1, V]
        logits = logits.view(B, K, 1, V).transpose(1, 2)  # [B, 1, K, V]
        forced = forced_token(s, t)
        if s.processed:  # the marginal, processed, then argmax or a draw (transformers' order)
            scores = adapter.history(s, _marginal(logits, log_prior), seq[:, None, :], K)
            nxt = pick_tokens(s, apply_processors(rest, seq, scores[:, 0], t), rng)
        elif forced is not None:
            nxt = torch.full((B,), forced, dtype=torch.long, device=device)
        else:
            _, _, tok = rag_token_beam_step(logits, log_prior, zeros, ban.at(t),
                                            num_candidates=1, impl=impl)
            nxt = tok[:, 0]
        if s.eos_token_id is not None:
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, s.greedy_fill_token_id))
            ended = unfinished & (nxt == s.eos_token_id)
            lengths = torch.where(ended, torch.full_like(lengths, t), lengths)
            unfinished &= ~ended
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        if not bool(unfinished.any()):
            break
    return seq, torch.minimum(lengths, torch.full_like(lengths, t))


def _beam(adapter: GeneratorAdapter, log_prior, s: DecodingSettings, B: int, K: int, impl: str,
          rng=None):
    """``(sequences [B*R, 1+L], answer lengths [B*R])``, R = num_return_sequences."""
    W, V, device = s.num_beams, adapter.vocab_size, log_prior.device
    session = adapter.session(W, s.max_length)
    base = (torch.arange(B * K, device=device) * W).view(B, K, 1)

    def step_logits(last, pos):  # decoder rows (b, k, j) -> [B, W, K, V], a strided view
        rows = last[:, None, :].expand(B, K, W).reshape(-1)
        return session.logits(rows, pos).view(B, K, W, V).transpose(1, 2)

    def reorder(sources, t):  # row (b, k, j) continues from row (b, k, sources[b, j])
        session.reorder((base + sources[:, None, :]).reshape(-1), t)

    state = beam_search(
        BeamState(B, s, device), step_logits, log_prior, MinLengthBias(s, B * W, V, device),
        reorder, impl,
        log_probs=lambda logits: torch.log_softmax(_marginal(logits, log_prior), dim=-1),
        history=lambda lp, seqs: adapter.history(s, lp, seqs, K), rng=rng)
    seqs, _ = state.result()
    R = s.num_return_sequences
    return seqs.reshape(B * R, -1), state.finished_len[:, :R].reshape(-1)
