"""RAG-Sequence decoding: thorough (rescore every hypothesis against every passage) and fast.

Thorough decoding, batched over all questions at once:
1. one beam search per (question, passage), all B*K of them in one batch (the fused beam step
   with one passage per row), the encoder run once per (question, passage);
2. the union of each question's K*W hypotheses, de-duplicated on token ids (first occurrence
   first);
3. every hypothesis scored against every passage by teacher forcing, in chunks of questions,
   reusing the encoder's cross-attention keys/values (no re-encoding, no retrieval) and taking
   only per-row normalisers and target logits from the logits (the fused row statistics);
   position by position, with the beams' own scores as lower bounds, the LM head skips the
   (hypothesis, passage) pairs whose share of a score is below float32 resolution and the
   hypotheses that can no longer be among the answers (same scores where they matter,
   fewer LM-head rows);
4. ``log p(y|x) = logsumexp_k (log p(z_k|x) + log p(y|x, z_k))``, best first.

The scoring follows ``transformers``' ``RagSequenceForGeneration.get_nll`` with
``exclude_bos_score=True`` (passage prior added at target position 1, first target dropped
when every candidate of the question starts with BOS, padding masked), so the same weights and
passages give the same ids as ``RagSequenceForGeneration.generate``. The beam searches use the
generator's own generation config and, like ``transformers``, no encoder mask; scoring uses
``context_attention_mask``.

Fast decoding skips step 3: a hypothesis counts only for the passages whose beam produced it,
with the log-probability that beam search accumulated.

Every encoder-decoder generator is supported: BART through the lean :class:`BartDecoder`, the
others (T5, Pegasus, Marian, mBART, ...) through their own decoder modules
(:class:`~rag_fast.generation._generic_decoder.GenericDecoder`). The per-passage searches apply
the generator's logits processors as ``transformers``' ``generate`` does, sampling included:
with ``do_sample`` the questions are searched one after the other (K passages at a time), so
that the random draws come in the same order as ``transformers``' per-question ``generate``
calls; seeded alike, they give the same samples.
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
from rag_fast.ops.backend import resolve_impl
from rag_fast.ops.rag_token_beam_step import rag_token_beam_step
from rag_fast.reference_decoding import select_top

# Logits of at most this many bytes are materialised at once while rescoring: a cap on the
# rescoring's peak memory, not a value tuned for speed (at V=50265 it is about 1,300 rows per
# matmul, already large); lower it to bound memory, at the cost of more, smaller matmuls.
SCORE_CHUNK_BYTES = 256 * 2**20
# Rescoring skips (hypothesis, passage) pairs whose share of a score is below exp(-PAIR_GAP)
# (invisible in float32: exp(-40) ~ 4e-18, far below float32's relative resolution 6e-8) and
# hypotheses that cannot reach the answers; BOUND_SLACK (nats) absorbs the rounding between
# the beam search's sums and the rescoring's (float32 sums of at most a few hundred terms
# differ by far less than 1 nat). Both are correctness margins derived from float32, not tuned
# on a machine; raising either only prunes less (slower, same ids).
PAIR_GAP = 40.0
BOUND_SLACK = 1.0


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
    **settings,
) -> torch.Tensor:
    """Generate answers with RAG-Sequence decoding.

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
    if decoding not in ("thorough", "fast"):
        raise ValueError(f"decoding must be 'thorough' or 'fast', got {decoding!r}")
    inp = resolve_inputs(model, context_input_ids, context_attention_mask, doc_scores, n_docs,
                         use_generator_config=True)
    check_rng(rng)
    dec = make_decoder(inp.generator)
    if "num_beams" not in settings or settings["num_beams"] is None:
        settings["num_beams"] = getattr(inp.rag_config, "num_beams", None) or 1
    settings["num_return_sequences"] = settings["num_beams"]
    s = settings_from(inp.generation_config, dec.vocab_size, allow_processors=True,
                      **settings)
    R = num_return_sequences
    if R is None:
        R = getattr(inp.rag_config, "num_return_sequences", None) or 1
    B, K = inp.B, inp.K
    pad = _generator_pad(inp)
    ids = inp.context_input_ids

    # 1. Beam search per (question, passage). transformers runs these with no encoder mask
    # (it passes attention_mask=None to the generator), so padding is attended here too.
    enc = dec.encode(ids, None)
    cross = dec.cross_state(enc, None)
    search = _greedy_per_passage if s.num_beams == 1 else _beam_per_passage
    if s.do_sample:  # one question at a time: transformers' order of random draws
        parts = []
        for b in range(B):
            rows = torch.arange(b * K, (b + 1) * K, device=ids.device)
            parts.append(search(dec, dec.select_cross(cross, rows), s, K, impl, rng))
        hyps, lengths, beam_logp = (torch.cat(p, dim=0) for p in zip(*parts))
    else:
        hyps, lengths, beam_logp = search(dec, cross, s, B * K, impl, rng)
    W = hyps.shape[1]
    hyps = hyps.view(B, K * W, -1)
    lengths = lengths.view(B, K * W)
    width = 1 + lengths.max(dim=1).values  # [B] per-question output width, as transformers

    # 2. Union of hypotheses per question, de-duplicated, first occurrence first.
    hyps = hyps[:, :, : int(width.max())]
    uniq, first_pos, owner = _dedupe(hyps)  # [B, N, L], [B, N] (-1: none), [B, K*W] -> slot
    # transformers scores each question's hypotheses at that question's own width: positions
    # past it do not exist there, so they become padding here (they would otherwise count
    # when finished beams are filled with EOS, as for T5 whose pad id is 0).
    cols = torch.arange(uniq.shape[2], device=ids.device)
    uniq = uniq.masked_fill(cols[None, None, :] >= width[:, None, None], pad)
    valid = first_pos >= 0
    log_prior = torch.log_softmax(inp.doc_scores.float(), dim=1)

    if decoding == "fast":
        # A hypothesis counts for the passages whose beam produced it.
        contrib = log_prior.repeat_interleave(W, dim=1) + beam_logp.view(B, K * W)
        scores = torch.full(uniq.shape[:2], float("-inf"), device=ids.device)
        for slot in range(uniq.shape[1]):
            hit = owner == slot
            scores[:, slot] = torch.logsumexp(contrib.masked_fill(~hit, float("-inf")), dim=1)
    else:
        # 3. Rescore against every passage with the context mask: the encoder outputs are
        # reused when that mask hides nothing, else encoded once more with it.
        score_mask = inp.context_attention_mask
        same_encoding = bool(score_mask.bool().all())
        if not same_encoding:
            enc = dec.encode(ids, score_mask)
        cross = dec.cross_state(enc, score_mask)
        lower = None
        # The beams' log-probabilities bound the rescoring's when both read the same encoder
        # outputs, no token was forced (a forced token counts 0 in the beam) and the positions
        # after EOS are masked when rescoring.
        # Processors (sampling, penalties) change what the searches' scores sum, so they bound
        # nothing then.
        forced = s.forced_bos_token_id is not None or s.forced_eos_token_id is not None
        fill = s.greedy_fill_token_id if s.num_beams == 1 else s.fill_token_id
        if same_encoding and not forced and not s.processed and fill == pad:
            lower = _lower_bounds(owner, beam_logp.view(B, K * W), log_prior, W, uniq.shape[1])
        scores = -_sequence_loss(dec, cross, uniq, valid, log_prior, pad, inp, impl,
                                 lower=lower, keep=R)
    scores = scores.masked_fill(~valid, float("-inf"))

    # 4. Best first; questions with fewer hypotheses than R get padding rows.
    n = min(R, uniq.shape[1])
    best, order = select_top(scores, n)
    chosen = uniq.gather(1, order[:, :, None].expand(-1, -1, uniq.shape[2]))
    chosen = chosen.masked_fill(~torch.isfinite(best)[:, :, None], pad)
    out_width = int(width.max())
    cols = torch.arange(chosen.shape[2], device=ids.device)
    chosen = chosen.masked_fill(cols[None, None, :] >= width[:, None, None], pad)[:, :, :out_width]
    if n < R:
        fill = torch.full((B, R - n, out_width), pad, dtype=torch.long, device=ids.device)
        chosen = torch.cat([chosen, fill], dim=1)
    return chosen.reshape(B * R, out_width)


