"""The encoder-decoder generator adapter (BART, T5, Pegasus, Marian, mBART, ...): encode the
B*K (question, passage) contexts once, cached decoder steps through :class:`BartDecoder` (BART,
the lean fast path) or :class:`GenericDecoder` (the generator's own decoder module), and
RAG-Sequence's teacher-forced rescoring.

Answers are decoder sequences: the decoder start token first, then the answer, then fill tokens
(``transformers``' rules). RAG-Sequence's per-passage searches read the contexts with no
encoder mask and its rescoring with the context mask, as ``transformers`` does.

Rescoring (:meth:`EncoderDecoder.sequence_scores`) follows ``transformers``'
``RagSequenceForGeneration.get_nll`` with ``exclude_bos_score=True`` (passage prior added at
target position 1, first target dropped when every candidate of the question starts with BOS,
padding masked). It reuses the encoder's cross-attention keys/values (no re-encoding) and
takes only per-row normalisers and target logits from the logits (the fused row statistics);
position by position, with the beams' own scores as lower bounds, the LM head skips the
(hypothesis, passage) pairs whose share of a score is below float32 resolution and the
hypotheses that can no longer be among the answers (same scores where they matter, fewer
LM-head rows).
"""
from __future__ import annotations

import torch

from rag_fast.generation._decoder import BartDecoder, check_generator, is_bart
from rag_fast.generation._generic_decoder import GenericDecoder
from rag_fast.generation._search import (
    BOUND_SLACK,
    PAIR_GAP,
    DecodingSettings,
    apply_processors,
)
from rag_fast.ops.backend import resolve_impl

# Logits of at most this many bytes are materialized at once while rescoring: a cap on the
# rescoring's peak memory, not a value tuned for speed (at V=50265 it is about 1,300 rows per
# matmul, already large); lower it to bound memory, at the cost of more, smaller matmuls.
SCORE_CHUNK_BYTES = 256 * 2**20


def make_decoder(generator: torch.nn.Module):
    """The decoder for ``generator``: :class:`BartDecoder` for BART (the fast path), else
    :class:`GenericDecoder`."""
    check_generator(generator)
    if is_bart(generator):
        return BartDecoder(generator)
    return GenericDecoder(generator)


