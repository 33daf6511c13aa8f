"""Generator families: what differs between an encoder-decoder generator (BART, T5, Pegasus,
...) and a decoder-only one (any ``*ForCausalLM``: Qwen2, Llama, GPT-2, ...), decided once per
model and held by it (``RagModel.family``).

Everything else (retrieval, the passage prior, the losses over ``[B*K, T, V]`` logits, the
searches over the adapter protocol) is the same for both. A family answers, for its
generators: whether a generator is one of its own and usable; its LM head; how contexts are
padded and how long they may be; the labels a batch trains on (what the decoder reads, what it
predicts, which id is ignored); the generator states the loss reads; how an answer is decoded;
the layout of its model directory. :func:`family_of` picks the first registered family that
claims a generator; :func:`register_family` adds one (a test registers a third to show that a
family is one class and one call).

Shapes: ``B`` questions, ``K`` passages each, contexts ``[B*K, L]``, labels ``[B, T]``,
states ``[B*K, T', d]`` with ``T'`` the targets' length (``T - 1`` encoder-decoder, ``T``
decoder-only).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rag_fast._validation import check_context_length
from rag_fast.generation import (causal, heads, rag_sequence_generate, rag_token_generate,
                                 start_token_id)
from rag_fast.models import _causal, _lean, _seq2seq
from rag_fast.models.options import CAUSAL_IGNORE, eos_ids

# the layouts of rag_fast.json's "layout": a transformers RAG folder (the default, also when
# absent), or the generator and question encoder saved side by side (decoder-only generators)
LAYOUT_RAG, LAYOUT_CAUSAL = "rag", "causal"


class GeneratorFamily:
    """One family of generators. Subclasses set the class attributes and override what their
    generators do differently; each method is one place where families differ."""

    name = "generator"  #: words for messages ("encoder-decoder", "decoder-only")
    layout = LAYOUT_RAG  #: rag_fast.json's "layout" of its model directories
    decoder_only = False  #: answers continue the prompt (no encoder, no start token)
    padding_side = "right"  #: where contexts are padded and cut (a prompt: on the left)
    auto_class = "AutoModelForSeq2SeqLM"  #: the transformers class that builds one from a config

    def claims_config(self, config: Any) -> bool:
        """Whether a generator of ``config`` (a transformers config, or None) belongs to this
        family (families are asked in registration order)."""
        raise NotImplementedError

    def claims(self, generator: nn.Module) -> bool:
        """Whether ``generator`` belongs to this family (by its config)."""
        return self.claims_config(getattr(generator, "config", None))

    def check(self, generator: nn.Module) -> None:
        """Raise ValueError unless RagModel can drive ``generator``."""
        raise NotImplementedError

    def lm_head(self, generator: nn.Module) -> heads.LMHead:
        """The generator's LM head as ``(weight [V, d], bias [V] or None, scale)``."""
        raise NotImplementedError

    def ignore_index(self, pad_token_id: int) -> int:
        """The target id the loss ignores."""
        return pad_token_id

    def answer_start(self, model: Any) -> list[int]:
        """The token ids every training answer starts with (before the answer's own)."""
        return []

    def label_padding(self, pad_token_id: int) -> int:
        """The id labels are padded with."""
        return pad_token_id

    def prepare_labels(self, labels: torch.Tensor, pad_token_id: int,
                       config: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(decoder inputs, targets)`` from labels ``[B, T]``; both ``[B, T']``."""
        raise NotImplementedError

    def check_lengths(self, context_input_ids: torch.Tensor, labels: torch.Tensor,
                      max_positions: int | None) -> None:
        """Raise ValueError when contexts and labels need more positions than the generator
        has."""
        check_context_length(context_input_ids, max_positions)

    def prompt_positions(self, max_context_length: int) -> int:
        """Positions the prompt takes from what new tokens may use at decoding."""
        return 0

    def excludes_bos(self) -> bool:
        """Whether RAG-Sequence's ``exclude_bos`` applies to its targets."""
        return True

    def states(self, generator: nn.Module, context_input_ids: torch.Tensor,
               context_attention_mask: torch.Tensor, decoder_input_ids: torch.Tensor, K: int,
               tied: Any) -> torch.Tensor:
        """Generator states ``[B*K, T', d]`` (before the LM head's scale) for the targets."""
        raise NotImplementedError

    def decoder_start_token_id(self, model: Any) -> int | None:
        """The first decoder token of every answer; None where answers continue the prompt."""
        return None

    def generate(self, model: Any, context_input_ids: torch.Tensor,
                 context_attention_mask: torch.Tensor, doc_scores: torch.Tensor, *,
                 decoding: str, impl: str, settings: dict) -> torch.Tensor:
        """Answer token ids ``[B*R, L]`` decoded over the contexts (RagModel.generate)."""
        raise NotImplementedError


class EncoderDecoder(GeneratorFamily):
    """``*ForConditionalGeneration`` models: the context is encoded once per passage, the
    decoder reads ``labels[:, :-1]`` and predicts ``labels[:, 1:]`` (``transformers``' RAG)."""

    name = "encoder-decoder"

    def claims_config(self, config: Any) -> bool:
        return bool(getattr(config, "is_encoder_decoder", False))

    def check(self, generator: nn.Module) -> None:
        _seq2seq.check_seq2seq(generator)

    def lm_head(self, generator: nn.Module) -> heads.LMHead:
        return heads.encoder_decoder_lm_head(generator)

    def answer_start(self, model: Any) -> list[int]:
        start = [model.decoder_start_token_id]
        if model.bos_token_id is not None and model.bos_token_id != start[0]:
            start.append(model.bos_token_id)
        return start

    def prepare_labels(self, labels, pad_token_id, config):
        if labels.dim() != 2 or labels.shape[1] < 2:
            raise ValueError(f"labels must be [B, T] with T >= 2, got {tuple(labels.shape)}")
        labels = labels.masked_fill(labels == -100, pad_token_id)
        return labels[:, :-1], labels[:, 1:]

    def states(self, generator, context_input_ids, context_attention_mask, decoder_input_ids, K,
               tied):
        encoder_states = _seq2seq.encode(generator, context_input_ids, context_attention_mask,
                                         tied)
        # (lean activations) the cross-attention keys and values are recomputed from it
        _lean.share_input(encoder_states)
        return _seq2seq.decode(generator, decoder_input_ids.repeat_interleave(K, dim=0),
                               encoder_states, context_attention_mask, tied)

    def decoder_start_token_id(self, model: Any) -> int | None:
        view = model.transformers_view()
        config = view.generation_config if model.mode == "token" else getattr(
            model.generator, "generation_config", None)
        start = start_token_id(config)
        return start_token_id(model.generator.config) if start is None else start

    def generate(self, model, context_input_ids, context_attention_mask, doc_scores, *,
                 decoding, impl, settings):
        view = model.transformers_view()
        if model.mode == "token":
            return rag_token_generate(view, context_input_ids, context_attention_mask,
                                      doc_scores, impl=impl, **settings)
        return rag_sequence_generate(view, context_input_ids, context_attention_mask,
                                     doc_scores, decoding=decoding, impl=impl, **settings)


class DecoderOnly(GeneratorFamily):
    """``*ForCausalLM`` models (docs/decoder_only.md): the prompt (left-padded, cut on the
    left) and the answer share one sequence; state t predicts ``labels[:, t]`` from the token
    before it, the prompt's last token for t = 0."""

    name = "decoder-only"
    layout = LAYOUT_CAUSAL
    decoder_only = True
    padding_side = "left"
    auto_class = "AutoModelForCausalLM"

    def claims_config(self, config: Any) -> bool:
        return config is not None and not getattr(config, "is_encoder_decoder", False)

    def check(self, generator: nn.Module) -> None:
        causal.check_causal(generator)  # also requires config.pad_token_id

    def lm_head(self, generator: nn.Module) -> heads.LMHead:
        return causal.decoder_only_lm_head(generator)

    def ignore_index(self, pad_token_id: int) -> int:
        return CAUSAL_IGNORE

    def label_padding(self, pad_token_id: int) -> int:
        return CAUSAL_IGNORE  # its pad token may be its EOS (a target)

    def prepare_labels(self, labels, pad_token_id, config):
        """The labels are the answer tokens themselves; ``answer_ids`` have -100 replaced by
        the pad token; in ``targets`` every ignored position is -100: -100 itself, and the pad
        token unless it is also the EOS token (then it is the EOS target)."""
        if labels.dim() != 2 or labels.shape[1] < 1:
            raise ValueError(f"labels must be [B, T] answer token ids with T >= 1, got "
                             f"{tuple(labels.shape)}")
        ids = labels.masked_fill(labels == CAUSAL_IGNORE, pad_token_id)
        targets = labels
        if pad_token_id not in eos_ids(config):
            targets = labels.masked_fill(labels == pad_token_id, CAUSAL_IGNORE)
        return ids, targets

    def check_lengths(self, context_input_ids, labels, max_positions):
        # prompt and answer share the positions: S + T - 1 of them at most
        need = context_input_ids.shape[1] + labels.shape[1] - 1
        if max_positions is not None and need > max_positions:
            raise ValueError(
                f"context_input_ids ({context_input_ids.shape[1]} tokens) and labels "
                f"({labels.shape[1]}) need {need} positions but the generator has "
                f"{max_positions} (config.max_position_embeddings); shorten the contexts "
                "(max_context_length) or the answers")

    def prompt_positions(self, max_context_length: int) -> int:
        return int(max_context_length)

    def excludes_bos(self) -> bool:
        return False  # an answer has no start token

    def states(self, generator, context_input_ids, context_attention_mask, decoder_input_ids, K,
               tied):
        return _causal.answer_states(generator, context_input_ids, context_attention_mask,
                                     decoder_input_ids, tied)

    def generate(self, model, context_input_ids, context_attention_mask, doc_scores, *,
                 decoding, impl, settings):
        return causal.causal_generate(
            model.generator, context_input_ids, context_attention_mask, doc_scores,
            mode=model.mode, decoding=decoding, impl=impl,
            generation_config=model.generation_config, **settings)


_FAMILIES: list[GeneratorFamily] = [DecoderOnly(), EncoderDecoder()]


def families() -> tuple[GeneratorFamily, ...]:
    """The registered families, in the order :func:`family_of` asks them."""
    return tuple(_FAMILIES)


def register_family(family: GeneratorFamily) -> None:
    """Register ``family`` ahead of the others (it is asked first). Its ``layout`` must be
    new or one of an existing family's."""
    if not isinstance(family, GeneratorFamily):
        raise TypeError(f"family must be a GeneratorFamily, got {type(family).__name__}")
    _FAMILIES.insert(0, family)


def unregister_family(family: GeneratorFamily) -> None:
    """Remove ``family`` (registered with :func:`register_family`)."""
    _FAMILIES.remove(family)


def family_of(generator: nn.Module) -> GeneratorFamily:
    """The first registered family that claims ``generator``; encoder-decoder when none does
    (its check then names what the generator lacks)."""
    for family in _FAMILIES:
        if family.claims(generator):
            return family
    return next(f for f in _FAMILIES if isinstance(f, EncoderDecoder))


def family_of_config(config: Any) -> GeneratorFamily:
    """:func:`family_of` for a generator not built yet, by its transformers config."""
    for family in _FAMILIES:
        if family.claims_config(config):
            return family
    return next(f for f in _FAMILIES if isinstance(f, EncoderDecoder))


def family_of_layout(layout: str) -> GeneratorFamily:
    """The family whose model directories have ``layout`` (rag_fast.json's "layout")."""
    for family in _FAMILIES:
        if family.layout == layout:
            return family
    raise ValueError(f"no generator family has the model directory layout {layout!r}")


__all__ = ["DecoderOnly", "EncoderDecoder", "GeneratorFamily", "LAYOUT_CAUSAL", "LAYOUT_RAG",
           "families", "family_of", "family_of_config", "family_of_layout", "register_family",
           "unregister_family"]