def _generator_pad(inp) -> int:
    pad = getattr(inp.generator.config, "pad_token_id", None)
    if pad is None:
        raise ValueError("the generator's config has no pad_token_id (needed to pad answers)")
    return int(pad)


def _greedy_per_passage(dec, cross, s: DecodingSettings, E: int, impl: str, rng=None):
    device, V = cross.device, dec.vocab_size
    cache = dec.new_cache(E, s.max_length)
    seq = torch.full((E, s.max_length), s.greedy_fill_token_id, dtype=torch.long, device=device)
    seq[:, 0] = s.decoder_start_token_id
    lengths = torch.full((E,), s.max_length - 1, dtype=torch.long, device=device)
    logp = torch.zeros(E, device=device)
    unfinished = torch.ones(E, dtype=torch.bool, device=device)
    prior = torch.zeros((E, 1), device=device)
    ban = MinLengthBias(s, E, V, device)
    t = 1
    for t in range(1, s.max_length):
        logits = dec.step_logits(dec.step(seq[:, t - 1], t - 1, cache, cross, Q=1))
        forced = forced_token(s, t)
        if s.processed:  # the generator's logits, processed, then argmax or a draw
            raw = logits.float()
            nxt = pick_tokens(s, apply_processors(s, seq[:, :t], raw, t), rng)
            step_logp = torch.log_softmax(raw, dim=-1).gather(1, nxt[:, None])[:, 0]
        elif forced is not None:
            nxt = torch.full((E,), forced, dtype=torch.long, device=device)
            step_logp = torch.zeros(E, device=device)
        else:
            sc, _, tok = rag_token_beam_step(logits.view(E, 1, 1, V), prior, prior,
                                             ban.at(t), num_candidates=1,
                                             impl=impl)
            nxt, step_logp = tok[:, 0], sc[:, 0]
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


