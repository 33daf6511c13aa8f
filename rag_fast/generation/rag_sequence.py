"""RAG-Sequence decoding: thorough (rescore every hypothesis against every passage) and fast,
for every generator family (written once over
:class:`~rag_fast.generation._search.GeneratorAdapter`).

Batched over all questions at once:
1. one search per (question, passage) (greedy or W beams), all B*K of them in one batch (the
   fused beam step with one passage per row), the contexts encoded (or prefilled) once;
2. the union of each question's K*W hypotheses, de-duplicated on token ids (first occurrence
   first);
3. thorough: every hypothesis scored against every passage by teacher forcing (the adapter's
   :meth:`~rag_fast.generation._search.GeneratorAdapter.sequence_scores`), with the searches'
   own sums as lower bounds where they bound the scores; fast: a hypothesis counts only for the
   passages whose search produced it, with the log-probability that search accumulated;
4. ``log p(y|x) = logsumexp_k (log p(z_k|x) + log p(y|x, z_k))``, best first.

With an encoder-decoder generator the same weights and passages give the same ids as
``transformers``' ``RagSequenceForGeneration.generate`` (its per-passage searches use the
generator's own generation config). The per-passage searches apply the logits processors as
``transformers``' ``generate`` does, sampling included: with ``do_sample`` an encoder-decoder's
questions are searched one after the other (K passages at a time), so that the random draws
come in the same order as ``transformers``' per-question ``generate`` calls.
"""
from __future__ import annotations

import torch

