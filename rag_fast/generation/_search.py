"""Decoding settings, the generator adapter protocol and the beam-search bookkeeping shared by
RAG-Token and RAG-Sequence.

The bookkeeping follows ``transformers``' vectorised beam search step by step, so that the same
step scores give the same hypotheses: keep the ``2W`` best candidates, continue the ``W`` best
that did not stop, move stopped candidates among the first ``W`` into a ``W``-slot finished
list scored by ``score / generated_length ** length_penalty``, and stop a question by the same
early-stopping rules (``True``, ``False`` heuristic, ``"never"``). Candidate selection itself is
the fused beam step (rag_fast.ops.rag_token_beam_step); ties anywhere go to the lower index.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from numbers import Integral, Real
from typing import Callable, Protocol

import torch

from rag_fast.ops.rag_token_beam_step import rag_token_beam_step
from rag_fast._topk import select_top

NEG = -1.0e9  # the "excluded" score transformers uses (not -inf: it must stay orderable)
# RAG-Sequence's thorough rescoring skips (hypothesis, passage) pairs whose share of a score is
# below exp(-PAIR_GAP) (invisible in float32: exp(-40) ~ 4e-18, far below float32's relative
# resolution 6e-8) and hypotheses that cannot reach the answers; BOUND_SLACK (nats) absorbs the
# rounding between the beam search's sums and the rescoring's (float32 sums of at most a few
# hundred terms differ by far less than 1 nat). Both are correctness margins derived from
# float32, not tuned on a machine; raising either only prunes less (slower, same ids).
PAIR_GAP = 40.0
BOUND_SLACK = 1.0


class Session(Protocol):
    """The cached decoder of one search: E prompt rows (a question with one passage), Q decoder
    rows reading each (the beams), decoder rows ordered ``(e, q)``."""

    def logits(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        """Feed ``tokens [E*Q]`` at answer position ``pos`` (0: the start token) ->
        next-token logits ``[E, Q, V]``, valid until the next call."""

    def reorder(self, rows: torch.Tensor, length: int) -> None:
        """Decoder row r continues from row ``rows[r]`` (same prompt row), ``length``
        positions decoded."""


class GeneratorAdapter(Protocol):
    """What the RAG-Token and RAG-Sequence searches need of a generator family, for the B*K
    (question, passage) inputs of one decoding, encoded (or prefilled) once: cached steps
    (:meth:`session`), the logits processors that read a row's history, the teacher-forced
    scores of RAG-Sequence's thorough decoding, and the family's output format.
    Implementations: ``encoder_decoder.EncoderDecoder`` and ``causal.DecoderOnly``."""

    vocab_size: int
    score_dtype: torch.dtype  # of log-priors and summed log-probabilities
    pad_token_id: int
    device: torch.device
    sample_per_question: bool  # sampled RAG-Sequence searches run one question at a time

    def session(self, Q: int, max_length: int, *, search: str = "token",
                rows: torch.Tensor | None = None) -> Session:
        """A fresh cached decoder over prompt rows ``rows`` (None: all), Q decoder rows each.
        ``search``: ``"token"`` or ``"sequence"`` (RAG-Sequence's per-passage searches)."""

    def history(self, s: DecodingSettings, scores: torch.Tensor, seqs: torch.Tensor,
                group: int) -> torch.Tensor:
        """``scores [G, W, V]`` after the processors that read each row's history (repetition
        penalty, no-repeat n-grams), given the hypotheses ``seqs [G, W, t]`` (start token
        first) of G groups of ``group`` consecutive prompt rows; float32."""

    def hypotheses(self, hyps: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The finished hypotheses ``[E, W, L]`` as RAG-Sequence compares and scores them."""

    def bounds_hold(self, s: DecodingSettings) -> bool:
        """Whether the searches' summed log-probabilities bound the teacher-forced scores."""

    def sequence_scores(self, uniq: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor,
                        log_prior: torch.Tensor, impl: str, lower: torch.Tensor | None,
                        keep: int) -> torch.Tensor:
        """RAG-Sequence log-likelihoods ``[B, N]`` of hypotheses ``uniq [B, N, L]`` (answer
        ``lengths [B, N]``, ``valid [B, N]``) against every passage of their question."""

    def token_output(self, seqs: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """RAG-Token's returned ids from hypotheses ``[M, L]`` and answer lengths ``[M]``."""

    def sequence_output(self, chosen: torch.Tensor, lengths: torch.Tensor, found: torch.Tensor,
                        width: torch.Tensor, R: int) -> torch.Tensor:
        """RAG-Sequence's returned ids ``[B*R, L']`` from the best hypotheses ``chosen [B, n,
        L]`` (``found``: a real one), their ``lengths`` and each question's width ``[B]``."""


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
    # Logits processors beyond min length / forced tokens (transformers' definitions, applied
    # in transformers' order: repetition penalty, no-repeat n-grams, min length, forced BOS,
    # forced EOS, then, when sampling, temperature, top-k, top-p).
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off
    no_repeat_ngram_size: int = 0  # 0: off

    @property
    def fill_token_id(self) -> int:
        """What pads finished beam hypotheses (transformers: pad if set and non-zero, else EOS)."""
        if self.eos_token_id is None:
            return -1 if not self.pad_token_id else self.pad_token_id
        return self.pad_token_id if self.pad_token_id else self.eos_token_id

    @property
    def greedy_fill_token_id(self) -> int:
        """What follows EOS in greedy / sampled sequences (transformers: the pad token, EOS when
        there is none). Differs from :attr:`fill_token_id` when pad is 0, as for T5."""
        if self.pad_token_id is not None:
            return int(self.pad_token_id)
        return -1 if self.eos_token_id is None else int(self.eos_token_id)

    def processor_settings(self) -> list[str]:
        """The names of the active settings that need the processor path."""
        names = []
        if self.do_sample:
            names.append("do_sample")
        if self.repetition_penalty != 1.0:
            names.append("repetition_penalty")
        if self.no_repeat_ngram_size > 0:
            names.append("no_repeat_ngram_size")
        return names

    def without_history(self) -> DecodingSettings:
        """These settings with the repetition penalty and the n-gram ban off (a generator
        adapter's :meth:`GeneratorAdapter.history` applies them); min length, forced tokens and
        the sampling warpers stay."""
        return replace(self, repetition_penalty=1.0, no_repeat_ngram_size=0)

    def history_only(self) -> DecodingSettings:
        """These settings with only the repetition penalty and the n-gram ban on."""
        return replace(self, min_length=0, forced_bos_token_id=None, forced_eos_token_id=None,
                       do_sample=False)

    @property
    def processed(self) -> bool:
        """Whether a step needs the plain-PyTorch processor path (sampling, repetition
        penalty or no-repeat n-grams), rather than the fused beam step."""
        return (self.do_sample or self.repetition_penalty != 1.0
                or self.no_repeat_ngram_size > 0)


def _pick(value, *fallbacks):
    for v in (value, *fallbacks):
        if v is not None:
            return v
    return None


def start_token_id(config) -> int | None:
    """The decoder start token a ``GenerationConfig``-like ``config`` gives an encoder-decoder
    search: its ``decoder_start_token_id``, else its ``bos_token_id`` (None: neither set).
    Every answer starts with it, in decoding and in training labels."""
    start = _pick(getattr(config, "decoder_start_token_id", None),
                  getattr(config, "bos_token_id", None))
    return None if start is None else int(start)


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
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    allow_processors: bool = False,
) -> DecodingSettings:
    """Resolve arguments against a ``GenerationConfig``-like ``config`` (None: its defaults).

    The decoder prompt is the one start token, so ``max_new_tokens`` means
    ``max_length = 1 + max_new_tokens`` and ``min_new_tokens`` means ``min_length = 1 + it``.

    ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p`` / ``repetition_penalty`` /
    ``no_repeat_ngram_size`` follow transformers' defaults (top_k 50 when unset anywhere; the
    sampling warpers are dropped when not sampling). A caller whose search applies them
    (:func:`apply_processors`, :func:`processed_candidates`) passes ``allow_processors=True``;
    otherwise active ones raise a ValueError naming them.

    Raises:
        ValueError: num_beams < 1 or above the vocabulary, num_return_sequences outside
            [1, num_beams], a maximum length that leaves no room after the 1-token prompt,
            a missing decoder start token, an unknown early_stopping value, a processor setting
            out of range (named), an unimplemented processor set in the config.
    """
    def cfg(name):
        return getattr(config, name, None) if config is not None else None

    def off(name, *neutral):
        v = cfg(name)
        return v is None or v is False or v in neutral

    unsupported = {
        "bad_words_ids": not off("bad_words_ids") and bool(cfg("bad_words_ids")),
        "suppress_tokens": not off("suppress_tokens") and bool(cfg("suppress_tokens")),
        "begin_suppress_tokens": not off("begin_suppress_tokens")
        and bool(cfg("begin_suppress_tokens")),
        "sequence_bias": not off("sequence_bias") and bool(cfg("sequence_bias")),
        "encoder_repetition_penalty": not off("encoder_repetition_penalty", 1.0),
        "encoder_no_repeat_ngram_size": not off("encoder_no_repeat_ngram_size", 0),
        "exponential_decay_length_penalty": not off("exponential_decay_length_penalty"),
        "renormalize_logits": not off("renormalize_logits"),
        "num_beam_groups": not off("num_beam_groups", 1),
        "min_p": not off("min_p"),
        "top_h": not off("top_h"),
        "typical_p": not off("typical_p", 1.0),
        "epsilon_cutoff": not off("epsilon_cutoff", 0.0),
        "eta_cutoff": not off("eta_cutoff", 0.0),
    }
    active = [name for name, on in unsupported.items() if on]
    if active:
        raise ValueError(
            f"the generation config sets {active}, which rag_fast.generation does not implement "
            "(it applies min length, forced BOS/EOS, repetition_penalty, no_repeat_ngram_size "
            "and, when sampling, temperature, top_k and top_p); unset them to decode here"
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
    start = _pick(decoder_start_token_id, start_token_id(config))
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
    sample = _pick(do_sample, cfg("do_sample"), False)
    if not isinstance(sample, bool):
        raise ValueError(f"do_sample must be True or False, got {sample!r}")
    temp = _pick(temperature, cfg("temperature"), 1.0)
    k_top = _pick(top_k, cfg("top_k"), 50)  # transformers' default when unset anywhere
    p_top = _pick(top_p, cfg("top_p"), 1.0)
    if sample:  # the warpers only matter (and are only checked, as there) when sampling
        if isinstance(temp, bool) or not isinstance(temp, Real) or not 0.0 < temp < float("inf"):
            raise ValueError(f"temperature must be a finite float > 0, got {temp!r}")
        if isinstance(k_top, bool) or not isinstance(k_top, Integral) or k_top < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no top-k filter), got {k_top!r}")
        if isinstance(p_top, bool) or not isinstance(p_top, Real) or not 0.0 <= p_top <= 1.0:
            raise ValueError(
                f"top_p must be a float in [0, 1] (1: no top-p filter), got {p_top!r}")
    penalty = _pick(repetition_penalty, cfg("repetition_penalty"), 1.0)
    if (isinstance(penalty, bool) or not isinstance(penalty, Real)
            or not 0.0 < penalty < float("inf")):
        raise ValueError(f"repetition_penalty must be a finite float > 0 (1.0: off), got {penalty!r}")
    ngram = _pick(no_repeat_ngram_size, cfg("no_repeat_ngram_size"), 0)
    if isinstance(ngram, bool) or not isinstance(ngram, Integral) or ngram < 0:
        raise ValueError(f"no_repeat_ngram_size must be an integer >= 0 (0: off), got {ngram!r}")
    if not sample:  # transformers applies the sampling warpers only when sampling
        temp, k_top, p_top = 1.0, 0, 1.0
    if not allow_processors:
        wanted = [name for name, on in (("do_sample", sample), ("repetition_penalty",
                                                                penalty != 1.0),
                                        ("no_repeat_ngram_size", ngram > 0)) if on]
        if wanted:
            raise ValueError(
                f"{wanted} are not supported by this decoder (it applies min length and forced "
                "BOS/EOS only); unset them to decode here"
            )
    special = {"decoder_start_token_id": start, "eos_token_id": eos,
               "forced_bos_token_id": _pick(forced_bos_token_id, cfg("forced_bos_token_id")),
               "forced_eos_token_id": _pick(forced_eos_token_id, cfg("forced_eos_token_id"))}
    for name, value in special.items():  # (an edited generation config: one line, not a crash)
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)
                                  or not 0 <= value < vocab_size):
            raise ValueError(f"{name} {value!r} is not a token id of the generator's "
                             f"vocabulary (0..{vocab_size - 1}); check the generation config")
    return DecodingSettings(
        do_sample=sample,
        temperature=float(temp),
        top_k=int(k_top),
        top_p=float(p_top),
        repetition_penalty=float(penalty),
        no_repeat_ngram_size=int(ngram),
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


def apply_processors(s: DecodingSettings, seqs: torch.Tensor, scores: torch.Tensor,
                     cur_len: int) -> torch.Tensor:
    """The step's scores ``[R, V]`` after the logits processors, given the sequences so far
    ``seqs [R, cur_len]`` (decoder start token included), in ``transformers``' order.

    Definitions (those of transformers' processors of the same names):
    - repetition penalty p: a token already in the row's sequence has its score s become
      ``s * p`` when ``s < 0`` and ``s / p`` otherwise (once, however often it occurred);
    - no-repeat n-grams n: a token that would complete an n-gram already present in the row's
      sequence gets ``-inf`` (n = 1 bans every token seen, the start token included);
    - min length: EOS gets ``-inf`` while ``cur_len < min_length``;
    - forced BOS (at ``cur_len == 1``) / EOS (at ``cur_len == max_length - 1``): every token
      but the forced one gets ``-inf``, the forced one 0;
    - when sampling: division by the temperature; top-k keeps the scores not below the k-th
      largest (k raised to ``min_keep``); top-p drops, in ascending order of score, the tokens
      whose cumulative softmax mass is ``<= 1 - top_p``, always keeping the ``min_keep`` best.
      ``min_keep`` is 1 for sampling and 2 for beam sampling.
    """
    scores = scores.float()
    R, V = scores.shape
    if s.repetition_penalty != 1.0:
        seen = scores.gather(1, seqs)
        seen = torch.where(seen < 0, seen * s.repetition_penalty, seen / s.repetition_penalty)
        scores = scores.scatter(1, seqs, seen)
    n = s.no_repeat_ngram_size
    if n > 0 and cur_len >= n:
        # The last n-1 tokens, compared with the first n-1 tokens of every n-token window of
        # the sequence; each matching window bans the token that ended it.
        last = seqs[:, cur_len - n + 1:]  # [R, n-1]
        windows = seqs.unfold(1, n, 1)  # [R, cur_len - n + 1, n]
        hit = (windows[:, :, : n - 1] == last[:, None, :]).all(dim=2)
        rows, where = hit.nonzero(as_tuple=True)
        if rows.numel():
            banned = torch.zeros((R, V), dtype=torch.bool, device=scores.device)
            banned[rows, windows[rows, where, n - 1]] = True
            scores = scores.masked_fill(banned, float("-inf"))
    if s.eos_token_id is not None and cur_len < s.min_length:
        scores = scores.clone()
        scores[:, s.eos_token_id] = float("-inf")
    forced = forced_token(s, cur_len)
    if forced is not None:
        scores = torch.full_like(scores, float("-inf"))
        scores[:, forced] = 0.0
    if not s.do_sample:
        return scores
    min_keep = 2 if s.num_beams > 1 else 1
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k > 0:
        k = min(max(s.top_k, min_keep), V)
        kth = torch.topk(scores, k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if s.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=False)
        mass = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass <= 1.0 - s.top_p
        drop_sorted[:, V - min_keep:] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def pick_tokens(s: DecodingSettings, scores: torch.Tensor,
                rng: torch.Generator | None) -> torch.Tensor:
    """Next token per row of processed ``scores [R, V]``: a draw from their softmax when
    sampling (``rng``, or torch's global generator when None), else the first argmax."""
    if s.do_sample:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=rng)[:, 0]
    return torch.argmax(scores, dim=-1)