def _beam_per_passage(dec, cross, s: DecodingSettings, E: int, impl: str, rng=None):
    W, V, device = s.num_beams, dec.vocab_size, cross.device
    cache = dec.new_cache(E * W, s.max_length)
    base = (torch.arange(E, device=device) * W)[:, None]

    def step_logits(last, pos):  # each (question, passage) pair is its own search, K = 1
        hidden = dec.step(last.reshape(-1), pos, cache, cross, Q=W)
        return dec.step_logits(hidden).view(E, W, 1, V)

    state = beam_search(
        BeamState(E, s, device), step_logits, torch.zeros((E, 1), device=device),
        MinLengthBias(s, E * W, V, device),
        lambda sources, t: dec.reorder_cache(cache, (base + sources).reshape(-1), t), impl,
        log_probs=lambda logits: torch.log_softmax(logits[:, :, 0].float(), dim=-1), rng=rng)
    lengths = state.finished_len
    # Undo the length penalty: the summed log-probability of each finished hypothesis.
    logp = state.finished_scores * lengths.clamp(min=1).float() ** s.length_penalty
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


def _lm_row_stats(dec, hidden: torch.Tensor, impl: str):
    """Logits of ``hidden [U, K, d]`` -> ``(logits [U, K, V], lse [U, K], sum_v x [U, K])``.

    fp32 logits go through the fused row statistics (``torch.ops.rag_fast.row_stats``: C++ for
    CPU tensors, Triton for CUDA ones, as ``impl`` resolves); other dtypes and impl="torch"
    through plain PyTorch. The fused ``lse`` is float64 (a difference ``x - lse`` keeps float32's
    relative precision); callers cast the differences they store."""
    logits = dec.logits(hidden)
    resolved = resolve_impl(impl, logits)
    if resolved != "torch" and logits.dtype == torch.float32:
        lse, _, xsum = torch.ops.rag_fast.row_stats(logits.unsqueeze(2), None, -100, resolved)
        return logits, lse[:, :, 0], xsum[:, :, 0]
    return logits, torch.logsumexp(logits, dim=-1), logits.sum(-1)