from rag_fast.generation._inputs import check_rng, resolve_inputs
from rag_fast.generation._search import (
    BOUND_SLACK,
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
from rag_fast._topk import select_top


@torch.no_grad()
def rag_sequence_generate(
    model: torch.nn.Module,
    context_input_ids: torch.Tensor,
    context_attention_mask: torch.Tensor | None,
    doc_scores: torch.Tensor,
    *,
    n_docs: int | None = None,
    num_return_sequences: int | None = None,
    decoding: str = "thorough",
    impl: str = "auto",
    rng: torch.Generator | None = None,
    mask_searches: bool = False,
    **settings,
) -> torch.Tensor:
    """Generate answers with RAG-Sequence decoding over an encoder-decoder generator.

    Args:
        model: a ``transformers`` ``RagSequenceForGeneration`` or a bare encoder-decoder
            generator (BART, T5, Pegasus, Marian, ...).
        context_input_ids: ``[B*K, S]`` int64 passage-and-question ids, K rows per question.
        context_attention_mask: ``[B*K, S]`` mask used when rescoring (None: all ones).
        doc_scores: ``[B, K]`` passage scores; ``-inf`` marks a missing passage.
        n_docs: K, optional check.
        num_return_sequences: answers per question (default: the RAG config's, else 1).
        decoding: ``"thorough"`` or ``"fast"``.
        impl: kernel backend of the beam steps and the rescoring's row statistics
            (``"auto"`` | ``"cpp"`` | ``"triton"`` | ``"torch"``; "cpp" needs CPU tensors).
        rng: the ``torch.Generator`` sampling draws from (None: torch's global generator, as
            ``transformers`` uses).
        mask_searches: the per-passage searches read the encoder with ``context_attention_mask``
            (True), or attend to the contexts' padding as ``transformers`` does (False, the
            default). Padding depends on the longest context of the batch, so only True makes
            a question's answer independent of the questions batched with it (what
            ``rag-fast serve`` uses); the rescoring is masked either way.
        **settings: the per-passage search's ``num_beams``, ``max_length`` /
            ``max_new_tokens``, ``min_length`` / ``min_new_tokens``, ``length_penalty``,
            ``early_stopping``, token ids, ``do_sample``, ``temperature``, ``top_k``,
            ``top_p``, ``repetition_penalty``, ``no_repeat_ngram_size`` (defaults: the
            generator's generation config).

    Returns:
        ``[B * num_return_sequences, L]`` int64 ids padded with the generator's pad token.
        A question with fewer distinct hypotheses than requested gets padding rows.

    Raises:
        ValueError: bad shapes, unknown ``decoding``, num_beams above the vocabulary, max
            length not above the prompt, a generator without an encoder.
    """
    check_decoding(decoding)
    inp = resolve_inputs(model, context_input_ids, context_attention_mask, doc_scores, n_docs,
                         use_generator_config=True)
    check_rng(rng)
    adapter = EncoderDecoder(inp.generator, inp.context_input_ids, inp.context_attention_mask,
                             inp.K, rag_config=inp.rag_config, mask_searches=mask_searches)
    adapter._pad()  # answers are padded: the generator needs a pad token
    if "num_beams" not in settings or settings["num_beams"] is None:
        settings["num_beams"] = getattr(inp.rag_config, "num_beams", None) or 1
    settings["num_return_sequences"] = settings["num_beams"]
    s = settings_from(inp.generation_config, adapter.vocab_size, allow_processors=True,
                      **settings)
    R = num_return_sequences
    if R is None:
        R = getattr(inp.rag_config, "num_return_sequences", None) or 1
    log_prior = torch.log_softmax(inp.doc_scores.float(), dim=1)
    return rag_sequence_search(adapter, log_prior, s, inp.B, inp.K, R, decoding, impl, rng)


def check_decoding(decoding: str) -> None:
    if decoding not in ("thorough", "fast"):
        raise ValueError(f"decoding must be 'thorough' or 'fast', got {decoding!r}")


def rag_sequence_search(adapter: GeneratorAdapter, log_prior: torch.Tensor, s: DecodingSettings,
                        B: int, K: int, R: int, decoding: str, impl: str,
                        rng: torch.Generator | None = None) -> torch.Tensor:
    """RAG-Sequence decoding of B questions with K passages each (``log_prior [B, K]``)
    through ``adapter``: R answers per question in the adapter's output format."""
    device = log_prior.device
    pad = adapter.pad_token_id
    # 1. A search per (question, passage).
    search = _greedy_per_passage if s.num_beams == 1 else _beam_per_passage
    if s.do_sample and adapter.sample_per_question:  # transformers' order of random draws
        parts = []
        for b in range(B):
            rows = torch.arange(b * K, (b + 1) * K, device=device)
            parts.append(search(adapter, s, K, impl, rng, rows))
        hyps, lengths, beam_logp = (torch.cat(p, dim=0) for p in zip(*parts))
    else:
        hyps, lengths, beam_logp = search(adapter, s, B * K, impl, rng, None)
    W = hyps.shape[1]
    hyps = adapter.hypotheses(hyps, lengths).view(B, K * W, -1)
    lengths = lengths.view(B, K * W)
    width = 1 + lengths.max(dim=1).values  # [B] per-question output width, as transformers

    # 2. Union of hypotheses per question, de-duplicated, first occurrence first.
    hyps = hyps[:, :, : int(width.max())]
    uniq, first_pos, owner = _dedupe(hyps)  # [B, N, L], [B, N] (-1: none), [B, K*W] -> slot
    # transformers scores each question's hypotheses at that question's own width: positions
    # past it do not exist there, so they become padding here (they would otherwise count
    # when finished beams are filled with EOS, as for T5 whose pad id is 0).
    cols = torch.arange(uniq.shape[2], device=device)
    uniq = uniq.masked_fill(cols[None, None, :] >= width[:, None, None], pad)
    valid = first_pos >= 0
    uniq_lengths = lengths.gather(1, first_pos.clamp(min=0))
    beam_logp = beam_logp.view(B, K * W)

    if decoding == "fast":  # a hypothesis counts for the passages whose search produced it
        contrib = log_prior.repeat_interleave(W, dim=1) + beam_logp
        scores = torch.full(uniq.shape[:2], float("-inf"), dtype=contrib.dtype, device=device)
        for slot in range(uniq.shape[1]):
            hit = owner == slot
            scores[:, slot] = torch.logsumexp(contrib.masked_fill(~hit, float("-inf")), dim=1)
    else:  # 3. rescored against every passage
        lower = None
        if adapter.bounds_hold(s):
            lower = _lower_bounds(owner, beam_logp, log_prior, W, uniq.shape[1])
        scores = adapter.sequence_scores(uniq, uniq_lengths, valid, log_prior, impl, lower, R)
    scores = scores.masked_fill(~valid, float("-inf"))

    # 4. Best first; questions with fewer hypotheses than R get padding rows.
    n = min(R, uniq.shape[1])
    best, order = select_top(scores, n)
    chosen = uniq.gather(1, order[:, :, None].expand(-1, -1, uniq.shape[2]))
    return adapter.sequence_output(chosen, uniq_lengths.gather(1, order), torch.isfinite(best),
                                   width, R)


def _greedy_per_passage(adapter: GeneratorAdapter, s: DecodingSettings, E: int, impl: str,
                        rng, rows):
    """One greedy answer per prompt row: ``(hyps [E, 1, max_length], lengths [E, 1],
    summed log-probabilities [E, 1])``."""
    session = adapter.session(1, s.max_length, search="sequence", rows=rows)
    V, dtype = adapter.vocab_size, adapter.score_dtype
    device = adapter.device
    seq = torch.full((E, s.max_length), s.greedy_fill_token_id, dtype=torch.long, device=device)
    seq[:, 0] = s.decoder_start_token_id
    lengths = torch.full((E,), s.max_length - 1, dtype=torch.long, device=device)
    logp = torch.zeros(E, dtype=dtype, device=device)
    unfinished = torch.ones(E, dtype=torch.bool, device=device)
    prior = torch.zeros((E, 1), dtype=dtype, device=device)
    ban = MinLengthBias(s, E, V, device)
    rest = s.without_history()
    t = 1
    for t in range(1, s.max_length):
        logits = session.logits(seq[:, t - 1], t - 1).view(E, V)
        forced = forced_token(s, t)
        if s.processed:  # the generator's logits, processed, then argmax or a draw
            raw = logits.to(dtype)
            scores = adapter.history(s, raw[:, None], seq[:, None, :t], 1)[:, 0]
            nxt = pick_tokens(s, apply_processors(rest, seq[:, :t], scores, t), rng)
            step_logp = torch.log_softmax(raw, dim=-1).gather(1, nxt[:, None])[:, 0]
        elif forced is not None:
            nxt = torch.full((E,), forced, dtype=torch.long, device=device)
            step_logp = torch.zeros(E, dtype=dtype, device=device)
        else:
            sc, _, tok = rag_token_beam_step(logits.view(E, 1, 1, V), prior, prior, ban.at(t),
                                             num_candidates=1, impl=impl)
            nxt, step_logp = tok[:, 0], sc[:, 0].to(dtype)
        logp = logp + torch.where(unfinished, step_logp, torch.zeros_like(step_logp))
        nxt = torch.where(unfinished, nxt, torch.full_like(nxt, s.greedy_fill_token_id))
        seq[:, t] = nxt
        if s.eos_token_id is not None:
            ended = unfinished & (nxt == s.eos_token_id)
            lengths = torch.where(ended, torch.full_like(lengths, t), lengths)
            unfinished &= ~ended
        if not bool(unfinished.any()):
            break
    lengths = torch.minimum(lengths, torch.full_like(lengths, t))
    return seq[:, None, :], lengths[:, None], logp[:, None]


def _beam_per_passage(adapter: GeneratorAdapter, s: DecodingSettings, E: int, impl: str, rng,
                      rows):
    """W beams per prompt row: ``(hyps [E, W, max_length], lengths [E, W], logp [E, W])``."""
    W, V, dtype = s.num_beams, adapter.vocab_size, adapter.score_dtype
    device = adapter.device
    session = adapter.session(W, s.max_length, search="sequence", rows=rows)
    base = (torch.arange(E, device=device) * W)[:, None]

    def step_logits(last, pos):  # each (question, passage) pair is its own search, K = 1
        return session.logits(last.reshape(-1), pos).view(E, W, 1, V)

    state = beam_search(
        BeamState(E, s, device), step_logits, torch.zeros((E, 1), dtype=dtype, device=device),
        MinLengthBias(s, E * W, V, device),
        lambda sources, t: session.reorder((base + sources).reshape(-1), t), impl,
        log_probs=lambda logits: torch.log_softmax(logits[:, :, 0].to(dtype), dim=-1),
        history=lambda lp, seqs: adapter.history(s, lp, seqs, 1), rng=rng)
    lengths = state.finished_len
    # Undo the length penalty: the summed log-probability of each finished hypothesis.
    scores = state.finished_scores
    logp = scores * lengths.clamp(min=1).to(scores.dtype) ** s.length_penalty
    return state.finished, lengths, logp


def _dedupe(hyps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct rows of ``hyps [B, M, L]`` per question, in order of first occurrence.

    Returns ``(uniq [B, N, L], first [B, N], owner [B, M])``: N = the most distinct rows of any
    question, ``first`` the position of each distinct row's first occurrence (-1 for padding
    slots, whose rows repeat slot 0), ``owner`` the slot of every input row.
    """
    B, M, L = hyps.shape
    qid = torch.arange(B, device=hyps.device)[:, None, None].expand(B, M, 1)
    flat = torch.cat([qid, hyps], dim=2).reshape(B * M, L + 1)
    _, inverse = torch.unique(flat, dim=0, return_inverse=True)
    inverse = inverse.view(B, M)
    pos = torch.arange(M, device=hyps.device).expand(B, M)
    # First position of each row's group; a row is a first occurrence when it is its own.
    same = inverse[:, :, None] == inverse[:, None, :]  # [B, M, M]
    first_of = torch.where(same, pos[:, None, :], M).min(dim=2).values  # [B, M]
    is_first = first_of == pos
    rank = torch.cumsum(is_first.long(), dim=1) - 1  # slot of each first occurrence
    N = int(is_first.sum(dim=1).max())
    first = torch.full((B, N), -1, dtype=torch.long, device=hyps.device)
    b_idx, m_idx = is_first.nonzero(as_tuple=True)
    first[b_idx, rank[b_idx, m_idx]] = m_idx
    owner = rank.gather(1, first_of)
    uniq = hyps.gather(1, first.clamp(min=0)[:, :, None].expand(-1, -1, L))
    return uniq, first, owner


def _lower_bounds(owner: torch.Tensor, beam_logp: torch.Tensor, log_prior: torch.Tensor, W: int,
                  N: int) -> torch.Tensor:
    """A lower bound ``[B, N]`` of every distinct hypothesis' RAG-Sequence score.

    The beam of passage k that produced hypothesis n summed ``log p(y_t | y_<t, z_k)`` over its
    tokens: the rescoring sums the same terms (or fewer, each <= 0) for that passage, so
    ``score >= log p(z_k|x) + beam_logp``, up to rounding (``BOUND_SLACK`` covers it).
    Slots without a hypothesis get ``-inf``.
    """
    B = owner.shape[0]
    contrib = log_prior.repeat_interleave(W, dim=1) + beam_logp  # [B, K*W]
    lower = torch.full((B, N), float("-inf"), device=owner.device)
    lower.scatter_reduce_(1, owner, contrib, reduce="amax")
    return lower - BOUND_SLACK