def processed_candidates(s: DecodingSettings, log_probs: torch.Tensor, running: torch.Tensor,
                         seqs: torch.Tensor, cur_len: int,
                         rng: torch.Generator | None) -> tuple[torch.Tensor, ...]:
    """The ``2W`` candidates ``(scores, beams, tokens)`` ``[B, 2W]`` of one beam step from
    ``log_probs [B, W, V]`` (as transformers' beam search sees them, before processing), the
    running scores ``[B, W]`` and sequences ``seqs [B, W, cur_len]``: processors, then the
    best ``2W`` (or, when sampling, ``2W`` draws without replacement from the softmax of the
    accumulated scores over all ``W*V`` continuations, sorted by score)."""
    B, W, V = log_probs.shape
    forced = forced_token(s, cur_len)
    if forced is not None:
        return forced_candidates(running, forced)
    lp = apply_processors(s, seqs.reshape(B * W, cur_len), log_probs.reshape(B * W, V), cur_len)
    acc = (lp.view(B, W, V) + running[:, :, None]).reshape(B, W * V)
    n = min(2 * W, W * V)
    if s.do_sample:
        flat = torch.multinomial(torch.softmax(acc, dim=-1), n, generator=rng)
        scores = acc.gather(1, flat)
        scores, order = scores.sort(dim=-1, descending=True)
        flat = flat.gather(1, order)
    else:
        scores, flat = select_top(acc, n)
    return scores, flat // V, flat % V


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
    log_probs: Callable[[torch.Tensor], torch.Tensor] | None = None,
    history: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    rng: torch.Generator | None = None,
) -> BeamState:
    """Run ``state`` to the end: per step, ``step_logits(last tokens [B, W], position)`` gives
    the ``[B, W, K, V]`` logits, the fused beam step (or a forced token) picks the candidates,
    and ``reorder(sources [B, W], cur_len)`` moves the decoder cache after the beams.

    When the settings need the processor path (``s.processed``), ``log_probs(logits)`` turns
    the step logits into the ``[B, W, V]`` log-probabilities transformers' beam search would
    process, ``history(log_probs, seqs [B, W, t])`` applies the processors that read the
    hypotheses (repetition penalty, n-grams: the generator adapter's), and
    :func:`processed_candidates` the others and picks the candidates (drawing from ``rng``
    when sampling)."""
    s = state.s
    if s.processed and (log_probs is None or history is None):
        raise ValueError(
            f"{s.processor_settings()} are not supported by this decoder (its beam search "
            "applies min length and forced BOS/EOS only); unset them")
    rest = s.without_history()
    while not state.done:
        t = state.cur_len
        logits = step_logits(state.running[:, :, t - 1], t - 1)
        if s.processed:
            seqs = state.running[:, :, :t]
            cand = processed_candidates(rest, history(log_probs(logits), seqs),
                                        state.running_scores, seqs, t, rng)
            sources = state.advance(*cand)
            if not state.done:
                reorder(sources, t)
            continue
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
