"""Decoding settings and the beam-search bookkeeping shared by RAG-Token and RAG-Sequence.

The bookkeeping follows ``transformers``' vectorised beam search step by step, so that the same
step scores give the same hypotheses: keep the ``2W`` best candidates, continue the ``W`` best
that did not stop, move stopped candidates among the first ``W`` into a ``W``-slot finished
list scored by ``score / generated_length ** length_penalty``, and stop a question by the same
early-stopping rules (``True``, ``False`` heuristic, ``"never"``). Candidate selection itself is
the fused beam step (rag_fast.ops.rag_token_beam_step); ties anywhere go to the lower index.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rag_fast.ops.rag_token_beam_step import rag_token_beam_step
from rag_fast.reference_decoding import select_top

NEG = -1.0e9  # the "excluded" score transformers uses (not -inf: it must stay orderable)


@dataclass(frozen=True)
class DecodingSettings:
    """Resolved decoding settings (see ``settings_from``)."""

    num_beams: int
    max_length: int  # total decoder length, the start token included
    min_length: int  # EOS is banned while the sequence is shorter than this
    length_penalty: float
    early_stopping: bool | str
    num_return_sequences: int
    decoder_start_token_id: int
    eos_token_id: int | None
    pad_token_id: int | None
    forced_bos_token_id: int | None
    forced_eos_token_id: int | None

    @property
    def fill_token_id(self) -> int:
        """What pads finished hypotheses (transformers: pad if set and non-zero, else EOS)."""
        if self.eos_token_id is None:
            return -1 if not self.pad_token_id else self.pad_token_id
        return self.pad_token_id if self.pad_token_id else self.eos_token_id


def _pick(value, *fallbacks):
    for v in (value, *fallbacks):
        if v is not None:
            return v
    return None


def settings_from(
    config,
    vocab_size: int,
    *,
    num_beams: int | None = None,
    max_length: int | None = None,
    max_new_tokens: int | None = None,
    min_length: int | None = None,
    min_new_tokens: int | None = None,
    length_penalty: float | None = None,
    early_stopping: bool | str | None = None,
    num_return_sequences: int | None = None,
    decoder_start_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | None = None,
) -> DecodingSettings:
    """Resolve arguments against a ``GenerationConfig``-like ``config`` (None: its defaults).

    The decoder prompt is the one start token, so ``max_new_tokens`` means
    ``max_length = 1 + max_new_tokens`` and ``min_new_tokens`` means ``min_length = 1 + it``.

    Raises:
        ValueError: num_beams < 1 or above the vocabulary, num_return_sequences outside
            [1, num_beams], a maximum length that leaves no room after the 1-token prompt,
            a missing decoder start token, an unknown early_stopping value.
    """
    def cfg(name):
        return getattr(config, name, None) if config is not None else None

    unsupported = {
        "do_sample": cfg("do_sample") not in (None, False),
        "no_repeat_ngram_size": (cfg("no_repeat_ngram_size") or 0) > 0,
        "repetition_penalty": cfg("repetition_penalty") not in (None, 1.0),
        "bad_words_ids": bool(cfg("bad_words_ids")),
        "suppress_tokens": bool(cfg("suppress_tokens")),
    }
    active = [name for name, on in unsupported.items() if on]
    if active:
        raise ValueError(
            f"the generation config sets {active}, which rag_fast.generation does not implement "
            "(it applies min length and forced BOS/EOS only); unset them to decode here"
        )
    beams = int(_pick(num_beams, cfg("num_beams"), 1))
    if beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {beams}")
    if beams > vocab_size:
        raise ValueError(
            f"num_beams={beams} is larger than the vocabulary ({vocab_size} tokens): "
            "beam search needs at least num_beams distinct tokens"
        )
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        max_len = 1 + int(max_new_tokens)
    else:
        max_len = int(_pick(max_length, cfg("max_length"), 20))
    if max_len < 2:
        raise ValueError(
            f"max_length={max_len} is not above the decoder prompt (1 start token): "
            "nothing could be generated; use max_length >= 2 or max_new_tokens >= 1"
        )
    if min_new_tokens is not None:
        min_len = 1 + int(min_new_tokens)
    else:
        min_len = int(_pick(min_length, cfg("min_length"), 0))
    start = _pick(decoder_start_token_id, cfg("decoder_start_token_id"), cfg("bos_token_id"))
    if start is None:
        raise ValueError("decoder_start_token_id is not set (neither given nor in the config)")
    stop = _pick(early_stopping, cfg("early_stopping"), False)
    if stop not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {stop!r}")
    n_ret = int(_pick(num_return_sequences, cfg("num_return_sequences"), 1))
    if not 1 <= n_ret <= beams:
        raise ValueError(f"num_return_sequences={n_ret} must lie in [1, num_beams={beams}]")
    eos = _pick(eos_token_id, cfg("eos_token_id"))
    if isinstance(eos, (list, tuple)):
        if len(eos) != 1:
            raise ValueError(f"exactly one eos_token_id is supported, got {eos}")
        eos = eos[0]
    return DecodingSettings(
        num_beams=beams,
        max_length=max_len,
        min_length=min_len,
        length_penalty=float(_pick(length_penalty, cfg("length_penalty"), 1.0)),
        early_stopping=stop,
        num_return_sequences=n_ret,
        decoder_start_token_id=int(start),
        eos_token_id=None if eos is None else int(eos),
        pad_token_id=_pick(pad_token_id, cfg("pad_token_id")),
        forced_bos_token_id=_pick(forced_bos_token_id, cfg("forced_bos_token_id")),
        forced_eos_token_id=_pick(forced_eos_token_id, cfg("forced_eos_token_id")),
    )


class MinLengthBias:
    """The additive ``[rows, V]`` bias of the minimum-length rule (EOS banned), built once per
    decoding and shared by every step that needs it, instead of a fresh ``[rows, V]`` each step."""

    def __init__(self, s: DecodingSettings, rows: int, vocab: int, device) -> None:
        self.s, self.rows, self.vocab, self.device = s, rows, vocab, device
        self._bias: torch.Tensor | None = None

    def at(self, cur_len: int) -> torch.Tensor | None:
        """The bias at length ``cur_len``, or None when the rule no longer applies."""
        if self.s.eos_token_id is None or cur_len >= self.s.min_length:
            return None
        if self._bias is None:
            self._bias = torch.zeros((self.rows, self.vocab), dtype=torch.float32,
                                     device=self.device)
            self._bias[:, self.s.eos_token_id] = float("-inf")
        return self._bias


def forced_token(s: DecodingSettings, cur_len: int) -> int | None:
    """The token forced at length ``cur_len`` (forced BOS first, forced EOS last), if any."""
    if cur_len == 1 and s.forced_bos_token_id is not None:
        return int(s.forced_bos_token_id)
    if cur_len == s.max_length - 1 and s.forced_eos_token_id is not None:
        return int(s.forced_eos_token_id)
    return None


def forced_candidates(running: torch.Tensor, token: int) -> tuple[torch.Tensor, ...]:
    """Top-2W candidates when every beam must emit ``token`` (its log-prob becomes 0)."""
    B, W = running.shape
    scores, beams = select_top(running, W)
    pad = torch.full((B, W), float("-inf"), device=running.device)
    fill_beams = torch.arange(W, device=running.device).expand(B, W)
    tokens = torch.full((B, 2 * W), token, dtype=torch.long, device=running.device)
    return torch.cat([scores, pad], 1), torch.cat([beams, fill_beams], 1), tokens


class BeamState:
    """Running and finished hypotheses of ``B`` independent beam searches of width ``W``."""

    def __init__(self, B: int, s: DecodingSettings, device) -> None:
        W, L = s.num_beams, s.max_length
        self.s, self.B, self.W = s, B, W
        self.cur_len = 1
        self.running = torch.full((B, W, L), s.fill_token_id, dtype=torch.long, device=device)
        self.running[:, :, 0] = s.decoder_start_token_id
        self.running_scores = torch.zeros((B, W), device=device)
        self.running_scores[:, 1:] = NEG  # only beam 0 expands at the first step
        self.finished = self.running.clone()
        self.finished_scores = torch.full((B, W), NEG, device=device)
        self.finished_len = torch.zeros((B, W), dtype=torch.long, device=device)
        self.is_finished = torch.zeros((B, W), dtype=torch.bool, device=device)
        self.improvable = torch.ones((B, 1), dtype=torch.bool, device=device)
        self.done = False

    def advance(self, scores: torch.Tensor, beams: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Apply one step's ``2W`` best candidates ``[B, 2W]`` (score, source beam, token).

        Returns the source beam ``[B, W]`` of each new running beam (for cache reordering).
        """
        s, W, t = self.s, self.W, self.cur_len
        cand = self.running.gather(1, beams[:, :, None].expand(-1, -1, s.max_length)).clone()
        cand[:, :, t] = tokens
        hits = torch.full_like(tokens, t + 1 >= s.max_length, dtype=torch.bool)
        if s.eos_token_id is not None:
            hits |= tokens == s.eos_token_id
        # Continue with the W best candidates that did not stop.
        masked = scores + hits.float() * NEG
        _, keep = select_top(masked, W)
        self.running = cand.gather(1, keep[:, :, None].expand(-1, -1, s.max_length))
        self.running_scores = masked.gather(1, keep)
        sources = beams.gather(1, keep)
        # Stopped candidates among the first W enter the finished list, length-penalised.
        top_w = torch.zeros_like(hits)
        top_w[:, :W] = True
        just = hits & top_w
        final = scores / float(t + 1 - 1) ** s.length_penalty
        full = self.is_finished.all(dim=1, keepdim=True) & (s.early_stopping is True)
        final = final + full.float() * NEG + (~self.improvable).float() * NEG + (~just).float() * NEG
        merged_scores = torch.cat([self.finished_scores, final], 1)
        _, pick = select_top(merged_scores, W)
        merged_seq = torch.cat([self.finished, cand], 1)
        merged_len = torch.cat([self.finished_len, torch.full_like(tokens, t)], 1)
        merged_fin = torch.cat([self.is_finished, just], 1)
        self.finished = merged_seq.gather(1, pick[:, :, None].expand(-1, -1, s.max_length))
        self.finished_scores = merged_scores.gather(1, pick)
        self.finished_len = merged_len.gather(1, pick)
        self.is_finished = merged_fin.gather(1, pick)
        # Stopping rules, as transformers applies them after the step.
        self.cur_len = t + 1
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_len = s.max_length - 1
        else:
            best_len = self.cur_len - 1
        best_running = self.running_scores[:, :1] / float(best_len) ** s.length_penalty
        worst = torch.where(self.is_finished, self.finished_scores.min(dim=1, keepdim=True)[0],
                            torch.full_like(self.finished_scores, NEG))
        self.improvable = self.improvable & (best_running > worst).any(dim=-1, keepdim=True)
        open_beams = not (bool(self.is_finished.all()) and s.early_stopping is True)
        self.done = not (bool(self.improvable.any()) and open_beams and not bool(hits.all()))
        return sources

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sequences [B, R, L'], scores [B, R])``: the R = num_return_sequences best
        finished hypotheses, cropped to the longest of all returned ones."""
        R = self.s.num_return_sequences
        lengths = self.finished_len[:, :R]
        width = 1 + int(lengths.max()) if lengths.numel() else 1
        return self.finished[:, :R, :width], self.finished_scores[:, :R]


def beam_search(
    state: BeamState,
    step_logits: Callable[[torch.Tensor, int], torch.Tensor],
    log_prior: torch.Tensor,
    ban: MinLengthBias,
    reorder: Callable[[torch.Tensor, int], None],
    impl: str,
) -> BeamState:
    """Run ``state`` to the end: per step, ``step_logits(last tokens [B, W], position)`` gives
    the ``[B, W, K, V]`` logits, the fused beam step (or a forced token) picks the candidates,
    and ``reorder(sources [B, W], cur_len)`` moves the decoder cache after the beams."""
    s = state.s
    while not state.done:
        t = state.cur_len
        logits = step_logits(state.running[:, :, t - 1], t - 1)
        forced = forced_token(s, t)
        if forced is not None:
            cand = forced_candidates(state.running_scores, forced)
        else:
            cand = rag_token_beam_step(logits, log_prior, state.running_scores, ban.at(t),
                                       impl=impl)
        sources = state.advance(*cand)
        if not state.done:
            reorder(sources, t)
    return state