def _sequence_loss(dec, cross, uniq: torch.Tensor, valid: torch.Tensor,
                   log_prior: torch.Tensor, pad: int, inp, impl: str,
                   lower: torch.Tensor | None = None, keep: int = 1) -> torch.Tensor:
    """``transformers``' RAG-Sequence loss (exclude_bos_score=True) of every hypothesis
    ``uniq [B, N, L]`` against the K passages of its question -> ``[B, N]``.

    With score lower bounds ``lower [B, N]`` (and no label smoothing) the loss is exact only
    where it can matter: see ``_pruned_log_likelihood``; the others get ``+inf``.

    The decoder runs on every (question, passage, hypothesis); the LM head only on the
    distinct prefixes of each question whose next target is a real token: hypotheses of a
    beam search share most of their prefixes, and positions after EOS are masked anyway.
    """
    B, N, L = uniq.shape
    K, V = inp.K, dec.vocab_size
    device = uniq.device
    targets = torch.cat([uniq[:, :, 1:], torch.full_like(uniq[:, :, :1], pad)], dim=2)
    mask = (targets != pad) & valid[:, :, None]  # [B, N, L] positions that count
    rag_config = inp.rag_config
    eps = float(getattr(rag_config, "label_smoothing", 0.0) or 0.0)
    bos = getattr(rag_config, "bos_token_id", None) if rag_config is not None else None
    bos = bos or getattr(inp.generator.config, "bos_token_id", None)
    if bos is None:
        use_bos = torch.zeros(B, dtype=torch.bool, device=device)
    else:  # the first target is dropped when every candidate of the question starts with BOS
        use_bos = ((targets[:, :, 0] == bos) | ~valid).all(dim=1)

    # Decoder hidden states of every (b, k, n, t): rows grouped by encoder row (b, k).
    tokens = uniq[:, None].expand(B, K, N, L).reshape(B * K * N, L)
    hidden = dec.teacher_forced(tokens, cross, Q=N).view(B, K, N, L, -1)

    # Distinct prefixes: key (b, t, tokens[:t+1]) of every counted position.
    b_idx, n_idx, t_idx = mask.nonzero(as_tuple=True)  # P positions
    cols = torch.arange(L, device=device)
    prefix = uniq[b_idx, n_idx].masked_fill(cols[None, :] > t_idx[:, None], -1)
    keys = torch.cat([b_idx[:, None], t_idx[:, None], prefix], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    U = int(inverse.max()) + 1 if inverse.numel() else 0
    rep = torch.full((U,), keys.shape[0], dtype=torch.long, device=device)
    rep.scatter_reduce_(0, inverse, torch.arange(keys.shape[0], device=device), reduce="amin")
    h_rep = hidden[b_idx[rep], :, n_idx[rep], t_idx[rep]]  # [U, K, d]
    y = targets[b_idx, n_idx, t_idx]  # [P]

    if lower is not None and eps == 0:
        at_one = mask[:, :, 1] if L > 1 else torch.zeros((B, N), dtype=torch.bool, device=device)
        ll = _pruned_log_likelihood(dec, hidden, b_idx, n_idx, t_idx, inverse, rep, y,
                                    use_bos, valid, at_one, log_prior, lower, keep, impl)
        prior = log_prior[:, :, None]
        return -torch.logsumexp(ll + prior * at_one.float()[:, None, :], dim=1)

    lp = torch.empty((keys.shape[0], K), device=device)  # log p(y | prefix, passage k)
    sv = torch.empty_like(lp) if eps > 0 else None  # sum_v log p(v | prefix, passage k)
    rows = max(1, SCORE_CHUNK_BYTES // (K * V * 4))
    for u0 in range(0, U, rows):
        u1 = min(U, u0 + rows)
        logits, lse, xsum = _lm_row_stats(dec, h_rep[u0:u1], impl)
        at = ((inverse >= u0) & (inverse < u1)).nonzero(as_tuple=True)[0]
        local = inverse[at] - u0
        tgt = logits[local, :, y[at]] if at.numel() else lse[:0]  # [p, K]
        lp[at] = (tgt - lse[local]).to(lp.dtype)
        if sv is not None:
            sv[at] = (xsum[local] - V * lse[local]).to(sv.dtype)
        del logits

    # Sum over positions per (b, k, n); t = 0 dropped under use_bos; prior added at t = 1.
    weight = torch.where(use_bos[b_idx] & (t_idx == 0), 0.0, 1.0)
    slot = (b_idx * N + n_idx)[:, None] * K + torch.arange(K, device=device)[None, :]
    ll = torch.zeros(B * N * K, device=device)
    ll.index_add_(0, slot.reshape(-1), (lp * weight[:, None]).reshape(-1))
    ll = ll.view(B, N, K).transpose(1, 2)  # [B, K, N]
    at_one = mask[:, :, 1].float()[:, None, :] if L > 1 else torch.zeros((B, 1, N), device=device)
    prior = log_prior[:, :, None]  # [B, K, 1]
    nll = -torch.logsumexp(ll + prior * at_one, dim=1)
    if eps == 0:
        return nll
    smooth = torch.zeros(B * N * K, device=device)
    smooth.index_add_(0, slot.reshape(-1), sv.reshape(-1))
    smooth = smooth.view(B, N, K).transpose(1, 2) + V * prior * at_one
    return (1.0 - eps) * nll + (eps / V) * -torch.logsumexp(smooth, dim=1)


def _pruned_log_likelihood(dec, hidden: torch.Tensor, b_idx: torch.Tensor,
                           n_idx: torch.Tensor, t_idx: torch.Tensor, inverse: torch.Tensor,
                           rep: torch.Tensor, y: torch.Tensor, use_bos: torch.Tensor,
                           valid: torch.Tensor, at_one: torch.Tensor, log_prior: torch.Tensor,
                           lower: torch.Tensor, keep: int, impl: str) -> torch.Tensor:
    """``sum_t log p(y_t | y_<t, z_k)`` ``[B, K, N]``, position by position, with the LM head
    run only on (prefix, passage) pairs that can still change the answer.

    Every term is <= 0, so a partial sum bounds the full one from above. After each position:
    - a pair (n, k) whose bound ``prior_k + partial`` is ``PAIR_GAP`` nats below the
      hypothesis' lower bound adds less than ``exp(-PAIR_GAP)`` of the score, below float32
      resolution: it is dropped (-inf), which leaves the score's float32 value unchanged;
    - a hypothesis whose upper bound (logsumexp over passages) is below the ``keep``-th best
      lower bound of its question cannot be among the ``keep`` answers: all its pairs drop.
    Inputs are ``_sequence_loss``'s: ``hidden [B, K, N, L, d]``, per counted position p the
    indices ``b_idx, n_idx, t_idx [P]``, its prefix ``inverse [P]`` (``rep [U]``: one position
    of each prefix) and target ``y [P]``.
    """
    B, K, N, L, _ = hidden.shape
    device = hidden.device
    U = rep.shape[0]
    prior = torch.where(at_one[:, :, None], log_prior[:, None, :], 0.0)  # [B, N, K] as added
    S = torch.zeros(B * N, K, device=device)  # partial sums, rows (b, n)
    alive = valid[:, :, None].expand(B, N, K).clone()
    if N >= keep:
        thr = torch.topk(lower, keep, dim=1).values[:, -1:]  # [B, 1]
    else:
        thr = torch.full((B, 1), float("-inf"), device=device)
    weight = torch.where(use_bos[b_idx] & (t_idx == 0), 0.0, 1.0)
    rows_per_chunk = max(1, SCORE_CHUNK_BYTES // (dec.vocab_size * 4))
    for t in range(L):
        sel = (t_idx == t).nonzero(as_tuple=True)[0]
        if sel.numel() == 0:
            continue
        pb, pn, pu = b_idx[sel], n_idx[sel], inverse[sel]
        need = alive[pb, pn]  # [p, K] pairs of each position still needed
        wanted = torch.zeros((U, K), dtype=torch.int32, device=device)
        wanted.index_add_(0, pu, need.int())
        pair_u, pair_k = (wanted > 0).nonzero(as_tuple=True)  # M (prefix, passage) pairs
        if pair_u.numel() == 0:
            continue
        row_of = torch.full((U, K), -1, dtype=torch.long, device=device)
        row_of[pair_u, pair_k] = torch.arange(pair_u.numel(), device=device)
        r = rep[pair_u]
        h = hidden[b_idx[r], pair_k, n_idx[r], t]  # [M, d]
        p_at, k_at = need.nonzero(as_tuple=True)  # every needed (position, passage)
        row = row_of[pu[p_at], k_at]
        lp = torch.empty(row.shape[0], device=device)
        for r0 in range(0, h.shape[0], rows_per_chunk):
            logits, lse, _ = _lm_row_stats(dec, h[r0:r0 + rows_per_chunk, None], impl)
            here = ((row >= r0) & (row < r0 + rows_per_chunk)).nonzero(as_tuple=True)[0]
            local = row[here] - r0
            lp[here] = (logits[local, 0, y[sel[p_at[here]]]] - lse[local, 0]).to(lp.dtype)
            del logits
        slot = (pb[p_at] * N + pn[p_at]) * K + k_at
        S.view(-1).index_add_(0, slot, lp * weight[sel[p_at]])
        # Prune with the bounds after position t.
        bound = S.view(B, N, K) + prior  # upper bound of each pair's final term
        alive &= bound >= lower[:, :, None] - PAIR_GAP
        upper = torch.logsumexp(bound, dim=2)  # [B, N]
        alive &= (upper >= thr - BOUND_SLACK)[:, :, None]
    S = S.view(B, N, K).masked_fill(~alive, float("-inf"))
    return S.transpose(1, 2)
