"""Incremental decoding through any Hugging Face encoder-decoder generator's own modules.

:class:`BartDecoder` re-implements BART's decoder layer by layer for speed; every other
seq2seq generator (T5, mT5, Flan-T5, Pegasus, Marian, mBART, ...) runs here through its own
decoder module (``generator.get_decoder()``) with a ``transformers`` cache
(``EncoderDecoderCache`` of two ``DynamicCache``), so the arithmetic is the generator's own and
nothing architecture-specific (relative position buckets, sinusoidal positions, pre- or
post-layer-norm) is re-implemented. The LM head reproduces what the generator's forward does
after its decoder: T5's ``d_model ** -0.5`` output scale when the config asks for it, the output
embedding, then BART-style ``final_logits_bias`` when the generator has one.

The interface is :class:`BartDecoder`'s (``encode``, ``cross_state``, ``select_cross``,
``step``, ``logits``, ``step_logits``, ``new_cache``, ``reorder_cache``, ``teacher_forced``),
with the same row grouping: decoder rows are ``[E, Q]``, Q rows reading each of E encoder rows.
Here the encoder outputs are repeated per row once per grouping (the decoder module needs one
encoder row per decoder row); the cross-attention keys/values are computed by the first step
and then kept in the cache, and beam reordering, which never moves a row to another encoder
row, only gathers the self-attention part.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from rag_fast.generation._decoder import check_generator
from rag_fast.generation.heads import decoder_parts, encoder_decoder_lm_head, head_logits


def cache_argument(module: torch.nn.Module) -> str:
    """The name of a ``transformers`` decoder's key/value cache argument: ``cache`` in
    transformers 5, ``past_key_values`` before."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class GenericCross:
    """Encoder outputs ``hidden [E, S, d]`` and their mask ``[E, S]`` (None: attend to all),
    with the per-row repetitions made for each grouping Q (memoised)."""

    hidden: torch.Tensor
    mask: torch.Tensor | None
    _rows: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def rows(self, Q: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Encoder outputs and mask per decoder row, rows grouped ``[E, Q]``."""
        got = self._rows.get(Q)
        if got is None:
            if Q == 1:
                got = (self.hidden, self.mask)
            else:
                got = (self.hidden.repeat_interleave(Q, dim=0),
                       None if self.mask is None else self.mask.repeat_interleave(Q, dim=0))
            self._rows = {Q: got}  # one grouping at a time: a decoding uses one
        return got


class GenericCache:
    """A ``transformers`` ``EncoderDecoderCache`` for one decoding (rows fixed)."""

    def __init__(self, rows: int) -> None:
        from transformers import DynamicCache, EncoderDecoderCache

        self.rows = rows
        self.hf = EncoderDecoderCache(DynamicCache(), DynamicCache())


class GenericDecoder:
    """Incremental and teacher-forced decoding through a seq2seq generator's own modules."""

    def __init__(self, generator: torch.nn.Module) -> None:
        check_generator(generator)
        self.generator = generator
        self.parts = decoder_parts(generator)  # a composite's decoder body, transform, projection
        self.decoder = self.parts.body
        self._cache_arg = cache_argument(self.decoder)
        self.lm = encoder_decoder_lm_head(generator)  # weight, bias (+ final_logits_bias), T5's output scale
        self.vocab_size = int(self.lm.weight.shape[0])
        self.d_model = int(self.lm.weight.shape[1])

    # encoder side -----------------------------------------------------------------------
    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Encoder outputs ``[N, S, d]`` of ``input_ids [N, S]``."""
        out = self.generator.get_encoder()(
            input_ids=input_ids, attention_mask=attention_mask, return_dict=True
        )
        project = self.parts.project
        return out.last_hidden_state if project is None else project(out.last_hidden_state)

    def cross_state(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> GenericCross:
        return GenericCross(hidden, attention_mask)

    def select_cross(self, cross: GenericCross, rows: torch.Tensor) -> GenericCross:
        """The cross state of encoder rows ``rows``."""
        return GenericCross(cross.hidden.index_select(0, rows),
                            None if cross.mask is None else cross.mask.index_select(0, rows))

    # decoder side -----------------------------------------------------------------------
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, as the generator's forward applies it: ``hidden [..., d]`` -> ``[..., V]``."""
        return head_logits(self.lm, hidden)

    def step_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

    def new_cache(self, rows: int, max_len: int) -> GenericCache:
        return GenericCache(rows)

    def _run(self, tokens: torch.Tensor, cross: GenericCross, Q: int, cache) -> torch.Tensor:
        enc, mask = cross.rows(Q)
        if enc.shape[0] != tokens.shape[0]:
            raise ValueError(
                f"{tokens.shape[0]} decoder rows do not match {cross.hidden.shape[0]} encoder "
                f"rows x Q={Q}")
        out = self.decoder(input_ids=tokens, encoder_hidden_states=enc,
                           encoder_attention_mask=mask, use_cache=cache is not None,
                           return_dict=True, **{self._cache_arg: cache})
        transform = self.parts.transform
        return out.last_hidden_state if transform is None else transform(out.last_hidden_state)

    def step(self, tokens: torch.Tensor, pos: int, cache: GenericCache, cross: GenericCross,
             Q: int) -> torch.Tensor:
        """One incremental step: ``tokens [E*Q]`` at position ``pos`` -> hidden ``[E*Q, d]``."""
        have = cache.hf.get_seq_length()
        if have != pos:  # (a decoder of no layers, say: an edited config)
            raise ValueError(f"the generator's decoder cached {have} positions where {pos} were "
                             "decoded: a decoder that keeps no cache (one without layers) "
                             "cannot be decoded step by step")
        return self._run(tokens[:, None], cross, Q, cache.hf)[:, 0]

    def reorder_cache(self, cache: GenericCache, rows: torch.Tensor, length: int) -> None:
        """Row r of the self-attention cache becomes old row ``rows[r]``. Rows only move within
        their encoder row's group, so the cross-attention keys/values stay in place."""
        cache.hf.self_attention_cache.reorder_cache(rows)

    def teacher_forced(self, tokens: torch.Tensor, cross: GenericCross, Q: int) -> torch.Tensor:
        """Hidden states ``[E*Q, T, d]`` of decoder inputs ``tokens [E*Q, T]`` (causal)."""
        return self._run(tokens, cross, Q, None)