class _Session:
    """Cached decoder steps over encoder rows (``cross``), Q decoder rows each."""

    def __init__(self, dec, cross, E: int, Q: int, max_length: int) -> None:
        self.dec, self.cross, self.E, self.Q = dec, cross, E, Q
        self.cache = dec.new_cache(E * Q, max_length)

    def logits(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        hidden = self.dec.step(tokens, pos, self.cache, self.cross, Q=self.Q)
        return self.dec.step_logits(hidden).view(self.E, self.Q, -1)

    def reorder(self, rows: torch.Tensor, length: int) -> None:
        self.dec.reorder_cache(self.cache, rows, length)


class EncoderDecoder:
    """:class:`~rag_fast.generation._search.GeneratorAdapter` of an encoder-decoder generator
    over contexts ``ids [B*K, S]`` with ``mask`` (K rows per question)."""

    score_dtype = torch.float32
    sample_per_question = True  # transformers samples RAG-Sequence one question at a time

    def __init__(self, generator: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 K: int, *, rag_config=None, mask_searches: bool = False) -> None:
        self.dec = make_decoder(generator)
        # RAG-Sequence's searches read the encoder with the context mask too (see
        # rag_sequence_generate's mask_searches); RAG-Token's always do
        self.mask_searches = bool(mask_searches)
        self.generator, self.ids, self.mask, self.K = generator, ids, mask, K
        self.device = ids.device
        self.rag_config = rag_config
        self.vocab_size = self.dec.vocab_size
        pad = getattr(generator.config, "pad_token_id", None)
        self.pad_token_id = -1 if pad is None else int(pad)
        self._cross: dict[str, object] = {}
        self._hidden: dict[str, torch.Tensor] = {}

    def _encoded(self, masked: bool):
        """Encoder outputs and cross state with the context mask (``masked``) or without it."""
        key = "masked" if masked else "unmasked"
        if key not in self._cross:
            full = bool(self.mask.bool().all())
            other = "unmasked" if masked else "masked"
            if full and other in self._hidden:  # a mask that hides nothing: the same encoding
                hidden = self._hidden[other]
            else:
                hidden = self.dec.encode(self.ids, self.mask if masked else None)
            self._hidden[key] = hidden
            self._cross[key] = self.dec.cross_state(hidden, self.mask if masked else None)
        return self._cross[key]

    def session(self, Q: int, max_length: int, *, search: str = "token", rows=None):
        # transformers runs RAG-Sequence's searches with no encoder mask (padding attended)
        cross = self._encoded(masked=search == "token" or self.mask_searches)
        E = self.ids.shape[0]
        if rows is not None:
            cross, E = self.dec.select_cross(cross, rows), rows.shape[0]
        return _Session(self.dec, cross, E, Q, max_length)

    def history(self, s: DecodingSettings, scores, seqs, group: int):
        G, W, V = scores.shape
        t = seqs.shape[2]
        out = apply_processors(s.history_only(), seqs.reshape(G * W, t),
                               scores.reshape(G * W, V), t)
        return out.view(G, W, V)

    def hypotheses(self, hyps, lengths):
        return hyps  # fill tokens count where transformers counts them (T5 fills with EOS)

    def bounds_hold(self, s: DecodingSettings) -> bool:
        # The beams' log-probabilities bound the rescoring's when both read the same encoder
        # outputs, no token was forced (a forced token counts 0 in the beam) and the positions
        # after EOS are masked when rescoring; processors (sampling, penalties) change what
        # the searches' scores sum, so they bound nothing then.
        forced = s.forced_bos_token_id is not None or s.forced_eos_token_id is not None
        fill = s.greedy_fill_token_id if s.num_beams == 1 else s.fill_token_id
        return ((self.mask_searches or bool(self.mask.bool().all())) and not forced
                and not s.processed
                and fill == self._pad())

    def _pad(self) -> int:
        if self.pad_token_id < 0:
            raise ValueError("the generator's config has no pad_token_id (needed to pad answers)")
        return self.pad_token_id

    def sequence_scores(self, uniq, lengths, valid, log_prior, impl, lower, keep):
        cross = self._encoded(masked=True)
        return -_sequence_loss(self.dec, cross, uniq, valid, log_prior, self._pad(), self.K,
                               self.generator, self.rag_config, impl, lower=lower, keep=keep)

    def token_output(self, seqs, lengths):
        return seqs

    def sequence_output(self, chosen, lengths, found, width, R):
        pad = self._pad()
        B, n = chosen.shape[:2]
        chosen = chosen.masked_fill(~found[:, :, None], pad)
        out_width = int(width.max())
        cols = torch.arange(chosen.shape[2], device=chosen.device)
        chosen = chosen.masked_fill(cols[None, None, :] >= width[:, None, None],
                                    pad)[:, :, :out_width]
        if n < R:
            fill = torch.full((B, R - n, out_width), pad, dtype=torch.long, device=chosen.device)
            chosen = torch.cat([chosen, fill], dim=1)
        return chosen.reshape(B * R, out_width)


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
                   log_prior: torch.Tensor, pad: int, K: int, generator, rag_config, impl: str,
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
    V = dec.vocab_size
    device = uniq.device
    targets = torch.cat([uniq[:, :, 1:], torch.full_like(uniq[:, :, :1], pad)], dim=2)
    mask = (targets != pad) & valid[:, :, None]  # [B, N, L] positions that count
    eps = float(getattr(rag_config, "label_smoothing", 0.0) or 0.0)
    bos = getattr(rag_config, "bos_token_id", None) if rag_config is not None else None
    bos = bos or getattr(generator.config, "bos_token_id", None)
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
